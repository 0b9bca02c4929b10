"""Hybrid ranking: vector similarity and lexical relevance, fused with a gate.

Plain reciprocal rank fusion lets a lexical list with no real match (a
Chinese question over English facts shares no term with them) drag good
vector hits down. Here the lexical list only counts in proportion to how
well its best hit matched the query's terms; with no real match the result
is the vector ranking, with a strong one it is close to the lexical ranking.

Vectors are compared after per-language centering: e5-style embeddings of
one language share a common direction, which makes every Chinese passage
look alike to a Chinese query and unlike an English paraphrase. Subtracting
the mean of the stored vectors of the segment's (and query's) language
removes that shared part (on the quality set, recall@5 of vector search
rose from 0.54 to 0.84, zh<->en from 0.10 to 0.78).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Vector = npt.NDArray[np.float32]
Matrix = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class Hit:
    """A candidate segment (its row key) with a score: higher is better."""

    key: int
    score: float


@dataclass(frozen=True, slots=True)
class FusionSettings:
    # How much a perfect lexical match counts against the vector score.
    lexical_weight: float = 0.6
    # A lexical hit counts fully once it matches this share of the query's terms.
    full_match_share: float = 0.5
    # With prefer_recent: the score a segment loses per halving of its age rank.
    recency_weight: float = 0.05


def fuse(
    vector: Sequence[Hit],
    lexical: Sequence[Hit],
    *,
    best_match_share: float,
    limit: int,
    recency_rank: Mapping[int, int] | None = None,
    settings: FusionSettings = FusionSettings(),
) -> list[Hit]:
    """The fused ranking of two candidate lists.

    `vector` scores are (centered) cosines; `lexical` scores are BM25-like
    (any positive scale); `best_match_share` is the share of the query's
    distinct terms that the best lexical hit contains (0 to 1). With
    `recency_rank` (0 for the newest candidate), newer segments win ties.
    """
    gate = min(1.0, best_match_share / settings.full_match_share) if lexical else 0.0
    top_lexical = max((hit.score for hit in lexical), default=0.0)
    scores: dict[int, float] = {}
    for hit in vector:
        scores[hit.key] = hit.score
    floor = min((hit.score for hit in vector), default=0.0)
    for hit in lexical:
        lexical_part = settings.lexical_weight * gate * (hit.score / top_lexical if top_lexical > 0 else 0.0)
        # A lexical-only candidate starts from the lowest vector score seen.
        scores[hit.key] = scores.get(hit.key, floor) + lexical_part
    if recency_rank is not None:
        for key, rank in recency_rank.items():
            if key in scores:
                scores[key] -= settings.recency_weight * math.log2(1 + rank)
    ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
    return [Hit(key, score) for key, score in ranked[:limit]]


class LanguageMeans:
    """Running means of stored vectors per language, for centering."""

    def __init__(self, dimensions: int) -> None:
        self.dimensions = dimensions
        self._sums: dict[str, npt.NDArray[np.float64]] = {}
        self._counts: dict[str, int] = {}

    def add(self, vector: Vector, language: str, count: int = 1) -> None:
        total = self._sums.setdefault(language, np.zeros(self.dimensions, dtype=np.float64))
        total += vector.astype(np.float64) * count
        self._counts[language] = self._counts.get(language, 0) + count

    def mean(self, language: str) -> Vector:
        count = self._counts.get(language, 0)
        if not count:
            return np.zeros(self.dimensions, dtype=np.float32)
        return (self._sums[language] / count).astype(np.float32)

    def center(self, vector: Vector, language: str) -> Vector:
        """The vector minus its language's mean, unit length again."""
        centered = vector - self.mean(language)
        norm = float(np.linalg.norm(centered))
        return centered / norm if norm > 0 else centered

    def state(self) -> dict[str, tuple[int, list[float]]]:
        """What to persist: count and sum per language."""
        return {lang: (self._counts[lang], self._sums[lang].tolist()) for lang in self._sums}

    @classmethod
    def restored(cls, dimensions: int, state: Mapping[str, tuple[int, Sequence[float]]]) -> LanguageMeans:
        means = cls(dimensions)
        for lang, (count, total) in state.items():
            means._sums[lang] = np.asarray(total, dtype=np.float64)
            means._counts[lang] = count
        return means
