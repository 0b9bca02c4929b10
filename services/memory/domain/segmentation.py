"""Cutting an ended run into segments by step type, long text into parts.

Each step yields its parts in a fixed order (reasoning, content, then each
tool call), and `segment_index` counts them from 0 within the step: the
anchor `<run_id>/<step_sequence>/<segment_index>` then names one part for
good, as long as the run is not replaced.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from services.memory.domain.errors import InvalidRequest
from services.memory.domain.model import ArchivedRun, ArchivedStep, SegmentDraft, SegmentType, StepRole

# Sentence ends in Latin and Chinese text; a line break ends one too.
_SENTENCE_END = re.compile("(?<=[.!?;\n\u3002\uff01\uff1f\uff1b])")  # and the full-width ones
_PARAGRAPH_BREAK = re.compile(r"(\n\s*\n)")


@dataclass(frozen=True, slots=True)
class SplitSettings:
    """How long text is cut: at most `max_chars` a part, the next part
    repeating about `overlap_chars` of the previous one's end, so that a
    sentence cut in two is still found whole in one of them."""

    max_chars: int = 1000
    overlap_chars: int = 100

    def __post_init__(self) -> None:
        if self.max_chars < 50 or not 0 <= self.overlap_chars < self.max_chars // 2:
            raise ValueError("need max_chars >= 50 and 0 <= overlap_chars < max_chars / 2")


@dataclass(frozen=True, slots=True)
class RunLimits:
    """What one ArchiveRun may carry."""

    max_steps: int = 2000
    max_step_chars: int = 200_000
    max_segments: int = 5000


def split_text(text: str, settings: SplitSettings) -> list[str]:
    """`text` in parts of at most `settings.max_chars`, cut at paragraph, then
    sentence, then word boundaries; empty text gives no part."""
    text = text.strip()
    if not text:
        return []
    if len(text) <= settings.max_chars:
        return [text]
    parts: list[str] = []
    current = ""
    for unit in _units(text, settings.max_chars):
        if current and len(current) + len(unit) > settings.max_chars:
            parts.append(current.strip())
            tail = _tail(current, settings.overlap_chars)
            current = tail + unit if len(tail) + len(unit) <= settings.max_chars else unit
        else:
            current += unit
    if current.strip():
        parts.append(current.strip())
    return parts


def _units(text: str, max_chars: int) -> list[str]:
    """Pieces of at most `max_chars` whose concatenation is `text`."""
    units: list[str] = []
    for paragraph in _PARAGRAPH_BREAK.split(text):
        if len(paragraph) <= max_chars:
            units.append(paragraph)
            continue
        for sentence in _SENTENCE_END.split(paragraph):
            rest = sentence
            while len(rest) > max_chars:
                cut = rest.rfind(" ", max_chars // 2, max_chars)
                cut = cut + 1 if cut > 0 else max_chars
                units.append(rest[:cut])
                rest = rest[cut:]
            if rest:
                units.append(rest)
    return units


def _tail(text: str, overlap: int) -> str:
    if overlap <= 0:
        return ""
    tail = text[-overlap:]
    # Start the overlap at a word when there is one to start at.
    space = tail.find(" ")
    if 0 <= space < len(tail) - 1:
        tail = tail[space + 1 :]
    return tail


def segment_run(run: ArchivedRun, settings: SplitSettings) -> list[SegmentDraft]:
    """Every segment of `run`, in step order."""
    drafts: list[SegmentDraft] = []
    for step in run.steps:
        drafts.extend(_segment_step(step, settings))
    return drafts


def _segment_step(step: ArchivedStep, settings: SplitSettings) -> list[SegmentDraft]:
    parts: list[tuple[SegmentType, str, str]] = []
    if step.role is StepRole.ASSISTANT:
        parts += [(SegmentType.REASONING, text, "") for text in split_text(step.reasoning, settings)]
        parts += [(SegmentType.RESPONSE, text, "") for text in split_text(step.content, settings)]
        for call in step.tool_calls:
            described = f"{call.name} {call.arguments}".strip()
            parts += [(SegmentType.TOOL_CALL, text, call.name) for text in split_text(described, settings)]
    elif step.role is StepRole.TOOL:
        parts += [
            (SegmentType.TOOL_RESULT, text, step.tool_name) for text in split_text(step.content, settings)
        ]
    else:
        kind = SegmentType.SUMMARY if step.summary else SegmentType.USER_MESSAGE
        parts += [(kind, text, "") for text in split_text(step.content, settings)]
    return [
        SegmentDraft(
            step_sequence=step.sequence,
            segment_index=index,
            type=kind,
            text=text,
            tool_name=tool_name,
            group_id=step.group_id,
            created_at=step.created_at,
        )
        for index, (kind, text, tool_name) in enumerate(parts)
    ]


def check_run(run: ArchivedRun, limits: RunLimits) -> None:
    """Refuses a run that is malformed or larger than the limits allow.

    Raises:
        InvalidRequest: naming the first problem.
    """
    for name in ("workspace_id", "agent_id", "agent_member_id", "session_id", "run_id"):
        value = getattr(run, name)
        if not value:
            raise InvalidRequest(f"run.{name} is required")
        if len(value) > 128:
            raise InvalidRequest(f"run.{name} is longer than 128 characters")
    if "/" in run.run_id:
        raise InvalidRequest("run.run_id may not contain '/' (anchors use it as a separator)")
    if len(run.steps) > limits.max_steps:
        raise InvalidRequest(f"run has {len(run.steps)} steps; at most {limits.max_steps} are accepted")
    if run.ended_at < run.started_at:
        raise InvalidRequest("run.end_time is before run.start_time")
    seen: set[int] = set()
    for position, step in enumerate(run.steps):
        where = f"run.steps[{position}]"
        if step.sequence < 0:
            raise InvalidRequest(f"{where}.sequence must not be negative")
        if step.sequence in seen:
            raise InvalidRequest(f"{where}.sequence {step.sequence} appears twice")
        seen.add(step.sequence)
        size = (
            len(step.content)
            + len(step.reasoning)
            + sum(len(c.name) + len(c.arguments) for c in step.tool_calls)
        )
        if size > limits.max_step_chars:
            raise InvalidRequest(
                f"{where} has {size} characters; at most {limits.max_step_chars} are accepted"
            )
        if step.group_id and step.group_id not in run.conversations:
            raise InvalidRequest(
                f"{where} names group {step.group_id}, but run.conversations does not list its members"
            )
    for group_id, members in run.conversations.items():
        if not group_id:
            raise InvalidRequest("run.conversations: a conversation has no group_id")
        if not members:
            raise InvalidRequest(f"run.conversations: group {group_id} has no members")


def content_hash(run: ArchivedRun, drafts: list[SegmentDraft]) -> str:
    """What makes an archive the same as an earlier one: its segments, where
    they came from, and who could see each conversation."""
    payload = {
        "anchor": [run.workspace_id, run.agent_id, run.agent_member_id, run.session_id],
        "times": [run.started_at.isoformat(), run.ended_at.isoformat()],
        "conversations": {group: sorted(members) for group, members in sorted(run.conversations.items())},
        "segments": [
            [
                d.step_sequence,
                d.segment_index,
                int(d.type),
                d.text,
                d.tool_name,
                d.group_id,
                d.created_at.isoformat(),
            ]
            for d in drafts
        ],
    }
    encoded = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()
