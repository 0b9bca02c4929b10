"""People's controls of an agent (issue 5): the transitions, pause at a step
boundary, interrupt mid-stream and mid-tool, terminate, and going on after a
restart, against the in-memory fakes."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from services.common.status import status_name
from services.runtime.domain.commands import (
    InterruptAgent,
    PauseAgent,
    ResumeAgent,
    StartAgent,
    TerminateAgent,
)
from services.runtime.domain.errors import AgentGone, InvalidTransition
from services.runtime.domain.lifecycle import (
    CANCELLED_RESULT,
    Control,
    Next,
    check_control,
    interrupted_message,
    resume_point,
    unanswered_calls,
)
from services.runtime.domain.llm import ChatMessage, Role, ToolCall, ToolSpec
from services.runtime.domain.model import (
    AgentState,
    Emitted,
    RunStatus,
    StateChanged,
    Step,
    StepMetrics,
)
from services.runtime.service_layer.messagebus import MessageBus
from services.runtime.service_layer.tools import Tool, ToolContext, ToolRegistry, default_registry
from tests.unit.runtime_fakes import Script
from tests.unit.test_runner import WAIT, Harness, harness

# -- the rules ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("control", "allowed"),
    [
        (Control.START, {AgentState.TERMINATED}),
        (Control.PAUSE, {AgentState.IDLE, AgentState.RUNNING, AgentState.ERROR}),
        (Control.RESUME, {AgentState.PAUSED}),
        (Control.INTERRUPT, {AgentState.RUNNING}),
        (Control.TERMINATE, set(AgentState) - {AgentState.TERMINATED}),
    ],
)
def test_each_control_is_allowed_in_its_states_only(control: Control, allowed: set[AgentState]) -> None:
    for state in AgentState:
        if state in allowed:
            check_control(control, state)
        else:
            with pytest.raises(InvalidTransition, match=f"cannot {control.value}"):
                check_control(control, state)


def _step(sequence: int, message: ChatMessage) -> Step:
    nil = uuid.UUID(int=0)
    return Step(nil, nil, nil, nil, sequence, message, StepMetrics(), created_at=None)  # type: ignore[arg-type]


def test_where_a_history_resumes_from() -> None:
    call = ToolCall(id="c1", name="list_groups", arguments="{}")
    asked = _step(1, ChatMessage(role=Role.USER, content="hi"))
    calling = _step(2, ChatMessage(role=Role.ASSISTANT, tool_calls=(call, replace(call, id="c2"))))
    one_result = _step(3, ChatMessage(role=Role.TOOL, content="r", tool_call_id="c1"))
    both = _step(4, ChatMessage(role=Role.TOOL, content="r", tool_call_id="c2"))
    answered = _step(5, ChatMessage(role=Role.ASSISTANT, content="done"))
    assert resume_point([]) is Next.NOTHING
    assert resume_point([asked]) is Next.CALL_MODEL
    assert resume_point([asked, calling]) is Next.RUN_TOOLS
    assert unanswered_calls([asked, calling, one_result]) == (replace(call, id="c2"),)
    assert resume_point([asked, calling, one_result]) is Next.RUN_TOOLS
    assert resume_point([asked, calling, one_result, both]) is Next.CALL_MODEL
    assert resume_point([asked, calling, one_result, both, answered]) is Next.NOTHING


def test_an_interrupted_step_keeps_its_text_and_only_whole_tool_calls() -> None:
    partial = ChatMessage(
        role=Role.ASSISTANT,
        content="I will",
        reasoning="think",
        tool_calls=(
            ToolCall(id="a", name="send", arguments='{"to": "bob"}'),
            ToolCall(id="b", name="send", arguments='{"to": "bo'),
        ),
    )
    kept = interrupted_message(partial)
    assert kept.content == "I will" and kept.reasoning == "think"
    assert [c.id for c in kept.tool_calls] == ["a"]


# -- the runner under control ---------------------------------------------------------


async def lifecycle_harness(*scripts: Script) -> AsyncIterator[tuple[Harness, MessageBus]]:
    async for h in harness(*scripts):
        yield h, h.app.bus


def states(events: list[Emitted]) -> list[AgentState]:
    return [e.event.state for e in events if isinstance(e.event, StateChanged)]


async def wait_for_state(h: Harness, agent_id: uuid.UUID, state: AgentState) -> None:
    """Until the agent's stream says it is in `state` (or it already is)."""
    watcher, _ = h.hub.watch([agent_id])
    events = watcher.events()
    try:
        runner = h.supervisor.runner(agent_id)
        if runner is not None and runner.agent.state is state:
            return

        async def reached() -> None:
            async for emitted in events:
                if isinstance(emitted.event, StateChanged) and emitted.event.state is state:
                    return

        await asyncio.wait_for(reached(), WAIT)
    finally:
        await events.aclose()


async def collect(events: AsyncIterator[Emitted], into: list[Emitted]) -> None:
    async for emitted in events:
        into.append(emitted)


def gate_script(content: str, *, hold_after: int) -> tuple[Script, asyncio.Event]:
    gate = asyncio.Event()
    return Script(content=content, reasoning="hmm", hold_after=hold_after, gate=gate), gate


async def test_interrupt_mid_stream_keeps_the_partial_step_and_pauses() -> None:
    script, gate = gate_script("Hello there, Alice!", hold_after=3)
    async for h, bus in lifecycle_harness(script):
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "hi")
        await asyncio.wait_for(script.reached.wait(), WAIT)
        agent = await bus.handle(InterruptAgent(caller=h.me, agent_id=str(ada.id)))
        assert agent.state is AgentState.PAUSED
        steps = h.store.steps[ada.session_id]
        assert [s.role for s in steps] == [Role.USER, Role.ASSISTANT]
        partial = steps[-1]
        assert partial.interrupted and partial.message.reasoning == "hmm"
        # It held after three deltas: the reasoning, "Hell" and "o th".
        assert partial.message.content == "Hello th"
        (run,) = h.store.runs.values()
        assert run.status is RunStatus.INTERRUPTED and "interrupted" in run.error
        assert h.store.agents[ada.id].state is AgentState.PAUSED
        gate.set()
        # Paused, it answers nothing; what arrives waits.
        h.im.post(h.human, chat.id, "still there?")
        await asyncio.sleep(0.01)
        assert [m.content for m in h.im.in_group(chat.id)] == ["hi", "still there?"]
        with pytest.raises(InvalidTransition):
            await bus.handle(InterruptAgent(caller=h.me, agent_id=str(ada.id)))


async def test_pause_takes_effect_at_the_next_step_boundary_and_resume_goes_on() -> None:
    calls = [("list_groups", "{}")]
    gate = asyncio.Event()
    tool_step = Script(tool_calls=calls, hold_after=1, gate=gate)
    async for h, bus in lifecycle_harness(tool_step, Script(content="all done")):
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        watcher, _ = h.hub.watch([ada.id])
        got: list[Emitted] = []
        collecting = asyncio.create_task(collect(watcher.events(), got))
        h.im.post(h.human, chat.id, "look around")
        await wait_for_state(h, ada.id, AgentState.RUNNING)
        agent = await bus.handle(PauseAgent(caller=h.me, agent_id=str(ada.id)))
        assert agent.state is AgentState.RUNNING, "a run is paused at its next boundary, not at once"
        gate.set()
        await wait_for_state(h, ada.id, AgentState.PAUSED)
        roles = [s.role for s in h.store.steps[ada.session_id]]
        assert roles == [Role.USER, Role.ASSISTANT, Role.TOOL], "the step and its tool results completed"
        assert len(h.llm.requests) == 1
        h.im.post(h.human, chat.id, "and then?")
        await asyncio.sleep(0.01)
        assert len(h.llm.requests) == 1, "paused: the new message waits"

        await bus.handle(ResumeAgent(caller=h.me, agent_id=str(ada.id)))
        await h.settle(ada)
        await asyncio.sleep(0)
        await h.settle(ada)
        contents = [m.content for m in h.im.in_group(chat.id)]
        assert contents[:2] == ["look around", "and then?"] and "all done" in contents[2:]
        runs = list(h.store.runs.values())
        assert runs[0].status is RunStatus.INTERRUPTED and runs[0].error == "paused by a person"
        assert all(r.status is RunStatus.COMPLETED for r in runs[1:])
        await asyncio.sleep(0)
        collecting.cancel()
        assert AgentState.PAUSED in states(got) and states(got)[-1] is AgentState.IDLE


async def test_interrupting_tools_in_flight_answers_every_call_and_resume_continues() -> None:
    release, both_started = asyncio.Event(), asyncio.Event()
    executed: list[str] = []

    async def slow(context: ToolContext, arguments: dict[str, Any]) -> str:
        executed.append(arguments["name"])
        if arguments["name"] == "slow":
            both_started.set()
            await release.wait()
        return f"done {arguments['name']}"

    calls = [("probe", json.dumps({"name": "fast"})), ("probe", json.dumps({"name": "slow"}))]
    async for h, bus in lifecycle_harness(Script(tool_calls=calls), Script(content="finished")):
        h.tools.register(Tool(ToolSpec("probe", "a probe", {"type": "object"}), slow))
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "probe")
        await asyncio.wait_for(both_started.wait(), WAIT)
        await bus.handle(InterruptAgent(caller=h.me, agent_id=str(ada.id)))
        steps = h.store.steps[ada.session_id]
        assert [s.role for s in steps] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.TOOL]
        results = {s.message.tool_call_id: s.message.content for s in steps[2:]}
        call_ids = [c.id for c in steps[1].message.tool_calls]
        assert results[call_ids[0]] == "done fast"  # it finished: its result is kept
        assert results[call_ids[1]] == CANCELLED_RESULT
        assert unanswered_calls(steps) == ()

        await bus.handle(ResumeAgent(caller=h.me, agent_id=str(ada.id)))
        await h.settle(ada)
        await asyncio.sleep(0)
        await h.settle(ada)
        assert [m.content for m in h.im.in_group(chat.id)][-1] == "finished"
        assert executed == ["fast", "slow"], "no tool call with a recorded result runs again"
        context = h.llm.last_messages()
        assert [m.role for m in context[1:]] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.TOOL]


async def test_terminate_then_start_handles_what_waited() -> None:
    async for h, bus in lifecycle_harness(Script(content="back")):
        ada = await h.agent()
        await h.settle(ada)
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        agent = await bus.handle(TerminateAgent(caller=h.me, agent_id=str(ada.id), clear_queue=False))
        assert agent.state is AgentState.TERMINATED
        assert h.store.agents[ada.id].state is AgentState.TERMINATED
        h.im.post(h.human, chat.id, "anyone?")
        await asyncio.sleep(0.01)
        assert len(h.im.in_group(chat.id)) == 1
        for refused in (PauseAgent, ResumeAgent, InterruptAgent):
            with pytest.raises(InvalidTransition):
                await bus.handle(refused(caller=h.me, agent_id=str(ada.id)))
        with pytest.raises(InvalidTransition):
            await bus.handle(TerminateAgent(caller=h.me, agent_id=str(ada.id), clear_queue=False))
        await bus.handle(StartAgent(caller=h.me, agent_id=str(ada.id)))
        await asyncio.sleep(0)
        await h.settle(ada)
        assert [m.content for m in h.im.in_group(chat.id)] == ["anyone?", "back"]
        with pytest.raises(InvalidTransition):
            await bus.handle(StartAgent(caller=h.me, agent_id=str(ada.id)))


async def test_pausing_an_idle_agent_is_immediate_and_a_resume_with_nothing_pending_runs_nothing() -> None:
    async for h, bus in lifecycle_harness(Script(content="hello")):
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "hi")
        await asyncio.sleep(0)
        await h.settle(ada)
        assert (await bus.handle(PauseAgent(caller=h.me, agent_id=str(ada.id)))).state is AgentState.PAUSED
        await bus.handle(ResumeAgent(caller=h.me, agent_id=str(ada.id)))
        await asyncio.sleep(0)
        await h.settle(ada)
        assert len(h.llm.requests) == 1, "the last step was an answer: nothing to go on with"
        assert h.store.agents[ada.id].state is AgentState.IDLE


async def test_a_control_of_an_agent_deleted_on_the_way_is_not_found() -> None:
    async for h, bus in lifecycle_harness():
        ada = await h.agent()
        await h.supervisor.stop_agent(ada.id)  # its runner is gone, as in a delete racing the control
        with pytest.raises(AgentGone) as refused:
            await bus.handle(PauseAgent(caller=h.me, agent_id=str(ada.id)))
        assert status_name(refused.value) == "NOT_FOUND"
        assert str(ada.id) in refused.value.message


# A completed run with a later id than the one stopped in: begun by a replica
# whose clock runs ahead (run ids are UUIDv7, the time of the process that
# makes them), before a replica whose clock runs behind began the other.
@pytest.mark.parametrize("completed_ahead", [False, True])
async def test_after_a_restart_mid_run_the_agent_goes_on_from_its_last_step(completed_ahead: bool) -> None:
    executed: list[str] = []

    async def probe(context: ToolContext, arguments: dict[str, Any]) -> str:
        executed.append(arguments["name"])
        return f"done {arguments['name']}"

    calls = [("probe", json.dumps({"name": "recorded"})), ("probe", json.dumps({"name": "missing"}))]
    async for h, _bus in lifecycle_harness(Script(tool_calls=calls), Script(content="recovered")):
        h.tools.register(Tool(ToolSpec("probe", "a probe", {"type": "object"}), probe))
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        h.im.post(h.human, chat.id, "probe")
        await asyncio.sleep(0)
        await h.settle(ada)
        # Make the store look as if the process died after the first tool result:
        # the run still RUNNING, the agent RUNNING, the second result never stored.
        steps = h.store.steps[ada.session_id]
        del steps[3:]
        (run,) = h.store.runs.values()
        h.store.runs[run.id] = replace(run, status=RunStatus.RUNNING, ended_at=None)
        if completed_ahead:
            ahead = uuid.UUID(int=run.id.int + (60_000 << 80))  # its time 60 s later
            h.store.runs[ahead] = replace(run, id=ahead, status=RunStatus.COMPLETED)
        h.store.agents[ada.id] = replace(h.store.agents[ada.id], state=AgentState.RUNNING)
        executed.clear()
        await h.crash()

        await h.restart(tools=[Tool(ToolSpec("probe", "a probe", {"type": "object"}), probe)])
        await h.settle(ada)
        assert executed == ["missing"], "the call whose result was recorded does not run again"
        run = h.store.runs[run.id]
        assert run.status is RunStatus.COMPLETED, "the run the runtime stopped in goes on"
        assert [m.content for m in h.im.in_group(chat.id)][-1] == "recovered"
        assert h.store.agents[ada.id].state is AgentState.IDLE


def noting_sends(h: Harness, prefix: str) -> asyncio.Event:
    """An event set once the agents send a message starting with `prefix`."""
    sent_it = asyncio.Event()
    send = h.im.send_message

    async def noting(*args: Any, **kwargs: Any) -> Any:
        sent = await send(*args, **kwargs)
        if sent.content.startswith(prefix):
            sent_it.set()
        return sent

    h.im.send_message = noting  # type: ignore[method-assign]
    return sent_it


async def test_ask_human_keeps_the_agent_busy_until_a_person_answers() -> None:
    question = json.dumps({"question": "Which branch shall I deploy?"})
    async for h, _bus in lifecycle_harness(
        Script(tool_calls=[("ask_human", question)]), Script(content="Deploying main.")
    ):
        ada = await h.agent(tools=("ask_human",))
        bea = await h.agent("bea")  # not in the chat: it only speaks up in it
        chat = h.im.group("", h.human, ada.member_id)
        asked = noting_sends(h, "Which branch")
        h.im.post(h.human, chat.id, "@ada deploy please", mentions=[ada.member_id])
        await asyncio.wait_for(asked.wait(), WAIT)
        runner = h.supervisor.runner(ada.id)
        assert runner is not None and runner.agent.state is AgentState.RUNNING
        # Another agent's message is no answer; a person's is.
        h.im.post(bea.member_id, chat.id, "I think develop")
        await asyncio.sleep(0.01)
        assert runner.agent.state is AgentState.RUNNING and len(h.llm.requests) == 1
        h.im.post(h.human, chat.id, "main")
        await asyncio.sleep(0)
        await h.settle(ada)
        steps = h.store.steps[ada.session_id]
        tool_result = next(s for s in steps if s.role is Role.TOOL)
        assert tool_result.message.content == f"answer from member_id={h.human}: main"
        assert [m.content for m in h.im.in_group(chat.id)][-1] == "Deploying main."
        assert len([r for r in h.store.runs.values() if r.agent_id == ada.id]) == 1
        assert len(h.llm.requests) == 2, "the answer was the tool's result, not a new run"


async def test_a_tool_may_have_its_own_time_limit() -> None:
    async def forever(context: ToolContext, arguments: dict[str, Any]) -> str:
        await asyncio.Event().wait()
        return "never"

    registry = ToolRegistry(
        [Tool(ToolSpec("wait", "waits", {"type": "object"}), forever, timeout_seconds=0.01)],
        timeout_seconds=60,
    )
    async for h in harness():
        ada = await h.agent()
        context = ToolContext(
            agent=ada, im=h.im, trigger_group_id=None, create_sub_agent=h.app.factory.create_child
        )
        outcome = await asyncio.wait_for(registry.execute(context, ToolCall("c1", "wait", "{}")), WAIT)
        assert outcome.content == "error: wait did not finish within 0.01 s"
        ask = await default_registry(ask_human_timeout_seconds=5).execute(
            context, ToolCall("c2", "ask_human", json.dumps({"question": "?"}))
        )
        assert ask.content == "error: nobody can be asked from here"


async def test_every_state_change_has_a_higher_version_and_an_answer_is_never_newer_than_the_events() -> None:
    """Resume with a message waiting: the run starts at once, so the RUNNING
    event may reach a client before ResumeAgent's answer (IDLE): the version
    tells which is newer."""
    script, gate = gate_script("done", hold_after=1)
    async for h, bus in lifecycle_harness(script):
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        paused = await bus.handle(PauseAgent(caller=h.me, agent_id=str(ada.id)))
        watcher, _ = h.hub.watch([ada.id])
        got: list[Emitted] = []
        collecting = asyncio.create_task(collect(watcher.events(), got))
        h.im.post(h.human, chat.id, "waiting for you")
        answer = await bus.handle(ResumeAgent(caller=h.me, agent_id=str(ada.id)))
        await asyncio.wait_for(script.reached.wait(), WAIT)
        gate.set()
        await h.settle(ada)
        await asyncio.sleep(0)
        collecting.cancel()
        changes = [e.event for e in got if isinstance(e.event, StateChanged)]
        assert [c.state for c in changes] == [AgentState.IDLE, AgentState.RUNNING, AgentState.IDLE]
        versions = [c.version for c in changes]
        assert versions == sorted(set(versions)) and versions[0] > paused.state_version
        running = changes[1]
        assert answer.state_version < running.version, "the answer is older than the run's start"
        # What is stored (and read after a restart) has the last version.
        assert h.store.agents[ada.id].state_version == versions[-1]
        assert (await h.app.agents.get_agent(h.me, str(ada.id))).state_version == versions[-1]


async def test_terminating_an_agent_mid_answer_tells_the_chat_and_interrupting_does_not() -> None:
    for control_name, told in (("terminate", True), ("interrupt", False)):
        script, gate = gate_script("Here is a long answer", hold_after=3)
        async for h, bus in lifecycle_harness(script):
            ada = await h.agent()
            chat = h.im.group("", h.human, ada.member_id, direct=True)
            h.im.post(h.human, chat.id, "explain")
            await asyncio.wait_for(script.reached.wait(), WAIT)
            if control_name == "terminate":
                await bus.handle(TerminateAgent(caller=h.me, agent_id=str(ada.id), clear_queue=False))
            else:
                await bus.handle(InterruptAgent(caller=h.me, agent_id=str(ada.id)))
            gate.set()
            said = h.im.in_group(chat.id)[1:]
            if told:
                (notice,) = said
                assert notice.content_type == "system" and "terminated me" in notice.content
                # Nothing to retry until a person starts it again.
                assert "retry" not in (notice.metadata or {})["agent_failure"]
            else:
                assert said == [], "an interrupt is the person's own pause: nothing to tell"
