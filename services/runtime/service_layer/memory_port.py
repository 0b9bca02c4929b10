"""The runtime's view of the memory service: archiving ended runs and recalling them.

The adapter (`services.runtime.adapters.memory_client`) calls the memory
service's gRPC API acting as the agent; tests use an in-memory fake. A
memory that cannot be reached is `MemoryUnavailable`: archiving waits in the
outbox and recall goes without, never holding an agent up.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from services.runtime.domain.model import Agent, Run, Step


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat a run took part in, with its members then."""

    group_id: uuid.UUID
    member_ids: tuple[uuid.UUID, ...]


@dataclass(frozen=True, slots=True)
class RunRecord:
    """An ended run as it goes to memory: its steps, each with its chat."""

    agent: Agent
    run: Run
    steps: Sequence[tuple[Step, uuid.UUID | None]]
    conversations: Sequence[Conversation]


@dataclass(frozen=True, slots=True)
class Memory:
    """A recalled segment: `ref` (`<run_id>/<sequence>/<index>`) anchors it to its step."""

    ref: str
    type: str  # "user_message", "reasoning", "tool_call", "tool_result", "response", "summary"
    text: str
    score: float
    created_at: datetime
    group_id: uuid.UUID | None = None
    tool_name: str = ""
    duplicates: int = 0


@dataclass(frozen=True, slots=True)
class RecallQuery:
    text: str
    limit: int = 5
    types: tuple[str, ...] = ()
    since: datetime | None = None
    until: datetime | None = None
    exclude_run_ids: tuple[uuid.UUID, ...] = ()
    prefer_recent: bool = False


@dataclass(frozen=True, slots=True)
class Expanded:
    focus: Memory
    before: list[Memory] = field(default_factory=list)
    after: list[Memory] = field(default_factory=list)
    run_id: uuid.UUID | None = None


class MemoryPort(abc.ABC):
    """Calls to the memory service for an agent.

    `audience` is who will see what is recalled: the members of the chat the
    agent is answering (empty for a task). The memory shows a segment only
    to an audience that could all see where it came from.
    """

    @abc.abstractmethod
    async def archive(self, record: RunRecord) -> None:
        """Stores an ended run; the same run again changes nothing."""

    @abc.abstractmethod
    async def recall(self, agent: Agent, audience: Sequence[uuid.UUID], query: RecallQuery) -> list[Memory]:
        """The best memories for the query, best first."""

    @abc.abstractmethod
    async def expand(
        self, agent: Agent, audience: Sequence[uuid.UUID], ref: str, *, before: int, after: int
    ) -> Expanded:
        """A memory with the ones around it in its run."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Releases connections."""
