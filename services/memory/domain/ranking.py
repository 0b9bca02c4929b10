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

The lexical evidence fused is each candidate's weighted share of the
query's terms (`coverage`), not its BM25 score: BM25 ranks which segments
lexical search brings (the database does that), but among candidates that
hold the same query terms it prefers the shortest, and a fact is seldom the
shortest segment that names its service. A second lexical list looks for
the query's words in the other language (`domain.lexicon`), with a gate of
its own, so that a Chinese question can find an English fact by its words
and not by its vector alone.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from services.memory.domain.lexicon import Concept

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
    # The translated lexical ranking's share when its best hit holds every
    # concept of the query (its gate opens as the lexical one's does).
    translation_weight: float = 0.4
    # How much of a candidate's score rests on holding the query's bridges
    # (see `bridge_terms`): one that holds none keeps 1 - bridge_weight of
    # it (0.6 to 0.8 gave the same results on all three quality sets; 0.5
    # lost one query of seed 13's latest slice).
    bridge_weight: float = 0.6
    # How much of its score a candidate that names no time loses when the
    # question asks when (see `domain.answer_type`; 0.5 to 0.7 gave the
    # same results on six quality sets, 0.4 lost a query of one, 0.3 most
    # of what it gains).
    untimed_weight: float = 0.5


def fuse(
    vector: Sequence[Hit],
    lexical: Sequence[Hit],
    *,
    best_match_share: float,
    limit: int,
    translated: Sequence[Hit] = (),
    translated_share: float = 0.0,
    settings: FusionSettings = FusionSettings(),
) -> list[Hit]:
    """The fused ranking of two candidate lists.

    Each list's scores are brought to 0..1 (vector cosines from the lowest
    to the highest candidate, lexical scores against the best), then mixed:
    the lexical share is `lexical_weight` times the gate, which opens with
    `best_match_share`, the share of the query's distinct terms (weighted,
    if the caller can, by their rarity) that the best lexical hit contains.
    The `translated` ranking (the query's words looked for in the other
    language) is mixed in the same way, with `translation_weight` and a gate
    opened by `translated_share`. (What prefer_recent asks for is done
    after fusion: see `domain.supersession`.)
    """
    alpha = settings.lexical_weight * _gate(best_match_share, settings) if lexical else 0.0
    beta = settings.translation_weight * _gate(translated_share, settings) if translated else 0.0
    scores: dict[int, float] = {}
    if vector:
        top, floor = max(h.score for h in vector), min(h.score for h in vector)
        for hit in vector:
            scaled = (hit.score - floor) / (top - floor) if top > floor else 1.0
            scores[hit.key] = (1 - alpha - beta) * scaled
    # Without vectors (none yet, or no embedder) the lexical ranking is all there is.
    for hits, weight in ((lexical, alpha if vector else 1.0), (translated, beta)):
        top_score = max((hit.score for hit in hits), default=0.0)
        if top_score > 0 and weight > 0:
            for hit in hits:
                scores[hit.key] = scores.get(hit.key, 0.0) + weight * hit.score / top_score
    ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
    return [Hit(key, score) for key, score in ranked[:limit]]


def _gate(share: float, settings: FusionSettings) -> float:
    span = settings.gate_full - settings.gate_from
    return min(1.0, max(0.0, (share - settings.gate_from) / span)) if span > 0 else 0.0


def coverage(
    candidates: Mapping[int, Collection[str]], terms: Sequence[str], weights: Mapping[str, float]
) -> list[Hit]:
    """Each candidate's weighted share of the query's `terms` (of
    `candidates`, key -> the segment's terms), best first; those holding
    none left out. The best score is `best_match_share` of the best hit.

    Length and repeats do not count: that is BM25's business when the
    database picks candidates, and here it would rank a short segment that
    merely names the service above the fact about it.
    """
    weighted = {term: weights.get(term, 0.0) for term in terms}
    weighted = {term: weight for term, weight in weighted.items() if weight > 0}
    total = sum(weighted.values())
    if total <= 0:
        return []
    hits = []
    for key, held in candidates.items():
        found = weighted.keys() & held
        if found:
            hits.append(Hit(key, sum(weighted[term] for term in found) / total))
    hits.sort(key=lambda hit: (-hit.score, hit.key))
    return hits


def concept_coverage(
    candidates: Mapping[int, Collection[str]], concepts: Sequence[Concept], weights: Mapping[str, float]
) -> list[Hit]:
    """Each candidate's weighted share of the query's concepts, best first:
    a concept counts with the rarity of the rarest term of its best
    alternative the candidate holds, against the best any alternative could
    give (alternatives that are in no segment count for nothing)."""
    # Indexed by term, so that a candidate costs a set intersection and a
    # look at the alternatives it touches, not a pass over every alternative.
    single: dict[str, list[tuple[int, float]]] = {}
    several: dict[str, list[tuple[int, tuple[str, ...], float]]] = {}
    total = 0.0
    for number, concept in enumerate(concepts):
        best = 0.0
        for alternative in concept.alternatives:
            rarities = [weights.get(term, 0.0) for term in alternative]
            if not rarities or min(rarities) <= 0:
                continue
            value = max(rarities)
            best = max(best, value)
            if len(alternative) == 1:
                single.setdefault(alternative[0], []).append((number, value))
            else:
                several.setdefault(alternative[0], []).append((number, alternative, value))
        total += best
    if total <= 0:
        return []
    looked_for = set(single) | set(several)
    hits = []
    for key, held in candidates.items():
        found = looked_for.intersection(held)
        if not found:
            continue
        credit: dict[int, float] = {}
        for term in found:
            for number, value in single.get(term, ()):
                credit[number] = max(credit.get(number, 0.0), value)
            for number, alternative, value in several.get(term, ()):
                if value > credit.get(number, 0.0) and all(part in held for part in alternative):
                    credit[number] = value
        if credit:
            hits.append(Hit(key, sum(credit.values()) / total))
    hits.sort(key=lambda hit: (-hit.score, hit.key))
    return hits


def bridge_terms(
    terms: Sequence[str], candidates: Mapping[int, Collection[str]], weights: Mapping[str, float]
) -> list[str]:
    """The query's terms written the same in both languages (names, services,
    identifiers) that a candidate in the other language than the query holds.

    Across languages they are the only words a question shares with the fact
    it asks about. "What is the partner quota of the gateway API?" shares
    "partner quota API" with the English statements of every other
    service's quota, and only "gateway" with `gateway给合作方的接口配额...`;
    a statement about another service answers a different question, however
    much of the wording it shares. Within one language the lexical match
    already counts such terms, so a query none of whose terms is found
    across languages has no bridges.
    """
    chinese_query = any(is_chinese(term) for term in terms)
    other_language = [
        held for held in candidates.values() if any(is_chinese(term) for term in held) != chinese_query
    ]
    return [
        term
        for term in dict.fromkeys(terms)
        if weights.get(term, 0.0) > 0
        and not is_chinese(term)
        and any(term in held for held in other_language)
    ]


def hold_bridges(
    fused: Sequence[Hit],
    bridges: Sequence[str],
    candidates: Mapping[int, Collection[str]],
    weights: Mapping[str, float],
    *,
    bridge_weight: float,
) -> list[Hit]:
    """The fused ranking with each score scaled by the weighted share of the
    query's `bridges` its candidate holds (`bridge_terms`): one holding none
    keeps `1 - bridge_weight` of its score."""
    total = sum(weights.get(term, 0.0) for term in bridges)
    if total <= 0 or bridge_weight <= 0:
        return list(fused)
    scaled = []
    for hit in fused:
        held = candidates.get(hit.key, ())
        share = sum(weights.get(term, 0.0) for term in bridges if term in held) / total
        scaled.append(Hit(hit.key, hit.score * (1 - bridge_weight + bridge_weight * share)))
    scaled.sort(key=lambda hit: (-hit.score, hit.key))
    return scaled


def is_chinese(term: str) -> bool:
    """Whether a lexical term is Chinese (a bigram or a lone character)."""
    return any("\u3400" <= char <= "\u9fff" or "\uf900" <= char <= "\ufaff" for char in term)


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
