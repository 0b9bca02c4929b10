"""The memory service's lexical terms and its fusion of vector and lexical rankings."""

from __future__ import annotations

import numpy as np
import pytest

from services.memory.adapters.clusters import Stopped, cluster
from services.memory.domain.ranking import (
    FusionSettings,
    Hit,
    LanguageMeans,
    best_match_share,
    fuse,
    rarity,
    selective_terms,
)
from services.memory.domain.terms import language_of, lexical_terms

SETTINGS = FusionSettings()


def test_chinese_becomes_overlapping_bigrams_and_latin_lower_case_words() -> None:
    assert lexical_terms("部署失败 Deploy FAILED") == ["部署", "署失", "失败", "deploy", "failed"]
    assert lexical_terms("好") == ["好"]


def test_an_identifier_is_kept_whole_and_split_into_parts() -> None:
    terms = lexical_terms("see ERR_QUOTA_42 in services/im/bootstrap.py.")
    assert "err_quota_42" in terms and {"err", "quota", "42"} <= set(terms)
    assert "services/im/bootstrap.py" in terms and {"services", "im", "bootstrap", "py"} <= set(terms)


def test_language_follows_the_share_of_chinese_characters() -> None:
    assert language_of("预算改成了五万") == "zh"
    assert language_of("the budget is now 50k") == "en"
    assert language_of("预算 budget") == "zh"


def test_without_a_real_lexical_match_the_vector_ranking_stands() -> None:
    vector = [Hit(1, 0.9), Hit(2, 0.8), Hit(3, 0.1)]
    lexical = [Hit(3, 12.0)]
    fused = fuse(vector, lexical, best_match_share=0.0, limit=3)
    assert [hit.key for hit in fused] == [1, 2, 3]


def test_a_strong_lexical_match_lifts_its_segment_a_weak_one_does_not() -> None:
    vector = [Hit(1, 0.50), Hit(2, 0.45), Hit(3, 0.44), Hit(4, 0.40)]
    lexical = [Hit(3, 10.0)]
    assert [h.key for h in fuse(vector, lexical, best_match_share=1.0, limit=4)] == [1, 3, 2, 4]
    assert [h.key for h in fuse(vector, lexical, best_match_share=0.2, limit=4)] == [1, 2, 3, 4]


def test_without_vectors_the_lexical_ranking_is_all_there_is() -> None:
    fused = fuse([], [Hit(7, 3.0), Hit(8, 9.0)], best_match_share=0.1, limit=5)
    assert [h.key for h in fused] == [8, 7]


def test_recency_breaks_a_tie_towards_the_newer_segment() -> None:
    vector = [Hit(1, 0.5), Hit(2, 0.5)]
    fused = fuse(vector, [], best_match_share=0.0, limit=2, recency_rank={1: 5, 2: 0}, settings=SETTINGS)
    assert [hit.key for hit in fused] == [2, 1]


def test_centering_removes_what_every_vector_of_a_language_shares() -> None:
    shared = np.array([1.0, 0.0, 0.0], dtype=np.float32)
    a = shared + np.array([0.0, 1.0, 0.0], dtype=np.float32)
    b = shared + np.array([0.0, 0.0, 1.0], dtype=np.float32)
    means = LanguageMeans(3)
    means.add(a, "zh", count=100)
    means.add(b, "zh", count=100)
    before = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    after = float(means.center(a, "zh") @ means.center(b, "zh"))
    assert before > 0.4 and after < 0.05
    restored = LanguageMeans.restored(3, means.state())
    assert np.allclose(restored.mean("zh"), means.mean("zh"))


def test_a_language_with_few_vectors_is_barely_centered() -> None:
    lone = np.array([0.6, 0.8, 0.0], dtype=np.float32)
    means = LanguageMeans(3)
    means.add(lone, "zh")
    assert float(means.center(lone, "zh") @ lone) > 0.99  # not zeroed by its own mean


def test_lexical_search_keeps_the_rarest_terms_within_its_budget_of_postings() -> None:
    frequencies = {"the": 900, "deploy": 300, "zanzibar": 2, "ledger": 40, "never-seen": 0}
    assert selective_terms(frequencies, 1000) == ["zanzibar", "ledger", "deploy"]
    assert selective_terms(frequencies, 42) == ["zanzibar", "ledger"]
    assert selective_terms(frequencies, 5000) == ["zanzibar", "ledger", "deploy", "the"]


def test_a_query_of_common_terms_only_gets_no_lexical_ranking() -> None:
    # Ranking every segment that holds "the" would cost the most and say the least.
    assert selective_terms({"the": 900, "a": 800}, 500) == []
    assert selective_terms({"never-seen": 0}, 500) == []


def test_a_term_no_segment_holds_says_nothing_about_which_one_is_meant() -> None:
    assert rarity(1000, 0) == 0.0
    assert rarity(1000, 1) > rarity(1000, 50) > rarity(1000, 900) > 0.0


def test_the_gate_opens_with_the_weighted_share_of_the_query_in_the_best_hit() -> None:
    weights = {"zanzibar": 6.0, "the": 1.0, "是什么": 0.0}
    assert best_match_share(["zanzibar", "the", "是什么"], {"zanzibar"}, weights) == 6.0 / 7.0
    assert best_match_share(["zanzibar", "the"], {"the"}, weights) == 1.0 / 7.0
    assert best_match_share(["是什么"], {"是什么"}, weights) == 0.0


def _unit_rows(count: int, dimensions: int, seed: int) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((count, dimensions)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def test_the_approximate_index_files_each_row_under_its_nearest_list() -> None:
    matrix = _unit_rows(3000, 16, seed=1)
    clusters, order = cluster(matrix, probe_share=0.05)
    assert sorted(order.tolist()) == list(range(3000))
    ordered = matrix[order]
    for number in range(len(clusters.centroids)):
        start, end = clusters.offsets[number], clusters.offsets[number + 1]
        if end > start:
            nearest = np.argmax(ordered[start:end] @ clusters.centroids.T, axis=1)
            assert (nearest == number).all()
    # A query scores the rows of the lists whose centroids are nearest it, and no others.
    query = matrix[42]
    nearest_lists = np.argsort(-(clusters.centroids @ query))[: clusters.probes]
    expected = [
        row
        for found in sorted(nearest_lists)
        for row in range(clusters.offsets[found], clusters.offsets[found + 1])
    ]
    assert clusters.candidates(query).tolist() == expected
    assert np.flatnonzero(order == 42)[0] in expected, "a row is found from itself"


def test_building_the_approximate_index_stops_when_asked() -> None:
    with pytest.raises(Stopped):
        cluster(_unit_rows(500, 8, seed=2), probe_share=0.1, should_stop=lambda: True)
