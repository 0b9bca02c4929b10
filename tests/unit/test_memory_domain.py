"""The memory's pure core: segmentation, the run's checks and hash, anchors, the audience rule, duplicates."""

from __future__ import annotations

import dataclasses
import itertools
from datetime import UTC, datetime, timedelta

import pytest

from services.memory.domain.audience import audience_id, visible
from services.memory.domain.duplicates import collapse, dedup_key
from services.memory.domain.errors import InvalidRequest
from services.memory.domain.model import (
    ArchivedRun,
    ArchivedStep,
    Ref,
    SegmentType,
    StepRole,
    StoredSegment,
    ToolCall,
)
from services.memory.domain.segmentation import (
    RunLimits,
    SplitSettings,
    check_run,
    content_hash,
    segment_run,
    split_text,
)

T0 = datetime(2026, 11, 1, tzinfo=UTC)
SPLIT = SplitSettings(max_chars=200, overlap_chars=40)


def step(sequence: int, role: StepRole, content: str = "", **fields: object) -> ArchivedStep:
    values: dict[str, object] = {
        "sequence": sequence,
        "role": role,
        "content": content,
        "reasoning": "",
        "tool_calls": (),
        "tool_name": "",
        "group_id": "",
        "created_at": T0 + timedelta(seconds=sequence),
    }
    values.update(fields)
    return ArchivedStep(**values)  # type: ignore[arg-type]


def run_of(*steps: ArchivedStep, conversations: dict[str, frozenset[str]] | None = None) -> ArchivedRun:
    return ArchivedRun(
        workspace_id="w",
        agent_id="a",
        agent_member_id="am",
        session_id="s",
        run_id="r",
        started_at=T0,
        ended_at=T0 + timedelta(minutes=1),
        steps=steps,
        conversations=conversations or {},
    )


def test_each_step_type_becomes_its_segment_type() -> None:
    run = run_of(
        step(1, StepRole.SYSTEM, "a note from the owner"),
        step(2, StepRole.SYSTEM, "earlier runs: the budget was set", summary=True),
        step(3, StepRole.USER, "what is the budget?"),
        step(
            4,
            StepRole.ASSISTANT,
            "let me check",
            reasoning="the budget is in the sheet",
            tool_calls=(ToolCall("c1", "read_sheet", '{"name": "budget"}'), ToolCall("c2", "ping", "{}")),
        ),
        step(5, StepRole.TOOL, "budget: 50k", tool_name="read_sheet"),
        step(6, StepRole.ASSISTANT, ""),
    )
    drafts = segment_run(run, SPLIT)
    assert [(d.step_sequence, d.segment_index, d.type) for d in drafts] == [
        (1, 0, SegmentType.USER_MESSAGE),
        (2, 0, SegmentType.SUMMARY),
        (3, 0, SegmentType.USER_MESSAGE),
        (4, 0, SegmentType.REASONING),
        (4, 1, SegmentType.RESPONSE),
        (4, 2, SegmentType.TOOL_CALL),
        (4, 3, SegmentType.TOOL_CALL),
        (5, 0, SegmentType.TOOL_RESULT),
    ]
    assert drafts[5].text == 'read_sheet {"name": "budget"}' and drafts[5].tool_name == "read_sheet"
    assert drafts[7].tool_name == "read_sheet" and drafts[7].text == "budget: 50k"


def test_long_text_is_split_at_sentences_with_an_overlap() -> None:
    sentences = [f"Sentence number {i} says something about topic {i}." for i in range(20)]
    text = " ".join(sentences)
    parts = split_text(text, SPLIT)
    assert len(parts) > 3
    assert all(len(part) <= SPLIT.max_chars for part in parts)
    # Nothing lost: every sentence is whole in some part.
    assert all(any(sentence in part for part in parts) for sentence in sentences)
    # Each part starts with some of the previous one's end.
    for before, after in itertools.pairwise(parts):
        assert after[:15] in before


def test_long_chinese_and_unbroken_text_is_split_too() -> None:
    chinese = "预算改成了五万元\uff0c请通知财务部门\u3002" * 30
    parts = split_text(chinese, SPLIT)
    assert all(len(part) <= SPLIT.max_chars for part in parts) and all(
        p.endswith("\u3002") for p in parts[:-1]
    )
    unbroken = "x" * 450
    # The last part starts with the overlap (40) before its own 50 characters.
    assert [len(part) for part in split_text(unbroken, SPLIT)] == [200, 200, 90]


def test_parts_of_one_step_count_from_zero() -> None:
    long_reply = " ".join(f"Point {i} of the plan is important." for i in range(30))
    drafts = segment_run(run_of(step(7, StepRole.ASSISTANT, long_reply)), SPLIT)
    assert [d.segment_index for d in drafts] == list(range(len(drafts)))
    assert len(drafts) > 1 and {d.type for d in drafts} == {SegmentType.RESPONSE}


def test_the_hash_changes_with_the_steps_and_with_who_could_see_them() -> None:
    base = run_of(step(1, StepRole.USER, "hi", group_id="g"), conversations={"g": frozenset({"am", "p1"})})
    same = run_of(step(1, StepRole.USER, "hi", group_id="g"), conversations={"g": frozenset({"p1", "am"})})
    edited = run_of(
        step(1, StepRole.USER, "hello", group_id="g"), conversations={"g": frozenset({"am", "p1"})}
    )
    wider = run_of(
        step(1, StepRole.USER, "hi", group_id="g"), conversations={"g": frozenset({"am", "p1", "p2"})}
    )

    def digest(run: ArchivedRun) -> str:
        return content_hash(run, segment_run(run, SPLIT))

    assert digest(base) == digest(same)
    assert len({digest(base), digest(edited), digest(wider)}) == 3


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (run_of(step(1, StepRole.USER, "x", group_id="g")), "does not list its members"),
        (run_of(step(1, StepRole.USER, "x"), step(1, StepRole.USER, "y")), "appears twice"),
        (run_of(step(-1, StepRole.USER, "x")), "must not be negative"),
        (dataclasses.replace(run_of(), run_id=""), "run.run_id is required"),
        (dataclasses.replace(run_of(), run_id="a/b"), "may not contain '/'"),
        (dataclasses.replace(run_of(), ended_at=T0 - timedelta(days=1)), "before run.start_time"),
        (run_of(step(1, StepRole.USER, "x" * 101)), "at most 100 are accepted"),
        (run_of(*[step(i, StepRole.USER, "x") for i in range(4)]), "at most 3 are accepted"),
        (run_of(conversations={"g": frozenset()}), "has no members"),
    ],
)
def test_a_malformed_or_oversized_run_is_refused(run: ArchivedRun, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        check_run(run, RunLimits(max_steps=3, max_step_chars=100))


def test_refs_parse_and_print() -> None:
    ref = Ref.parse("run-1/12/0")
    assert (ref.run_id, ref.step_sequence, ref.segment_index) == ("run-1", 12, 0)
    assert str(ref) == "run-1/12/0"
    for bad in ("", "run", "run/1", "run/x/0", "/1/0", "run/1/0/2", "run/-1/0", "run/1/99999999999"):
        with pytest.raises(InvalidRequest):
            Ref.parse(bad)


def test_the_audience_rule() -> None:
    group = {"agent", "alice", "bob"}
    assert visible(group, {"alice"}, agent_scope=False)
    assert visible(group, {"alice", "bob"}, agent_scope=True)
    assert not visible(group, {"alice", "carol"}, agent_scope=True)
    assert not visible(group, {"carol"}, agent_scope=False)
    assert visible(group, set(), agent_scope=True)
    # A task's segment is the agent's own.
    assert visible(None, {"alice"}, agent_scope=True)
    assert not visible(None, {"alice"}, agent_scope=False)
    assert audience_id(["b", "a", "a"]) == audience_id(["a", "b"]) != audience_id(["a"])


def test_near_duplicates_collapse_into_the_best_with_a_count() -> None:
    assert dedup_key("Build 1234 OK  in 35 ms") == dedup_key("build 99 ok in 4 ms")
    assert dedup_key("build ok") != dedup_key("build failed")

    def segment(key: int, text: str) -> StoredSegment:
        return StoredSegment(
            key, "w", "a", "s", "r", key, 0, SegmentType.TOOL_RESULT, text, "", "", T0, dedup_key(text)
        )

    ranked = [
        (segment(1, "build 1 ok"), 0.9),
        (segment(2, "deploy failed"), 0.8),
        (segment(3, "build 2 ok"), 0.7),
        (segment(4, "build 3 ok"), 0.6),
    ]
    results = collapse(ranked, limit=10)
    assert [(r.segment.key, r.duplicates) for r in results] == [(1, 2), (2, 0)]
    assert [r.segment.key for r in collapse(ranked, limit=1)] == [1]
