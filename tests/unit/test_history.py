"""Human control of an agent's history (issue 5) against the in-memory fakes:
steps edited, deleted and added while paused, checkpoints, sessions, retry
from a step and fork."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from services.common import errors
from services.common.identity import Caller
from services.common.tokens import AccessClaims, PrincipalKind
from services.runtime.domain.commands import (
    AddNote,
    CreateAgent,
    CreateCheckpoint,
    DeleteStep,
    ForkFromStep,
    PauseAgent,
    RestoreCheckpoint,
    ResumeAgent,
    RetryFromStep,
    SetMainSession,
    TerminateAgent,
    UpdateAgent,
    UpdateStep,
)
from services.runtime.domain.errors import LLMUnavailable, NotAllowed
from services.runtime.domain.llm import Role
from services.runtime.domain.model import (
    Agent,
    AgentDraft,
    AgentState,
    Emitted,
    MainSessionChanged,
    StepsRewritten,
)
from services.runtime.service_layer.history_views import HistoryViews
from services.runtime.service_layer.hub import Watcher
from services.runtime.service_layer.messagebus import MessageBus
from tests.identities import caller_of
from tests.unit.runtime_fakes import Script
from tests.unit.test_runner import Harness, harness

CALL_TOOL = Script(tool_calls=[("list_groups", "{}")])


@dataclass
class World:
    h: Harness
    history: HistoryViews
    bus: MessageBus

    @property
    def me(self) -> Caller:
        return self.h.me

    async def talk(self, agent: Agent, text: str) -> None:
        """A direct message to the agent, and its run to the end."""
        chat = await self.h.im.get_or_create_direct_group(self.h.human, agent.member_id)
        self.h.im.post(self.h.human, chat.id, text)
        await asyncio.sleep(0)
        await self.h.settle(agent)

    async def paused(self, agent: Agent) -> None:
        await self.h.settle(agent)
        paused = await self.bus.handle(PauseAgent(caller=self.me, agent_id=str(agent.id)))
        assert paused.state is AgentState.PAUSED

    def live(self, agent: Agent) -> Agent:
        runner = self.h.supervisor.runner(agent.id)
        assert runner is not None
        return runner.agent

    def steps(self, agent: Agent) -> list[tuple[int, Role, str]]:
        session = self.live(agent).session_id
        stored = sorted(self.h.store.steps.get(session, []), key=lambda s: s.sequence)
        return [(s.sequence, s.role, s.message.content or "") for s in stored]

    def archived(self, reason: str) -> list[int]:
        return [step.sequence for why, _, step in self.h.store.archive if why == reason]


async def world(*scripts: Script) -> AsyncIterator[World]:
    async for h in harness(*scripts):
        yield World(h, h.app.history, h.app.bus)


@pytest.fixture
async def w() -> AsyncIterator[World]:
    async for value in world(Script(content="Hello Alice!")):
        yield value


async def drain(watcher: Watcher) -> list[Emitted]:
    """What the watcher has received so far."""
    got: list[Emitted] = []
    events = watcher.events()
    while True:
        try:
            got.append(await asyncio.wait_for(events.__anext__(), 0.05))
        except TimeoutError:
            await events.aclose()
            return got


def rewritten(events: list[Emitted]) -> list[tuple[uuid.UUID, int]]:
    return [
        (e.event.session_id, e.event.after_sequence) for e in events if isinstance(e.event, StepsRewritten)
    ]


def context(w: World) -> list[tuple[Role, str]]:
    """The last completion's context, system prompt left out."""
    return [(m.role, m.content or "") for m in w.h.llm.last_messages()[1:]]


# -- who may do what -------------------------------------------------------------


async def test_edits_need_a_paused_agent(w: World) -> None:
    ada = await w.h.agent()
    await w.talk(ada, "hi")
    with pytest.raises(errors.FailedPrecondition, match="IDLE: it may edit its steps only when PAUSED"):
        await w.bus.handle(UpdateStep(caller=w.me, agent_id=str(ada.id), sequence=1, content="changed"))
    with pytest.raises(errors.FailedPrecondition, match="only when PAUSED"):
        await w.bus.handle(DeleteStep(caller=w.me, agent_id=str(ada.id), sequence=1))
    with pytest.raises(errors.FailedPrecondition, match="only when PAUSED"):
        await w.bus.handle(AddNote(caller=w.me, agent_id=str(ada.id), role=Role.SYSTEM, content="be brief"))
    assert [s for s, _, _ in w.steps(ada)] == [1, 2] and w.h.store.archive == []


async def test_unknown_agents_bad_ids_and_strangers(w: World) -> None:
    ada = await w.h.agent()
    with pytest.raises(errors.NotFound):
        await w.history.list_sessions(w.me, str(uuid.uuid4()))
    with pytest.raises(errors.InvalidArgument, match="agent_id"):
        await w.bus.handle(CreateCheckpoint(caller=w.me, agent_id="nope", name="x"))
    stranger = w.h.im.human("eve")
    with pytest.raises(errors.NotFound):
        await w.history.list_sessions(caller_of(stranger.id, uuid.uuid4()), str(ada.id))
    with pytest.raises(errors.Unauthenticated):
        await w.history.list_sessions(None, str(ada.id))
    await w.paused(ada)
    with pytest.raises(errors.InvalidArgument, match="checkpoint_id"):
        await w.bus.handle(RestoreCheckpoint(caller=w.me, agent_id=str(ada.id), checkpoint_id="bad"))
    with pytest.raises(errors.NotFound):
        await w.bus.handle(
            RestoreCheckpoint(caller=w.me, agent_id=str(ada.id), checkpoint_id=str(uuid.uuid4()))
        )
    with pytest.raises(errors.NotFound, match="step 7"):
        await w.bus.handle(UpdateStep(caller=w.me, agent_id=str(ada.id), sequence=7, content="x"))
    with pytest.raises(errors.InvalidArgument, match="at least 1"):
        await w.bus.handle(DeleteStep(caller=w.me, agent_id=str(ada.id), sequence=0))


# -- edit, delete, note ------------------------------------------------------------


async def test_edit_then_resume_uses_the_edited_context_and_keeps_the_original(w: World) -> None:
    ada = await w.h.agent()
    await w.talk(ada, "the password is hunter2")
    await w.paused(ada)
    watcher, _ = w.h.hub.watch([ada.id])
    step = await w.bus.handle(
        UpdateStep(caller=w.me, agent_id=str(ada.id), sequence=1, content="the password is [removed]")
    )
    assert step.sequence == 1 and step.message.content == "the password is [removed]"
    assert rewritten(await drain(watcher)) == [(ada.session_id, 0)]
    ((reason, _, original),) = w.h.store.archive
    assert reason == "edited" and "hunter2" in (original.message.content or "")
    assert original.id == step.id
    with pytest.raises(errors.InvalidArgument, match="empty"):
        await w.bus.handle(UpdateStep(caller=w.me, agent_id=str(ada.id), sequence=1, content=""))

    chat = await w.h.im.get_or_create_direct_group(w.h.human, ada.member_id)
    w.h.im.post(w.h.human, chat.id, "what was it?")
    await asyncio.sleep(0)
    assert len(w.h.llm.requests) == 1, "paused: the message waits"
    await w.bus.handle(ResumeAgent(caller=w.me, agent_id=str(ada.id)))
    await w.h.settle(ada)
    seen = [content for _, content in context(w)]
    assert seen[0] == "the password is [removed]" and not any("hunter2" in c for c in seen)
    assert "what was it?" in seen[-1]


async def test_a_note_is_the_next_step_and_part_of_the_next_context(w: World) -> None:
    ada = await w.h.agent()
    await w.talk(ada, "hi")
    await w.paused(ada)
    watcher, _ = w.h.hub.watch([ada.id])
    note = await w.bus.handle(
        AddNote(caller=w.me, agent_id=str(ada.id), role=Role.SYSTEM, content="Answer in French from now on.")
    )
    user = await w.bus.handle(
        AddNote(caller=w.me, agent_id=str(ada.id), role=Role.USER, content="(Alice prefers short answers.)")
    )
    assert (note.sequence, user.sequence) == (3, 4) and note.role is Role.SYSTEM
    assert rewritten(await drain(watcher)) == [(ada.session_id, 2), (ada.session_id, 3)]
    for role in (None, Role.ASSISTANT, Role.TOOL):
        with pytest.raises(errors.InvalidArgument, match="role"):
            await w.bus.handle(AddNote(caller=w.me, agent_id=str(ada.id), role=role, content="x"))
    with pytest.raises(errors.InvalidArgument, match="content"):
        await w.bus.handle(AddNote(caller=w.me, agent_id=str(ada.id), role=Role.USER, content="  "))
    await w.bus.handle(ResumeAgent(caller=w.me, agent_id=str(ada.id)))
    await w.talk(ada, "and now?")
    assert context(w)[2:4] == [
        (Role.SYSTEM, "Answer in French from now on."),
        (Role.USER, "(Alice prefers short answers.)"),
    ]


async def test_a_tool_result_cannot_be_deleted_alone_but_goes_with_its_call() -> None:
    async for w in world(CALL_TOOL, Script(content="You are in one group.")):
        ada = await w.h.agent()
        await w.talk(ada, "which groups am I in?")
        roles = [r for _, r, _ in w.steps(ada)]
        assert roles == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
        await w.paused(ada)
        with pytest.raises(errors.FailedPrecondition, match="result of a tool call of step 2"):
            await w.bus.handle(DeleteStep(caller=w.me, agent_id=str(ada.id), sequence=3))
        removed = await w.bus.handle(DeleteStep(caller=w.me, agent_id=str(ada.id), sequence=2))
        assert removed == [2, 3]
        assert [(s, r) for s, r, _ in w.steps(ada)] == [(1, Role.USER), (4, Role.ASSISTANT)]
        assert sorted(w.archived("deleted")) == [2, 3]
        with pytest.raises(errors.NotFound):
            await w.bus.handle(DeleteStep(caller=w.me, agent_id=str(ada.id), sequence=2))
        # The next context has no call without its result.
        await w.bus.handle(ResumeAgent(caller=w.me, agent_id=str(ada.id)))
        await w.talk(ada, "thanks")
        assert [r for r, _ in context(w)] == [Role.USER, Role.ASSISTANT, Role.USER]


async def test_deleting_a_plain_step_keeps_the_later_numbers(w: World) -> None:
    ada = await w.h.agent()
    await w.talk(ada, "one")
    await w.talk(ada, "two")
    await w.paused(ada)
    assert await w.bus.handle(DeleteStep(caller=w.me, agent_id=str(ada.id), sequence=3)) == [3]
    assert [s for s, _, _ in w.steps(ada)] == [1, 2, 4]
    await w.bus.handle(ResumeAgent(caller=w.me, agent_id=str(ada.id)))
    await w.talk(ada, "three")
    assert [s for s, _, _ in w.steps(ada)] == [1, 2, 4, 5, 6]
    assert [r for r, _ in context(w)] == [Role.USER, Role.ASSISTANT, Role.ASSISTANT, Role.USER]


# -- checkpoints ------------------------------------------------------------------


async def test_restoring_a_checkpoint_brings_back_settings_and_steps(w: World) -> None:
    ada = await w.h.agent(system_prompt="Be kind.")
    await w.talk(ada, "one")
    checkpoint = await w.bus.handle(CreateCheckpoint(caller=w.me, agent_id=str(ada.id), name=" before two "))
    assert (checkpoint.name, checkpoint.sequence, checkpoint.session_id) == ("before two", 2, ada.session_id)
    await w.bus.handle(
        UpdateAgent(
            caller=w.me,
            agent_id=str(ada.id),
            draft=AgentDraft(name="ada2", system_prompt="Be terse."),
            fields=("name", "system_prompt"),
        )
    )
    await w.talk(ada, "two")
    with pytest.raises(errors.InvalidArgument, match="name"):
        await w.bus.handle(CreateCheckpoint(caller=w.me, agent_id=str(ada.id), name=""))
    (listed,) = (await w.history.list_checkpoints(w.me, str(ada.id), page_size=0, page_token=""))[0]
    assert listed.settings.system_prompt == "Be kind." and listed.settings.name == "ada"

    watcher, _ = w.h.hub.watch([ada.id])
    restored = await w.bus.handle(
        RestoreCheckpoint(caller=w.me, agent_id=str(ada.id), checkpoint_id=str(checkpoint.id))
    )
    assert restored.system_prompt == "Be kind." and restored.name == "ada"
    assert w.h.store.agents[ada.id].system_prompt == "Be kind."
    assert w.h.im.members[ada.member_id].display_name == "ada"
    assert [s for s, _, _ in w.steps(ada)] == [1, 2]
    assert sorted(w.archived("restored")) == [3, 4]
    assert rewritten(await drain(watcher)) == [(ada.session_id, 2)]
    await w.talk(ada, "three")
    prompt = w.h.llm.last_messages()[0].content or ""
    assert "Be kind." in prompt and [c for _, c in context(w)][1] == "Hello Alice!"
    assert not any("two" in c for _, c in context(w))


async def test_checkpoints_list_newest_first_in_pages(w: World) -> None:
    ada = await w.h.agent()
    made = [
        await w.bus.handle(CreateCheckpoint(caller=w.me, agent_id=str(ada.id), name=f"c{i}"))
        for i in range(5)
    ]
    first, token = await w.history.list_checkpoints(w.me, str(ada.id), page_size=2, page_token="")
    second, token2 = await w.history.list_checkpoints(w.me, str(ada.id), page_size=2, page_token=token)
    third, end = await w.history.list_checkpoints(w.me, str(ada.id), page_size=2, page_token=token2)
    assert [c.name for c in first + second + third] == ["c4", "c3", "c2", "c1", "c0"] and end == ""
    assert {c.id for c in made} == {c.id for c in first + second + third}
    with pytest.raises(errors.InvalidArgument):
        await w.history.list_checkpoints(w.me, str(ada.id), page_size=-1, page_token="")


async def test_restore_is_refused_while_running_or_terminated() -> None:
    gate, started = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        started.set()
        await gate.wait()

    async for w in world(Script(content="slow", before=hold)):
        ada = await w.h.agent()
        checkpoint = await w.bus.handle(CreateCheckpoint(caller=w.me, agent_id=str(ada.id), name="empty"))
        chat = await w.h.im.get_or_create_direct_group(w.h.human, ada.member_id)
        w.h.im.post(w.h.human, chat.id, "hi")
        await asyncio.wait_for(started.wait(), 3)
        assert w.live(ada).state is AgentState.RUNNING
        with pytest.raises(errors.FailedPrecondition, match="RUNNING"):
            await w.bus.handle(
                RestoreCheckpoint(caller=w.me, agent_id=str(ada.id), checkpoint_id=str(checkpoint.id))
            )
        with pytest.raises(errors.FailedPrecondition, match="RUNNING"):
            await w.bus.handle(RetryFromStep(caller=w.me, agent_id=str(ada.id), sequence=2))
        with pytest.raises(errors.FailedPrecondition, match="RUNNING"):
            await w.bus.handle(
                SetMainSession(caller=w.me, agent_id=str(ada.id), session_id=str(ada.session_id))
            )
        with pytest.raises(errors.FailedPrecondition, match="RUNNING"):
            await w.bus.handle(ForkFromStep(caller=w.me, agent_id=str(ada.id), sequence=1, new_agent=False))
        gate.set()
        await w.h.settle(ada)
        await w.bus.handle(TerminateAgent(caller=w.me, agent_id=str(ada.id), clear_queue=False))
        with pytest.raises(errors.FailedPrecondition, match="TERMINATED"):
            await w.bus.handle(
                RestoreCheckpoint(caller=w.me, agent_id=str(ada.id), checkpoint_id=str(checkpoint.id))
            )


# -- sessions ---------------------------------------------------------------------


async def test_every_agent_has_a_main_session_and_may_switch(w: World) -> None:
    ada = await w.h.agent()
    await w.talk(ada, "one")
    agent, sessions = await w.history.list_sessions(w.me, str(ada.id))
    assert [(s.id, count) for s, count in sessions] == [(ada.session_id, 2)]
    assert agent.session_id == ada.session_id
    fork, _ = await w.bus.handle(ForkFromStep(caller=w.me, agent_id=str(ada.id), sequence=2, new_agent=False))
    _, sessions = await w.history.list_sessions(w.me, str(ada.id))
    assert [(s.id, count) for s, count in sessions] == [(ada.session_id, 2), (fork.id, 2)]
    assert w.live(ada).session_id == fork.id

    watcher, _ = w.h.hub.watch([ada.id])
    back = await w.bus.handle(
        SetMainSession(caller=w.me, agent_id=str(ada.id), session_id=str(ada.session_id))
    )
    assert back.session_id == ada.session_id == w.h.store.agents[ada.id].session_id
    again = await w.bus.handle(
        SetMainSession(caller=w.me, agent_id=str(ada.id), session_id=str(ada.session_id))
    )
    assert again.session_id == ada.session_id
    changes = [e.event.session.id for e in await drain(watcher) if isinstance(e.event, MainSessionChanged)]
    assert changes == [ada.session_id], "a change is one event; no change, none"
    await w.talk(ada, "two")
    assert len(w.h.store.steps[ada.session_id]) == 4 and len(w.h.store.steps[fork.id]) == 2

    bea = await w.h.agent("bea")
    with pytest.raises(errors.NotFound):
        await w.bus.handle(SetMainSession(caller=w.me, agent_id=str(ada.id), session_id=str(bea.session_id)))
    with pytest.raises(errors.NotFound):
        await w.bus.handle(SetMainSession(caller=w.me, agent_id=str(ada.id), session_id=str(uuid.uuid4())))
    with pytest.raises(errors.InvalidArgument, match="session_id"):
        await w.bus.handle(SetMainSession(caller=w.me, agent_id=str(ada.id), session_id="x"))


# -- retry ------------------------------------------------------------------------


async def test_retry_after_a_user_step_calls_the_model_again() -> None:
    async for w in world(Script(content="first answer"), Script(content="second answer")):
        ada = await w.h.agent()
        await w.talk(ada, "hi")
        chat = await w.h.im.get_or_create_direct_group(w.h.human, ada.member_id)
        watcher, _ = w.h.hub.watch([ada.id])
        await w.bus.handle(RetryFromStep(caller=w.me, agent_id=str(ada.id), sequence=2))
        await w.h.settle(ada)
        assert [(s, c) for s, _, c in w.steps(ada)][1] == (2, "second answer")
        assert w.archived("retried") == [2]
        assert [(r, "hi" in c) for r, c in context(w)] == [(Role.USER, True)]
        assert [m.content for m in w.h.im.in_group(chat.id)][-1] == "second answer"
        assert rewritten(await drain(watcher))[0] == (ada.session_id, 1)
        assert w.live(ada).state is AgentState.IDLE


async def test_retry_after_a_tool_step_calls_the_model_with_the_result() -> None:
    async for w in world(CALL_TOOL, Script(content="one group")):
        ada = await w.h.agent()
        await w.talk(ada, "groups?")
        assert len(w.h.llm.requests) == 2
        await w.bus.handle(RetryFromStep(caller=w.me, agent_id=str(ada.id), sequence=4))
        await w.h.settle(ada)
        assert len(w.h.llm.requests) == 3
        assert [r for r, _ in context(w)] == [Role.USER, Role.ASSISTANT, Role.TOOL]
        assert [r for _, r, _ in w.steps(ada)] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]


async def test_retry_after_tool_calls_runs_them_first() -> None:
    async for w in world(CALL_TOOL, Script(content="one group")):
        ada = await w.h.agent()
        await w.talk(ada, "groups?")
        first_result = w.h.store.steps[ada.session_id][2]
        await w.bus.handle(RetryFromStep(caller=w.me, agent_id=str(ada.id), sequence=3))
        await w.h.settle(ada)
        steps = w.h.store.steps[ada.session_id]
        assert [s.role for s in steps] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
        assert (
            steps[2].id != first_result.id
            and steps[2].message.tool_call_id == first_result.message.tool_call_id
        )
        assert len(w.h.llm.requests) == 3, "the tool ran again, then the model"
        assert sorted(w.archived("retried")) == [3, 4]


async def test_retry_of_an_agent_in_error_goes_on_from_the_tool_result() -> None:
    down = Script(fail=LLMUnavailable("endpoint down"))
    async for w in world(CALL_TOOL, down, Script(content="back")):
        ada = await w.h.agent()
        await w.talk(ada, "groups?")
        assert w.live(ada).state is AgentState.ERROR
        assert [r for _, r, _ in w.steps(ada)] == [Role.USER, Role.ASSISTANT, Role.TOOL]
        agent = await w.bus.handle(RetryFromStep(caller=w.me, agent_id=str(ada.id), sequence=3))
        assert agent.id == ada.id
        await w.h.settle(ada)
        assert w.live(ada).state is AgentState.IDLE
        assert [c for _, _, c in w.steps(ada)][-1] == "back" and len(w.steps(ada)) == 4
        assert w.archived("retried") == [3], "the tool ran again"


async def test_retry_of_a_paused_agent_resumes_it(w: World) -> None:
    ada = await w.h.agent()
    await w.talk(ada, "hi")
    await w.paused(ada)
    agent = await w.bus.handle(RetryFromStep(caller=w.me, agent_id=str(ada.id), sequence=2))
    assert agent.state is not AgentState.PAUSED
    await w.h.settle(ada)
    assert w.live(ada).state is AgentState.IDLE and len(w.h.llm.requests) == 2


async def test_retry_bounds_and_nothing_to_continue(w: World) -> None:
    ada = await w.h.agent()
    with pytest.raises(errors.InvalidArgument, match="no step"):
        await w.bus.handle(RetryFromStep(caller=w.me, agent_id=str(ada.id), sequence=2))
    await w.talk(ada, "one")
    await w.talk(ada, "two")
    for bad in (0, 1, 5):
        with pytest.raises(errors.InvalidArgument, match="between 2 and the last step"):
            await w.bus.handle(RetryFromStep(caller=w.me, agent_id=str(ada.id), sequence=bad))
    with pytest.raises(errors.InvalidArgument, match="step 2 is the agent's answer"):
        await w.bus.handle(RetryFromStep(caller=w.me, agent_id=str(ada.id), sequence=3))
    assert w.h.store.archive == []


# -- fork -------------------------------------------------------------------------


async def test_fork_into_a_session_copies_and_continues_there() -> None:
    async for w in world(Script(content="first"), Script(content="forked answer")):
        ada = await w.h.agent()
        await w.talk(ada, "hi")
        original = list(w.h.store.steps[ada.session_id])
        watcher, _ = w.h.hub.watch([ada.id])
        fork, agent = await w.bus.handle(
            ForkFromStep(caller=w.me, agent_id=str(ada.id), sequence=1, new_agent=False)
        )
        await w.h.settle(ada)
        assert agent.id == ada.id and fork.forked_from == ada.session_id and fork.forked_at_sequence == 1
        assert w.h.store.steps[ada.session_id] == original, "the original is untouched"
        copied = w.h.store.steps[fork.id]
        assert [(s.sequence, s.message.content) for s in copied] == [
            (1, original[0].message.content),
            (2, "forked answer"),
        ]
        assert copied[0].id != original[0].id and copied[0].session_id == fork.id
        assert w.h.store.agents[ada.id].session_id == fork.id
        changed = [
            e.event.session.id for e in await drain(watcher) if isinstance(e.event, MainSessionChanged)
        ]
        assert changed == [fork.id]
        with pytest.raises(errors.InvalidArgument, match="between 1"):
            await w.bus.handle(ForkFromStep(caller=w.me, agent_id=str(ada.id), sequence=3, new_agent=False))
        with pytest.raises(errors.InvalidArgument, match="new_agent"):
            await w.bus.handle(
                ForkFromStep(caller=w.me, agent_id=str(ada.id), sequence=1, new_agent=False, name="x")
            )


async def test_fork_into_a_clone_agent() -> None:
    async for w in world(CALL_TOOL, Script(content="one group"), Script(content="clone says hi")):
        boss = await w.h.agent("boss")
        ada = await w.bus.handle(
            CreateAgent(
                caller=w.me,
                draft=AgentDraft(name="ada", role="helper", system_prompt="Be kind.", tools=("list_groups",)),
                parent_id=str(boss.id),
            )
        )
        await w.talk(ada, "groups?")
        original = list(w.h.store.steps[ada.session_id])
        await w.paused(ada)
        fork, clone = await w.bus.handle(
            ForkFromStep(caller=w.me, agent_id=str(ada.id), sequence=1, new_agent=True)
        )
        await w.h.settle(clone)
        assert clone.id != ada.id and clone.name == "ada (fork)" and clone.parent_id == boss.id
        assert (clone.role, clone.system_prompt, clone.tools) == ("helper", "Be kind.", ("list_groups",))
        assert clone.member_id != ada.member_id and w.h.im.members[clone.member_id].kind == "agent"
        assert (
            fork.id == clone.session_id and fork.agent_id == clone.id and fork.forked_from == ada.session_id
        )
        steps = w.h.store.steps[clone.session_id]
        assert [s.sequence for s in steps] == [1, 2] and steps[1].message.content == "clone says hi"
        assert all(s.agent_id == clone.id for s in steps)
        # The original is untouched, still paused.
        assert w.h.store.steps[ada.session_id] == original and w.live(ada).state is AgentState.PAUSED
        _, sessions = await w.history.list_sessions(w.me, str(clone.id))
        assert [(s.id, s.forked_from, n) for s, n in sessions] == [(clone.session_id, ada.session_id, 2)]
        named, _ = await w.bus.handle(
            ForkFromStep(caller=w.me, agent_id=str(ada.id), sequence=1, new_agent=True, name="ada-b")
        )
        assert w.h.store.agents[named.agent_id].name == "ada-b"


async def test_a_fork_after_an_answer_waits_for_the_next_message(w: World) -> None:
    ada = await w.h.agent()
    await w.talk(ada, "hi")
    fork, _ = await w.bus.handle(ForkFromStep(caller=w.me, agent_id=str(ada.id), sequence=2, new_agent=False))
    await w.h.settle(ada)
    assert len(w.h.llm.requests) == 1 and len(w.h.store.steps[fork.id]) == 2


async def test_a_clone_and_a_sub_agent_belong_to_the_owner_of_the_agent_they_come_from(w: World) -> None:
    workspace = w.h.im.members[w.h.human].workspace_id

    def token(member: uuid.UUID, role: str) -> Caller:
        claims = AccessClaims(
            kind=PrincipalKind.HUMAN, member_id=member, workspace_id=workspace, roles=(role,)
        )
        return Caller(claims=claims)

    owner, admin = token(w.h.human, "member"), token(uuid.uuid4(), "admin")
    other = token(uuid.uuid4(), "member")
    ada = await w.bus.handle(CreateAgent(caller=owner, draft=AgentDraft(name="ada")))
    assert ada.owner_id == w.h.human
    await w.talk(ada, "hi")
    await w.paused(ada)
    with pytest.raises(NotAllowed):
        await w.bus.handle(ForkFromStep(caller=other, agent_id=str(ada.id), sequence=2, new_agent=True))
    _, clone = await w.bus.handle(
        ForkFromStep(caller=admin, agent_id=str(ada.id), sequence=2, new_agent=True)
    )
    assert clone.owner_id == w.h.human
    child = await w.h.app.factory.create_child(ada, "kid", "", "")
    assert child.owner_id == w.h.human
    # The admin created neither; the owner controls both.
    await w.history.list_sessions(owner, str(clone.id))
    await w.h.app.agents.list_steps(owner, str(child.id), after_sequence=0, page_size=10, run_id="")
