"""The runtime's domain: agents, runs and steps, and the events of the live stream."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime

from services.runtime.domain.llm import (
    ChatMessage,
    ContentDelta,
    Delta,
    ModelSettings,
    ReasoningDelta,
    Role,
    ToolCallDelta,
    storable_text,
)


class AgentState(enum.StrEnum):
    IDLE = "idle"
    RUNNING = "running"
    ERROR = "error"
    # Set by a person: what arrives waits until resumed (or started again).
    PAUSED = "paused"
    TERMINATED = "terminated"


class RunStatus(enum.StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    ITERATION_LIMIT = "iteration_limit"
    BUDGET_EXHAUSTED = "budget_exhausted"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True, slots=True)
class Agent:
    id: uuid.UUID
    workspace_id: uuid.UUID
    member_id: uuid.UUID
    name: str
    role: str
    system_prompt: str
    model: ModelSettings
    tools: tuple[str, ...]
    parent_id: uuid.UUID | None
    created_at: datetime
    updated_at: datetime
    state: AgentState = AgentState.IDLE
    last_error: str = ""
    tokens_used: int = 0
    token_budget: int = 0
    # The main session (thread of steps): where new messages and tasks go.
    session_id: uuid.UUID = field(default_factory=uuid.uuid4)
    # Asked to pause during a run: it pauses at the next step boundary or the run's end.
    pause_pending: bool = False
    # Memories recalled at the start of each run; None: the runtime's default.
    auto_recall: int | None = None
    # Counts changes of state, last_error and pause_pending: a client showing
    # the state keeps the one of the highest version, whatever order the
    # answers and events reach it in.
    state_version: int = 0
    # The member who owns it (controls it with the workspace's admins); None
    # for an agent created before owners were recorded: admins only.
    owner_id: uuid.UUID | None = None

    def with_state(self, state: AgentState, last_error: str, *, pause_pending: bool = False) -> Agent:
        """This agent in `state` (a new state version if anything changed)."""
        if (state, last_error, pause_pending) == (self.state, self.last_error, self.pause_pending):
            return self
        return replace(
            self,
            state=state,
            last_error=last_error,
            pause_pending=pause_pending,
            state_version=self.state_version + 1,
        )


@dataclass(frozen=True, slots=True)
class AgentDraft:
    """What a caller asks an agent to be: its settings, unchecked."""

    name: str
    role: str = ""
    system_prompt: str = ""
    model: ModelSettings = field(default_factory=ModelSettings)
    tools: tuple[str, ...] = ()
    token_budget: int = 0
    auto_recall: int | None = None

    @classmethod
    def of(cls, agent: Agent) -> AgentDraft:
        """The settings `agent` has."""
        return cls(
            name=agent.name,
            role=agent.role,
            system_prompt=agent.system_prompt,
            model=agent.model,
            tools=agent.tools,
            token_budget=agent.token_budget,
            auto_recall=agent.auto_recall,
        )


@dataclass(frozen=True, slots=True)
class StepMetrics:
    duration_ms: float = 0.0
    first_token_ms: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    model: str = ""
    tool_duration_ms: float = 0.0
    # The token counts are the runtime's estimate (the endpoint reported none).
    usage_estimated: bool = False


class StepKind(enum.StrEnum):
    MESSAGE = "message"
    # A summary of earlier runs the model wrote when they left the context.
    SUMMARY = "summary"
    # Memories recalled at the start of a run.
    RECALL = "recall"
    # What the model had streamed when its stream broke off: kept for the
    # record (people saw it), never shown to the model again; the retried
    # request comes after it.
    CUT = "cut"


def shown_to_model(steps: Iterable[Step]) -> list[Step]:
    """The steps a model's context may hold: all but the CUT ones."""
    return [step for step in steps if step.kind is not StepKind.CUT]


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an input step came from: a chat message (who sent it, in which
    chat) or a task. The model reads the names; the ids are for tools,
    memory and people who ask."""

    group_id: uuid.UUID | None = None
    group_name: str = ""
    direct: bool = False
    sender_id: uuid.UUID | None = None
    sender_name: str = ""
    message_id: uuid.UUID | None = None
    task_id: uuid.UUID | None = None


def storable_origin(origin: Origin) -> Origin:
    """The origin with names any store takes (see `storable_text`)."""
    return replace(
        origin, group_name=storable_text(origin.group_name), sender_name=storable_text(origin.sender_name)
    )


@dataclass(frozen=True, slots=True)
class Step:
    """A native chat message in an agent's session, with where and how it came to be."""

    id: uuid.UUID
    agent_id: uuid.UUID
    session_id: uuid.UUID
    run_id: uuid.UUID
    sequence: int
    message: ChatMessage
    metrics: StepMetrics
    created_at: datetime
    # Cut short by an interrupt: what was streamed until then.
    interrupted: bool = False
    kind: StepKind = StepKind.MESSAGE
    # SUMMARY steps: the last sequence of the session the summary covers.
    summary_through: int = 0
    # Input steps: the message or task they came from.
    origin: Origin | None = None

    @property
    def role(self) -> Role:
        return self.message.role


@dataclass(frozen=True, slots=True)
class Session:
    """A thread of an agent's steps; a fork remembers where it came from."""

    id: uuid.UUID
    agent_id: uuid.UUID
    created_at: datetime
    forked_from: uuid.UUID | None = None
    forked_at_sequence: int = 0


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """An agent's settings and its session's steps up to `sequence`, named."""

    id: uuid.UUID
    agent_id: uuid.UUID
    name: str
    session_id: uuid.UUID
    sequence: int
    settings: Agent
    created_at: datetime


class TaskStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a retry is due at retry_at
    CANCELLED = "cancelled"
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class Task:
    """Work submitted to an agent; it runs in its turn, serially with the agent's other work."""

    id: uuid.UUID
    agent_id: uuid.UUID
    session_id: uuid.UUID
    input: str
    status: TaskStatus
    created_at: datetime
    priority: int = 0
    attempts: int = 0
    last_error: str = ""
    result: str = ""
    request_id: str = ""
    started_at: datetime | None = None
    ended_at: datetime | None = None
    retry_at: datetime | None = None
    run_id: uuid.UUID | None = None


@dataclass(frozen=True, slots=True)
class Run:
    id: uuid.UUID
    agent_id: uuid.UUID
    session_id: uuid.UUID
    status: RunStatus
    trigger_message_ids: tuple[uuid.UUID, ...]
    started_at: datetime
    iterations: int = 0
    error: str = ""
    ended_at: datetime | None = None
    # The chat it answers; None for a task.
    group_id: uuid.UUID | None = None


# The live stream of an agent. Step snapshots are persisted; deltas are not.


@dataclass(frozen=True, slots=True)
class RunStarted:
    run: Run


@dataclass(frozen=True, slots=True)
class RunEnded:
    run: Run


@dataclass(frozen=True, slots=True)
class StepStarted:
    run_id: uuid.UUID
    sequence: int
    role: Role


@dataclass(frozen=True, slots=True)
class StepDelta:
    sequence: int
    delta: Delta


@dataclass(frozen=True, slots=True)
class StepCompleted:
    step: Step


@dataclass(frozen=True, slots=True)
class StepAborted:
    """The step in flight will not complete: the replica running it stopped
    (or lost its lease) mid-step. What streamed of it is void; the runner
    that goes on with the agent starts it again with the same sequence."""

    run_id: uuid.UUID
    sequence: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class StateChanged:
    state: AgentState
    error: str = ""
    pause_pending: bool = False
    # The agent's state_version after the change.
    version: int = 0


@dataclass(frozen=True, slots=True)
class TaskChanged:
    task: Task


@dataclass(frozen=True, slots=True)
class MainSessionChanged:
    session: Session


@dataclass(frozen=True, slots=True)
class StepsRewritten:
    """Steps after `after_sequence` of a session were edited, archived or added by a person."""

    session_id: uuid.UUID
    after_sequence: int


@dataclass(frozen=True, slots=True)
class OwnerChanged:
    """Another replica runs the agent from now on (it took the agent's
    shard). Not shown to clients: it tells a watch to read the stored steps
    again, since the last owner may have died between storing a step and
    announcing it, with nothing announced after it."""


AgentEvent = (
    RunStarted
    | RunEnded
    | StepStarted
    | StepDelta
    | StepCompleted
    | StepAborted
    | StateChanged
    | TaskChanged
    | MainSessionChanged
    | StepsRewritten
    | OwnerChanged
)


@dataclass(frozen=True, slots=True)
class Emitted:
    """An event of an agent at a moment."""

    agent_id: uuid.UUID
    at: datetime
    event: AgentEvent


def merge_deltas(events: Iterable[Emitted]) -> list[Emitted]:
    """Joins consecutive fragments of one step into one: content with content,
    reasoning with reasoning, a tool call's arguments with the same call's.

    What a slow watcher has waiting then goes out as fewer, longer deltas that
    add up to the same text; nothing else is reordered or dropped.
    """
    merged: list[Emitted] = []
    for emitted in events:
        last = merged[-1] if merged else None
        if last is not None and last.agent_id == emitted.agent_id:
            joined = _joined(last.event, emitted.event)
            if joined is not None:
                merged[-1] = replace(emitted, event=joined)
                continue
        merged.append(emitted)
    return merged


def _joined(first: AgentEvent, second: AgentEvent) -> StepDelta | None:
    if not (isinstance(first, StepDelta) and isinstance(second, StepDelta)):
        return None
    if first.sequence != second.sequence:
        return None
    a, b = first.delta, second.delta
    if isinstance(a, ContentDelta) and isinstance(b, ContentDelta):
        return StepDelta(first.sequence, ContentDelta(a.text + b.text))
    if isinstance(a, ReasoningDelta) and isinstance(b, ReasoningDelta):
        return StepDelta(first.sequence, ReasoningDelta(a.text + b.text))
    if (
        isinstance(a, ToolCallDelta)
        and isinstance(b, ToolCallDelta)
        and a.index == b.index
        and b.id is None
        and b.name is None
    ):
        return StepDelta(first.sequence, replace(a, arguments=a.arguments + b.arguments))
    return None


@dataclass(frozen=True, slots=True)
class Placed:
    """A task and, while it is QUEUED, how many tasks are ahead of it."""

    task: Task
    position: int = 0
