"""Memory storage at scale: archive throughput and Retrieve latency.

Seeds one agent's memory with N segments (runs of 10 steps of varied
bilingual text, vectors precomputed: 384-d, unit length, clustered so that
queries have near neighbours) through the memory's own handler and store,
then measures Retrieve through the handler with the query vector given (the
embedder answers at once), on SQLite and on PostgreSQL (no pgvector).
Run with `.venv/bin/python -m bench.memory_store_bench --segments 100000`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import sqlalchemy as sa

from services.memory.adapters import migrate
from services.memory.adapters.sql import Database, SqlMemoryStore
from services.memory.adapters.tables import SCHEMA
from services.memory.domain.scope import Filters
from services.memory.entrypoints.mappers import run_in
from services.memory.service_layer.handlers import AgentScopeRequest, Caller, Memory
from services.memory.service_layer.ports import Embedder, Vector
from tests.memory_support import FakeDirectory, RunBuilder

DIMENSIONS = 384
CLUSTERS = 2000
WORDS = [
    "deploy",
    "build",
    "release",
    "billing",
    "search",
    "checkout",
    "payments",
    "ledger",
    "gateway",
    "inventory",
    "shipping",
    "report",
    "latency",
    "error",
    "timeout",
    "quota",
    "budget",
    "review",
    "incident",
    "rollback",
    "migration",
    "schema",
    "index",
    "cache",
]
HANZI = "部署发布账单搜索结账支付网关库存配送报告延迟错误超时配额预算评审事故回滚迁移索引缓存"


class PrecomputedEmbedder(Embedder):
    """Vectors from a hash of the text, near the centre of one of CLUSTERS directions: at once."""

    name = "precomputed"
    dimensions = DIMENSIONS

    def __init__(self) -> None:
        rng = np.random.default_rng(7)
        centres = rng.standard_normal((CLUSTERS, DIMENSIONS)).astype(np.float32)
        self.centres = centres / np.linalg.norm(centres, axis=1, keepdims=True)

    def vector(self, text: str) -> Vector:
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        rng = np.random.default_rng(seed)
        v = self.centres[seed % CLUSTERS] + 0.3 * rng.standard_normal(DIMENSIONS).astype(np.float32)
        return (v / np.linalg.norm(v)).astype(np.float32)

    async def embed_passages(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        return np.stack([self.vector(t) for t in texts]) if texts else np.zeros((0, DIMENSIONS), np.float32)

    async def embed_query(self, text: str) -> Vector:
        return self.vector(text)


def sentence(rng: random.Random, number: int) -> str:
    if rng.random() < 0.3:
        return "".join(rng.choice(HANZI) for _ in range(rng.randint(12, 40))) + f" #{number}"
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30)))
    return f"{words} ERR_{rng.randint(1, 999)} services/{rng.choice(WORDS)}/{rng.choice(WORDS)}.py #{number}"


async def seed(
    memory: Memory, store: SqlMemoryStore, embedder: PrecomputedEmbedder, segments: int
) -> tuple[str, str, float]:
    directory = FakeDirectory()
    workspace, agent = str(uuid.uuid4()), str(uuid.uuid4())
    member = directory.add(workspace, is_agent=True)
    memory._directory = directory
    person = directory.add(workspace)
    group = str(uuid.uuid4())
    rng = random.Random(7)
    started = time.perf_counter()
    for index in range(segments // 10):
        builder = RunBuilder(workspace, agent, member)
        for step in range(10):
            text = sentence(rng, index * 10 + step)
            if step % 2:
                builder.assistant(text, group=group, members=[person])
            else:
                builder.user(text, group=group, members=[person])
        await memory.archive_run(Caller(member), run_in(builder.build()))
        # Embedding as the worker does, with vectors at hand.
        while pending := await store.pending_embeddings(256):
            vectors = await embedder.embed_passages([p.text for p in pending])
            await store.store_embeddings(pending, vectors)
    return agent, member, (segments // 10 * 10) / (time.perf_counter() - started)


async def measure(memory: Memory, agent: str, member: str, queries: int) -> list[float]:
    rng = random.Random(11)
    times = []
    for number in range(queries):
        query = sentence(rng, number)[:120]
        started = time.perf_counter()
        await memory.retrieve(
            Caller(member),
            AgentScopeRequest(agent, (member,)),
            query=query,
            limit=10,
            filters=Filters(),
            prefer_recent=False,
        )
        times.append((time.perf_counter() - started) * 1000)
    return times


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


async def run_backend(url: str, segments: int, queries: int, rounds: int) -> str:
    database = Database(url)
    if not database.is_sqlite:
        async with database.engine.begin() as conn:
            await conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
    await migrate.upgrade(database)
    embedder = PrecomputedEmbedder()
    store = SqlMemoryStore(database, dimensions=DIMENSIONS)
    memory = Memory(store=store, embedder=embedder, directory=FakeDirectory())
    try:
        agent, member, rate = await seed(memory, store, embedder, segments)
        await measure(memory, agent, member, 20)  # warm: the scope's matrix is loaded once
        p50s, p95s, p99s = [], [], []
        for _ in range(rounds):
            times = await measure(memory, agent, member, queries)
            p50s.append(percentile(times, 0.5))
            p95s.append(percentile(times, 0.95))
            p99s.append(percentile(times, 0.99))
    finally:
        await store.aclose()
        await database.aclose()
    kind = "SQLite" if url.startswith("sqlite") else "PostgreSQL"
    p50, p95, p99 = (statistics.median(values) for values in (p50s, p95s, p99s))
    return f"| {kind} | {segments:,} | {rate:,.0f} | {p50:.1f} | {p95:.1f} | {p99:.1f} |"


async def main(segments: int, queries: int, rounds: int, postgres: str) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        rows.append(await run_backend(f"sqlite:///{Path(workdir) / 'memory.db'}", segments, queries, rounds))
    if postgres:
        rows.append(await run_backend(postgres, segments, queries, rounds))
    print(f"Retrieve with the query vector given, {queries} queries x {rounds} rounds (medians of rounds).\n")
    print("| Store | Segments | Archived segments/s | p50 ms | p95 ms | p99 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--segments", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/bench_h3")
    options = parser.parse_args()
    asyncio.run(main(options.segments, options.queries, options.rounds, options.postgres))
