"""A runner's state and the steps it keeps; the signals passed between its parts."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field, replace

from uuid_utils.compat import uuid7

from services.runtime.domain.context import Calibration, SentSteps
from services.runtime.domain.conversations import conversation_of_input
from services.runtime.domain.errors import LLMError
from services.runtime.domain.llm import ChatMessage, CompletionAssembler, Role, Usage, storable_message
from services.runtime.domain.model import (
    Agent,
    AgentEvent,
    AgentState,
    Emitted,
    Origin,
    Run,
    StateChanged,
    Step,
    StepAborted,
    StepCompleted,
    StepKind,
    StepMetrics,
    Task,
    shown_to_model,
    storable_origin,
)
from services.runtime.service_layer.im_port import IMMessage
from services.runtime.service_layer.leases import Fence
from services.runtime.service_layer.runner.env import RunnerEnv
from services.runtime.service_layer.tools import ToolOutcome


class RunnerCore:
    """One agent's runner state: its agent, steps, inbox and run in flight, and
    how a step is made, stored and told. The other parts of the runner
    (`Inbox`, `Context`, `OneRun`, `AgentRunner`) build on it."""

    def __init__(self, agent: Agent, env: RunnerEnv) -> None:
        self.agent = agent
        self._env = env
        self._wake = asyncio.Event()
        self._steps: list[Step] | None = None
        # Each step's message as sent and its token estimate, worked out once.
        self._sent_steps = SentSteps()
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
        # The step being streamed: its run, sequence and what came so far.
        self._streaming: tuple[uuid.UUID, int, CompletionAssembler] | None = None
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

    def wake(self, *, retry: bool = False) -> None:
        """Makes the runner look for work; `retry` also retries a failed run
        (an agent in ERROR), which new messages alone do too."""
        self._retry = self._retry or retry
        # A person's wake looks at everything the IM holds for the agent.
        self._catch_up = self._catch_up or retry
        self.idle.clear()
        self._wake.set()

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
        await self._env.store.append_step(step, fence=self._fence())
        self._remember(step)
        return step

    def _fence(self) -> Fence | None:
        """What this runner's writes prove themselves with (see `Fences`).

        Raises:
            LeaseLost: this replica no longer holds the agent's shard.
        """
        return self._env.fences.fence_for(self.agent.workspace_id)

    async def _set_state(self, state: AgentState, error: str) -> None:
        """Moves the agent to a state (which ends any pending pause) and stores it."""
        # Changed here before the write, so that the loop (which checks the
        # state between its awaits) sees it at once; back as it was if the write fails.
        before = self.agent
        self.agent = self.agent.with_state(state, error)
        try:
            await self._env.store.save_progress(self.agent, fence=self._fence())
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

    def _abort_streaming(self, reason: str) -> None:
        """Tells watchers the step being streamed will not complete (it is started again later)."""
        streaming, self._streaming = self._streaming, None
        if streaming is not None:
            run_id, sequence, _ = streaming
            self._emit(StepAborted(run_id, sequence, reason))

    def _emit(self, event: AgentEvent) -> None:
        self._env.hub.publish(
            Emitted(self.agent.id, self._env.clock(), event),
            workspace_id=self.agent.workspace_id,
            from_runner=True,
        )

    def _count_tokens(self, usage: Usage) -> None:
        """Adds a call's tokens to what the agent has used (its budget's measure)."""
        used = self.agent.tokens_used + usage.input_tokens + usage.output_tokens
        self.agent = replace(self.agent, tokens_used=used)

    def _paused(self) -> bool:
        return self.agent.state is AgentState.PAUSED

    def _held_back(self) -> bool:
        """A person paused or terminated the agent (or asked for a pause): no new run begins."""
        return self.agent.state in (AgentState.PAUSED, AgentState.TERMINATED) or self.agent.pause_pending

    def _over_budget(self) -> bool:
        budget = self.agent.token_budget or self._env.settings.default_token_budget
        return self.agent.tokens_used >= budget

    def _last_group(self) -> uuid.UUID | None:
        # Resuming after an error: answer where the last message came from.
        for step in reversed(self._steps or []):
            chat = conversation_of_input(step)
            if isinstance(chat, uuid.UUID):
                return chat
        return None

    def _pause_point(self) -> None:
        """A step boundary: where a requested pause takes effect."""
        if self.agent.pause_pending:
            raise _PausedAtBoundary


@dataclass(frozen=True, slots=True)
class _Cut:
    """Why the run in flight is being cut short, and the state it leaves the agent in
    (None: as the run would have; a cancelled task)."""

    reason: str
    state: AgentState | None


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
