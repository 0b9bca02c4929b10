"""The memory service's lexical terms and its fusion of vector and lexical rankings."""

from __future__ import annotations

import numpy as np
import pytest

from services.memory.adapters.clusters import Stopped, cluster
from services.memory.domain.lexicon import Concept
from services.memory.domain.ranking import (
    FusionSettings,
    Hit,
    LanguageMeans,
    best_match_share,
    bridge_terms,
    concept_coverage,
    coverage,
    fuse,
    hold_bridges,
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


def test_a_translated_match_lifts_its_segment_through_its_own_gate() -> None:
    vector = [Hit(1, 0.50), Hit(2, 0.45), Hit(4, 0.44), Hit(3, 0.30)]
    translated = [Hit(4, 1.0), Hit(2, 0.2)]
    lifted = fuse(vector, [], best_match_share=0.0, limit=4, translated=translated, translated_share=1.0)
    assert [h.key for h in lifted] == [4, 1, 2, 3]
    shut = fuse(vector, [], best_match_share=0.0, limit=4, translated=translated, translated_share=0.2)
    assert [h.key for h in shut] == [1, 2, 4, 3]


def test_coverage_counts_the_weighted_share_of_the_query_held_not_length_or_repeats() -> None:
    weights = {"billing": 2.0, "deploy": 1.0, "failed": 1.0, "absent": 0.0}
    candidates = {
        1: {"merged", "docs", "billing"},
        2: {"the", "billing", "deploy", "on", "monday", "failed", "because", "memory"},
        3: {"search", "deploy"},
        4: {"nothing", "here"},
    }
    hits = coverage(candidates, ["billing", "deploy", "failed", "absent", "billing"], weights)
    assert [(h.key, h.score) for h in hits] == [(2, 1.0), (1, 0.5), (3, 0.25)]
    assert coverage(candidates, ["absent"], weights) == []


def test_a_concept_counts_once_with_its_best_alternative_held_whole() -> None:
    weights = {"quota": 3.0, "配额": 4.0, "合作": 2.0, "作方": 5.0, "partner": 2.0, "gateway": 1.0}
    concepts = [
        Concept("quota", (("quota",), ("配额",))),
        Concept("partner", (("partner",), ("合作", "作方"), ("unseen",))),
        Concept("gateway", (("gateway",),)),
    ]
    candidates = {
        1: {"gateway", "给合", "合作", "作方", "配额"},  # every concept, in Chinese
        2: {"the", "quota", "for", "partners"},  # "partners" is not "partner"
        3: {"合作"},  # half a word is no word
    }
    hits = concept_coverage(candidates, concepts, weights)
    # Best alternatives: 配额 (4), 合作方 (its rarer bigram, 5), gateway (1): 10 in all.
    assert [(h.key, h.score) for h in hits] == [(1, 1.0), (2, 0.3)]


def test_bridges_are_the_query_terms_a_candidate_in_the_other_language_holds() -> None:
    weights = {"gateway": 1.0, "partner": 2.0, "quota": 3.0, "api": 1.5, "配额": 4.0, "unknown": 0.0}
    candidates = {
        1: {"gateway", "给合", "合作", "作方", "配额"},  # Chinese, about the gateway
        2: {"the", "shipping", "api", "quota", "for", "partners", "partner"},  # English, another service
        3: {"the", "gateway", "build", "broke"},  # English, about the gateway
    }
    english_query = ["what", "partner", "quota", "gateway", "api", "unknown"]
    # "partner", "quota", "api" are in English candidates only.
    assert bridge_terms(english_query, candidates, weights) == ["gateway"]
    # A Chinese question: its Latin words that an English candidate holds.
    chinese_query = ["gateway", "api", "配额", "unknown"]
    assert bridge_terms(chinese_query, candidates, weights) == ["gateway", "api"]
    # One language only: nothing is a bridge (the lexical match already counts names).
    english_only = {key: held for key, held in candidates.items() if key != 1}
    assert bridge_terms(english_query, english_only, weights) == []


def test_a_candidate_without_the_query_bridges_keeps_only_part_of_its_score() -> None:
    candidates = {1: {"gateway", "配额"}, 2: {"shipping", "quota"}, 3: {"gateway", "ada"}}
    weights = {"gateway": 1.0, "ada": 3.0}
    fused = [Hit(2, 0.9), Hit(1, 0.7), Hit(3, 0.4)]
    held = hold_bridges(fused, ["gateway"], candidates, weights, bridge_weight=0.5)
    assert [(h.key, round(h.score, 3)) for h in held] == [(1, 0.7), (2, 0.45), (3, 0.4)]
    # Each bridge counts by its rarity.
    both = hold_bridges(fused, ["gateway", "ada"], candidates, weights, bridge_weight=0.5)
    assert [(h.key, round(h.score, 3)) for h in both] == [(2, 0.45), (1, 0.438), (3, 0.4)]
    assert hold_bridges(fused, [], candidates, weights, bridge_weight=0.5) == fused


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
