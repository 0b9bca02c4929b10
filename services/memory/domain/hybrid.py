"""The hybrid ranking of Retrieve, from the candidates each search brought.

Three searches bring candidates: by vector, lexically by the query's own
terms, and lexically by its words in the other language (`domain.lexicon`).
Every candidate is then judged on all three counts, whichever search
brought it: its vector score, the weighted share of the query's terms it
holds, and the weighted share of the query's concepts. A candidate that one
search missed (the fact among 270 segments that name the same service,
beyond lexical search's first 50) is still credited for the terms it holds.
Last, a candidate that holds none of the query's bridges (names and
identifiers that candidates in the other language hold too) keeps only part
of its score (`ranking.bridge_terms`), and so does, for a question that
asks when, a candidate that names no time (`domain.answer_type`).
The memory service ranks this way, and so does the quality benchmark.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from services.memory.domain.answer_type import asks_when, prefer_times
from services.memory.domain.lexicon import Concept
from services.memory.domain.ranking import (
    FusionSettings,
    Hit,
    best_match_share,
    bridge_terms,
    concept_coverage,
    coverage,
    fuse,
    hold_bridges,
)
from services.memory.domain.supersession import SupersessionSettings, query_signature, supersede


@dataclass(frozen=True, slots=True)
class Candidates:
    """What the searches found, and what is known of each candidate.

    Attributes:
        vector: by centered cosine, best first (empty without a query vector).
        lexical: by BM25 over the query's terms, best first.
        translated: by BM25 over the terms of the query's concepts, best first.
        terms: each candidate's lexical terms (of every list).
        times: each candidate's time, larger is newer (for prefer_recent).
    """

    vector: Sequence[Hit]
    lexical: Sequence[Hit]
    translated: Sequence[Hit] = ()
    terms: Mapping[int, Collection[str]] = field(default_factory=dict)
    times: Mapping[int, float] = field(default_factory=dict)


DEFAULT_FUSION = FusionSettings()
DEFAULT_SUPERSESSION = SupersessionSettings()


def searchable_concepts(concepts: Sequence[Concept], searched: Collection[str]) -> list[Concept]:
    """The concepts with only the alternatives whose terms were all searched
    (the others' rarity is unknown); concepts left with none are dropped."""
    kept = []
    for concept in concepts:
        alternatives = tuple(alt for alt in concept.alternatives if all(term in searched for term in alt))
        if alternatives:
            kept.append(Concept(concept.word, alternatives))
    return kept


def rank(
    terms: Sequence[str],
    concepts: Sequence[Concept],
    candidates: Candidates,
    weights: Mapping[str, float],
    *,
    limit: int,
    prefer_recent: bool = False,
    fusion: FusionSettings = DEFAULT_FUSION,
    supersession: SupersessionSettings = DEFAULT_SUPERSESSION,
) -> list[Hit]:
    """The candidates in their fused order, at most `limit`.

    Args:
        terms: the query's lexical terms.
        concepts: the query's words in the other language (may be empty).
        candidates: what the searches found.
        weights: each term's rarity (of `terms` and of the concepts' terms).
        limit: how many to return.
        prefer_recent: the newest statement of a fact first (see `supersession`).
    """
    lists = (candidates.vector, candidates.lexical, candidates.translated)
    keys = {hit.key for hits in lists for hit in hits}
    held = {key: candidates.terms.get(key, ()) for key in keys}
    if candidates.vector:
        lexical = coverage(held, terms, weights)
        share = lexical[0].score if lexical else 0.0
    else:
        # Lexical search alone: its own BM25 order (coverage would tie most of it).
        lexical = list(candidates.lexical)
        share = best_match_share(terms, set(held[lexical[0].key]), weights) if lexical else 0.0
    translated = concept_coverage(held, concepts, weights) if concepts else []
    fused = fuse(
        candidates.vector,
        lexical,
        best_match_share=share,
        limit=len(keys),
        translated=translated,
        translated_share=translated[0].score if translated else 0.0,
        settings=fusion,
    )
    bridges = bridge_terms(terms, held, weights)
    if bridges:
        fused = hold_bridges(fused, bridges, held, weights, bridge_weight=fusion.bridge_weight)
    if asks_when(terms):
        fused = prefer_times(fused, held, untimed_weight=fusion.untimed_weight)
    if prefer_recent:
        signatures = {key: query_signature(held[key], terms, concepts) for key in keys}
        fused = supersede(
            fused, terms=held, times=candidates.times, signature=signatures, settings=supersession
        )
    return fused[:limit]
