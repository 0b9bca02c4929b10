"""The agent loop against in-memory fakes of the IM, the LLM and the store."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from services.common import errors
from services.common.identity import Caller
from services.runtime.bootstrap import RuntimeApp
from services.runtime.domain.commands import CreateAgent, UpdateAgent, WakeAgent
from services.runtime.domain.errors import (
    ContextTooLong,
    IMError,
    IMUnavailable,
    InvalidAgentRequest,
    LLMRejected,
    LLMUnavailable,
)
from services.runtime.domain.etiquette import GroupPolicy
from services.runtime.domain.llm import ContentDelta, ModelSettings, ReasoningDelta, Role
from services.runtime.domain.model import (
    Agent,
    AgentDraft,
    AgentState,
    Emitted,
    RunEnded,
    RunStatus,
    StateChanged,
    StepCompleted,
    StepDelta,
    StepKind,
    StepStarted,
)
from services.runtime.service_layer.hub import AgentHub
from services.runtime.service_layer.im_port import IMEvent
from services.runtime.service_layer.runner import HistoryCache
from services.runtime.service_layer.supervisor import Supervisor
from services.runtime.service_layer.tools import Tool, ToolRegistry
from services.runtime.service_layer.watches import AgentWatches
from tests.identities import caller_of
from tests.unit.runtime_fakes import FakeClock, FakeIM, InMemoryAgentStore, Refused, Script, ScriptedLLM
from tests.unit.runtime_support import fake_runtime, unit_settings

WAIT = 3.0


@dataclass
class Harness:
    """The runtime over fakes (`bootstrap.build`), and the fakes."""

    app: RuntimeApp
    im: FakeIM
    llm: ScriptedLLM
    store: InMemoryAgentStore
    clock: FakeClock
    human: uuid.UUID

    @property
    def hub(self) -> AgentHub:
        return self.app.hub

    @property
    def watches(self) -> AgentWatches:
        return self.app.watches

    @property
    def tools(self) -> ToolRegistry:
        return self.app.tools

    @property
    def supervisor(self) -> Supervisor:
        assert self.app.supervisor is not None
        return self.app.supervisor

    @property
    def me(self) -> Caller:
        # The workspace's only person, its owner.
        return caller_of(self.human, self.im.workspace, roles=("owner",))

    async def agent(self, name: str = "ada", **fields: object) -> Agent:
        draft = AgentDraft(name=name, **fields)  # type: ignore[arg-type]
        return await self.app.bus.handle(CreateAgent(caller=self.me, draft=draft))

    async def settle(self, *agents: Agent) -> None:
        """Waits until the agents' runners are idle."""
        for agent in agents:
            runner = self.supervisor.runner(agent.id)
            assert runner is not None
            await asyncio.sleep(0)
            await asyncio.wait_for(runner.idle.wait(), WAIT)

    def steps(self, agent: Agent) -> list[tuple[Role, str]]:
        return [(s.role, s.message.content or "") for s in self.store.steps.get(agent.session_id, [])]

    async def crash(self) -> None:
        """Stops the runtime where it is (a crash: its runners stop mid-work)."""
        await self.app.stop()

    async def restart(self, *, tools: Sequence[Tool] = ()) -> int:
        """A new runtime over the same store, IM and model after `crash`, with
        `tools` besides the built-in ones; returns how many agents it started."""
        self.app = fake_runtime(
            settings=self.app.settings, store=self.store, im=self.im, llm=self.llm, clock=self.clock
        )
        for tool in tools:
            self.app.tools.register(tool)
        _, started = await self.app.start()
        return started


async def harness(
    *scripts: Script,
    max_iterations: int = 10,
    chatter_limit: int = 20,
    max_reply_bytes: int = 64 * 1024,
    unread_batch: int = 200,
    im: FakeIM | None = None,
) -> AsyncIterator[Harness]:
    im = im if im is not None else FakeIM()
    llm, store, clock = ScriptedLLM(*scripts), InMemoryAgentStore(), FakeClock()
    settings = unit_settings(
        max_iterations=max_iterations,
        agent_chatter_limit=chatter_limit,
        max_reply_bytes=max_reply_bytes,
        unread_batch=unread_batch,
        group_policy=GroupPolicy.UNLESS_OTHERS_MENTIONED,
    )
    app = fake_runtime(settings=settings, store=store, im=im, llm=llm, clock=clock)
    await app.start()
    h = Harness(app, im, llm, store, clock, im.human("alice").id)
    yield h
    await h.app.stop()


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    async for value in harness(Script(content="Hello Alice!", reasoning="Greet her.")):
        yield value


async def test_a_direct_message_gets_an_answer(h: Harness) -> None:
    ada = await h.agent()
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    h.im.post(h.human, chat.id, "hi ada")
    await asyncio.sleep(0)
    await h.settle(ada)
    assert [m.content for m in h.im.in_group(chat.id)] == ["hi ada", "Hello Alice!"]
    # The input is the text as sent; who sent it where is its origin.
    said = h.store.steps[ada.session_id][0]
    assert said.role is Role.USER and said.message.content == "hi ada"
    assert said.origin is not None and said.origin.direct and said.origin.group_id == chat.id
    assert said.origin.sender_id == h.human and said.origin.sender_name.lower() == "alice"
    assistant = h.store.steps[ada.session_id][1]
    assert assistant.message.content == "Hello Alice!" and assistant.message.reasoning == "Greet her."
    assert assistant.metrics.input_tokens == 10 and assistant.metrics.model == "scripted"
    (run,) = h.store.runs.values()
    assert run.status is RunStatus.COMPLETED and run.iterations == 1
    assert h.store.agents[ada.id].state is AgentState.IDLE
    assert await h.im.get_all_unread(ada.member_id) == []
    # The context was the system prompt then the steps, as native messages.
    context = h.llm.last_messages()
    assert context[0].role is Role.SYSTEM and "ada" in (context[0].content or "")
    assert [m.role for m in context[1:]] == [Role.USER]
    # A direct chat: the text as sent, the sender named once in the system prompt, and no id.
    sent = context[1].to_openai()
    assert sent["content"] == "hi ada" and "name" not in sent
    assert f"direct chat with {said.origin.sender_name}" in (context[0].content or "")
    assert str(h.human) not in str([m.to_openai() for m in context])


async def test_a_group_message_reaches_the_model_with_the_group_and_sender_names() -> None:
    async for h in harness(Script(content="On it.")):
        ada = await h.agent()
        team = h.im.group("Team Alpha", h.human, ada.member_id)
        h.im.post(h.human, team.id, "@ada status?", mentions=[ada.member_id])
        await asyncio.sleep(0)
        await h.settle(ada)
        said = h.store.steps[ada.session_id][0]
        assert said.message.content == "@ada status?"
        assert said.origin is not None and not said.origin.direct and said.origin.group_name == "Team Alpha"
        name = said.origin.sender_name
        system, message = h.llm.last_messages()[:2]
        assert message.to_openai()["content"] == f"{name}: @ada status?"
        assert 'group chat "Team Alpha"' in (system.content or "")
        assert str(h.human) not in json.dumps([m.to_openai() for m in h.llm.last_messages()[1:]])
        # OpenAI's own API also gets the sender in `name`; other endpoints only the text.
        assert message.to_openai(user_names=True)["name"] == name


async def test_tool_calls_run_and_the_loop_continues() -> None:
    async for h in harness(
        Script(tool_calls=[("send_direct_message", json.dumps({"to": "bob", "content": "ping from ada"}))]),
        Script(content="I told Bob."),
    ):
        bob = h.im.human("bob")
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "tell @bob ping")
        await asyncio.sleep(0)
        await h.settle(ada)
        direct = await h.im.get_or_create_direct_group(ada.member_id, bob.id)
        assert [m.content for m in h.im.in_group(direct.id)] == ["ping from ada"]
        assert [m.content for m in h.im.in_group(chat.id)][-1] == "I told Bob."
        roles = [role for role, _ in h.steps(ada)]
        assert roles == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
        tool_step = h.store.steps[ada.session_id][2]
        call = h.store.steps[ada.session_id][1].message.tool_calls[0]
        assert tool_step.message.tool_call_id == call.id and tool_step.message.name == "send_direct_message"
        assert "sent message" in (tool_step.message.content or "")
        # The second call saw the tool result in its context.
        assert h.llm.requests[1].messages[-1].role is Role.TOOL


async def test_parallel_tool_calls_keep_their_order_and_failures_become_results() -> None:
    calls = [
        ("list_members", "{}"),
        ("no_such_tool", "{}"),
        ("send_message", "not json"),
        ("read_history", json.dumps({"group_id": str(uuid.uuid4())})),
    ]
    async for h in harness(Script(tool_calls=calls), Script(content="done")):
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "go")
        await asyncio.sleep(0)
        await h.settle(ada)
        tool_steps = [s for s in h.store.steps[ada.session_id] if s.role is Role.TOOL]
        assert [s.message.name for s in tool_steps] == [name for name, _ in calls]
        contents = [s.message.content or "" for s in tool_steps]
        assert "alice" in contents[0]
        assert contents[1].startswith("error: unknown tool 'no_such_tool'")
        assert contents[2].startswith("error: the arguments are not valid JSON")
        assert contents[3].startswith("error:") and "not found" in contents[3]
        assert h.store.agents[ada.id].state is AgentState.IDLE


async def test_a_message_arriving_mid_run_joins_the_same_run() -> None:
    state: dict[str, object] = {}

    async def meanwhile() -> None:
        h = state["h"]
        assert isinstance(h, Harness)
        chat = state["chat"]
        assert isinstance(chat, uuid.UUID)
        h.im.post(h.human, chat, "also, one more thing")

    async for h in harness(
        Script(tool_calls=[("list_groups", "{}")], before=None),
        Script(content="both handled", before=None),
    ):
        h.llm.scripts[0].before = meanwhile
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        state.update(h=h, chat=chat.id)
        h.im.post(h.human, chat.id, "first thing")
        await asyncio.sleep(0)
        await h.settle(ada)
        assert len(h.store.runs) == 1
        second_context = [m.content or "" for m in h.llm.requests[1].messages]
        assert any("one more thing" in c for c in second_context)
        (run,) = h.store.runs.values()
        assert len(run.trigger_message_ids) == 2


async def test_the_iteration_limit_ends_a_runaway_run() -> None:
    async for h in harness(Script(tool_calls=[("list_groups", "{}")]), max_iterations=3):
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "loop forever")
        await asyncio.sleep(0)
        await h.settle(ada)
        (run,) = h.store.runs.values()
        assert run.status is RunStatus.ITERATION_LIMIT and run.iterations == 3
        assert len(h.llm.requests) == 3


async def test_group_etiquette(h: Harness) -> None:
    ada = await h.agent()
    bob = h.im.human("bob")
    team = h.im.group("team", h.human, bob.id, ada.member_id)
    h.im.post(h.human, team.id, "@bob can you look?", mentions=[bob.id])
    await asyncio.sleep(0)
    await h.settle(ada)
    assert not h.store.runs, "a message for someone else is not answered"
    assert await h.im.get_all_unread(ada.member_id) == [], "but it is read"
    h.im.post(h.human, team.id, "@ada and you?", mentions=[ada.member_id])
    await asyncio.sleep(0)
    await h.settle(ada)
    assert len(h.store.runs) == 1
    h.im.post(h.human, team.id, "anyone?")
    await asyncio.sleep(0)
    await h.settle(ada)
    assert len(h.store.runs) == 2


async def test_a_person_mentioning_one_of_two_agents_gets_one_answer_and_the_agents_do_not_chat() -> None:
    async for h in harness(Script(content="Glad to help, everyone. What do you think?")):
        ada = await h.agent("ada")
        bea = await h.agent("bea")
        team = h.im.group("pair", ada.member_id, bea.member_id, h.human)
        h.im.post(h.human, team.id, "@ada can you look?", mentions=[ada.member_id])
        for _ in range(5):
            await asyncio.sleep(0.01)
            await h.settle(ada, bea)
        said = [(m.sender_id, m.content) for m in h.im.in_group(team.id)[1:]]
        assert said == [(ada.member_id, "Glad to help, everyone. What do you think?")]
        assert len(h.store.runs) == 1 and not h.steps(bea)
        # A person's message for no one in particular: both answer it, and
        # still neither answers the other.
        h.im.post(h.human, team.id, "anyone else?")
        for _ in range(5):
            await asyncio.sleep(0.01)
            await h.settle(ada, bea)
        senders = sorted(str(m.sender_id) for m in h.im.in_group(team.id)[3:])
        assert senders == sorted([str(ada.member_id), str(bea.member_id)])


async def test_an_agent_answers_another_that_names_it_or_replies_to_it_and_may_stay_silent() -> None:
    async for h in harness(
        Script(content="@Bea, what do you think?"),
        Script(content="I agree with @ada."),
        Script(content="no_reply."),
    ):
        ada = await h.agent("ada")
        bea = await h.agent("Bea")
        team = h.im.group("pair", ada.member_id, bea.member_id, h.human)
        h.im.post(h.human, team.id, "@ada ideas?", mentions=[ada.member_id])
        for _ in range(5):
            await asyncio.sleep(0.01)
            await h.settle(ada, bea)
        messages = h.im.in_group(team.id)
        # Ada's answer @names Bea, Bea's names Ada; Ada then has nothing to add.
        assert [(m.sender_id, m.content, m.mentions) for m in messages[1:]] == [
            (ada.member_id, "@Bea, what do you think?", (bea.member_id,)),
            (bea.member_id, "I agree with @ada.", (ada.member_id,)),
        ]
        assert len(h.store.runs) == 3
        # A reply to an agent's message reaches it without a mention.
        h.llm.scripts = [Script(content="Replying to your reply.")]
        h.llm.requests.clear()
        h.im.post(bea.member_id, team.id, "one more thing", reply_to=messages[1].id)
        for _ in range(5):
            await asyncio.sleep(0.01)
            await h.settle(ada, bea)
        assert [(m.sender_id, m.content) for m in h.im.in_group(team.id)[-1:]] == [
            (ada.member_id, "Replying to your reply.")
        ]


async def test_two_agents_in_a_direct_chat_say_one_thing_each_and_stop() -> None:
    """Ada asks Bea (as its send_direct_message tool does); Bea answers; Ada
    reads the answer and says its piece; Bea does not answer that: with a
    model that always answers, three messages, not a ping-pong to the limit."""
    async for h in harness(Script(content="Always something to say.")):
        ada = await h.agent("ada")
        bea = await h.agent("bea")
        pair = h.im.group("", ada.member_id, bea.member_id, direct=True)
        h.im.post(ada.member_id, pair.id, "what is the status?")
        for _ in range(10):
            await asyncio.sleep(0.01)
            await h.settle(ada, bea)
        said = [(m.sender_id, m.metadata) for m in h.im.in_group(pair.id)]
        assert [sender for sender, _ in said] == [ada.member_id, bea.member_id, ada.member_id]
        assert said[1][1]["agent_answer"]["ends_exchange"] is False  # type: ignore[index]
        assert said[2][1]["agent_answer"]["ends_exchange"] is True  # type: ignore[index]
        # Asked again by name, Bea answers: an exchange ends only by default.
        h.im.post(ada.member_id, pair.id, "@bea one more?", mentions=[bea.member_id])
        for _ in range(10):
            await asyncio.sleep(0.01)
            await h.settle(ada, bea)
        assert [m.sender_id for m in h.im.in_group(pair.id)][3:] == [
            ada.member_id,
            bea.member_id,
            ada.member_id,
        ]


async def test_agents_talking_to_each_other_stop_at_the_limit() -> None:
    async for h in harness(Script(content="@ada @bea and what do you think?"), chatter_limit=6):
        ada = await h.agent("ada")
        bea = await h.agent("bea")
        team = h.im.group("pair", ada.member_id, bea.member_id, h.human)
        h.im.post(h.human, team.id, "discuss")
        for _ in range(40):
            await asyncio.sleep(0.01)
            await h.settle(ada, bea)
        agent_messages = [m for m in h.im.in_group(team.id) if m.sender_id != h.human]
        assert 1 <= len(agent_messages) <= 7
        before = len(agent_messages)
        h.im.post(h.human, team.id, "go on")
        for _ in range(10):
            await asyncio.sleep(0.01)
            await h.settle(ada, bea)
        assert len([m for m in h.im.in_group(team.id) if m.sender_id != h.human]) > before


async def test_a_failing_endpoint_puts_the_agent_in_error_and_a_wake_recovers() -> None:
    async for h in harness(
        Script(fail=LLMUnavailable("endpoint down after 4 tries")), Script(content="back")
    ):
        ada = await h.agent()
        watcher, _ = h.hub.watch([ada.id])
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "hello?")
        await asyncio.sleep(0)
        await h.settle(ada)
        assert h.store.agents[ada.id].state is AgentState.ERROR
        assert "endpoint down" in h.store.agents[ada.id].last_error
        (failed,) = h.store.runs.values()
        assert failed.status is RunStatus.FAILED
        # The person sees in the chat why no answer came, and how to retry.
        notice = h.im.in_group(chat.id)[-1]
        assert notice.sender_id == ada.member_id and notice.content_type == "system"
        assert notice.content.startswith("I could not answer: my model did not respond")
        assert "endpoint down after 4 tries" in notice.content
        assert notice.metadata == {
            "agent_failure": {
                "agent_id": str(ada.id),
                "run_id": str(failed.id),
                "status": "failed",
                "trouble": "model_down",
                "retry": "WakeAgent",
            }
        }
        await h.app.bus.handle(WakeAgent(caller=h.me, agent_id=str(ada.id)))
        await h.settle(ada)
        assert h.store.agents[ada.id].state is AgentState.IDLE
        assert [m.content for m in h.im.in_group(chat.id)] == ["hello?", notice.content, "back"]
        states: list[AgentState] = []
        events = watcher.events()
        while True:
            try:
                emitted = await asyncio.wait_for(events.__anext__(), 0.05)
            except TimeoutError:
                break
            if isinstance(emitted.event, StateChanged):
                states.append(emitted.event.state)
        assert AgentState.ERROR in states and states[-1] is AgentState.IDLE
        await events.aclose()


async def test_a_run_failed_for_its_context_is_told_in_the_chat_and_a_wake_retries_it() -> None:
    too_long = ContextTooLong("http://llm refused model 'm' with HTTP 400: context too long", window=4096)
    async for h in harness(Script(fail=too_long), Script(fail=too_long), Script(content="fits now")):
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "a long story")
        await asyncio.sleep(0)
        await h.settle(ada)
        # Not the agent's fault: it stays IDLE, and the chat says what happened.
        assert h.store.agents[ada.id].state is AgentState.IDLE
        notice = h.im.in_group(chat.id)[-1]
        assert (
            notice.content_type == "system" and "no longer fits my model's context window" in notice.content
        )
        assert "context too long" in notice.content
        await h.app.bus.handle(WakeAgent(caller=h.me, agent_id=str(ada.id)))
        await h.settle(ada)
        assert h.im.in_group(chat.id)[-1].content == "fits now"
        statuses = sorted(r.status.value for r in h.store.runs.values())
        assert statuses == ["completed", "failed"]


async def test_another_agents_failure_notice_is_not_answered(h: Harness) -> None:
    ada = await h.agent("ada")
    bea = await h.agent("bea")
    between = h.im.group("", ada.member_id, bea.member_id, direct=True)
    h.im.post(
        bea.member_id, between.id, "I could not answer: my model did not respond.", content_type="system"
    )
    await asyncio.sleep(0)
    await h.settle(ada, bea)
    assert not h.store.runs and len(h.im.in_group(between.id)) == 1


async def test_a_spent_budget_is_told_in_the_chat() -> None:
    async for h in harness(Script(tool_calls=[("list_groups", "{}")])):
        ada = await h.agent(token_budget=20)
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "work hard")
        await asyncio.sleep(0)
        await h.settle(ada)
        notice = h.im.in_group(chat.id)[-1]
        assert notice.content_type == "system" and "used up my token budget" in notice.content
        assert notice.metadata is not None and notice.metadata["agent_failure"]["trouble"] == "budget"


async def test_watching_mid_run_gives_missed_steps_then_live_deltas() -> None:
    gate = asyncio.Event()
    release = asyncio.Event()

    async def pause() -> None:
        gate.set()
        await release.wait()

    async for h in harness(Script(content="a long answer", reasoning="hmm", before=None)):
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.llm.scripts[0].before = pause
        h.im.post(h.human, chat.id, "question")
        await asyncio.wait_for(gate.wait(), WAIT)
        stream = await h.watches.watch_agent(h.me, str(ada.id), after_sequence=0, live_only=False)
        release.set()
        got: list[Emitted] = []
        async for emitted in stream:
            got.append(emitted)
            if isinstance(emitted.event, StepCompleted) and emitted.event.step.role is Role.ASSISTANT:
                break
        await stream.aclose()
        kinds = [type(e.event) for e in got]
        assert kinds[0] is StepCompleted and got[0].event.step.sequence == 1  # type: ignore[union-attr]
        assert StepStarted in kinds
        text = "".join(
            e.event.delta.text
            for e in got
            if isinstance(e.event, StepDelta) and isinstance(e.event.delta, ContentDelta | ReasoningDelta)
        )
        assert text == "hmm" + "a long answer"
        sequences = [e.event.step.sequence for e in got if isinstance(e.event, StepCompleted)]
        assert sequences == [1, 2]


async def test_a_sub_agent_made_by_an_agent_runs_at_once_and_answers_its_own_chats() -> None:
    make_one = Script(tool_calls=[("create_sub_agent", json.dumps({"name": "kid", "role": "helper"}))])
    async for h in harness(make_one, Script(content="done")):
        ada = await h.agent(tools=("create_sub_agent",))
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "make a helper")
        await asyncio.sleep(0)
        await h.settle(ada)
        (kid,) = [a for a in h.store.agents.values() if a.parent_id == ada.id]
        assert h.app.runners.live(kid.id) is not None, "its runner started with it"
        asked = len(h.llm.requests)
        kid_chat = h.im.group("", h.human, kid.member_id, direct=True)
        h.im.post(h.human, kid_chat.id, "hello kid")
        await asyncio.sleep(0)
        await h.settle(kid)
        assert len(h.llm.requests) == asked + 1
        assert [m.content for m in h.im.in_group(kid_chat.id)] == ["hello kid", "done"]


async def test_restart_restores_agents_with_their_history(h: Harness) -> None:
    ada = await h.agent()
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    h.im.post(h.human, chat.id, "remember me")
    await asyncio.sleep(0)
    await h.settle(ada)
    await h.crash()
    assert await h.restart() == 1
    h.im.post(h.human, chat.id, "still there?")
    runner = h.supervisor.runner(ada.id)
    assert runner is not None
    runner.wake()
    await asyncio.sleep(0)
    await asyncio.wait_for(runner.idle.wait(), WAIT)
    context = [m.content or "" for m in h.llm.last_messages()]
    assert any("remember me" in c for c in context) and any("still there?" in c for c in context)


async def test_bad_agent_settings_are_refused(h: Harness) -> None:
    with pytest.raises(InvalidAgentRequest, match="unknown tools"):
        await h.agent(tools=("launch_rockets",))
    with pytest.raises(InvalidAgentRequest, match="temperature"):
        await h.agent(model=ModelSettings(temperature=5.0))
    with pytest.raises(InvalidAgentRequest, match="base_url"):
        await h.agent(model=ModelSettings(base_url="ftp://x"))
    with pytest.raises(InvalidAgentRequest, match="name"):
        await h.agent(name="  ")


async def test_the_token_budget_stops_an_agent() -> None:
    async for h in harness(Script(tool_calls=[("list_groups", "{}")])):
        ada = await h.agent(token_budget=20)  # each scripted completion uses 15 tokens
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "work hard")
        await asyncio.sleep(0)
        await h.settle(ada)
        (run,) = h.store.runs.values()
        assert run.status is RunStatus.BUDGET_EXHAUSTED and len(h.llm.requests) == 2
        assert h.store.agents[ada.id].tokens_used == 30
        # A new message does not start the model again until the budget is raised.
        h.im.post(h.human, chat.id, "more")
        await asyncio.sleep(0)
        await h.settle(ada)
        assert len(h.llm.requests) == 2
        await h.app.bus.handle(
            UpdateAgent(
                caller=h.me,
                agent_id=str(ada.id),
                draft=AgentDraft(name="ada", token_budget=100),
                fields=("token_budget",),
            )
        )
        h.im.post(h.human, chat.id, "now go on")
        await asyncio.sleep(0)
        await h.settle(ada)
        assert len(h.llm.requests) > 2


async def test_without_usage_from_the_endpoint_tokens_are_estimated_and_the_budget_holds() -> None:
    answer = "a fairly long answer " * 20
    async for h in harness(
        Script(tool_calls=[("list_groups", "{}")], usage=None), Script(content=answer, usage=None)
    ):
        ada = await h.agent(token_budget=100_000)
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "work hard")
        await asyncio.sleep(0)
        await h.settle(ada)
        steps = [s for s in h.store.steps[ada.session_id] if s.role is Role.ASSISTANT]
        assert len(steps) == 2 and all(s.metrics.usage_estimated for s in steps)
        first, second = (s.metrics for s in steps)
        # The request grew by the tool round; the answer is longer than the tool call.
        assert 0 < first.input_tokens < second.input_tokens
        assert 0 < first.output_tokens < second.output_tokens
        used = h.store.agents[ada.id].tokens_used
        assert used == sum(m.input_tokens + m.output_tokens for m in (first, second))
        # And the budget is enforced on the estimate.
        await h.app.bus.handle(
            UpdateAgent(
                caller=h.me,
                agent_id=str(ada.id),
                draft=AgentDraft(name="ada", token_budget=used),
                fields=("token_budget",),
            )
        )
        h.im.post(h.human, chat.id, "more")
        await asyncio.sleep(0)
        await h.settle(ada)
        assert len(h.llm.requests) == 2


async def test_watching_several_agents_and_the_workspace(h: Harness) -> None:
    ada = await h.agent("ada")
    bea = await h.agent("bea")
    both = await h.watches.watch_agents(h.me, agent_ids=[str(ada.id)], workspace_id="")
    everyone = await h.watches.watch_agents(h.me, agent_ids=[], workspace_id="")
    for agent in (ada, bea):
        chat = h.im.group("", h.human, agent.member_id, direct=True)
        h.im.post(h.human, chat.id, "hi")
        await asyncio.sleep(0)
        await h.settle(agent)

    async def drain(events: AsyncIterator[Emitted]) -> set[uuid.UUID]:
        seen: set[uuid.UUID] = set()
        while True:
            try:
                emitted = await asyncio.wait_for(events.__anext__(), 0.05)
            except TimeoutError:
                return seen
            seen.add(emitted.agent_id)

    assert await drain(both) == {ada.id}
    assert await drain(everyone) == {ada.id, bea.id}
    await both.aclose()
    await everyone.aclose()


async def test_an_unreachable_im_is_retried_without_blaming_the_agent(h: Harness) -> None:
    ada = await h.agent()
    await h.settle(ada)
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    real = h.im.get_all_unread
    failures = 0

    async def flaky(as_member: uuid.UUID, *, limit: int = 200) -> list[Any]:
        nonlocal failures
        if failures == 0:
            failures += 1
            raise IMUnavailable("the IM is restarting")
        return await real(as_member, limit=limit)

    h.im.get_all_unread = flaky  # type: ignore[method-assign]
    watcher, _ = h.hub.watch([ada.id])
    events = watcher.events()
    h.im.post(h.human, chat.id, "are you there?")
    # The event brings the message; catching up with the IM (as after a
    # gap in the events) finds it away.
    runner = h.supervisor.runner(ada.id)
    assert runner is not None
    runner.catch_up()

    async def run_ended() -> None:
        async for emitted in events:
            if isinstance(emitted.event, RunEnded):
                return

    await asyncio.wait_for(run_ended(), WAIT)
    await events.aclose()
    assert failures == 1
    assert [m.content for m in h.im.in_group(chat.id)][-1].startswith("Hello")
    assert h.store.agents[ada.id].state is AgentState.IDLE and not h.store.agents[ada.id].last_error


async def test_an_answer_longer_than_the_im_allows_arrives_in_parts() -> None:
    paragraph = "word " * 30
    answer = "\n\n".join([paragraph] * 10)
    async for h in harness(Script(content=answer), max_reply_bytes=400):
        h.im.max_content_bytes = 400
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "write a lot")
        await asyncio.sleep(0)
        await h.settle(ada)
        parts = [m.content for m in h.im.in_group(chat.id)][1:]
        assert len(parts) > 1 and "".join(parts) == answer
        (run,) = h.store.runs.values()
        assert run.status is RunStatus.COMPLETED


async def test_an_answer_the_im_refuses_fails_the_run_not_the_agent(h: Harness) -> None:
    ada = await h.agent()
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    h.im.send_failures.append(Refused("group not found"))
    h.im.post(h.human, chat.id, "first")
    await asyncio.sleep(0)
    await h.settle(ada)
    (run,) = h.store.runs.values()
    assert run.status is RunStatus.FAILED and "group not found" in run.error
    assert h.store.agents[ada.id].state is AgentState.IDLE
    h.im.post(h.human, chat.id, "second")
    await asyncio.sleep(0)
    await h.settle(ada)
    assert [m.content for m in h.im.in_group(chat.id)] == ["first", "second", "Hello Alice!"]
    assert [r.status for r in h.store.runs.values()] == [RunStatus.FAILED, RunStatus.COMPLETED]


async def until_a_run_completes(h: Harness, agent: Agent) -> list[RunStatus]:
    """Waits (the runner is idle while it backs off) for a COMPLETED run; returns every run's status."""
    watcher, _ = h.hub.watch([agent.id])
    events = watcher.events()
    try:

        async def completed() -> None:
            async for emitted in events:
                if isinstance(emitted.event, RunEnded) and emitted.event.run.status is RunStatus.COMPLETED:
                    return

        await asyncio.wait_for(completed(), WAIT)
    finally:
        await events.aclose()
    await h.settle(agent)
    return [r.status for r in sorted(h.store.runs.values(), key=lambda r: r.id)]


async def test_an_answer_lost_to_an_unreachable_im_is_posted_once_the_im_is_back(h: Harness) -> None:
    ada = await h.agent()
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    h.im.send_failures.append(IMUnavailable("the IM is restarting"))
    h.im.post(h.human, chat.id, "hello?")
    assert await until_a_run_completes(h, ada) == [RunStatus.COMPLETED]
    assert [m.content for m in h.im.in_group(chat.id)] == ["hello?", "Hello Alice!"]
    agent = h.store.agents[ada.id]
    assert agent.state is AgentState.IDLE and not agent.last_error, "the IM's outage is not the agent's fault"
    assert len(h.llm.requests) == 1, "the answer was kept, not asked for again"
    assert await h.im.get_all_unread(ada.member_id) == [], "what it read stays read"


async def test_a_tool_call_lost_to_an_unreachable_im_runs_again_once_the_im_is_back() -> None:
    calls = [
        ("list_groups", "{}"),
        ("send_direct_message", json.dumps({"to": "bob", "content": "ping from ada"})),
    ]
    async for h in harness(Script(tool_calls=calls), Script(content="I told Bob.")):
        bob = h.im.human("bob")
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.send_failures.append(IMUnavailable("the IM is restarting"))
        h.im.post(h.human, chat.id, "tell @bob ping")
        assert await until_a_run_completes(h, ada) == [RunStatus.COMPLETED]
        direct = await h.im.get_or_create_direct_group(ada.member_id, bob.id)
        assert [m.content for m in h.im.in_group(direct.id)] == ["ping from ada"]
        assert [m.content for m in h.im.in_group(chat.id)][-1] == "I told Bob."
        results = [s.message for s in h.store.steps[ada.session_id] if s.role is Role.TOOL]
        # The result that came is kept; the lost call is answered once, by its second try.
        assert [r.name for r in results] == ["list_groups", "send_direct_message"]
        assert "sent message" in (results[1].content or ""), "the outage is not the model's to handle"
        assert len(h.llm.requests) == 2, "the tool call was run again, not asked for again"
        agent = h.store.agents[ada.id]
        assert agent.state is AgentState.IDLE and not agent.last_error


async def test_a_database_outage_mid_run_resumes_the_run_without_blaming_the_agent() -> None:
    store_box: list[InMemoryAgentStore] = []

    async def database_goes_down() -> None:
        store_box[0].outages["append_step"] = 1  # the completion cannot be stored

    async for h in harness(Script(content="first try", before=database_goes_down), Script(content="Hello!")):
        store_box.append(h.store)
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "hello?")
        # The run the outage cut goes on once the database is back, as after a restart.
        assert await until_a_run_completes(h, ada) == [RunStatus.COMPLETED]
        assert [m.content for m in h.im.in_group(chat.id)] == ["hello?", "Hello!"]
        assert h.steps(ada)[0][1].endswith("hello?") and h.steps(ada)[1:] == [(Role.ASSISTANT, "Hello!")]
        agent = h.store.agents[ada.id]
        assert agent.state is AgentState.IDLE and not agent.last_error


async def test_a_run_whose_end_could_not_be_stored_is_not_left_running(h: Harness) -> None:
    ada = await h.agent()
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    h.store.outages["update_run"] = 1
    h.im.post(h.human, chat.id, "hello?")
    assert await until_a_run_completes(h, ada) == [RunStatus.COMPLETED]
    assert [m.content for m in h.im.in_group(chat.id)] == ["hello?", "Hello Alice!"], "posted once"
    assert h.store.agents[ada.id].state is AgentState.IDLE


async def test_a_run_that_could_not_begin_leaves_its_messages_for_the_next(h: Harness) -> None:
    ada = await h.agent()
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    h.store.outages["add_run"] = 1
    h.im.post(h.human, chat.id, "hello?")
    assert await until_a_run_completes(h, ada) == [RunStatus.COMPLETED]
    assert [m.content for m in h.im.in_group(chat.id)] == ["hello?", "Hello Alice!"]
    assert h.store.agents[ada.id].state is AgentState.IDLE


async def test_messages_read_into_a_run_are_not_read_again_when_marking_them_failed(h: Harness) -> None:
    ada = await h.agent()
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    real = h.im.mark_read
    failures = 0

    async def unreachable_once(as_member: uuid.UUID, group_id: uuid.UUID, up_to: uuid.UUID) -> None:
        nonlocal failures
        if failures == 0:
            failures += 1
            raise IMUnavailable("the IM is restarting")
        await real(as_member, group_id, up_to)

    h.im.mark_read = unreachable_once  # type: ignore[method-assign]
    h.im.post(h.human, chat.id, "hello?")
    await asyncio.sleep(0)
    await h.settle(ada)
    h.im.post(h.human, chat.id, "and now?")
    await asyncio.sleep(0)
    await h.settle(ada)
    answers = ["hello?", "Hello Alice!", "and now?", "Hello Alice!"]
    assert [m.content for m in h.im.in_group(chat.id)] == answers
    inputs = [content for role, content in h.steps(ada) if role is Role.USER]
    assert len(inputs) == 2 and inputs[1].endswith("and now?"), "the first message was not read in twice"
    assert await h.im.get_all_unread(ada.member_id) == []


async def test_adding_agents_resumes_the_watch_without_waking_the_others(h: Harness) -> None:
    ada = await h.agent()
    await h.settle(ada)
    reads = h.im.unread_reads.total()
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    others = [await h.agent(f"agent-{i}") for i in range(5)]
    h.im.post(h.human, chat.id, "sent while the watch restarts")
    await asyncio.sleep(0)
    await h.settle(ada, *others)
    assert [m.content for m in h.im.in_group(chat.id)][-1] == "Hello Alice!", "the message was not lost"
    # One read per new agent (its first look) and one for ada's message: none for waking everyone.
    assert h.im.unread_reads.total() - reads <= len(others) + 2


def test_the_history_cache_keeps_the_most_recently_used_within_its_bound() -> None:
    cache = HistoryCache(max_steps=5)
    agents = [uuid.uuid4() for _ in range(3)]
    step_lists: list[list[Any]] = [[object()] * 2 for _ in agents]
    for agent, steps in zip(agents, step_lists, strict=True):
        cache.keep(agent, steps)
    assert len(cache) == 2, "the least recently used went first"
    assert cache.take(agents[0]) is None
    assert cache.take(agents[2]) is step_lists[2] and cache.take(agents[2]) is None
    too_many: list[Any] = [object()] * 6
    cache.keep(agents[0], too_many)  # larger than the whole cache: not kept
    assert cache.take(agents[0]) is None


async def test_an_agent_in_a_conversation_does_not_reload_its_history(h: Harness) -> None:
    ada = await h.agent()
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    loads = 0
    real = h.store.list_steps

    async def counted(session_id: uuid.UUID, **kwargs: Any) -> Any:
        nonlocal loads
        loads += 1
        return await real(session_id, **kwargs)

    h.store.list_steps = counted  # type: ignore[method-assign]
    for text in ("one", "two", "three"):
        h.im.post(h.human, chat.id, text)
        await asyncio.sleep(0)
        await h.settle(ada)
    assert loads == 1
    assert [m.role for m in h.llm.last_messages()[1:]] == [Role.USER, Role.ASSISTANT] * 2 + [Role.USER]


async def test_a_restart_resumes_the_im_watch_and_wakes_only_the_agents_it_concerns(h: Harness) -> None:
    ada, bea = await h.agent("ada"), await h.agent("bea")
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    h.im.post(h.human, chat.id, "first")
    await asyncio.sleep(0)
    await h.settle(ada, bea)
    for _ in range(20):  # the cursor is saved once the agents are idle
        await asyncio.sleep(0)
    assert h.store.cursors == {h.im.workspace: str(len(h.im.messages))}
    await h.crash()

    h.im.post(h.human, chat.id, "sent while the runtime was down")
    h.im.unread_reads.clear()
    assert await h.restart() == 2
    await asyncio.sleep(0)
    await h.settle(ada, bea)
    assert [m.content for m in h.im.in_group(chat.id)][-1] == "Hello Alice!"
    assert len(h.im.in_group(chat.id)) == 4
    # The replay brought the message to ada: nobody asked the IM for unread messages.
    assert not h.im.unread_reads


async def test_a_message_left_for_a_retry_is_not_skipped_by_the_saved_cursor(h: Harness) -> None:
    """A runner that meets the database away waits before it tries again,
    idle meanwhile: the cursor saved then must not pass the message it still
    owes an answer, or the next start (a restart, another replica taking the
    shard) replays from after it and nobody ever answers it."""
    ada = await h.agent("ada")
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    await h.settle(ada)
    for _ in range(20):
        await asyncio.sleep(0)
    assert h.store.cursors, "the watch's start was saved"
    await h.crash()
    await h.restart()  # ada waits for the replay: she reads her marks with the first message
    real = h.store.read_marks
    tried = asyncio.Event()

    async def away(agent_id: uuid.UUID) -> dict[uuid.UUID, uuid.UUID]:
        tried.set()
        raise errors.Unavailable("the database is restarting")

    h.store.read_marks = away  # type: ignore[method-assign]
    h.im.post(h.human, chat.id, "are you there?")
    await asyncio.wait_for(tried.wait(), WAIT)
    await h.settle(ada)
    for _ in range(20):
        await asyncio.sleep(0)
    await h.crash()  # before the runner's retry
    h.store.read_marks = real  # type: ignore[method-assign]
    await h.restart()
    for _ in range(20):
        await asyncio.sleep(0)
    await h.settle(ada)
    assert [m.content for m in h.im.in_group(chat.id)][-1] == "Hello Alice!"


async def test_agents_that_were_busy_look_at_once_after_a_restart(h: Harness) -> None:
    ada, bea = await h.agent("ada"), await h.agent("bea")
    await h.settle(ada, bea)
    for _ in range(20):
        await asyncio.sleep(0)
    assert h.store.cursors, "the watch's start was saved"
    await h.crash()
    h.store.agents[ada.id] = dataclasses.replace(h.store.agents[ada.id], state=AgentState.RUNNING)
    h.im.unread_reads.clear()
    await h.restart()
    await h.settle(ada)
    assert set(h.im.unread_reads) == {ada.member_id}


async def test_more_unread_than_one_read_takes_are_all_answered() -> None:
    async for h in harness(Script(content="got it"), unread_batch=2):
        ada = await h.agent()
        await h.settle(ada)
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        runner = h.supervisor.runner(ada.id)
        assert runner is not None
        await runner.stop()  # the messages pile up while it is away
        for text in ("one", "two", "three"):
            h.im.post(h.human, chat.id, text)
        runner.start()
        await asyncio.sleep(0)
        await h.settle(ada)
        runs = list(h.store.runs.values())
        assert len(runs) == 2 and [len(r.trigger_message_ids) for r in runs] == [2, 1]
        assert await h.im.get_all_unread(ada.member_id) == []


async def test_a_stream_that_breaks_off_midway_is_kept_as_cut_and_asked_for_again() -> None:
    cut = LLMUnavailable("stream cut after 2 deltas from the endpoint: connection reset")
    async for h in harness(
        Script(content="Hello there, Alice", reasoning="Greet.", cut_after=3, cut=cut),
        Script(content="Hello Alice!"),
    ):
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "hi")
        await asyncio.sleep(0)
        await h.settle(ada)
        # One answer in the chat: the retried one.
        assert [m.content for m in h.im.in_group(chat.id)] == ["hi", "Hello Alice!"]
        steps = h.store.steps[ada.session_id]
        assert [(s.role, s.kind) for s in steps] == [
            (Role.USER, StepKind.MESSAGE),
            (Role.ASSISTANT, StepKind.CUT),
            (Role.ASSISTANT, StepKind.MESSAGE),
        ]
        # What people saw stream stays, marked as cut.
        assert steps[1].message.content == "Hello th" and steps[1].message.reasoning == "Greet."
        # The retry asked again without it, and counted as the same iteration.
        assert len(h.llm.requests) == 2
        assert "Hello th" not in str([m.to_openai() for m in h.llm.requests[1].messages])
        (run,) = h.store.runs.values()
        assert run.status is RunStatus.COMPLETED and run.iterations == 1
        assert h.store.agents[ada.id].state is AgentState.IDLE


async def test_a_stream_broken_off_by_an_error_no_retry_fixes_is_kept_and_not_asked_again() -> None:
    refused = LLMRejected("the endpoint refused the request (invalid_request_error): bad tool schema")
    async for h in harness(Script(content="Let me think about that", cut_after=2, cut=refused)):
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "hi")
        await asyncio.sleep(0)
        await h.settle(ada)
        assert len(h.llm.requests) == 1
        steps = h.store.steps[ada.session_id]
        assert [s.kind for s in steps] == [StepKind.MESSAGE, StepKind.CUT]
        assert steps[1].message.content == "Let me t"
        (run,) = h.store.runs.values()
        assert run.status is RunStatus.FAILED and "bad tool schema" in run.error
        # The people in the chat are told, with the endpoint's reason.
        notice = h.im.in_group(chat.id)[-1]
        assert notice.content_type == "system" and "bad tool schema" in notice.content


class LossyIM(FakeIM):
    """A fake IM whose event stream drops, repeats and reorders events, as a
    faulty network or a buggy port might (the IM itself never does)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.random = random.Random(seed)
        self.dropped = self.repeated = self.reordered = 0
        self.lossy = True

    async def watch(
        self,
        workspace_id: uuid.UUID,
        *,
        member_ids: Sequence[uuid.UUID] = (),
        after_cursor: str = "",
        on_subscribed: Callable[[str], object] | None = None,
    ) -> AsyncIterator[IMEvent]:
        held: IMEvent | None = None
        events = super().watch(
            workspace_id, member_ids=member_ids, after_cursor=after_cursor, on_subscribed=on_subscribed
        )
        async for event in events:
            roll = self.random.random()
            if not self.lossy:
                out = [event]
            elif roll < 0.2:
                self.dropped += 1
                out = []
            elif roll < 0.4:
                self.repeated += 1
                out = [event, event]
            elif roll < 0.6 and held is None:
                held, out = event, []  # comes after the next one
            else:
                out = [event]
            if held is not None and out:
                self.reordered += 1
                out, held = [*out, held], None
            for item in out:
                yield item


async def test_events_dropped_repeated_or_reordered_at_the_port_make_each_message_input_once() -> None:
    im = LossyIM(seed=5)
    async for h in harness(Script(content="noted"), im=im):
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        await h.settle(ada)
        sent = []
        for number in range(60):
            sent.append(h.im.post(h.human, chat.id, f"note {number}").id)
            for _ in range(im.random.randrange(4)):
                await asyncio.sleep(0)
        # The last event may be held back: a quiet stream and a person's look.
        im.lossy = False
        h.im.post(h.human, chat.id, "that is all")
        await asyncio.sleep(0)
        await h.settle(ada)
        assert im.dropped and im.repeated and im.reordered, "the port did lose, repeat and reorder events"
        inputs = [
            step.origin.message_id
            for step in h.store.steps[ada.session_id]
            if step.role is Role.USER and step.origin is not None and step.origin.message_id is not None
        ]
        assert sorted(inputs) == sorted([*sent, h.im.messages[-2].id]), "every message input exactly once"
        assert h.im.in_group(chat.id)[-1].content == "noted"


async def test_a_wake_takes_the_message_from_its_event_without_asking_the_im(h: Harness) -> None:
    ada = await h.agent()
    await h.settle(ada)
    h.im.unread_reads.clear()
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    for number in range(5):
        h.im.post(h.human, chat.id, f"message {number}")
        await asyncio.sleep(0)
        await h.settle(ada)
    assert len([m for m in h.im.in_group(chat.id) if m.sender_id == ada.member_id]) == 5
    assert not h.im.unread_reads, "one push per wake: no GetAllUnread"


async def test_an_answer_the_im_had_under_its_key_already_counts_as_sent(h: Harness) -> None:
    # Another replica sent this step's answer before a handoff, knowing the
    # chat a little differently: the IM refuses the key for other content.
    reused = IMError("request_id 'answer/...' was already used for a different message")
    reused.relayed_status = "ALREADY_EXISTS"
    h.im.send_failures.append(reused)
    ada = await h.agent()
    chat = h.im.group("", h.human, ada.member_id, direct=True)
    h.im.post(h.human, chat.id, "hi ada")
    await asyncio.sleep(0)
    await h.settle(ada)
    (run,) = h.store.runs.values()
    assert run.status is RunStatus.COMPLETED, run.error
    assert [m.content for m in h.im.in_group(chat.id)] == ["hi ada"], "not sent a second time"
    assert h.app.runners.live(ada.id) is not None and h.store.agents[ada.id].state is AgentState.IDLE
