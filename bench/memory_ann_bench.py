"""The memory's approximate vector index at a million segments: recall@10
against exact search, latency, and the time to build it.

Runs the service's own code (`VectorIndex.rank`, `clusters.cluster`) on one
scope of N synthetic unit vectors (384-d): TOPICS topic directions, each
vector a topic's direction plus Gaussian noise, queries drawn the same way.
A vector's true neighbours are then the members of its topic, nearly tied:
a hard case for any approximate index. Rounds repeat the queries; the table
gives medians. Run with `.venv/bin/python -m bench.memory_ann_bench`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import numpy.typing as npt

from bench.stats import floor_percentile, median
from services.memory.adapters.clusters import cluster
from services.memory.adapters.search import ScopeMatrix, VectorIndex

DIMENSIONS = 384


def draw(centres: npt.NDArray[np.float32], count: int, noise: float, seed: int) -> npt.NDArray[np.float32]:
    rng = np.random.default_rng(seed)
    topics = rng.integers(0, len(centres), count)
    rows = centres[topics] + rng.standard_normal((count, DIMENSIONS)).astype(np.float32) * (
        noise / np.sqrt(DIMENSIONS)
    )
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def main(options: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((options.topics, DIMENSIONS)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    chunk = 100_000
    matrix = np.concatenate(
        [
            draw(centres, min(chunk, options.rows - start), options.noise, seed=start)
            for start in range(0, options.rows, chunk)
        ]
    )
    queries = draw(centres, options.queries, options.noise, seed=10**9)
    index = VectorIndex(DIMENSIONS)
    exact_scope = ScopeMatrix.of_vectors(matrix)
    every = np.ones(options.rows, dtype=bool)
    # Filtered searches: a third of the scope visible, and a tenth.
    third = np.random.default_rng(1).random(options.rows) < 1 / 3
    tenth = np.random.default_rng(2).random(options.rows) < 0.1

    started = time.perf_counter()
    clusters, order = cluster(matrix, probe_share=options.probe_share)
    approximate_scope = exact_scope.reordered(order, clusters, exact_scope)
    build_seconds = time.perf_counter() - started

    rows = []
    for name, mask in (("all rows visible", every), ("a third visible", third), ("a tenth visible", tenth)):
        truth = [{hit.key for hit in index.rank(exact_scope, mask, query, 10)} for query in queries]
        # The approximate scope's rows are ordered list by list: so is its mask.
        ordered_mask = mask[order]
        exact_p99, approximate_p50, approximate_p99, recalls = [], [], [], []
        for _ in range(options.rounds):
            times = []
            for query in queries:
                started = time.perf_counter()
                index.rank(exact_scope, mask, query, 10)
                times.append((time.perf_counter() - started) * 1000)
            exact_p99.append(floor_percentile(times, 0.99))
            times, found = [], 0.0
            for query, expected in zip(queries, truth, strict=True):
                started = time.perf_counter()
                hits = index.rank(approximate_scope, ordered_mask, query, 10)
                times.append((time.perf_counter() - started) * 1000)
                found += len({hit.key for hit in hits} & expected) / 10
            approximate_p50.append(floor_percentile(times, 0.5))
            approximate_p99.append(floor_percentile(times, 0.99))
            recalls.append(found / len(queries))
        rows.append(
            f"| {name} | {median(exact_p99):.1f} | {median(approximate_p50):.1f}"
            f" | {median(approximate_p99):.1f} | {median(recalls):.3f} |"
        )
    print(
        f"{options.rows:,} vectors ({options.topics:,} topics, noise {options.noise}),"
        f" {len(clusters.centroids):,} lists, {clusters.probes} probed ({options.probe_share:.1%});"
        f" built in {build_seconds:.0f} s;"
        f" {options.queries} queries x {options.rounds} rounds (medians).\n"
    )
    print("| Search | Exact p99 ms | Approximate p50 ms | Approximate p99 ms | Recall@10 |")
    print("|---|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--topics", type=int, default=20_000)
    parser.add_argument("--noise", type=float, default=0.8)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--probe-share", type=float, default=0.025)
    main(parser.parse_args())
