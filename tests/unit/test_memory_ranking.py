"""The memory service's lexical terms and its fusion of vector and lexical rankings."""

from __future__ import annotations

import numpy as np

from services.memory.domain.ranking import FusionSettings, Hit, LanguageMeans, fuse
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
