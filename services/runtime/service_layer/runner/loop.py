"""The resident loop of one agent.

An idle runner awaits an event and costs nothing. Woken (by a message in one
of its groups, a task, or a Wake call), it takes the oldest work waiting:
its unread messages or its next queued task. A run streams a completion,
executes the tool calls it asks for (concurrently, results in call order),
reads what arrived meanwhile, and calls the model again, until the model
stops; then it answers in the chat that woke it (or finishes the task).
Every step is stored the moment it completes and streamed live while it forms.

People stay in charge: a paused agent finishes its step and waits; an
interrupt cuts the run at once, keeping what was streamed as an interrupted
step and answering every tool call (a cancelled result where it never ran),
so that the history stays valid for any model; resuming goes on from the
last step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from uuid_utils.compat import uuid7

from services.common import errors
from services.runtime.domain.context import (
    Calibration,
    Fitted,
    answer_reserve,
    context_window,
    estimate_message,
    estimated_usage,
    fit_context,
    latest_summary,
    summary_request,
)
from services.runtime.domain.conversations import (
    TASKS,
    Conversation,
    conversation_line,
    conversation_of_input,
    in_conversation,
    origin_of_run,
    run_conversations,
)
from services.runtime.domain.errors import ContextTooLong, IMError, LLMError, LLMRejected
from services.runtime.domain.etiquette import (
    NO_REPLY,
    ChatterGuard,
    GroupPolicy,
    Trouble,
    answer_metadata,
    ends_exchange,
    failure_notice,
    is_agent_answer,
    is_silence,
    mentioned,
    should_answer,
    split_reply,
)
from services.runtime.domain.intents import answer_request_id, failure_request_id, tool_request_id
from services.runtime.domain.lifecycle import (
    CANCELLED_RESULT,
    Next,
    interrupted_message,
    resume_point,
    unanswered_calls,
)
from services.runtime.domain.llm import (
    ChatMessage,
    Completion,
    CompletionAssembler,
    CompletionRequest,
    ContentDelta,
    Role,
    ToolCall,
    ToolSpec,
    Usage,
    storable_delta,
    storable_message,
    storable_text,
)
from services.runtime.domain.model import (
    Agent,
    AgentEvent,
    AgentState,
    Emitted,
    Origin,
    Run,
    RunEnded,
    RunStarted,
    RunStatus,
    StateChanged,
    Step,
    StepCompleted,
    StepDelta,
    StepKind,
    StepMetrics,
    StepStarted,
    Task,
    TaskStatus,
    shown_to_model,
    storable_origin,
)
from services.runtime.service_layer.hub import AgentHub
from services.runtime.service_layer.im_port import IMMessage, IMPort
from services.runtime.service_layer.llm_port import LLM
from services.runtime.service_layer.memory_port import MemoryPort, RecallQuery
from services.runtime.service_layer.read_positions import ReadPositions
from services.runtime.service_layer.store import AgentStore
from services.runtime.service_layer.tools import (
    SubAgentFactory,
    ToolContext,
    ToolOutcome,
    ToolRegistry,
    recalled_note,
)
from services.runtime.service_layer.work import TaskQueue

logger = logging.getLogger(__name__)

# When runs must leave the context, enough leave to bring it down to this
# share of the budget, so that a summary is written now and then, not at every call.
SUMMARY_HEADROOM = 0.6
# Most runs a recall leaves out as already in the context (the memory's limit).
MAX_EXCLUDED_RUNS = 1000

# Why a run that was in flight when its process stopped ended.
STOPPED_DURING_RUN = "the runtime stopped during the run"


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """Limits of the loop; all configurable."""

    max_iterations: int = 10
    group_policy: GroupPolicy = GroupPolicy.UNLESS_OTHERS_MENTIONED
    default_token_budget: int = 1_000_000
    unread_batch: int = 200
    # An answer longer than this is sent as several messages (the IM's limit).
    max_reply_bytes: int = 64 * 1024
    # Memories recalled into a new run from its input (0: none), and how long
    # recall may take before the run goes on without.
    auto_recall: int = 3
    recall_timeout_seconds: float = 3.0
    # Memories scoring below this are not recalled automatically (the recall
    # tool shows them all): better nothing than noise in every run.
    recall_min_score: float = 0.3
    # The context window: the model named when an agent names none (with an
    # endpoint, and without one: the offline model), and the window of a
    # model whose window is not known (OPENAI_CONTEXT_TOKENS).
    default_model: str = ""
    unconfigured_model: str = "offline"
    context_tokens: int | None = None
    # A stream that breaks off after it began is asked for again this many
    # times (the LLM adapter retries the ones that fail before), after a wait
    # that starts here and doubles.
    stream_cut_retries: int = 4
    stream_cut_backoff_seconds: float = 0.5


# Senders of replied-to messages kept at once (the cache starts over when full).
_KNOWN_SENDERS = 10_000


class Directory:
    """Names and kinds of members and groups, cached (they rarely change)."""

    def __init__(self, im: IMPort) -> None:
        self._im = im
        self._names: dict[uuid.UUID, str] = {}
        self._kinds: dict[uuid.UUID, str] = {}
        self._direct: dict[uuid.UUID, bool] = {}
        self._labels: dict[uuid.UUID, str] = {}
        self._senders: dict[uuid.UUID, uuid.UUID] = {}

    async def _member(self, as_member: uuid.UUID, member_id: uuid.UUID) -> None:
        member = await self._im.get_member(as_member, member_id)
        self._names[member_id] = member.display_name
        self._kinds[member_id] = member.kind

    async def name(self, as_member: uuid.UUID, member_id: uuid.UUID) -> str:
        if member_id not in self._names:
            await self._member(as_member, member_id)
        return self._names[member_id]

    async def is_person(self, as_member: uuid.UUID, member_id: uuid.UUID) -> bool:
        if member_id not in self._kinds:
            await self._member(as_member, member_id)
        return self._kinds[member_id] == "human"

    async def sender(self, as_member: uuid.UUID, message_id: uuid.UUID) -> uuid.UUID | None:
        """Who sent a message (None if it is not to be seen); messages keep their sender."""
        if message_id not in self._senders:
            if len(self._senders) >= _KNOWN_SENDERS:
                self._senders.clear()
            try:
                message = await self._im.get_message(as_member, message_id)
            except IMError as error:
                if isinstance(error, errors.Unavailable):
                    raise
                return None
            self._senders[message_id] = message.sender_id
        return self._senders[message_id]

    async def group(self, as_member: uuid.UUID, group_id: uuid.UUID) -> tuple[bool, str]:
        """(is it a direct chat, its name)."""
        if group_id not in self._direct:
            group = await self._im.get_group(as_member, group_id)
            self._direct[group_id] = group.kind == "direct"
            self._labels[group_id] = group.name
        return self._direct[group_id], self._labels[group_id]


class HistoryCache:
    """The steps of recently active agents, kept between their runs.

    An agent woken again soon (as in a conversation) then skips reloading its
    history; the least recently used are dropped once all of them hold more
    than `max_steps` steps, so idle agents cost no memory. Only an agent's
    own runner changes its steps, which keeps the copy right.
    """

    def __init__(self, max_steps: int = 20_000) -> None:
        self.max_steps = max_steps
        self._steps: OrderedDict[uuid.UUID, list[Step]] = OrderedDict()
        self._total = 0

    def take(self, agent_id: uuid.UUID) -> list[Step] | None:
        steps = self._steps.pop(agent_id, None)
        if steps is not None:
            self._total -= len(steps)
        return steps

    def keep(self, agent_id: uuid.UUID, steps: list[Step]) -> None:
        self.take(agent_id)
        if len(steps) > self.max_steps:
            return
        self._steps[agent_id] = steps
        self._total += len(steps)
        while self._total > self.max_steps:
            _, dropped = self._steps.popitem(last=False)
            self._total -= len(dropped)

    def __len__(self) -> int:
        return len(self._steps)


@dataclass(frozen=True, slots=True)
class RunnerEnv:
    """What every runner shares."""

    store: AgentStore
    im: IMPort
    llm: LLM
    tools: ToolRegistry
    hub: AgentHub
    guard: ChatterGuard
    directory: Directory
    settings: LoopSettings
    create_sub_agent: SubAgentFactory
    clock: Callable[[], datetime]
    # How many runners may ask the IM for their unread messages at once.
    reads: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(32))
    history: HistoryCache = field(default_factory=HistoryCache)
    tasks: TaskQueue | None = None
    # Long-term memory: recall from it, and who to tell that a run ended.
    memory: MemoryPort | None = None
    run_ended: Callable[[], None] = lambda: None
    # Where the IM's read positions of the agents are moved (in batches);
    # None moves each at once (tests that count the calls).
    read_positions: ReadPositions | None = None


@dataclass(frozen=True, slots=True)
class _Cut:
    """Why the run in flight is being cut short, and the state it leaves the agent in
    (None: as the run would have; a cancelled task)."""

    reason: str
    state: AgentState | None


class AgentRunner:
    """One agent's serial loop. `start()` it, `wake()` it, `stop()` it; the
    lifecycle methods (`pause`, `resume`, `interrupt`, `terminate`,
    `start_again`) are the people's controls."""

    def __init__(self, agent: Agent, env: RunnerEnv) -> None:
        self.agent = agent
        self._env = env
        self._wake = asyncio.Event()
        self._steps: list[Step] | None = None
        # The session the run in flight works in (the main one unless a task names another).
        self._session_id = agent.session_id
        # Read positions to move in the IM once the messages read are stored as steps.
        self._pending_reads: dict[uuid.UUID, uuid.UUID] = {}
        # The messages the IM's events brought that are not input yet (by id),
        # and whether to ask the IM for the unread ones all the same (what
        # the events may not have brought: at the start, after a gap).
        self._inbox: dict[uuid.UUID, IMMessage] = {}
        self._catch_up = False
        # How far each group's messages have been taken as input (group -> message
        # id), as stored with the steps they became; loaded when first needed.
        # The IM's own read positions follow, and may lag (or be lost to a crash).
        self._marks: dict[uuid.UUID, uuid.UUID] | None = None
        # A run whose end could not be stored (the database was away), and its answer.
        self._unended: tuple[Run, str] | None = None
        self._task: asyncio.Task[None] | None = None
        self._retry = False
        # Whether the last run ended without the answer it owed (see `_tell_chat`).
        self._failed = False
        # Whether the run in flight answers another agent's answer.
        self._to_an_answer = False
        self._continue = False
        self._unreachable = 0
        # Steps made but not yet stored (numbered after the last stored one).
        self._unstored = 0
        # The run in flight, and what is being cut short in it.
        self._current: asyncio.Task[None] | None = None
        self._cut: _Cut | None = None
        self._running_task: Task | None = None
        self._streaming: tuple[int, CompletionAssembler] | None = None
        self._tool_outcomes: dict[str, ToolOutcome] = {}
        self._retry_timer: asyncio.TimerHandle | None = None
        self._begun = asyncio.Event()
        # Tools waiting for a person's answer in a group: (group, after message) -> answer.
        self._reply_waiters: dict[tuple[uuid.UUID, uuid.UUID], asyncio.Future[IMMessage]] = {}
        # The members of the chat the run in flight answers (who sees what it
        # recalls); empty for a task, None when they could not be learnt.
        self._audience: tuple[uuid.UUID, ...] | None = ()
        # How the endpoint's token counts compare with our estimate, and the
        # estimate of the last request (to learn from a "too long").
        self._calibration = Calibration()
        self._last_estimate = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def start(self, *, look: bool = True) -> None:
        """Starts the loop; `look` makes it read its unread messages at once
        (which may have arrived while the runtime was down)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"agent-{self.agent.id}")
            if self.agent.state is AgentState.RUNNING:
                # The runtime stopped during a run: go on from its last step.
                self._continue = True
                look = True
            if look:
                self.catch_up()

    def deliver(self, message: IMMessage) -> None:
        """A message of one of the agent's chats, as the IM's event brought it:
        the runner takes it from here, without asking the IM again."""
        if message.sender_id == self.agent.member_id:
            return
        if self._marks is not None and message.id <= self._marks.get(message.group_id, _NO_MESSAGE):
            return  # input already (an event that came again)
        if message.id not in self._inbox and len(self._inbox) >= self._env.settings.unread_batch:
            # More waits than a run takes in: the IM keeps them all, ask it.
            self._inbox.clear()
            self._catch_up = True
        else:
            self._inbox[message.id] = message
        self.wake()

    def catch_up(self) -> None:
        """Makes the runner ask the IM for its unread messages: the events
        may not have brought them all (at the start, after a gap)."""
        self._catch_up = True
        self.wake()

    def wake(self, *, retry: bool = False) -> None:
        """Makes the runner look for work; `retry` also retries a failed run
        (an agent in ERROR), which new messages alone do too."""
        self._retry = self._retry or retry
        # A person's wake looks at everything the IM holds for the agent.
        self._catch_up = self._catch_up or retry
        self.idle.clear()
        self._wake.set()

    def update(self, agent: Agent) -> None:
        """New settings (or a new main session) take effect from the next completion."""
        self.agent = replace(
            agent,
            state=self.agent.state,
            last_error=self.agent.last_error,
            tokens_used=self.agent.tokens_used,
            pause_pending=self.agent.pause_pending,
            state_version=self.agent.state_version,
        )

    def forget_history(self) -> None:
        """The stored steps changed under the runner (a person edited them):
        the next run reads them again."""
        self._env.history.take(self.agent.id)
        if self._current is None:
            self._steps = None

    def on_message(self, message: IMMessage, *, from_person: bool) -> None:
        """A message in one of the agent's groups: the answer a tool may be waiting for."""
        if not from_person:
            return
        for (group_id, after), waiter in list(self._reply_waiters.items()):
            if group_id == message.group_id and message.id > after and not waiter.done():
                waiter.set_result(message)

    async def _wait_for_reply(self, group_id: uuid.UUID, after: uuid.UUID) -> IMMessage:
        waiter: asyncio.Future[IMMessage] = asyncio.get_running_loop().create_future()
        self._reply_waiters[(group_id, after)] = waiter
        try:
            # Asked again after a restart, the answer may be there already.
            earlier = await self._reply_in_history(group_id, after)
            if earlier is not None and not waiter.done():
                waiter.set_result(earlier)
            return await waiter
        finally:
            self._reply_waiters.pop((group_id, after), None)

    async def _reply_in_history(self, group_id: uuid.UUID, after: uuid.UUID) -> IMMessage | None:
        member = self.agent.member_id
        recent = await self._env.im.list_messages(member, group_id, limit=50)
        for message in recent:
            if (
                message.id > after
                and message.sender_id != member
                and await self._env.directory.is_person(member, message.sender_id)
            ):
                return message
        return None

    def continue_from_history(self) -> None:
        """Makes the runner go on from its last step: call the model after
        input, or run the tool calls still without results."""
        self._continue = True
        self.wake()

    async def stop(self) -> None:
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._env.history.take(self.agent.id)

    # -- the people's controls (the caller checks the transition) --------------

    async def pause(self) -> None:
        """PAUSED now if idle; a run goes on to its next step boundary (or its
        end, if no boundary comes) first, with the pause pending meanwhile."""
        current = self._current
        if current is None:
            await self._set_state(AgentState.PAUSED, "")
            return
        if not self.agent.pause_pending:
            self.agent = self.agent.with_state(self.agent.state, self.agent.last_error, pause_pending=True)
            await self._env.store.save_progress(self.agent)
            self._emit_state()
        # Answer with the state the request leaves: a run that begins is
        # RUNNING until its boundary; work that does not start is PAUSED now.
        begun = asyncio.ensure_future(self._begun.wait())
        await asyncio.wait([current, begun], return_when=asyncio.FIRST_COMPLETED)
        begun.cancel()
        if current.done():
            await self._apply_pending_pause()

    async def _apply_pending_pause(self) -> None:
        """A pause asked for during work that has ended takes effect now."""
        if self.agent.pause_pending and (self._current is None or self._current.done()):
            await self._set_state(AgentState.PAUSED, "")

    async def resume(self) -> None:
        """Back to work: what was cut short goes on, then what waits."""
        await self._set_state(AgentState.IDLE, "")
        self.continue_from_history()

    async def interrupt(self) -> None:
        """Cuts the run in flight at once and pauses."""
        await self._cut_run(_Cut("interrupted by a person", AgentState.PAUSED))
        if self.agent.state is not AgentState.PAUSED:
            await self._set_state(AgentState.PAUSED, "")

    async def terminate(self) -> None:
        """Cuts the run in flight; nothing more until `start_again`. A task
        left RUNNING by a pause goes back to the queue, as a cut one does."""
        await self._cut_run(_Cut("terminated by a person", AgentState.TERMINATED))
        if self.agent.state is not AgentState.TERMINATED:
            await self._set_state(AgentState.TERMINATED, "")
            tasks = self._env.tasks
            found = await tasks.running_task(self.agent.id) if tasks is not None else None
            if found is not None and tasks is not None:
                await tasks.put_back(found.task)

    async def start_again(self) -> None:
        await self._set_state(AgentState.IDLE, "")
        self.wake()

    async def cancel_task(self, task_id: uuid.UUID) -> bool:
        """Cuts the run of that task if it is the one in flight; False if not."""
        if self._running_task is None or self._running_task.id != task_id:
            return False
        await self._cut_run(_Cut("its task was cancelled", None))
        return True

    async def _cut_run(self, cut: _Cut) -> None:
        current = self._current
        if current is None or current.done():
            return
        # A run is cut once it has begun (its run and input stored): the
        # beginning is one short write, and cutting into it would leave a run
        # stored as running with nobody to end it.
        begun = asyncio.ensure_future(self._begun.wait())
        await asyncio.wait([current, begun], return_when=asyncio.FIRST_COMPLETED)
        begun.cancel()
        if current.done():
            return
        self._cut = cut
        current.cancel()
        # The run records what it had and ends itself; wait for that.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(current)

    # -- the loop -------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if not self._wake.is_set():
                self.idle.set()
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._cycle()
                self._unreachable = 0
            except asyncio.CancelledError:
                raise
            except errors.Unavailable as error:
                # A dependency (the IM, the database) is away: not the agent's
                # fault. Look again later; the wait doubles up to a minute. A
                # run it cut short stays as stored and goes on then, as after
                # a restart.
                if self.agent.state is AgentState.RUNNING:
                    self._continue = True
                self._unreachable += 1
                delay = min(60.0, 0.5 * 2 ** (self._unreachable - 1))
                logger.warning("agent %s: %s; trying again in %.1f s", self.agent.id, error, delay)
                asyncio.get_running_loop().call_later(delay, self.wake)
            except Exception as error:
                logger.exception("agent %s failed", self.agent.id)
                # A pause asked for meanwhile still takes effect.
                state = AgentState.PAUSED if self.agent.pause_pending else AgentState.ERROR
                await self._set_state(state, f"internal error: {error}")

    async def _cycle(self) -> None:
        if self._unended is not None:
            await self._end_unended()
        # A person's wake retries a run that failed (its input is still unanswered).
        resume = self._continue or (
            self._retry and (self.agent.state is AgentState.ERROR or (self._failed and not self._paused()))
        )
        if not resume:
            # (A run cut by a restart applies its pending pause as it ends: see `_resume`.)
            await self._apply_pending_pause()
        if self.agent.state in (AgentState.PAUSED, AgentState.TERMINATED):
            return  # what arrives waits for a person
        self._retry = self._continue = False
        # One run per cycle: whatever arrives meanwhile wakes the runner again
        # (the loop then comes straight back), so no second look is needed.
        try:
            if resume:
                try:
                    await self._resume()
                except BaseException:
                    self._continue = True  # what was pending still is: the next cycle tries again
                    raise
                self.wake()  # then what waits
                return
            taken = await self._take_unread()
            task = await self._next_task(taken.messages)
            if task is not None:
                self._pending_reads = {}  # the messages stay unread for the next cycle
                self.wake()  # then the next task, or the messages
                await self._in_flight(self._run(_Taken(), task=task))
            elif taken.messages:
                await self._in_flight(self._run(taken))
            else:
                # Nothing to answer: read all the same (no step keeps them, so
                # reading them again after a crash costs nothing but the look).
                self._advance_marks(taken.marks)
                await self._mark_read()
        except BaseException:
            self._steps = None  # what failed may have left them behind the store
            raise
        finally:
            await self._schedule_retry()
            if self._env.tasks is not None and not self._paused():
                # Idle now: a task this process left RUNNING (a write lost to
                # a fault) is settled as its run ended.
                await self._env.tasks.settle_orphans(self.agent.id)
        self._keep_history()

    def _keep_history(self) -> None:
        # Idle, the runner itself holds no history; the shared cache may.
        if self._steps is not None and self._session_id == self.agent.session_id:
            self._env.history.keep(self.agent.id, self._steps)
        self._steps = None

    async def _in_flight(self, run: Coroutine[object, object, None]) -> None:
        """Runs a run as its own task, so that a person can cut it short."""
        self._begun.clear()
        self._current = asyncio.create_task(run, name=f"agent-run-{self.agent.id}")
        try:
            await asyncio.shield(self._current)
        except asyncio.CancelledError:
            if not self._current.done():  # the runner itself is stopping
                self._current.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._current
            raise
        finally:
            self._current = None
            self._cut = None
        # Asked for when no step boundary came (the work did not start, or ended first).
        await self._apply_pending_pause()

    async def _next_task(self, messages: list[IMMessage]) -> Task | None:
        """The next task if it came before the oldest unread message."""
        if self._env.tasks is None:
            return None
        task = await self._env.tasks.next_task(self.agent.id, now=self._env.clock())
        if task is None:
            return None
        if messages and messages[0].sent_at < task.created_at:
            self.wake()  # its turn comes after these messages: nothing else will wake the runner
            return None
        return task

    async def _schedule_retry(self) -> None:
        if self._env.tasks is None or self.agent.state in (AgentState.PAUSED, AgentState.TERMINATED):
            return
        due = await self._env.tasks.next_retry_at(self.agent.id)
        if self._retry_timer is not None:
            self._retry_timer.cancel()
            self._retry_timer = None
        if due is not None:
            delay = max(0.0, (due - self._env.clock()).total_seconds())
            self._retry_timer = asyncio.get_running_loop().call_later(delay, self.wake)

    async def _resume(self) -> None:
        """Goes on from the last step of the main session, if anything is pending:
        the run the runtime stopped in, or what a pause or interrupt cut short
        (with its task, if it was a task's)."""
        await self._open_session(self.agent.session_id)
        assert self._steps is not None
        tasks = self._env.tasks
        found = await tasks.running_task(self.agent.id) if tasks is not None else None
        stale = await self._env.store.list_runs(self.agent.id, before=None, limit=1)
        if stale and stale[0].status is RunStatus.RUNNING:
            await self._go_on_after_restart(stale[0], found.task if found is not None else None)
            return
        task: Task | None = None
        if found is not None and tasks is not None:
            if found.run is not None and found.run.status is RunStatus.INTERRUPTED:
                task = found.task  # paused or interrupted: it goes on below
            else:
                # Its run ended (or never began) and the task was not settled.
                await tasks.settle_as_run_ended(found)
        if resume_point(self._steps) is Next.NOTHING:
            if self.agent.state is AgentState.RUNNING:
                await self._set_state(AgentState.IDLE, "")
            if task is not None and tasks is not None:
                await tasks.put_back(task)
            return
        await self._in_flight(self._run(_Taken(), task=task, resumed=True))

    async def _go_on_after_restart(self, run: Run, task: Task | None) -> None:
        """The runtime stopped during `run`: it goes on, in the same run and with
        its task, from its last stored step. Recorded tool calls never run
        again; those cut short run again with the same keys, so their effects
        happen once."""
        self._running_task = task
        shown = shown_to_model(self._steps or [])
        last = shown[-1] if shown else None
        if self.agent.pause_pending:
            # Asked to pause before the runtime stopped: the pause takes effect now.
            ended = replace(run, status=RunStatus.INTERRUPTED, error="paused by a person")
            await self._end_run(replace(ended, ended_at=self._env.clock()), None)
            await self._settle_task(ended, "")
            return
        if last is not None and last.run_id == run.id and _is_answer(last):
            # It had its answer: what may be missing is its delivery (sent
            # again with the same key, it arrives once) and its end.
            await self._deliver(last, None if task is not None else (run.group_id or self._last_group()))
            completed = replace(run, status=RunStatus.COMPLETED, ended_at=self._env.clock())
            await self._end_run(completed, None)
            await self._settle_task(completed, last.message.content or "")
            return
        await self._in_flight(self._run(_Taken(), task=task, resumed=True, going_on=run))

    async def _end_unended(self) -> None:
        """Stores the end of a run that could not be stored when it ended."""
        assert self._unended is not None
        run, answer = self._unended
        await self._env.store.end_run(run, self.agent)
        self._unended = None
        self._emit(RunEnded(run))
        await self._settle_task(run, answer)

    async def _open_session(self, session_id: uuid.UUID) -> None:
        if self._steps is None or self._session_id != session_id:
            self._session_id = session_id
            cached = self._env.history.take(self.agent.id) if session_id == self.agent.session_id else None
            self._steps = cached or await self._load_steps(session_id)

    async def _load_steps(self, session_id: uuid.UUID) -> list[Step]:
        steps: list[Step] = []
        while True:
            after = steps[-1].sequence if steps else 0
            page = await self._env.store.list_steps(session_id, after_sequence=after, limit=1000)
            steps.extend(page)
            if len(page) < 1000:
                return steps

    async def _take_unread(self, chat: uuid.UUID | None = None) -> _Taken:
        """The unread messages of one chat that call for an answer and were
        not taken as input before, and how far each group is then read; the
        IM is told (`_mark_read`) once they are stored as steps.

        A run answers one chat (`chat`, or the one with the oldest message
        waiting): the messages of other chats wait for runs of their own,
        each with its own conversation's context."""
        member = self.agent.member_id
        if self._marks is None:
            self._marks = await self._env.store.read_marks(self.agent.id)
        if self._catch_up:
            await self._catch_up_with_the_im()
        marks = self._marks
        for message_id in [i for i, m in self._inbox.items() if i <= marks.get(m.group_id, _NO_MESSAGE)]:
            del self._inbox[message_id]
        unread = sorted(self._inbox.values(), key=lambda m: m.id)
        if not unread:
            return _Taken()
        latest: dict[uuid.UUID, uuid.UUID] = {}
        relevant: list[IMMessage] = []
        for message in unread:
            latest[message.group_id] = message.id
            if message.id <= self._marks.get(message.group_id, _NO_MESSAGE):
                continue  # input already; only the IM's read mark was late (or lost)
            if message.sender_id == member or not self._env.guard.allows(message.group_id):
                continue
            if await self._calls_for_answer(message):
                relevant.append(message)
        if relevant:
            chosen = chat if chat is not None else relevant[0].group_id
            waiting = {m.group_id for m in relevant if m.group_id != chosen}
            relevant = [m for m in relevant if m.group_id == chosen]
            for group_id in waiting:
                del latest[group_id]  # read in its own run
            if waiting:
                self.wake()
        self._pending_reads.update(latest)
        return _Taken(relevant, latest)

    async def _catch_up_with_the_im(self) -> None:
        """Adds the IM's unread messages to those the events brought."""
        self._catch_up = False
        if self._env.read_positions is not None:
            # The IM's page starts after its read positions: move them first.
            await self._env.read_positions.flush(self.agent.member_id)
        # Bounded: after a restart every agent looks at once, and the IM must not drown.
        try:
            async with self._env.reads:
                unread = await self._env.im.get_all_unread(
                    self.agent.member_id, limit=self._env.settings.unread_batch
                )
        except BaseException:
            self._catch_up = True  # still to do
            raise
        if len(unread) >= self._env.settings.unread_batch:
            self.catch_up()  # a full page: there may be more after it
        for message in unread:
            self._inbox.setdefault(message.id, message)

    async def _calls_for_answer(self, message: IMMessage) -> bool:
        if message.content_type == "system":
            return False  # a notice (another agent's failure): nothing to answer
        member, directory = self.agent.member_id, self._env.directory
        is_direct, _ = await directory.group(member, message.group_id)
        mentions = set(message.mentions)
        if ends_exchange(message.metadata) and not await directory.is_person(member, message.sender_id):
            return member in mentions  # an answer to an answer: the exchange is over
        if is_direct or member in mentions:
            return True
        replies_to_agent = (
            message.reply_to is not None and await directory.sender(member, message.reply_to) == member
        )
        return should_answer(
            agent_member_id=member,
            is_direct=is_direct,
            mentions=mentions,
            policy=self._env.settings.group_policy,
            from_person=await directory.is_person(member, message.sender_id),
            replies_to_agent=replies_to_agent,
        )

    def _advance_marks(self, marks: dict[uuid.UUID, uuid.UUID]) -> None:
        if self._marks is None:
            return  # not loaded yet: the load will bring these
        for group_id, message_id in marks.items():
            if message_id > self._marks.get(group_id, _NO_MESSAGE):
                self._marks[group_id] = message_id
        for message_id in [
            i for i, m in self._inbox.items() if i <= self._marks.get(m.group_id, _NO_MESSAGE)
        ]:
            del self._inbox[message_id]

    async def _mark_read(self) -> None:
        pending, self._pending_reads = self._pending_reads, {}
        if self._env.read_positions is not None:
            self._env.read_positions.move(self.agent.member_id, pending.items())
            return
        outcomes = await asyncio.gather(
            *[self._env.im.mark_read(self.agent.member_id, group, up_to) for group, up_to in pending.items()],
            return_exceptions=True,
        )
        for (group, up_to), outcome in zip(pending.items(), outcomes, strict=True):
            if isinstance(outcome, Exception):
                # Kept for the next try; meanwhile those messages stay unread
                # in the IM (the agent's own marks keep them from being input twice).
                logger.warning("agent %s: marking group %s read failed: %s", self.agent.id, group, outcome)
                self._pending_reads.setdefault(group, up_to)
            elif isinstance(outcome, BaseException):
                raise outcome

    async def _run(
        self,
        taken: _Taken,
        *,
        task: Task | None = None,
        resumed: bool = False,
        going_on: Run | None = None,
    ) -> None:
        """A run: a new one (`_begin`), or `going_on` with a stored one."""
        started = await self._start(taken, task=task, resumed=resumed, going_on=going_on)
        if started is None:
            return
        run, reply_group = started
        reading = asyncio.create_task(self._mark_read())
        status, error, answer = RunStatus.ITERATION_LIMIT, "", ""
        failure: Exception | None = None
        # Why no answer came, for the people waiting for it.
        cause: Exception | None = None
        try:
            if task is not None and self._running_task is None:
                raise _TaskGone
            run, status, answer = await self._iterate(run, reply_group, resumed=resumed, chat=task is None)
        except _TaskGone:
            status, error = RunStatus.INTERRUPTED, "its task was cancelled"
        except asyncio.CancelledError:
            cut = self._cut
            if cut is None:
                raise  # the runtime is stopping
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            status, error = RunStatus.INTERRUPTED, cut.reason
            if cut.state is AgentState.TERMINATED:
                cause = _Terminated(cut.reason)  # the people waiting are told; a pause needs no word
            await self._record_cut(run)
        except _PausedAtBoundary:
            status, error = RunStatus.INTERRUPTED, "paused by a person"
        except ContextTooLong as too_long:
            # Even shrunk, the endpoint would not take it: this run fails, but
            # the next one starts from a smaller context (the estimate learnt).
            failure = cause = too_long
            status, error = RunStatus.FAILED, str(too_long)
        except LLMError as llm_failure:
            cause = llm_failure
            status, error = RunStatus.FAILED, str(llm_failure)
        except errors.Unavailable:
            # The database or the IM is away: nothing is wrong with the agent
            # or the run, which stays as stored (RUNNING) and goes on once the
            # dependency is back (see `_loop`), with the same keys.
            raise
        except Exception as other:
            # The IM refused or lost the answer, a tool's port broke...: the
            # run ends FAILED, never left RUNNING.
            failure = cause = other
            status, error = RunStatus.FAILED, str(other) or type(other).__name__
        finally:
            await reading
        # An error's text may quote the endpoint's answer: stored like a step's.
        ended = replace(run, status=status, error=storable_text(error), ended_at=self._env.clock())
        chat = reply_group if task is None else None
        await self._finish(ended, answer, failure=failure, cause=cause, chat=chat)

    async def _finish(
        self,
        ended: Run,
        answer: str,
        *,
        failure: Exception | None,
        cause: Exception | None,
        chat: uuid.UUID | None,
    ) -> None:
        """Stores the end of a run, settles its task and tells its chat if no answer came."""
        try:
            await self._end_run(ended, failure)
        except BaseException:
            # Stored at the next cycle, before anything else (see `_end_unended`).
            self._unended = (ended, answer)
            raise
        self._env.run_ended()
        await self._settle_task(ended, answer)
        await self._tell_chat(ended, cause, chat)

    async def _tell_chat(self, run: Run, cause: Exception | None, chat: uuid.UUID | None) -> None:
        """Tells the people waiting for an answer in `chat` that none is coming,
        why, and how to retry (the notice names the run: a client offers
        `WakeAgent`), if the run ended so. Posted once per run (keyed by it);
        lost if the IM is away meanwhile."""
        trouble = _trouble(run.status, cause)
        self._failed = trouble is not None and trouble is not Trouble.TERMINATED
        if trouble is None or chat is None:
            return
        notice = failure_notice(trouble, run.error)
        about = {
            "agent_id": str(self.agent.id),
            "run_id": str(run.id),
            "status": run.status.value,
            "trouble": trouble.value,
        }
        if self._failed:
            about["retry"] = "WakeAgent"
        try:
            await self._env.im.send_message(
                self.agent.member_id,
                chat,
                notice,
                content_type="system",
                metadata={"agent_failure": about},
                request_id=failure_request_id(run.id),
            )
        except IMError as error:
            logger.warning(
                "agent %s: the notice of run %s's failure was not posted: %s", self.agent.id, run.id, error
            )

    async def _members(self, chat: uuid.UUID | None) -> tuple[uuid.UUID, ...] | None:
        """Who will see the answer in `chat` (read afresh: someone may have joined)."""
        if chat is None or self._env.memory is None:
            return ()
        try:
            return (await self._env.im.get_group(self.agent.member_id, chat)).member_ids
        except IMError as error:
            # Unknown audience: no recall in this run.
            logger.warning("agent %s: members of chat %s unknown: %s", self.agent.id, chat, error)
            return None

    async def _recall(self, run: Run, messages: list[IMMessage], task: Task | None) -> list[ChatMessage]:
        """The memories most related to the run's input, as an input step of
        the run (visible and editable like any step), each with its ref; none
        if memory is slow or away: the run goes on without."""
        env, audience = self._env, self._audience
        limit = self.agent.auto_recall if self.agent.auto_recall is not None else env.settings.auto_recall
        if env.memory is None or limit <= 0 or audience is None:
            return []
        query = task.input if task is not None else "\n".join(m.content for m in messages)
        if not query.strip():
            return []
        conversation: Conversation | None = (
            TASKS if task is not None else (messages[-1].group_id if messages else None)
        )
        shown = (run.id, *self._runs_in_context(conversation))
        try:
            found = await asyncio.wait_for(
                env.memory.recall(
                    self.agent,
                    audience,
                    RecallQuery(text=query[-2000:], limit=limit, exclude_run_ids=shown[:MAX_EXCLUDED_RUNS]),
                ),
                env.settings.recall_timeout_seconds,
            )
        except (TimeoutError, errors.ServiceError) as error:
            logger.warning("agent %s: recall skipped: %s", self.agent.id, error)
            return []
        relevant = [memory for memory in found if memory.score >= env.settings.recall_min_score]
        return [ChatMessage(role=Role.USER, content=recalled_note(relevant))] if relevant else []

    def _runs_in_context(self, conversation: Conversation | None) -> list[uuid.UUID]:
        """The runs the conversation's next request will show, newest first:
        recall need not bring them back."""
        if self._steps is None or conversation is None:
            return []
        steps = in_conversation(self._steps, conversation, run_conversations(self._steps))
        window, reserve = self._window()
        fitted = fit_context(
            system_prompt="",
            steps=steps,
            current_run=None,
            tools=(),
            budget=int((window - reserve) / self._calibration.ratio),
        )
        left = {step.run_id for step in fitted.left_out}
        return sorted({step.run_id for step in steps} - left, reverse=True)

    async def _start(
        self, taken: _Taken, *, task: Task | None, resumed: bool, going_on: Run | None
    ) -> tuple[Run, uuid.UUID | None] | None:
        """The run to work in and the chat to answer; None if the work is not to be done."""
        try:
            if going_on is not None:
                chat = None if task is not None else (going_on.group_id or self._last_group())
                self._audience = await self._members(chat)
                self._begun.set()
                return going_on, chat
            return await self._begin(taken, task, resumed=resumed)
        except _NotStarted:
            self._pending_reads = {}  # what was read stays unread for later
            return None
        except errors.Unavailable:
            # Not begun (nothing stored): what was read stays unread for later,
            # and a task marked RUNNING meanwhile is settled once the runner is idle.
            self._pending_reads = {}
            self._running_task = None
            raise

    async def _begin(
        self, taken: _Taken, task: Task | None, *, resumed: bool
    ) -> tuple[Run, uuid.UUID | None]:
        """Stores the new run with its input; returns it and the chat to answer.

        Raises:
            _NotStarted: a person paused the agent, or cancelled the task,
                since the work was chosen.
        """
        env = self._env
        if self._held_back():
            raise _NotStarted
        messages = taken.messages
        # Answering another agent's answer: this answer ends the exchange.
        self._to_an_answer = any(is_agent_answer(m.metadata) for m in messages)
        await self._open_session(task.session_id if task is not None else self.agent.session_id)
        run = Run(
            id=uuid7(),
            agent_id=self.agent.id,
            session_id=self._session_id,
            status=RunStatus.RUNNING,
            trigger_message_ids=tuple(m.id for m in messages),
            started_at=env.clock(),
            group_id=messages[-1].group_id if messages else None,
        )
        inputs = [await self._incoming(m) for m in messages]
        reply_group = messages[-1].group_id if messages else (None if task else self._last_group())
        self._audience = await self._members(reply_group)
        # Before the input: the model reads what it remembers, then what it is asked.
        recalled = await self._recall(run, messages, task) if not resumed else []
        if task is not None:
            # Known as running before it is marked so, for a cancel meanwhile.
            self._running_task = task
            if env.tasks is not None and not resumed:
                inputs.append((ChatMessage(role=Role.USER, content=task.input), Origin(task_id=task.id)))
                task = await env.tasks.started(task, run_id=run.id, at=env.clock())
                if task.status is not TaskStatus.RUNNING:
                    self._running_task = None
                    raise _NotStarted
            self._running_task = task
        # The way to the first completion is short: one write stores the run,
        # the agent's state, the input and how far it was read; the IM's read
        # positions move while the model is already working.
        if self._held_back():
            # A person paused or terminated it while the work was being chosen.
            if task is not None and env.tasks is not None and not resumed:
                await env.tasks.put_back(task)
            self._running_task = None
            raise _NotStarted
        # RUNNING here before the write (with nothing awaited since the check),
        # so that a control applied meanwhile sees a run in flight; back as it
        # was if the write fails.
        before = self.agent
        self.agent = self.agent.with_state(AgentState.RUNNING, "")
        incoming = [self._step(run, m, StepMetrics(), kind=StepKind.RECALL) for m in recalled]
        incoming += [self._step(run, message, StepMetrics(), origin=origin) for message, origin in inputs]
        try:
            await env.store.begin_run(run, self.agent, incoming, read_marks=taken.marks)
        except BaseException:
            self.agent = self._restored_state(before)
            raise
        self._advance_marks(taken.marks)
        self._emit(RunStarted(run))
        if self.agent.state_version != before.state_version:
            self._emit_state()
        for step in incoming:
            self._remember(step)
        if task is not None and resumed and env.tasks is not None:
            # Moved to this run only now that it is stored: a restart in
            # between still finds the task (the agent's RUNNING one) and goes on.
            task = await env.tasks.continued(task, run_id=run.id)
            if task.status is not TaskStatus.RUNNING:
                self._running_task = None  # a person cancelled it meanwhile: `_run` ends here
        self._begun.set()
        return run, reply_group

    async def _iterate(
        self, run: Run, reply_group: uuid.UUID | None, *, resumed: bool, chat: bool
    ) -> tuple[Run, RunStatus, str]:
        """Completions and tool calls until the model answers; returns the run,
        how it ended and the answer."""
        steps = self._steps or []
        if resumed and resume_point(steps) is Next.RUN_TOOLS:
            await self._call_tools(run, _last_assistant(steps), unanswered_calls(steps), reply_group)
        for _ in range(self._env.settings.max_iterations):
            self._pause_point()
            if self._over_budget():
                return run, RunStatus.BUDGET_EXHAUSTED, ""
            run = replace(run, iterations=run.iterations + 1)
            completion, said = await self._complete_within_window(run)
            if completion.message.tool_calls:
                await self._call_tools(run, said, completion.message.tool_calls, reply_group)
                self._pause_point()
                taken = await self._take_unread(reply_group) if chat and reply_group else _Taken()
                if taken.messages:
                    arrived = taken.messages
                    run = replace(
                        run, trigger_message_ids=run.trigger_message_ids + tuple(m.id for m in arrived)
                    )
                    reply_group = arrived[-1].group_id
                    await self._read_in(run, taken)
                continue
            answer = completion.message.content or ""
            await self._deliver(said, reply_group)
            return run, RunStatus.COMPLETED, answer
        return run, RunStatus.ITERATION_LIMIT, ""

    def _pause_point(self) -> None:
        """A step boundary: where a requested pause takes effect."""
        if self.agent.pause_pending:
            raise _PausedAtBoundary

    async def _record_cut(self, run: Run) -> None:
        """Keeps what the cut run had: the step being streamed, marked
        interrupted, and a result for every tool call (cancelled where none)."""
        # The store is the truth: a write may have landed as the run was cut.
        self._steps = await self._load_steps(self._session_id)
        self._unstored = 0
        streaming, self._streaming = self._streaming, None
        if streaming is not None:
            sequence, assembler = streaming
            if not self._steps or self._steps[-1].sequence < sequence:
                partial = interrupted_message(assembler.message())
                await self._append(run, partial, StepMetrics(), interrupted=True)
        outcomes, self._tool_outcomes = self._tool_outcomes, {}
        for call in unanswered_calls(self._steps):
            outcome = outcomes.get(call.id)
            await self._append(
                run,
                ChatMessage(
                    role=Role.TOOL,
                    content=outcome.content if outcome is not None else CANCELLED_RESULT,
                    tool_call_id=call.id,
                    name=call.name,
                ),
                StepMetrics(tool_duration_ms=outcome.duration_ms if outcome is not None else 0.0),
            )

    async def _settle_task(self, run: Run, answer: str) -> None:
        task, self._running_task = self._running_task, None
        tasks = self._env.tasks
        if task is None or tasks is None:
            return
        at = self._env.clock()
        if run.status is RunStatus.COMPLETED:
            await tasks.succeeded(task, result=answer, at=at)
        elif run.status is RunStatus.INTERRUPTED and self.agent.state is AgentState.PAUSED:
            pass  # it stays RUNNING: resuming goes on with it where it was cut
        elif run.status is RunStatus.INTERRUPTED and self.agent.state is AgentState.TERMINATED:
            await tasks.put_back(task)
        elif run.status is RunStatus.INTERRUPTED:
            await tasks.cancelled(task, at=at)
        else:
            await tasks.failed(task, error=run.error or run.status.value, at=at)

    async def _end_run(self, run: Run, failure: Exception | None) -> None:
        agent, error = self.agent, run.error
        if isinstance(failure, IMError) and not isinstance(failure, errors.Unavailable):
            # Refused (the group is gone, the agent was removed from it): the
            # answer cannot be given, but nothing is wrong with the agent.
            logger.warning("agent %s: the IM refused its answer: %s", agent.id, error)
            state, error = AgentState.IDLE, ""
        elif isinstance(failure, ContextTooLong):
            state, error = AgentState.IDLE, ""  # not the agent's fault; the run says why
        elif run.status is RunStatus.FAILED:
            if failure is not None and not isinstance(failure, errors.ServiceError):
                logger.error("agent %s: run %s failed", agent.id, run.id, exc_info=failure)
            state = AgentState.ERROR
        elif run.status is RunStatus.INTERRUPTED:
            cut = self._cut
            if cut is not None and cut.state is not None:
                state, error = cut.state, ""
            elif cut is None:
                state, error = AgentState.PAUSED, ""  # paused at a step boundary
            else:
                state, error = AgentState.IDLE, ""
        else:
            state, error = AgentState.IDLE, ""
        if agent.pause_pending and state is not AgentState.TERMINATED:
            # Asked to pause during the run, and no step boundary came: it
            # takes effect as the run ends (why a failed run failed stays on the run).
            state, error = AgentState.PAUSED, ""
        self.agent = agent.with_state(state, error)
        # One write for the run's end and the agent's new state.
        await self._env.store.end_run(run, self.agent)
        self._emit(RunEnded(run))
        if self.agent.state_version != agent.state_version:
            self._emit_state()

    async def _deliver(self, said: Step, group_id: uuid.UUID | None) -> None:
        """Posts an answer step to the chat, in several messages if it is longer
        than one may be; each part keyed by the step, so that it arrives once
        however often this runs."""
        content = said.message.content or ""
        if is_silence(content) or group_id is None:
            return
        names = await self._names(group_id) if "@" in content else {}
        for index, part in enumerate(split_reply(content, self._env.settings.max_reply_bytes)):
            await self._env.im.send_message(
                self.agent.member_id,
                group_id,
                part,
                mentions=mentioned(part, names, author=self.agent.member_id) if "@" in part else (),
                metadata=answer_metadata(said.run_id, to_an_answer=self._to_an_answer),
                request_id=answer_request_id(said.id, index),
            )

    async def _names(self, group_id: uuid.UUID) -> dict[uuid.UUID, str]:
        """The display names of the chat's members, to find whom an answer @names."""
        member_ids = self._audience
        if not member_ids:
            member_ids = (await self._env.im.get_group(self.agent.member_id, group_id)).member_ids
        names: dict[uuid.UUID, str] = {}
        for member_id in member_ids:
            try:
                names[member_id] = await self._env.directory.name(self.agent.member_id, member_id)
            except IMError as error:
                if isinstance(error, errors.Unavailable):
                    raise
                # A member the IM no longer shows is mentioned by no one.
        return names

    def _last_group(self) -> uuid.UUID | None:
        # Resuming after an error: answer where the last message came from.
        for step in reversed(self._steps or []):
            chat = conversation_of_input(step)
            if isinstance(chat, uuid.UUID):
                return chat
        return None

    def _paused(self) -> bool:
        return self.agent.state is AgentState.PAUSED

    def _held_back(self) -> bool:
        """A person paused or terminated the agent (or asked for a pause): no new run begins."""
        return self.agent.state in (AgentState.PAUSED, AgentState.TERMINATED) or self.agent.pause_pending

    def _over_budget(self) -> bool:
        budget = self.agent.token_budget or self._env.settings.default_token_budget
        return self.agent.tokens_used >= budget

    async def _incoming(self, message: IMMessage) -> tuple[ChatMessage, Origin]:
        """An IM message as an input step: its text, and who sent it where."""
        member = self.agent.member_id
        direct, name = await self._env.directory.group(member, message.group_id)
        sender = await self._env.directory.name(member, message.sender_id)
        origin = Origin(
            group_id=message.group_id,
            group_name=name,
            direct=direct,
            sender_id=message.sender_id,
            sender_name=sender,
            message_id=message.id,
        )
        return ChatMessage(role=Role.USER, content=message.content), origin

    async def _read_in(self, run: Run, taken: _Taken) -> None:
        """Adds messages to the context as user steps (in one write with how
        far they were read), then marks them read in the IM."""
        inputs = [await self._incoming(message) for message in taken.messages]
        steps = [self._step(run, message, StepMetrics(), origin=origin) for message, origin in inputs]
        await self._env.store.append_input(self.agent.id, steps, taken.marks)
        self._advance_marks(taken.marks)
        for step in steps:
            self._remember(step)
        await self._mark_read()

    async def _complete_within_window(self, run: Run) -> tuple[Completion, Step]:
        """A completion whose request fits the model's window. An endpoint
        that still says "too long" teaches the estimate, and the request is
        made once more, shorter."""
        try:
            return await self._complete(run)
        except ContextTooLong as refused:
            logger.warning("agent %s: %s; shrinking the context and trying again", self.agent.id, refused)
            self._calibration.too_long(self._last_estimate, reported=refused.requested, window=refused.window)
            return await self._complete(run)

    def _window(self) -> tuple[int, int]:
        """The model's context window and the room kept for the answer."""
        model, settings = self.agent.model, self._env.settings
        name = model.model or (settings.default_model if model.base_url else settings.unconfigured_model)
        window = context_window(name, configured=model.context_tokens, fallback=settings.context_tokens)
        if self._calibration.window:
            window = min(window, self._calibration.window)  # the endpoint knows best
        return window, answer_reserve(window, model.max_tokens)

    def _conversation_steps(self, run: Run) -> list[Step]:
        assert self._steps is not None
        runs = run_conversations(self._steps)
        return in_conversation(self._steps, runs.get(run.id), runs)

    async def _fitted_context(self, run: Run, tools: Sequence[ToolSpec]) -> Fitted:
        """The request's messages within the budget; runs that must leave
        and no summary covers yet are summarized first (with room to spare,
        so that the next runs need no summary of their own)."""
        window, reserve = self._window()
        budget = int((window - reserve) / self._calibration.ratio)

        def fit(tokens: int) -> Fitted:
            return fit_context(
                system_prompt=self._system_prompt(origin_of_run(self._steps or [], run.id)),
                steps=self._conversation_steps(run),
                current_run=run.id,
                tools=tools,
                budget=tokens,
            )

        fitted = fit(budget)
        if any(step.sequence > fitted.summary_through for step in fitted.left_out):
            roomy = fit(int(budget * SUMMARY_HEADROOM))
            leaving = [s for s in roomy.left_out if s.sequence > roomy.summary_through]
            if leaving and await self._summarize(run, leaving, budget):
                fitted = fit(budget)
        self._last_estimate = fitted.estimated
        return fitted

    async def _summarize(self, run: Run, leaving: list[Step], budget: int) -> bool:
        """The model writes the rolling summary: the one before and the steps
        leaving the context, in a SUMMARY step covering them. Whether it could."""
        assert self._steps is not None
        previous = latest_summary(self._conversation_steps(run))
        request = CompletionRequest(
            messages=summary_request((previous.message.content or "") if previous else "", leaving, budget),
            settings=self.agent.model,
        )
        sequence = self._next_sequence()
        self._emit(StepStarted(run.id, sequence, Role.SYSTEM))
        started, assembler = time.perf_counter(), CompletionAssembler()
        usage: Usage | None = None
        try:
            async for item in self._env.llm.stream(request):
                if isinstance(item, Completion):
                    usage = item.usage
                elif isinstance(item, ContentDelta):
                    delta = storable_delta(item)
                    assembler.add(delta)
                    self._emit(StepDelta(sequence, delta))
        except LLMError as error:
            logger.warning("agent %s: no summary of the runs leaving its context: %s", self.agent.id, error)
            return False
        text = assembler.content.strip()
        if not text:
            return False
        if usage is None:
            prompt = self._calibration.tokens(sum(map(estimate_message, request.messages)))
            usage = estimated_usage(prompt, ChatMessage(role=Role.SYSTEM, content=text))
        metrics = StepMetrics(
            duration_ms=(time.perf_counter() - started) * 1000,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            model=self.agent.model.model,
            usage_estimated=usage.estimated,
        )
        await self._append(
            run,
            ChatMessage(role=Role.SYSTEM, content=text),
            metrics,
            sequence=sequence,
            kind=StepKind.SUMMARY,
            summary_through=max(step.sequence for step in leaving),
        )
        self._count_tokens(usage)
        return True

    async def _complete(self, run: Run) -> tuple[Completion, Step]:
        """A completion; a stream that breaks off midway is kept as a CUT step
        and asked for again (as the LLM adapter does with the requests that
        fail before their first delta), unless no retry could help."""
        settings = self._env.settings
        for attempt in range(settings.stream_cut_retries + 1):
            try:
                return await self._complete_once(run)
            except _StreamCut as cut:
                error = cut.error
                if attempt == settings.stream_cut_retries or isinstance(error, LLMRejected):
                    raise error from None
                delay = min(8.0, settings.stream_cut_backoff_seconds * 2**attempt)
                logger.warning(
                    "agent %s: the model's stream broke off (%s); asking again in %.1f s",
                    self.agent.id,
                    error,
                    delay,
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _complete_once(self, run: Run) -> tuple[Completion, Step]:
        env, agent = self._env, self.agent
        tools = env.tools.specs(agent.tools)
        fitted = await self._fitted_context(run, tools)
        request = CompletionRequest(messages=fitted.messages, tools=tools, settings=agent.model)
        sequence = self._next_sequence()
        self._emit(StepStarted(run.id, sequence, Role.ASSISTANT))
        started = time.perf_counter()
        first_token_ms = 0.0
        completion: Completion | None = None
        # What has streamed so far, kept should a person cut the step short.
        assembler = CompletionAssembler()
        self._streaming = (sequence, assembler)
        try:
            async for item in env.llm.stream(request):
                if isinstance(item, Completion):
                    completion = item
                    continue
                if not first_token_ms:
                    first_token_ms = (time.perf_counter() - started) * 1000
                # Watchers see what the stored step will hold.
                delta = storable_delta(item)
                assembler.add(delta)
                self._emit(StepDelta(sequence, delta))
        except LLMError as error:
            if not first_token_ms:
                raise
            await self._keep_cut(run, sequence, assembler, started, error)
            raise _StreamCut(error) from None
        if completion is None:
            raise LLMError("the model's stream ended without a completion")
        # What the model said is stored, answered and reused as it is stored.
        completion = replace(
            completion, message=storable_message(completion.message), model=storable_text(completion.model)
        )
        usage = completion.usage
        if usage is not None:
            self._calibration.observe(fitted.estimated, usage.input_tokens)
        else:
            usage = estimated_usage(self._calibration.tokens(fitted.estimated), completion.message)
        metrics = StepMetrics(
            duration_ms=(time.perf_counter() - started) * 1000,
            first_token_ms=first_token_ms,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_tokens=usage.cached_tokens,
            model=completion.model,
            usage_estimated=usage.estimated,
        )
        said = await self._append(run, completion.message, metrics, sequence=sequence)
        self._streaming = None
        self._count_tokens(usage)
        return completion, said

    async def _keep_cut(
        self, run: Run, sequence: int, assembler: CompletionAssembler, started: float, error: LLMError
    ) -> None:
        """Stores what a broken-off stream had said (people saw it stream) as a CUT step."""
        self._streaming = None
        partial = assembler.message()
        kept = ChatMessage(role=Role.ASSISTANT, content=partial.content, reasoning=partial.reasoning)
        logger.info("agent %s: stream of step %d broke off: %s", self.agent.id, sequence, error)
        await self._append(
            run,
            kept,
            StepMetrics(duration_ms=(time.perf_counter() - started) * 1000),
            sequence=sequence,
            kind=StepKind.CUT,
        )

    def _count_tokens(self, usage: Usage) -> None:
        """Adds a call's tokens to what the agent has used (its budget's measure)."""
        used = self.agent.tokens_used + usage.input_tokens + usage.output_tokens
        self.agent = replace(self.agent, tokens_used=used)

    def _system_prompt(self, origin: Origin | None = None) -> str:
        agent = self.agent
        identity = f"You are {agent.name}"
        if agent.role:
            identity += f", {agent.role}"
        identity += (
            ", a member of an instant-messaging workspace."
            " Your final answer is posted to the chat that woke you; use tools to write elsewhere."
            " In a group, @name a member to ask them; agents answer only those who @name them or"
            f" reply to them. If you have nothing to add, answer exactly {NO_REPLY} and nothing is posted."
        )
        where = conversation_line(origin)
        if where:
            identity += " " + where
        return f"{identity}\n\n{agent.system_prompt}".strip()

    async def _call_tools(
        self, run: Run, said: Step, calls: tuple[ToolCall, ...], reply_group: uuid.UUID | None
    ) -> None:
        """Runs the tool calls of the assistant step `said`, each keyed by that step and its call id."""
        env = self._env
        context = ToolContext(
            agent=self.agent,
            im=env.im,
            trigger_group_id=reply_group,
            create_sub_agent=env.create_sub_agent,
            wait_for_reply=self._wait_for_reply,
            memory=env.memory if self._audience is not None else None,
            audience=self._audience or (),
        )

        async def execute(call: ToolCall) -> ToolOutcome:
            keyed = replace(context, request_id=tool_request_id(said.id, call.id))
            outcome = await env.tools.execute(keyed, call)
            # Kept should the run be cut before the results are stored.
            self._tool_outcomes[call.id] = outcome
            return outcome

        outcomes = await asyncio.gather(*[execute(call) for call in calls])
        self._tool_outcomes = {}
        for call, outcome in zip(calls, outcomes, strict=True):
            await self._append(
                run,
                ChatMessage(role=Role.TOOL, content=outcome.content, tool_call_id=call.id, name=call.name),
                StepMetrics(duration_ms=outcome.duration_ms, tool_duration_ms=outcome.duration_ms),
            )

    def _next_sequence(self) -> int:
        assert self._steps is not None
        return self._steps[-1].sequence + 1 if self._steps else 1

    def _step(
        self,
        run: Run,
        message: ChatMessage,
        metrics: StepMetrics,
        *,
        sequence: int = 0,
        interrupted: bool = False,
        kind: StepKind = StepKind.MESSAGE,
        summary_through: int = 0,
        origin: Origin | None = None,
    ) -> Step:
        """A new step after the last one (or at `sequence`); not stored yet."""
        if not sequence:
            sequence = self._next_sequence() + self._unstored
            self._unstored += 1
        return Step(
            id=uuid7(),
            agent_id=self.agent.id,
            session_id=self._session_id,
            run_id=run.id,
            sequence=sequence,
            # Model output, tool results and incoming messages alike: no
            # text a client did not send may fail the write.
            message=storable_message(message),
            metrics=metrics,
            created_at=self._env.clock(),
            interrupted=interrupted,
            kind=kind,
            summary_through=summary_through,
            origin=storable_origin(origin) if origin is not None else None,
        )

    def _remember(self, step: Step) -> None:
        """Adds a stored step to the context and tells the watchers."""
        assert self._steps is not None
        self._steps.append(step)
        self._unstored = 0
        self._emit(StepCompleted(step))

    async def _append(
        self,
        run: Run,
        message: ChatMessage,
        metrics: StepMetrics,
        *,
        sequence: int = 0,
        interrupted: bool = False,
        kind: StepKind = StepKind.MESSAGE,
        summary_through: int = 0,
    ) -> Step:
        step = self._step(
            run,
            message,
            metrics,
            sequence=sequence,
            interrupted=interrupted,
            kind=kind,
            summary_through=summary_through,
        )
        await self._env.store.append_step(step)
        self._remember(step)
        return step

    async def _set_state(self, state: AgentState, error: str) -> None:
        """Moves the agent to a state (which ends any pending pause) and stores it."""
        # Changed here before the write, so that the loop (which checks the
        # state between its awaits) sees it at once; back as it was if the write fails.
        before = self.agent
        self.agent = self.agent.with_state(state, error)
        try:
            await self._env.store.save_progress(self.agent)
        except BaseException:
            self.agent = self._restored_state(before)
            raise
        if self.agent.state_version != before.state_version:
            self._emit_state()

    def _restored_state(self, before: Agent) -> Agent:
        """The agent with its state as `before` had it (a write of the new one
        failed); its version stays ahead, so that the state is told again
        however it was seen meanwhile."""
        version = max(before.state_version, self.agent.state_version)
        return replace(
            self.agent,
            state=before.state,
            last_error=before.last_error,
            pause_pending=before.pause_pending,
            state_version=version,
        )

    def _emit_state(self) -> None:
        agent = self.agent
        self._emit(
            StateChanged(
                agent.state, agent.last_error, pause_pending=agent.pause_pending, version=agent.state_version
            )
        )

    def _emit(self, event: AgentEvent) -> None:
        self._env.hub.publish(Emitted(self.agent.id, self._env.clock(), event))


_NO_MESSAGE = uuid.UUID(int=0)


@dataclass(frozen=True, slots=True)
class _Taken:
    """Messages taken as input, and how far each group is read with them."""

    messages: list[IMMessage] = field(default_factory=list)
    marks: dict[uuid.UUID, uuid.UUID] = field(default_factory=dict)


def _is_answer(step: Step) -> bool:
    """An assistant step that calls no tool: the answer of its run."""
    return step.role is Role.ASSISTANT and not step.message.tool_calls


def _last_assistant(steps: list[Step]) -> Step:
    return next(step for step in reversed(shown_to_model(steps)) if step.role is Role.ASSISTANT)


class _PausedAtBoundary(Exception):
    """A pause requested during a run takes effect at a step boundary."""


class _TaskGone(Exception):
    """The task a run was to go on with was cancelled meanwhile."""


class _NotStarted(Exception):
    """The work chosen is not to be done after all (paused, or the task cancelled)."""


class _Terminated(Exception):
    """A person terminated the agent during the run."""


class _StreamCut(Exception):
    """The model's stream broke off after it began; what it said is kept as a CUT step."""

    def __init__(self, error: LLMError) -> None:
        super().__init__(str(error))
        self.error = error


def _trouble(status: RunStatus, cause: Exception | None) -> Trouble | None:
    """Why a run that ended so owes the chat a notice; None if it does not
    (it answered, a person stopped it, or the IM refused the answer and would
    refuse a notice too)."""
    if status is RunStatus.BUDGET_EXHAUSTED:
        return Trouble.BUDGET
    if isinstance(cause, _Terminated):
        return Trouble.TERMINATED
    if status is not RunStatus.FAILED or isinstance(cause, IMError):
        return None
    if isinstance(cause, ContextTooLong):
        return Trouble.CONTEXT
    if isinstance(cause, LLMRejected):
        return Trouble.MODEL_REFUSED
    if isinstance(cause, LLMError):
        return Trouble.MODEL_DOWN
    return Trouble.OTHER
