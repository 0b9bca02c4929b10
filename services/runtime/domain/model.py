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
)


class AgentState(enum.StrEnum):
    IDLE = "idle"
    RUNNING = "running"
    ERROR = "error"


class RunStatus(enum.StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    ITERATION_LIMIT = "iteration_limit"
    BUDGET_EXHAUSTED = "budget_exhausted"


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
    # Each agent has one session (its thread of steps) for now: its main thread.
    session_id: uuid.UUID = field(default_factory=uuid.uuid4)


@dataclass(frozen=True, slots=True)
class StepMetrics:
    duration_ms: float = 0.0
    first_token_ms: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    model: str = ""
    tool_duration_ms: float = 0.0


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

    @property
    def role(self) -> Role:
        return self.message.role


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
class StateChanged:
    state: AgentState
    error: str = ""


AgentEvent = RunStarted | RunEnded | StepStarted | StepDelta | StepCompleted | StateChanged


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
