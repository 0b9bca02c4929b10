"""With prefer_recent: the newest statement of a fact first, the ones it superseded after it.

A value that changes over time is stated again and again in nearly the same
words ("Ada is on call for billing from now on.", a month later "Finn is on
call for billing from now on."). A recency prior (the score less a share
of each candidate's age rank, as Retrieve had) cannot tell such a
restatement from an unrelated newer segment: it pulls anything recent up,
and an old fact asked for with prefer_recent sinks (on the quality set,
asking every question with prefer_recent and a prior of 0.1 per doubling
of age rank cost 0.11-0.13 of recall@5 overall and 0.23-0.35 on zh<->en;
grouping, 0.00-0.01). Here candidates that state the same fact form a
group, which keeps the place of its best member, and within it the newest
comes first: nothing else moves.

Two candidates state the same fact when their terms mostly coincide (they
differ by a changed value: a name, a number, a day) and they hold the same
of the query's terms and concepts (so that "on call for billing" and "on
call for search", which a question about billing tells apart, stay apart).
Only the first candidates are grouped: a cost bounded whatever the store holds.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass

from services.memory.domain.lexicon import Concept
from services.memory.domain.ranking import Hit


@dataclass(frozen=True, slots=True)
class SupersessionSettings:
    # How many of the first candidates are grouped (each is compared with
    # the first member of each group before it: at most depth² / 2 pairs).
    depth: int = 50
    # The least share of terms two statements of one fact have in common
    # (Jaccard): one value changed in a short statement keeps about 0.75.
    overlap: float = 0.6


def overlap(a: Collection[str], b: Collection[str]) -> float:
    """The Jaccard similarity of two sets of terms."""
    union = len(set(a) | set(b))
    return len(set(a) & set(b)) / union if union else 0.0


def supersede(
    ranked: Sequence[Hit],
    *,
    terms: Mapping[int, Collection[str]],
    times: Mapping[int, float],
    signature: Mapping[int, Hashable],
    settings: SupersessionSettings = SupersessionSettings(),
) -> list[Hit]:
    """`ranked` with each group of statements of one fact together at the
    place of its best member, newest first, all at the best member's score.

    Args:
        ranked: candidates, best first.
        terms: each candidate's lexical terms.
        times: each candidate's time (larger is newer).
        signature: what of the query each candidate holds; only candidates
            with equal signatures are grouped.
        settings: how many candidates, how alike.
    """
    head = list(ranked[: settings.depth])
    groups: list[list[Hit]] = []
    for hit in head:
        for group in groups:
            first = group[0].key
            if signature.get(first) == signature.get(hit.key) and (
                overlap(terms.get(first, ()), terms.get(hit.key, ())) >= settings.overlap
            ):
                group.append(hit)
                break
        else:
            groups.append([hit])
    result: list[Hit] = []
    for group in groups:
        best = group[0].score
        newest_first = sorted(group, key=lambda hit: (-times.get(hit.key, 0.0), hit.key))
        result.extend(Hit(hit.key, best) for hit in newest_first)
    return result + list(ranked[settings.depth :])


def query_signature(
    held: Collection[str], terms: Sequence[str], concepts: Sequence[Concept]
) -> tuple[frozenset[str], tuple[bool, ...]]:
    """Which of the query's `terms` and `concepts` a segment holding `held` holds."""
    return (
        frozenset(term for term in terms if term in held),
        tuple(any(all(t in held for t in alt) for alt in concept.alternatives) for concept in concepts),
    )
