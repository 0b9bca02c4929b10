"""The memory benchmark's quality set is what the issue asks for, and well formed."""

from __future__ import annotations

from collections import Counter

from bench.memory_quality_set import SLICES, build_quality_set


def test_the_quality_set_has_its_size_and_every_slice() -> None:
    built = build_quality_set()
    assert len(built.runs) >= 100
    assert len(built.segments) >= 2_000
    assert len(built.queries) >= 200
    assert set(Counter(q.slice for q in built.queries)) == set(SLICES)


def test_every_query_is_answered_by_segments_of_the_set_and_is_the_same_every_time() -> None:
    built = build_quality_set()
    ids = {s.id for s in built.segments}
    assert len(ids) == len(built.segments)
    for query in built.queries:
        assert query.relevant and query.relevant <= ids, query
    again = build_quality_set()
    assert [q.text for q in again.queries] == [q.text for q in built.queries]
    assert [s.text for s in again.segments] == [s.text for s in built.segments]


def test_no_two_questions_ask_the_same_thing_of_one_family() -> None:
    built = build_quality_set()
    # Outside the time slice (a filter picks the answer), a question text answers one fact.
    texts = Counter(q.text for q in built.queries if q.slice != "time")
    assert [text for text, n in texts.items() if n > 1] == []
    # Only the newest statement of a changing value answers its question.
    by_id = {s.id: s for s in built.segments}
    for query in (q for q in built.queries if q.slice == "latest"):
        (answer,) = query.relevant
        assert len(query.superseded) == 2
        assert all(by_id[old].time < by_id[answer].time for old in query.superseded)
