"""The quality benchmark's metrics, on a hand-made set with hand-made vectors
(the real model's run belongs to the benchmark, not to the tests)."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np

from bench.memory_quality_bench import Bm25, Searcher, collapsed, evaluate, report
from bench.memory_quality_set import QualitySet, Query, Run, Segment

T0 = datetime(2026, 3, 2, tzinfo=UTC)


def segment(key: str, text: str, day: int) -> Segment:
    return Segment(
        id=key, run_id=f"r{key}", type="user_message", text=text, time=T0.replace(day=day), group="g"
    )


def test_bm25_prefers_the_rarer_term_and_the_shorter_text() -> None:
    bm25 = Bm25(["deploy failed", "deploy passed", "deploy passed again and again", "ERR_QUOTA_42 seen"])
    assert bm25.score(0, ["failed"]) > bm25.score(1, ["deploy"])
    assert bm25.score(1, ["passed"]) > bm25.score(2, ["passed"])
    assert bm25.score(3, ["err_quota_42"]) > 0 and bm25.score(0, ["err_quota_42"]) == 0


def test_recall_at_5_and_mrr_follow_where_the_relevant_segment_ranks() -> None:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    # Fillers that differ by more than a number: near-duplicates would count once.
    segments = [segment(str(i), f"filler text {word}", 2 + i) for i, word in enumerate(words)]
    segments[6] = segment("6", "the billing service moved to Frankfurt", 8)
    data = QualitySet(
        runs=[Run(id="r", time=T0, group="g", segments=segments)],
        queries=[
            Query(id="q1", text="where is billing hosted now?", slice="en", relevant=frozenset({"6"})),
            Query(id="q2", text="nothing like any of it", slice="zh", relevant=frozenset({"0"})),
        ],
    )
    # Vectors: q1 points at segment 6; q2 at segment 7 and away from its relevant 0 (last of 8).
    passages = np.eye(8, 16, dtype=np.float32) + 0.01
    queries = np.stack([passages[6], passages[7] - 2 * passages[0]]).astype(np.float32)
    results = evaluate(data, Searcher(data, passages, queries))
    assert results["vector"]["en"] == (1.0, 1.0)
    recall, mrr = results["vector"]["zh"]
    assert recall == 0.0 and 0 < mrr < 0.2
    assert results["vector"]["all"][0] == 0.5
    text = report(data, results)
    assert "| en | 1 | 1.00 |" in text and "NOT met" in text


def test_near_duplicates_count_as_one_result_as_retrieve_returns_them() -> None:
    texts = [
        "Merged the docs fix for ledger.",
        "merged the docs fix for LEDGER.",
        "the fact",
        "Merged  the docs fix for ledger.",
    ]
    assert collapsed([0, 1, 3, 2], texts.__getitem__) == [[0, 1, 3], [2]]
    # Three statements of one chatter line ahead of the fact push it down one place, not three.
    segments = [segment(str(i), text, 2 + i) for i, text in enumerate([*texts, "filler", "more filler"])]
    data = QualitySet(
        runs=[Run(id="r", time=T0, group="g", segments=segments)],
        queries=[Query(id="q", text="the fact?", slice="en", relevant=frozenset({"2"}))],
    )
    passages = np.eye(6, 8, dtype=np.float32)
    query = (4 * passages[0] + 3.9 * passages[1] + 3.8 * passages[3] + 3.7 * passages[2]).astype(np.float32)
    results = evaluate(data, Searcher(data, passages, query[None, :]))
    assert results["vector"]["en"] == (1.0, 0.5)
