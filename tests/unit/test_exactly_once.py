"""Crash safety of the agent loop (issue 8), against in-memory fakes.

A "crash" stops every runner where it is (as SIGKILL would, the store keeps
what was written and nothing more) and a "restart" builds new services over
the same store and IM. After any of them: a message is input exactly once,
every side effect (a tool's message, the answer) happens once, every task
ends settled, and a pause asked for is neither lost nor carried into a
later run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest

from services.common import errors
from services.common.identity import Caller
from services.runtime.bootstrap import RuntimeApp
from services.runtime.domain.commands import (
    CreateAgent,
    PauseAgent,
    ResumeAgent,
    SubmitTask,
    TerminateAgent,
)
from services.runtime.domain.llm import ChatMessage, Role
from services.runtime.domain.model import (
    Agent,
    AgentDraft,
    AgentState,
    Run,
    RunStatus,
    Step,
    StepMetrics,
    Task,
    TaskStatus,
)
from services.runtime.service_layer.hub import AgentHub
from services.runtime.service_layer.im_port import IMMessage
from services.runtime.service_layer.leases import Fence
from services.runtime.service_layer.llm_port import LLM
from services.runtime.service_layer.messagebus import MessageBus
from services.runtime.service_layer.supervisor import Supervisor
from services.runtime.service_layer.tasks import TaskViews
from tests.identities import caller_of
from tests.unit.runtime_fakes import FakeClock, FakeIM, InMemoryAgentStore, Script, ScriptedLLM
from tests.unit.runtime_support import fake_runtime

WAIT = 3.0


class GatedIM(FakeIM):
    """A fake IM whose writes can be held: the way to stop a process in the middle of one.

    `hold_sends(prefix, after=...)` makes sends of content starting with
    `prefix` wait forever, before the IM has it (`after=False`) or after
    (`after=True`: the message is there, its acknowledgement never comes).
    `late_marks` makes read marks land only after a while; `lost_marks`
    drops them (as a crash between the two writes does).
    """

    def __init__(self) -> None:
        super().__init__()
        self._held: list[tuple[str, bool]] = []
        self.late_marks = 0.0
        self.lost_marks = False

    def hold_sends(self, prefix: str, *, after: bool) -> None:
        self._held.append((prefix, after))

    def release(self) -> None:
        self._held.clear()

    async def send_message(
        self,
        as_member: uuid.UUID,
        group_id: uuid.UUID,
        content: str,
        *,
        mentions: Sequence[uuid.UUID] = (),
        reply_to: uuid.UUID | None = None,
        request_id: str = "",
        content_type: str = "text",
        metadata: Mapping[str, Any] | None = None,
    ) -> IMMessage:
        held = next((after for prefix, after in self._held if content.startswith(prefix)), None)
        if held is False:
            await asyncio.Event().wait()
        sent = await super().send_message(
            as_member,
            group_id,
            content,
            mentions=mentions,
            reply_to=reply_to,
            request_id=request_id,
            content_type=content_type,
            metadata=metadata,
        )
        if held is True:
            await asyncio.Event().wait()
        return sent

    async def mark_read(self, as_member: uuid.UUID, group_id: uuid.UUID, up_to: uuid.UUID) -> None:
        if self.lost_marks:
            return
        if self.late_marks:
            await asyncio.sleep(self.late_marks)
        await super().mark_read(as_member, group_id, up_to)


@dataclass
class System:
    """The runtime (`bootstrap.build` over fakes) over a store and an IM that outlive it."""

    app: RuntimeApp
    im: GatedIM
    llm: ScriptedLLM
    store: InMemoryAgentStore
    clock: FakeClock
    human: uuid.UUID
    # Every System built over this store and IM, the newest last (each restart adds one).
    lineage: list[System]

    @property
    def hub(self) -> AgentHub:
        return self.app.hub

    @property
    def supervisor(self) -> Supervisor:
        assert self.app.supervisor is not None
        return self.app.supervisor

    @property
    def tasks(self) -> TaskViews:
        return self.app.tasks

    @property
    def bus(self) -> MessageBus:
        return self.app.bus

    async def crash(self) -> None:
        """Stops the runtime where it is: its runners stop mid-work."""
        await self.app.stop()

    @property
    def me(self) -> Caller:
        # The workspace's only person, its owner.
        return caller_of(self.human, self.im.workspace, roles=("owner",))

    async def agent(self, name: str = "ada", **fields: Any) -> Agent:
        return await self.bus.handle(CreateAgent(caller=self.me, draft=AgentDraft(name=name, **fields)))

    async def settle(self, agent: Agent) -> None:
        runner = self.supervisor.runner(agent.id)
        assert runner is not None
        for _ in range(3):  # a cycle may wake the runner for one more
            await asyncio.sleep(0)
            await asyncio.wait_for(runner.idle.wait(), WAIT)

    def roles(self, agent: Agent) -> list[Role]:
        return [s.role for s in self.store.steps.get(agent.session_id, [])]


def build(
    im: GatedIM,
    *,
    llm: ScriptedLLM,
    store: InMemoryAgentStore,
    clock: FakeClock,
    human: uuid.UUID,
    lineage: list[System],
    model: LLM | None = None,
) -> System:
    """The runtime over the store and IM, not started; `model` (if given) answers instead of `llm`."""
    app = fake_runtime(store=store, im=im, llm=model or llm, clock=clock)
    built = System(app, im, llm, store, clock, human, lineage)
    lineage.append(built)
    return built


@contextlib.asynccontextmanager
async def system(
    *scripts: Script, im: GatedIM | None = None, model: LLM | None = None
) -> AsyncIterator[System]:
    """The runtime's services over a new store and `im` (a `GatedIM` by default)."""
    im = im or GatedIM()
    store, clock = InMemoryAgentStore(), FakeClock()
    first = build(
        im,
        llm=ScriptedLLM(*scripts),
        store=store,
        clock=clock,
        human=im.human("alice").id,
        lineage=[],
        model=model,
    )
    yield first
    await first.lineage[-1].app.stop()


async def crash_and_restart(s: System, *scripts: Script) -> System:
    """Stops every runner where it is and starts the services again over the same store and IM."""
    await s.crash()
    s.llm.requests.clear()  # from here on: what the new process asks
    if scripts:
        s.llm.scripts = list(scripts)
    fresh = build(s.im, llm=s.llm, store=s.store, clock=s.clock, human=s.human, lineage=s.lineage)
    await fresh.app.start()
    return fresh


def dm_call(to: str, content: str) -> Script:
    return Script(tool_calls=[("send_direct_message", json.dumps({"to": to, "content": content}))])


async def until(condition: Any, what: str) -> None:
    async def check() -> None:
        while not condition():  # noqa: ASYNC110 - the fakes offer no event for these
            await asyncio.sleep(0.005)

    try:
        await asyncio.wait_for(check(), WAIT)
    except TimeoutError:
        raise AssertionError(f"timed out waiting until {what}") from None


# -- every message is input once -------------------------------------------------


async def test_a_message_whose_read_mark_lands_late_is_input_once() -> None:
    async with system(Script(tool_calls=[("list_groups", "{}")]), Script(content="done")) as s:
        s.im.late_marks = 0.05  # the IM acknowledges read marks slowly
        ada = await s.agent()
        chat = s.im.group("", s.human, ada.member_id, direct=True)
        s.im.post(s.human, chat.id, "look around")
        await until(lambda: len(s.im.in_group(chat.id)) == 2, "the answer came")
        await asyncio.sleep(0.1)
        await s.settle(ada)
        assert s.roles(ada) == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
        assert [m.content for m in s.im.in_group(chat.id)] == ["look around", "done"]


async def test_input_stored_before_a_crash_is_not_taken_again_though_the_im_still_has_it_unread() -> None:
    gate = asyncio.Event()
    first, second = (
        Script(tool_calls=[("list_groups", "{}")]),
        Script(content="done", hold_after=0, gate=gate),
    )
    async with system(first, second) as s:
        s.im.lost_marks = True  # the IM never hears that the agent read it
        ada = await s.agent()
        chat = s.im.group("", s.human, ada.member_id, direct=True)
        s.im.post(s.human, chat.id, "look around")
        await until(lambda: len(s.llm.requests) == 2, "the second completion began")
        fresh = await crash_and_restart(s, Script(content="done"))
        await until(lambda: len(s.im.in_group(chat.id)) == 2, "the answer came")
        await asyncio.sleep(0.05)
        await fresh.settle(ada)
        assert s.roles(ada).count(Role.USER) == 1, s.roles(ada)
        assert [m.content for m in s.im.in_group(chat.id)] == ["look around", "done"]


# -- every side effect once -------------------------------------------------------


@pytest.mark.parametrize("acknowledged", [False, True], ids=["before-the-im", "after-the-im"])
async def test_an_answer_stored_before_a_crash_is_delivered_exactly_once(acknowledged: bool) -> None:
    async with system(Script(content="the answer")) as s:
        s.im.hold_sends("the answer", after=acknowledged)
        ada = await s.agent()
        chat = s.im.group("", s.human, ada.member_id, direct=True)
        s.im.post(s.human, chat.id, "question")
        await until(lambda: Role.ASSISTANT in s.roles(ada), "the answer step was stored")
        await asyncio.sleep(0.01)
        s.im.release()
        fresh = await crash_and_restart(s)
        await until(lambda: len(s.im.in_group(chat.id)) == 2, "the answer came")
        await asyncio.sleep(0.05)
        await fresh.settle(ada)
        assert [m.content for m in s.im.in_group(chat.id)] == ["question", "the answer"]
        assert len(s.llm.requests) == 0, "the stored answer is delivered, not asked for again"
        (run,) = s.store.runs.values()
        assert run.status is RunStatus.COMPLETED
        assert s.store.agents[ada.id].state is AgentState.IDLE


async def test_a_tool_call_cut_by_a_crash_runs_again_without_sending_twice() -> None:
    async with system(dm_call("bob", "the build is green"), Script(content="told him")) as s:
        bob = s.im.human("bob")
        s.im.hold_sends("the build", after=True)  # bob has it; the runtime dies before hearing so
        ada = await s.agent()
        chat = s.im.group("", s.human, ada.member_id, direct=True)
        s.im.post(s.human, chat.id, "tell bob the build is green")
        dm = await s.im.get_or_create_direct_group(ada.member_id, bob.id)
        await until(lambda: len(s.im.in_group(dm.id)) == 1, "bob got the message")
        s.im.release()
        fresh = await crash_and_restart(s, Script(content="told him"))
        await until(lambda: len(s.im.in_group(chat.id)) == 2, "the answer came")
        await fresh.settle(ada)
        assert [m.content for m in s.im.in_group(dm.id)] == ["the build is green"]
        assert s.roles(ada) == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT]
        (run,) = s.store.runs.values()
        assert run.status is RunStatus.COMPLETED, "the run went on after the restart"


async def test_ask_human_answered_while_the_runtime_was_down_finds_the_answer() -> None:
    question = Script(tool_calls=[("ask_human", json.dumps({"question": "which branch?"}))])
    async with system(question, Script(content="merging main")) as s:
        ada = await s.agent()
        chat = s.im.group("", s.human, ada.member_id, direct=True)
        s.im.post(s.human, chat.id, "merge it")
        await until(lambda: len(s.im.in_group(chat.id)) == 2, "the question was asked")
        await s.crash()
        s.im.post(s.human, chat.id, "main")  # answered while the runtime is down
        fresh = await crash_and_restart(s, Script(content="merging main"))
        await until(lambda: s.im.in_group(chat.id)[-1].content == "merging main", "the answer came")
        await fresh.settle(ada)
        contents = [m.content for m in s.im.in_group(chat.id)]
        assert contents == ["merge it", "which branch?", "main", "merging main"]
        tool = next(step for step in s.store.steps[ada.session_id] if step.role is Role.TOOL)
        assert tool.message.content is not None and tool.message.content.endswith(": main")


# -- every task settled -----------------------------------------------------------


async def test_a_task_left_running_by_a_run_that_was_never_stored_goes_back_to_the_queue() -> None:
    async with system(Script(content="done")) as s:
        ada = await s.agent()
        await s.crash()
        # The process died between marking the task RUNNING and storing its run.
        placed = await s.bus.handle(SubmitTask(caller=s.me, agent_id=str(ada.id), text="do it"))
        stranded = replace(placed.task, status=TaskStatus.RUNNING, attempts=1, run_id=uuid.uuid4())
        s.store.tasks[stranded.id] = stranded
        fresh = await crash_and_restart(s)
        await until(lambda: s.store.tasks[stranded.id].status is TaskStatus.SUCCEEDED, "the task succeeded")
        done = s.store.tasks[stranded.id]
        assert (done.attempts, done.result) == (1, "done"), "the attempt that never ran did not count"
        await fresh.settle(ada)


@pytest.mark.parametrize(
    ("ended", "expected"),
    [(RunStatus.COMPLETED, TaskStatus.SUCCEEDED), (RunStatus.FAILED, TaskStatus.FAILED)],
)
async def test_a_task_whose_run_ended_before_the_crash_ends_as_its_run_did(
    ended: RunStatus, expected: TaskStatus
) -> None:
    async with system(Script(content="never asked")) as s:
        ada = await s.agent()
        await s.crash()
        placed = await s.bus.handle(SubmitTask(caller=s.me, agent_id=str(ada.id), text="do it"))
        run = Run(
            id=uuid.uuid4(),
            agent_id=ada.id,
            session_id=ada.session_id,
            status=ended,
            trigger_message_ids=(),
            started_at=s.clock(),
            error="the model failed" if ended is RunStatus.FAILED else "",
            ended_at=s.clock(),
        )
        s.store.runs[run.id] = run
        answer = Step(
            id=uuid.uuid4(),
            agent_id=ada.id,
            session_id=ada.session_id,
            run_id=run.id,
            sequence=1,
            message=ChatMessage(role=Role.ASSISTANT, content="all done"),
            metrics=StepMetrics(),
            created_at=s.clock(),
        )
        s.store.steps[ada.session_id] = [answer]
        s.store.tasks[placed.task.id] = replace(
            placed.task, status=TaskStatus.RUNNING, attempts=1, run_id=run.id
        )
        fresh = await crash_and_restart(s)
        settled = s.store.tasks[placed.task.id]
        assert settled.status is expected
        if expected is TaskStatus.SUCCEEDED:
            assert settled.result == "all done"
        else:
            assert settled.last_error == "the model failed" and settled.retry_at is not None
        assert s.llm.requests == [], "an ended run is not run again"
        await fresh.settle(ada)


async def test_a_task_cut_by_a_crash_goes_on_in_its_run_and_sends_once() -> None:
    async with system(dm_call("bob", "task one is done"), Script(content="reported")) as s:
        bob = s.im.human("bob")
        s.im.hold_sends("task one", after=True)
        ada = await s.agent()
        placed = await s.bus.handle(
            SubmitTask(caller=s.me, agent_id=str(ada.id), text="tell bob task one is done")
        )
        dm = await s.im.get_or_create_direct_group(ada.member_id, bob.id)
        await until(lambda: len(s.im.in_group(dm.id)) == 1, "bob got the message")
        s.im.release()
        fresh = await crash_and_restart(s, Script(content="reported"))
        await until(
            lambda: s.store.tasks[placed.task.id].status is TaskStatus.SUCCEEDED, "the task succeeded"
        )
        await fresh.settle(ada)
        task = s.store.tasks[placed.task.id]
        assert (task.attempts, task.result) == (1, "reported")
        assert [m.content for m in s.im.in_group(dm.id)] == ["task one is done"]
        (run,) = s.store.runs.values()
        assert run.status is RunStatus.COMPLETED and task.run_id == run.id


class SettleFailsOnce(InMemoryAgentStore):
    """A store whose first write of a task's end is lost to a database outage."""

    failed = False

    async def update_task(self, task: Task, *, expected: Any, fence: Fence | None = None) -> bool:
        if task.status is TaskStatus.SUCCEEDED and not self.failed:
            self.failed = True
            raise errors.Unavailable("the database is unavailable")
        return await super().update_task(task, expected=expected, fence=fence)


async def test_a_task_whose_end_could_not_be_stored_is_settled_once_the_runner_is_idle() -> None:
    async with system(Script(content="done")) as s:
        await s.crash()
        store = SettleFailsOnce()
        fresh = build(s.im, llm=s.llm, store=store, clock=s.clock, human=s.human, lineage=s.lineage)
        ada = await fresh.agent()
        placed = await fresh.bus.handle(SubmitTask(caller=fresh.me, agent_id=str(ada.id), text="do it"))
        await until(lambda: store.failed, "the first end was lost")
        fresh.app.runners.wake(ada.id)
        await until(lambda: store.tasks[placed.task.id].status is TaskStatus.SUCCEEDED, "the task succeeded")
        assert store.tasks[placed.task.id].result == "done"
        assert len(s.llm.requests) == 1, "it did not run again"


# -- a pause is neither lost nor carried over --------------------------------------


async def test_a_pause_asked_during_the_last_completion_takes_effect_as_the_run_ends() -> None:
    gate = asyncio.Event()
    last = Script(content="finished", hold_after=1, gate=gate)
    async with system(last, Script(content="hello again")) as s:
        ada = await s.agent()
        chat = s.im.group("", s.human, ada.member_id, direct=True)
        s.im.post(s.human, chat.id, "finish it")
        await asyncio.wait_for(last.reached.wait(), WAIT)
        answered = await s.bus.handle(PauseAgent(caller=s.me, agent_id=str(ada.id)))
        assert (answered.state, answered.pause_pending) == (AgentState.RUNNING, True)
        assert s.store.agents[ada.id].pause_pending, "a pending pause is stored"
        gate.set()
        await until(lambda: s.store.agents[ada.id].state is AgentState.PAUSED, "it paused")
        assert [m.content for m in s.im.in_group(chat.id)] == ["finish it", "finished"]
        assert not s.store.agents[ada.id].pause_pending
        (run,) = s.store.runs.values()
        assert run.status is RunStatus.COMPLETED, "the run ended as it would have"
        await s.bus.handle(ResumeAgent(caller=s.me, agent_id=str(ada.id)))
        s.im.post(s.human, chat.id, "are you there?")
        await until(lambda: len(s.im.in_group(chat.id)) == 4, "the next message was answered")
        await s.settle(ada)
        assert s.store.agents[ada.id].state is AgentState.IDLE, "no stale pause in a later run"


async def test_a_pause_pending_when_the_runtime_stopped_takes_effect_after_the_restart() -> None:
    gate = asyncio.Event()
    async with system(Script(content="long answer", hold_after=1, gate=gate)) as s:
        ada = await s.agent()
        chat = s.im.group("", s.human, ada.member_id, direct=True)
        s.im.post(s.human, chat.id, "go")
        await asyncio.wait_for(s.llm.scripts[0].reached.wait(), WAIT)
        await s.bus.handle(PauseAgent(caller=s.me, agent_id=str(ada.id)))
        fresh = await crash_and_restart(s, Script(content="must not run"))
        await until(lambda: s.store.agents[ada.id].state is AgentState.PAUSED, "it is paused")
        await fresh.settle(ada)
        (run,) = s.store.runs.values()
        assert (run.status, run.error) == (RunStatus.INTERRUPTED, "paused by a person")
        assert s.llm.requests == [] and not s.store.agents[ada.id].pause_pending


class EndFailsOnce(InMemoryAgentStore):
    """A store whose first write of a run's end is lost to a database outage."""

    failed = False

    async def end_run(self, run: Run, agent: Agent, *, fence: Fence | None = None) -> None:
        if run.status is not RunStatus.RUNNING and not self.failed:
            self.failed = True
            raise errors.Unavailable("the database is unavailable")
        await super().end_run(run, agent, fence=fence)


async def test_a_run_whose_end_could_not_be_stored_is_ended_at_the_next_cycle() -> None:
    async with system(Script(content="done")) as s:
        await s.crash()
        store = EndFailsOnce()
        fresh = build(s.im, llm=s.llm, store=store, clock=s.clock, human=s.human, lineage=s.lineage)
        ada = await fresh.agent()
        placed = await fresh.bus.handle(SubmitTask(caller=fresh.me, agent_id=str(ada.id), text="do it"))
        await until(lambda: store.failed, "the first end was lost")
        fresh.app.runners.wake(ada.id)
        await until(lambda: store.tasks[placed.task.id].status is TaskStatus.SUCCEEDED, "the task succeeded")
        (run,) = store.runs.values()
        assert run.status is RunStatus.COMPLETED, "the run is not left RUNNING"
        assert store.agents[ada.id].state is AgentState.IDLE
        assert len(s.llm.requests) == 1, "it did not run again"


async def test_a_task_paused_mid_run_goes_on_where_it_was_when_resumed() -> None:
    gate = asyncio.Event()
    tool_round = Script(
        tool_calls=[("send_direct_message", json.dumps({"to": "bob", "content": "halfway"}))],
        hold_after=1,
        gate=gate,
    )
    async with system(tool_round, Script(content="reported")) as s:
        bob = s.im.human("bob")
        ada = await s.agent()
        placed = await s.bus.handle(SubmitTask(caller=s.me, agent_id=str(ada.id), text="tell bob"))
        await asyncio.wait_for(tool_round.reached.wait(), WAIT)
        await s.bus.handle(PauseAgent(caller=s.me, agent_id=str(ada.id)))
        gate.set()
        await until(lambda: s.store.agents[ada.id].state is AgentState.PAUSED, "it paused")
        paused = s.store.tasks[placed.task.id]
        assert paused.status is TaskStatus.RUNNING, "a paused task is neither done nor given up"
        await s.bus.handle(ResumeAgent(caller=s.me, agent_id=str(ada.id)))
        await until(
            lambda: s.store.tasks[placed.task.id].status is TaskStatus.SUCCEEDED, "the task succeeded"
        )
        await s.settle(ada)
        done = s.store.tasks[placed.task.id]
        assert (done.attempts, done.result) == (1, "reported")
        dm = await s.im.get_or_create_direct_group(ada.member_id, bob.id)
        assert [m.content for m in s.im.in_group(dm.id)] == ["halfway"]
        assert s.roles(ada) == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT], "its input once"
        first, second = sorted(s.store.runs.values(), key=lambda r: r.id)
        assert (first.status, second.status) == (RunStatus.INTERRUPTED, RunStatus.COMPLETED)
        assert done.run_id == second.id


async def test_terminating_an_agent_paused_mid_task_puts_the_task_back() -> None:
    gate = asyncio.Event()
    tool_round = Script(tool_calls=[("list_groups", "{}")], hold_after=1, gate=gate)
    async with system(tool_round, Script(content="done")) as s:
        ada = await s.agent()
        placed = await s.bus.handle(SubmitTask(caller=s.me, agent_id=str(ada.id), text="look around"))
        await asyncio.wait_for(tool_round.reached.wait(), WAIT)
        await s.bus.handle(PauseAgent(caller=s.me, agent_id=str(ada.id)))
        gate.set()
        await until(lambda: s.store.agents[ada.id].state is AgentState.PAUSED, "it paused")
        await s.bus.handle(TerminateAgent(caller=s.me, agent_id=str(ada.id), clear_queue=False))
        task = s.store.tasks[placed.task.id]
        assert (task.status, task.attempts) == (TaskStatus.QUEUED, 0)
