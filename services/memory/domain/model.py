"""What the memory keeps: archived runs, their segments and the anchors citing them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime

from services.memory.domain.errors import InvalidRequest


class SegmentType(enum.IntEnum):
    """What kind of step part a segment is (the proto's numbers)."""

    USER_MESSAGE = 1
    REASONING = 2
    TOOL_CALL = 3
    TOOL_RESULT = 4
    RESPONSE = 5
    SUMMARY = 6


class StepRole(enum.IntEnum):
    SYSTEM = 1
    USER = 2
    ASSISTANT = 3
    TOOL = 4


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ArchivedStep:
    sequence: int
    role: StepRole
    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    tool_name: str
    group_id: str
    created_at: datetime
    summary: bool = False


@dataclass(frozen=True, slots=True)
class ArchivedRun:
    """An ended run as the runtime sends it, with the members of every conversation it names."""

    workspace_id: str
    agent_id: str
    agent_member_id: str
    session_id: str
    run_id: str
    started_at: datetime
    ended_at: datetime
    steps: tuple[ArchivedStep, ...]
    # group id -> its members when the run was archived.
    conversations: dict[str, frozenset[str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SegmentDraft:
    """A segment cut from a run, before it is stored."""

    step_sequence: int
    segment_index: int
    type: SegmentType
    text: str
    tool_name: str
    group_id: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Ref:
    """An anchor's text form, `<run_id>/<step_sequence>/<segment_index>`."""

    run_id: str
    step_sequence: int
    segment_index: int

    def __str__(self) -> str:
        return f"{self.run_id}/{self.step_sequence}/{self.segment_index}"

    @classmethod
    def parse(cls, text: str) -> Ref:
        parts = text.strip().split("/")
        if len(parts) != 3 or not parts[0]:
            raise InvalidRequest(f"ref must look like <run_id>/<step_sequence>/<segment_index>, got {text!r}")
        run_id, sequence, index = parts
        if not (sequence.isdigit() and index.isdigit()):
            raise InvalidRequest(f"ref {text!r}: step_sequence and segment_index must be whole numbers")
        if len(sequence) > 18 or len(index) > 9:
            raise InvalidRequest(f"ref {text!r}: step_sequence or segment_index is out of range")
        return cls(run_id, int(sequence), int(index))


@dataclass(frozen=True, slots=True)
class StoredSegment:
    """A segment as stored, with its anchor."""

    key: int
    workspace_id: str
    agent_id: str
    session_id: str
    run_id: str
    step_sequence: int
    segment_index: int
    type: SegmentType
    text: str
    tool_name: str
    group_id: str
    created_at: datetime
    dedup_key: str
    # Its lexical terms joined by spaces, as indexed (read for ranking; empty
    # when not read, and then made from the text again).
    terms: str = ""

    @property
    def ref(self) -> Ref:
        return Ref(self.run_id, self.step_sequence, self.segment_index)


@dataclass(frozen=True, slots=True)
class RunInfo:
    run_id: str
    workspace_id: str
    agent_id: str
    agent_member_id: str
    session_id: str
    started_at: datetime
    ended_at: datetime
    segment_count: int


@dataclass(frozen=True, slots=True)
class RankedSegment:
    segment: StoredSegment
    score: float
    duplicates: int


@dataclass(frozen=True, slots=True)
class MemoryStats:
    run_count: int
    segment_count: int
    pending_embeddings: int
    oldest: datetime | None
    newest: datetime | None
