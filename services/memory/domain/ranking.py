"""Hybrid ranking: vector similarity and lexical relevance, fused with a gate.

Plain reciprocal rank fusion lets a lexical list with no real match (a
Chinese question over English facts shares no term with them) drag good
vector hits down. Here the lexical list only counts in proportion to how
well its best hit matched the query's terms; with no real match the result
is the vector ranking.

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
    # The lexical ranking's share of the score when its best hit matches the
    # query fully (tuned on bench/memory_quality_set.py; see docs/benchmarks.md).
    lexical_weight: float = 0.3
    # The gate: below this share of the query's terms in the best lexical hit
    # the lexical ranking counts nothing; from `gate_full` on, fully.
    gate_from: float = 0.3
    gate_full: float = 1.0
    # With prefer_recent: the score a segment loses per doubling of its age rank.
    recency_weight: float = 0.1


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

    Each list's scores are brought to 0..1 (vector cosines from the lowest
    to the highest candidate, lexical scores against the best), then mixed:
    the lexical share is `lexical_weight` times the gate, which opens with
    `best_match_share`, the share of the query's distinct terms (weighted,
    if the caller can, by their rarity) that the best lexical hit contains.
    With `recency_rank` (0 for the newest candidate), newer segments win
    near ties.
    """
    span = settings.gate_full - settings.gate_from
    gate = min(1.0, max(0.0, (best_match_share - settings.gate_from) / span)) if lexical and span > 0 else 0.0
    alpha = settings.lexical_weight * gate
    scores: dict[int, float] = {}
    if vector:
        top, floor = max(h.score for h in vector), min(h.score for h in vector)
        for hit in vector:
            scores[hit.key] = (1 - alpha) * ((hit.score - floor) / (top - floor) if top > floor else 1.0)
    top_lexical = max((hit.score for hit in lexical), default=0.0)
    if top_lexical > 0:
        # Without vectors (none yet, or no embedder) the lexical ranking is all there is.
        weight = alpha if vector else 1.0
        for hit in lexical:
            scores[hit.key] = scores.get(hit.key, 0.0) + weight * hit.score / top_lexical
    if recency_rank is not None:
        for key, rank in recency_rank.items():
            if key in scores:
                scores[key] -= settings.recency_weight * math.log2(1 + rank)
    ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
    return [Hit(key, score) for key, score in ranked[:limit]]


def rarity(total: int, frequency: int) -> float:
    """How much a query term says about which segment is meant: its idf, and
    nothing for a term no segment holds (it matches nothing: a Chinese
    question's own wording, "是什么", is in none of the statements)."""
    return idf(total, frequency) if frequency > 0 else 0.0


def best_match_share(terms: Sequence[str], matched: set[str], weights: Mapping[str, float]) -> float:
    """The share of the query's terms (each weighted) found in the best
    lexical hit's terms `matched`: the opening of the fusion gate."""
    total = sum(weights.get(term, 0.0) for term in terms)
    if total <= 0:
        return 0.0
    return sum(weights.get(term, 0.0) for term in terms if term in matched) / total


# Lexical search's budget of postings per query (see `selective_terms`).
DEFAULT_LEXICAL_POSTINGS = 3000


def idf(total: int, frequency: int) -> float:
    """FTS5's idf, never negative."""
    return math.log(1 + (max(total, 1) - frequency + 0.5) / (frequency + 0.5))


def selective_terms(frequencies: dict[str, int], postings: int) -> list[str]:
    """The rarest terms whose segments add up to no more than `postings`:
    those that pick out segments.

    A query term found in very many segments costs most to rank and says
    least; leaving it out bounds the work of a query whatever its words. A
    query made only of such terms gets no lexical ranking (vectors rank it).
    """
    present = sorted((count, term) for term, count in frequencies.items() if count > 0)
    kept: list[str] = []
    total = 0
    for count, term in present:
        if total + count > postings:
            break
        kept.append(term)
        total += count
    return kept


# Vectors a language's mean counts as if zero were among them: centering
# takes full effect only once a language has many more than this.
MEAN_PRIOR = 20


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
        """The language's mean, shrunk towards zero while it has few vectors
        (a lone segment minus its own mean would be nothing)."""
        count = self._counts.get(language, 0)
        if not count:
            return np.zeros(self.dimensions, dtype=np.float32)
        return (self._sums[language] / (count + MEAN_PRIOR)).astype(np.float32)

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
