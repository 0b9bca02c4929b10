"""Near-duplicate segments (the same tool result seen a hundred times) collapse into one result."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from services.memory.domain.model import RankedSegment, StoredSegment

_DIGITS = re.compile(r"\d+")
_SPACE = re.compile(r"\s+")


def dedup_key(text: str) -> str:
    """Equal for texts that differ only in case, numbers and spacing
    (timestamps, counters and ids of an otherwise repeated output)."""
    normalized = _SPACE.sub(" ", _DIGITS.sub("#", text.lower())).strip()
    return hashlib.sha256(normalized.encode()).hexdigest()[:32]


def collapse(ranked: Sequence[tuple[StoredSegment, float]], limit: int) -> list[RankedSegment]:
    """The best of each group of near-duplicates, best first, counting the rest."""
    kept: dict[str, int] = {}
    results: list[RankedSegment] = []
    for segment, score in ranked:
        position = kept.get(segment.dedup_key)
        if position is None:
            kept[segment.dedup_key] = len(results)
            results.append(RankedSegment(segment, score, 0))
        else:
            best = results[position]
            results[position] = RankedSegment(best.segment, best.score, best.duplicates + 1)
    return results[:limit]
