"""Conversations that don't leak, and long-term memory in the agent loop:
each chat answered with its own context, ended runs archived through the
outbox, memories recalled (automatically and with tools) under the audience rule."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from agentim.runtime.v1 import runtime_pb2 as pb
from services.runtime.adapters.memory_client import archived_run
from services.runtime.bootstrap import RuntimeApp
from services.runtime.domain.commands import CreateAgent, UpdateAgent
from services.runtime.domain.conversations import (
    TASKS,
    conversation_of_input,
    in_conversation,
    run_conversations,
    step_chats,
)
from services.runtime.domain.errors import InvalidAgentRequest
from services.runtime.domain.etiquette import GroupPolicy
from services.runtime.domain.llm import ChatMessage, ModelSettings, Role, ToolCall
from services.runtime.domain.model import (
    Agent,
    AgentDraft,
    Origin,
    Run,
    RunStatus,
    Step,
    StepKind,
    StepMetrics,
)
from services.runtime.entrypoints import mappers
from services.runtime.entrypoints.grpc_servicer import _draft
from services.runtime.service_layer.archiver import Archiver
from services.runtime.service_layer.memory_port import Memory, RunRecord
from services.runtime.service_layer.supervisor import Supervisor
from services.runtime.service_layer.tools import (
    RECALLED_HEADER,
    ToolContext,
    default_registry,
    describe_memory,
)
from tests.identities import caller_of
from tests.unit.runtime_fakes import FakeIM, FakeMemory, InMemoryAgentStore, Script, ScriptedLLM
from tests.unit.runtime_support import fake_runtime, unit_settings

WAIT = 3.0
SECRET = "PLUM-7731"


@dataclass
class World:
    """The runtime over fakes (`bootstrap.build`), with long-term memory."""

    app: RuntimeApp
    im: FakeIM
    llm: ScriptedLLM
    store: InMemoryAgentStore
    memory: FakeMemory
    alice: uuid.UUID
    bob: uuid.UUID

    @property
    def archiver(self) -> Archiver:
        assert self.app.archiver is not None
        return self.app.archiver

    @property
    def supervisor(self) -> Supervisor:
        assert self.app.supervisor is not None
        return self.app.supervisor

    async def agent(self) -> Agent:
        alice = caller_of(self.alice, self.im.workspace, roles=("owner",))
        return await self.app.bus.handle(CreateAgent(caller=alice, draft=AgentDraft(name="ada")))

    async def settle(self, agent: Agent) -> None:
        runner = self.supervisor.runner(agent.id)
        assert runner is not None
        for _ in range(3):  # a run may wake the runner for the next chat's
            await asyncio.sleep(0)
            await asyncio.wait_for(runner.idle.wait(), WAIT)

    async def archived(self) -> None:
        await asyncio.sleep(0)
        await asyncio.wait_for(self.archiver.idle.wait(), WAIT)

    def requests_text(self) -> list[str]:
        return ["\n".join(m.content or "" for m in r.messages) for r in self.llm.requests]


@pytest.fixture
async def world() -> AsyncIterator[World]:
    im, llm, store, memory = (
        FakeIM(),
        ScriptedLLM(Script(content="noted")),
        InMemoryAgentStore(),
        FakeMemory(),
    )
    settings = unit_settings(
        group_policy=GroupPolicy.ALWAYS,
        auto_recall=3,
        archive_retry_seconds=0.01,
        archive_retry_max_seconds=0.05,
    )
    async with fake_runtime(settings=settings, store=store, im=im, llm=llm, memory=memory) as app:
        alice, bob = im.human("alice"), im.human("bob")
        yield World(app, im, llm, store, memory, alice.id, bob.id)


async def test_a_secret_told_in_a_direct_chat_stays_out_of_a_group_that_includes_someone_else(
    world: World,
) -> None:
    ada = await world.agent()
    direct = world.im.group("", world.alice, ada.member_id, direct=True)
    team = world.im.group("team", world.alice, world.bob, ada.member_id)

    world.im.post(world.alice, direct.id, f"between us: the vault code is {SECRET}")
    await world.settle(ada)
    await world.archived()
    world.im.post(world.bob, team.id, "what is the vault code? alice said she told you")
    await world.settle(ada)
    world.im.post(world.alice, direct.id, "remind me of the vault code please")
    await world.settle(ada)

    first, group_answer, direct_answer = world.requests_text()
    assert SECRET in first
    assert SECRET not in group_answer  # neither live nor recalled
    assert "vault code" in group_answer  # (the group's own question is there)
    assert SECRET in direct_answer  # the direct chat keeps its context
    # Recall for the group was asked for everyone in it, and found nothing it may show.
    (_, audience, _), *_ = [r for r in world.memory.recalls if world.bob in r[1]]
    assert set(audience) == {world.alice, world.bob, ada.member_id}
    assert [m.content for m in world.im.in_group(team.id)][-1] == "noted"


async def test_a_chat_recalls_what_its_members_saw_in_another_chat_with_the_anchor(world: World) -> None:
    ada = await world.agent()
    team = world.im.group("team", world.alice, world.bob, ada.member_id)
    direct = world.im.group("", world.alice, ada.member_id, direct=True)
    world.im.post(world.bob, team.id, "the release codename is MARMALADE")
    await world.settle(ada)
    await world.archived()
    world.im.post(world.alice, direct.id, "which release codename did the team pick?")
    await world.settle(ada)

    steps = world.store.steps[ada.session_id]
    recalled = [s for s in steps if s.kind is StepKind.RECALL]
    assert len(recalled) == 1
    note = recalled[0].message.content or ""
    assert note.startswith(RECALLED_HEADER)
    team_run = steps[0].run_id
    assert f"ref={team_run}/1/0" in note and "MARMALADE" in note
    # Read first: the model sees what it remembers, then the question.
    direct_run = [s for s in steps if s.run_id == recalled[0].run_id]
    assert direct_run[0] == recalled[0] and "which release codename" in (direct_run[1].message.content or "")
    assert "MARMALADE" in world.requests_text()[-1]


async def test_weak_memories_are_not_recalled_and_recalled_ones_are_not_remembered_again(
    world: World,
) -> None:
    ada = await world.agent()
    team = world.im.group("team", world.alice, world.bob, ada.member_id)
    direct = world.im.group("", world.alice, ada.member_id, direct=True)
    world.im.post(world.bob, team.id, "the release codename is MARMALADE")
    await world.settle(ada)
    await world.archived()
    world.memory.score = 0.1  # below RUNTIME_RECALL_MIN_SCORE
    world.im.post(world.alice, direct.id, "which release codename?")
    await world.settle(ada)
    assert len(world.memory.recalls) == 2
    assert not any(s.kind is StepKind.RECALL for s in world.store.steps[ada.session_id])

    world.memory.score = 0.9
    world.im.post(world.alice, direct.id, "the release codename, again?")
    await world.settle(ada)
    await world.archived()
    (recall_step,) = [s for s in world.store.steps[ada.session_id] if s.kind is StepKind.RECALL]
    archived = world.memory.records[recall_step.run_id]
    assert recall_step.id not in {step.id for step, _ in archived.steps}  # a copy: not remembered again
    assert any("codename, again" in (step.message.content or "") for step, _ in archived.steps)


async def test_recall_leaves_out_the_runs_still_in_the_context(world: World) -> None:
    ada = await world.agent()
    direct = world.im.group("", world.alice, ada.member_id, direct=True)
    world.im.post(world.alice, direct.id, f"the vault code is {SECRET}")
    await world.settle(ada)
    await world.archived()
    world.im.post(world.alice, direct.id, "which vault code did I give you?")
    await world.settle(ada)
    first = world.store.steps[ada.session_id][0].run_id
    (*_, (_, _, query)) = world.memory.recalls
    assert first in query.exclude_run_ids  # it is in the context already
    assert not any(s.kind is StepKind.RECALL for s in world.store.steps[ada.session_id])


async def test_messages_waiting_in_two_chats_become_two_runs_each_answering_its_chat(world: World) -> None:
    ada = await world.agent()
    direct = world.im.group("", world.alice, ada.member_id, direct=True)
    team = world.im.group("team", world.alice, world.bob, ada.member_id)
    runner = world.supervisor.runner(ada.id)
    assert runner is not None
    world.im.post(world.alice, direct.id, "private: my salary is 90k")
    world.im.post(world.bob, team.id, "team: standup at ten")
    runner.wake()
    await world.settle(ada)

    runs = sorted(world.store.runs.values(), key=lambda r: r.id)
    assert [r.group_id for r in runs] == [direct.id, team.id]
    assert all(r.status is RunStatus.COMPLETED for r in runs)
    private, public = world.requests_text()
    assert "salary" in private and "standup" not in private
    assert "standup" in public and "salary" not in public
    assert [m.content for m in world.im.in_group(direct.id)][-1] == "noted"
    assert [m.content for m in world.im.in_group(team.id)][-1] == "noted"


async def test_every_ended_run_reaches_memory_with_its_chats_and_their_members(world: World) -> None:
    ada = await world.agent()
    team = world.im.group("team", world.alice, world.bob, ada.member_id)
    world.im.post(world.bob, team.id, "the release is on friday")
    await world.settle(ada)
    await world.archived()
    ((run_id, record),) = world.memory.records.items()
    assert world.store.runs[run_id].status is RunStatus.COMPLETED
    assert [chat for _, chat in record.steps] == [team.id, team.id]
    (conversation,) = record.conversations
    assert set(conversation.member_ids) == {world.alice, world.bob, ada.member_id}
    assert await world.store.unarchived_runs(limit=10) == []


async def test_the_outbox_holds_runs_while_memory_is_down_and_sends_each_once_it_is_back(
    world: World,
) -> None:
    world.memory.down = True
    ada = await world.agent()
    direct = world.im.group("", world.alice, ada.member_id, direct=True)
    for text in ("one", "two", "three"):
        world.im.post(world.alice, direct.id, text)
        await world.settle(ada)
    assert len(world.store.runs) == 3
    # The agent answered everything meanwhile; memory has nothing yet.
    assert [m.content for m in world.im.in_group(direct.id)].count("noted") == 3
    assert world.memory.records == {} and world.memory.archive_calls >= 1
    assert len(await world.store.unarchived_runs(limit=10)) == 3

    world.memory.down = False
    await asyncio.wait_for(_archived_runs(world.memory, 3), WAIT)
    assert set(world.memory.records) == set(world.store.runs)
    assert await world.store.unarchived_runs(limit=10) == []


async def test_a_run_memory_refuses_does_not_hold_up_the_others(world: World) -> None:
    ada = await world.agent()
    direct = world.im.group("", world.alice, ada.member_id, direct=True)
    world.memory.down = True
    world.im.post(world.alice, direct.id, "first")
    await world.settle(ada)
    (first,) = world.store.runs
    world.memory.refused.add(first)
    world.memory.down = False
    world.im.post(world.alice, direct.id, "second")
    await world.settle(ada)
    await world.archived()
    assert first not in world.memory.records and len(world.memory.records) == 1
    assert [r.id for r in await world.store.unarchived_runs(limit=10)] == [first]


async def test_a_changed_run_goes_to_memory_again(world: World) -> None:
    ada = await world.agent()
    direct = world.im.group("", world.alice, ada.member_id, direct=True)
    world.im.post(world.alice, direct.id, "the answer is 41")
    await world.settle(ada)
    await world.archived()
    step = world.store.steps[ada.session_id][0]
    await world.store.edit_step(step.id, "the answer is 42", at=datetime.now(UTC))
    world.archiver.notify()
    await world.archived()
    (record,) = world.memory.records.values()
    assert record.steps[0][0].message.content == "the answer is 42"
    assert world.memory.archive_calls == 2


async def test_recall_and_expand_tools_search_memory_for_the_chat_being_answered(world: World) -> None:
    ada = await world.agent()
    direct = world.im.group("", world.alice, ada.member_id, direct=True)
    world.im.post(world.alice, direct.id, f"the vault code is {SECRET}")
    await world.settle(ada)
    await world.archived()
    tools = default_registry()

    async def call(name: str, audience: tuple[uuid.UUID, ...], **arguments: object) -> str:
        context = ToolContext(
            agent=ada,
            im=world.im,
            trigger_group_id=None,
            create_sub_agent=world.app.factory.create_child,
            memory=world.memory,
            audience=audience,
        )
        outcome = await tools.execute(context, ToolCall("c1", name, json.dumps(arguments)))
        return outcome.content

    found = await call("recall", (world.alice, ada.member_id), query="vault code")
    assert SECRET in found and "ref=" in found
    assert await call("recall", (world.alice, world.bob, ada.member_id), query="vault code") == (
        "nothing found in memory"
    )
    ref = found.split("ref=", 1)[1].split(" ", 1)[0]
    expanded = await call("expand", (world.alice, ada.member_id), ref=ref, after=1)
    assert f"> ref={ref}" in expanded and "noted" in expanded
    assert (await call("recall", (), query="x", types=["gossip"])).startswith("error: 'types' must be")
    assert (await call("recall", (), query="x", since="last tuesday")).startswith("error: 'since' must be")
    assert (await call("expand", (), ref="", after=1)).startswith("error:")


async def test_memory_that_is_away_never_holds_an_agent_up(world: World) -> None:
    world.memory.down = True
    ada = await world.agent()
    direct = world.im.group("", world.alice, ada.member_id, direct=True)
    world.im.post(world.alice, direct.id, "hello there")
    await world.settle(ada)
    world.im.post(world.alice, direct.id, "hello again")
    await world.settle(ada)
    assert [m.content for m in world.im.in_group(direct.id)].count("noted") == 2
    assert len(world.memory.recalls) == 2  # tried, went on without


async def _archived_runs(memory: FakeMemory, count: int) -> None:
    while len(memory.records) < count:
        memory.changed.clear()
        await memory.changed.wait()


# -- the pure rules ---------------------------------------------------------------


def _step(run: uuid.UUID, sequence: int, message: ChatMessage, origin: Origin | None = None) -> Step:
    return Step(
        id=uuid.uuid4(),
        agent_id=uuid.UUID(int=1),
        session_id=uuid.UUID(int=2),
        run_id=run,
        sequence=sequence,
        message=message,
        metrics=StepMetrics(),
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        origin=origin,
    )


def _chat_input(run: uuid.UUID, sequence: int, group: uuid.UUID, text: str) -> Step:
    origin = Origin(group_id=group, group_name="chat", sender_id=uuid.UUID(int=9), sender_name="al")
    return _step(run, sequence, ChatMessage(role=Role.USER, content=text), origin)


def _task_input(run: uuid.UUID, sequence: int, text: str) -> Step:
    return _step(run, sequence, ChatMessage(role=Role.USER, content=text), Origin(task_id=uuid.uuid4()))


def _legacy_chat_input(group: uuid.UUID, text: str) -> ChatMessage:
    """An input as stored before steps had origins: the chat named in the text."""
    return ChatMessage(
        role=Role.USER, content=f"[group chat | group_id={group}] al (member_id={uuid.UUID(int=9)}): {text}"
    )


def test_each_run_belongs_to_the_conversation_its_input_names() -> None:
    chat_a, chat_b = uuid.uuid4(), uuid.uuid4()
    run_a, run_b, task_run, note_run = (uuid.uuid4() for _ in range(4))
    steps = [
        _chat_input(run_a, 1, chat_a, "hello"),
        _step(run_a, 2, ChatMessage(role=Role.ASSISTANT, content="hi")),
        _chat_input(run_b, 3, chat_b, "standup?"),
        _step(run_b, 4, ChatMessage(role=Role.ASSISTANT, content="at ten")),
        _task_input(task_run, 5, "write a report"),
        _step(note_run, 6, ChatMessage(role=Role.SYSTEM, content="be brief")),
    ]
    runs = run_conversations(steps)
    assert runs == {run_a: chat_a, run_b: chat_b, task_run: TASKS}
    assert [s.sequence for s in in_conversation(steps, chat_a, runs)] == [1, 2, 6]
    assert [s.sequence for s in in_conversation(steps, TASKS, runs)] == [5, 6]
    assert [s.sequence for s in in_conversation(steps, None, runs)] == [1, 2, 3, 4, 5, 6]


def test_inputs_stored_before_origins_name_their_conversation_in_their_text() -> None:
    chat, run, task_run = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    steps = [
        _step(run, 1, _legacy_chat_input(chat, "hello")),
        _step(task_run, 2, ChatMessage(role=Role.USER, content=f"[task {uuid.uuid4()}] write a report")),
    ]
    assert run_conversations(steps) == {run: chat, task_run: TASKS}
    nonsense = _step(run, 3, ChatMessage(role=Role.USER, content="[chat | group_id=nope] x"))
    assert conversation_of_input(nonsense) is None


def test_each_archived_step_carries_its_chat() -> None:
    chat_a, chat_b, run = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    steps = [
        _chat_input(run, 1, chat_a, "hello"),
        _step(run, 2, ChatMessage(role=Role.ASSISTANT, content="hi")),
    ]
    assert [chat for _, chat in step_chats(steps, chat_a)] == [chat_a, chat_a]
    # A run stored before runs knew their chat: its steps follow the chat they read.
    legacy = [*steps, _chat_input(run, 3, chat_b, "x"), _step(run, 4, ChatMessage(role=Role.TOOL))]
    assert [chat for _, chat in step_chats(legacy, None)] == [chat_a, chat_a, chat_b, chat_b]
    assert [chat for _, chat in step_chats([_task_input(run, 1, "go")], None)] == [None]


def test_a_recalled_memory_reads_with_its_ref_type_and_time() -> None:

    memory = Memory(
        ref="r/3/0",
        type="tool_result",
        text="x" * 700,
        score=0.5,
        created_at=datetime(2026, 5, 1, tzinfo=UTC),
    )
    line = describe_memory(memory)
    assert line.startswith("- ref=r/3/0 (tool_result, 2026-05-01 00:00 UTC): ") and line.endswith("…")


async def test_how_much_an_agent_recalls_is_its_own_setting(world: World) -> None:
    me = caller_of(world.alice, world.im.workspace, roles=("owner",))
    quiet = await world.app.bus.handle(CreateAgent(caller=me, draft=AgentDraft(name="quiet", auto_recall=0)))
    assert quiet.auto_recall == 0
    direct = world.im.group("", world.alice, quiet.member_id, direct=True)
    for text in (f"the vault code is {SECRET}", "which vault code was it?"):
        world.im.post(world.alice, direct.id, text)
        await world.settle(quiet)
        await world.archived()
    assert world.memory.recalls == []  # it never asked
    assert not any(
        (s.message.content or "").startswith(RECALLED_HEADER) for s in world.store.steps[quiet.session_id]
    )
    updated = await world.app.bus.handle(
        UpdateAgent(
            caller=me,
            agent_id=str(quiet.id),
            draft=AgentDraft(name="", auto_recall=5),
            fields=("auto_recall",),
        )
    )
    assert updated.auto_recall == 5
    cleared = await world.app.bus.handle(
        UpdateAgent(caller=me, agent_id=str(quiet.id), draft=AgentDraft(name=""), fields=("auto_recall",))
    )
    assert cleared.auto_recall is None  # back to the runtime's default
    for wrong in (-1, 21):
        with pytest.raises(InvalidAgentRequest, match="auto_recall must be from 0 to 20"):
            await world.app.bus.handle(CreateAgent(caller=me, draft=AgentDraft(name="x", auto_recall=wrong)))


def test_auto_recall_crosses_the_wire_unset_or_set() -> None:
    unset = pb.Agent(name="a")
    assert _draft(unset).auto_recall is None
    assert _draft(pb.Agent(name="a", auto_recall=0)).auto_recall == 0
    agent = Agent(
        id=uuid.uuid4(),
        workspace_id=uuid.uuid4(),
        member_id=uuid.uuid4(),
        name="a",
        role="",
        system_prompt="",
        model=ModelSettings(),
        tools=(),
        parent_id=None,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        updated_at=datetime(2026, 1, 1, tzinfo=UTC),
        session_id=uuid.uuid4(),
    )
    assert not mappers.agent(agent).HasField("auto_recall")
    assert mappers.agent(dataclasses.replace(agent, auto_recall=0)).HasField("auto_recall")


def test_an_archived_input_says_who_sent_it_and_a_task_does_not() -> None:
    agent = Agent(
        id=uuid.uuid4(),
        workspace_id=uuid.uuid4(),
        member_id=uuid.uuid4(),
        name="a",
        role="",
        system_prompt="",
        model=ModelSettings(),
        tools=(),
        parent_id=None,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        updated_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    run_id, chat = uuid.uuid4(), uuid.uuid4()
    run = Run(run_id, agent.id, uuid.uuid4(), RunStatus.COMPLETED, (), datetime(2026, 1, 1, tzinfo=UTC))
    steps = [_chat_input(run_id, 1, chat, "the build is green"), _task_input(run_id, 2, "write notes")]
    archived = archived_run(RunRecord(agent, run, [(steps[0], chat), (steps[1], None)], []))
    assert [s.content for s in archived.steps] == ["al: the build is green", "write notes"]
