"""An approximate vector index for large scopes: an inverted file (IVF).

Exact search scores every row: about 130 ms at a million 384-d rows on two
cores. Here the rows are grouped by the nearest of about 4·√n centroids
(spherical k-means on a sample), and stored list by list; a search scores
only the rows of the lists whose centroids are nearest the query (a share of
them, `probe_share`). Filters stay exact: they apply to the rows scored, a
filter that leaves a share f of the rows visible widens the probe to 1/f as
many lists, and below f² = `probe_share` scoring the visible rows alone
costs less, so search is exact there. Rows added after the index was built
are searched exactly until it is built again. Recall against exact search is measured in
`bench/memory_ann_bench.py`.

Plain numpy, no new dependency: HNSW (usearch) built ten times slower here
(about 2 minutes for 200,000 rows on two cores) for no better recall, and
its filters would have had to be applied after the search.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Matrix = npt.NDArray[np.float32]

# k-means: sample rows per list, and rounds.
_SAMPLE_PER_LIST = 40
_ROUNDS = 8
# Rows scored at once while assigning (bounds the temporary score matrix).
_CHUNK = 20_000


class Stopped(Exception):
    """The build was asked to stop (the service is shutting down)."""


@dataclass(frozen=True, slots=True)
class Clusters:
    """The lists of an IVF index over the first `rows` rows of a matrix
    ordered list by list (list `l` is rows `offsets[l]` to `offsets[l + 1]`)."""

    centroids: Matrix
    offsets: npt.NDArray[np.int64]
    rows: int
    probes: int

    def candidates(self, query: Matrix, *, visible_share: float = 1.0) -> npt.NDArray[np.int64]:
        """The rows of the lists nearest the query, in order: `probes` lists,
        more when filters leave only `visible_share` of the rows (the nearest
        visible rows are then further away)."""
        probes = min(len(self.centroids), math.ceil(self.probes / max(visible_share, 1e-9)))
        nearest = np.argpartition(-(self.centroids @ query), probes - 1)[:probes]
        nearest.sort()
        starts, ends = self.offsets[nearest], self.offsets[nearest + 1]
        sizes = ends - starts
        # The concatenated ranges start..end of the lists, without a Python loop.
        positions = np.arange(int(sizes.sum()), dtype=np.int64)
        shift = np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
        return positions + shift


def cluster(
    matrix: Matrix,
    *,
    probe_share: float,
    seed: int = 0,
    should_stop: Callable[[], bool] = lambda: False,
) -> tuple[Clusters, npt.NDArray[np.int64]]:
    """Builds the lists over `matrix` (rows of unit length). Returns them and
    the order to put the rows in (`matrix[order]` is ordered list by list).

    Raises:
        Stopped: `should_stop` said so between two steps.
    """
    rows = len(matrix)
    lists = max(1, min(rows, round(4 * math.sqrt(rows))))
    rng = np.random.default_rng(seed)
    sample = matrix[np.sort(rng.choice(rows, min(rows, _SAMPLE_PER_LIST * lists), replace=False))]
    centroids = sample[rng.choice(len(sample), lists, replace=False)].copy()
    for _ in range(_ROUNDS):
        assigned = _nearest(sample, centroids, should_stop)
        sums = np.zeros_like(centroids)
        np.add.at(sums, assigned, sample)
        counts = np.bincount(assigned, minlength=lists)
        # A list left empty keeps its centroid (it may win rows next round).
        moved = np.where(counts[:, None] > 0, sums, centroids)
        norms = np.linalg.norm(moved, axis=1, keepdims=True)
        centroids = (moved / np.where(norms > 0, norms, 1.0)).astype(np.float32)
    assigned = _nearest(matrix, centroids, should_stop)
    order = np.argsort(assigned, kind="stable").astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(assigned, minlength=lists))]).astype(np.int64)
    probes = max(1, math.ceil(lists * probe_share))
    return Clusters(centroids, offsets, rows, probes), order


def _nearest(rows: Matrix, centroids: Matrix, should_stop: Callable[[], bool]) -> npt.NDArray[np.int64]:
    nearest = np.empty(len(rows), dtype=np.int64)
    for start in range(0, len(rows), _CHUNK):
        if should_stop():
            raise Stopped
        nearest[start : start + _CHUNK] = np.argmax(rows[start : start + _CHUNK] @ centroids.T, axis=1)
    return nearest
