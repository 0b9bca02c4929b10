"""What each reconcile's looks across all agents cost as finished tasks pile up.

Every runtime replica asks, at each reconcile (`RUNTIME_RECONCILE_SECONDS`),
which agents have tasks waiting and which tasks were left running. Tasks are
kept when they end, so over months the table holds every task ever run.
This seeds one runtime database with `--tasks` finished tasks over 1,000
agents, 20 waiting and 5 running, then times the store's two looks
(`agents_with_waiting_tasks`, `running_tasks`) with the partial indexes
ix_tasks_waiting and ix_tasks_running, and again with them dropped (as
before migration 0013, when the first read every task).

Run with `.venv/bin/python -m bench.task_scan_bench [--tasks 300000]
[--backends sqlite postgresql]` (PostgreSQL: the database
agentim_tasks_bench, created if missing; its `runtime` schema is dropped).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from bench.harness import drop_runtime_schema
from bench.stats import median, percentile
from services.runtime.adapters import migrate
from services.runtime.adapters.sql import Database, SqlAgentStore
from services.runtime.adapters.tables import tasks
from services.runtime.domain.model import TaskStatus

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/agentim_tasks_bench"
AGENTS = 1000
ROUNDS = 3
CALLS = 30


async def _fresh_postgres(url: str) -> str:
    """The benchmark database (created if missing) without its `runtime` schema."""
    target = make_url(url).set(drivername="postgresql+asyncpg")
    admin = create_async_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            name = target.database or ""
            if not await conn.scalar(sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}):
                await conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    finally:
        await admin.dispose()
    await drop_runtime_schema(url)  # refuses a database not named *bench*
    return url


async def _seed(database: Database, count: int) -> None:
    agents = [uuid.uuid4() for _ in range(AGENTS)]
    at = datetime.now(UTC)
    finished = [TaskStatus.SUCCEEDED.value] * 8 + [TaskStatus.CANCELLED.value, TaskStatus.DEAD.value]

    def row(number: int, status: str) -> dict[str, Any]:
        return {
            "id": uuid.uuid4(),
            "agent_id": agents[number % AGENTS],
            "session_id": agents[number % AGENTS],
            "input": "summarise the open tickets of the week",
            "status": status,
            "priority": 0,
            "attempts": 1,
            "last_error": "",
            "result": "done",
            "request_id": "",
            "created_at": at,
        }

    rows = [row(n, finished[n % len(finished)]) for n in range(count)]
    rows += [row(n, TaskStatus.QUEUED.value) for n in range(20)]
    rows += [row(n, TaskStatus.RUNNING.value) for n in range(5)]
    for start in range(0, len(rows), 5000):
        async with database.transaction() as conn:
            await conn.execute(tasks.insert(), rows[start : start + 5000])
    async with database.transaction() as conn:
        await conn.execute(sa.text("ANALYZE"))


async def _time(call: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
    """Median over rounds of each round's p50 and p99, in ms."""
    p50s, p99s = [], []
    for _ in range(ROUNDS):
        samples = []
        for _ in range(CALLS):
            began = time.perf_counter()
            await call()
            samples.append((time.perf_counter() - began) * 1000)
        p50s.append(percentile(samples, 0.5))
        p99s.append(percentile(samples, 0.99))
    return median(p50s), median(p99s)


async def _measure(url: str, count: int) -> dict[str, tuple[float, float]]:
    database = Database(url)
    store = SqlAgentStore(database)
    try:
        await migrate.upgrade(database)
        await _seed(database, count)
        found: dict[str, tuple[float, float]] = {}
        assert len(await store.agents_with_waiting_tasks()) == 20
        assert len(await store.running_tasks()) == 5
        found["waiting, indexed"] = await _time(store.agents_with_waiting_tasks)
        found["running, indexed"] = await _time(store.running_tasks)
        schema = "" if database.is_sqlite else "runtime."
        async with database.transaction() as conn:
            await conn.execute(sa.text(f"DROP INDEX {schema}ix_tasks_waiting"))
            await conn.execute(sa.text(f"DROP INDEX {schema}ix_tasks_running"))
        found["waiting, no index"] = await _time(store.agents_with_waiting_tasks)
        found["running, no index"] = await _time(store.running_tasks)
        return found
    finally:
        await store.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=300_000, help="finished tasks to seed")
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"])
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    options = parser.parse_args()
    print(f"{options.tasks:,} finished tasks over {AGENTS:,} agents, 20 waiting, 5 running;")
    print(f"median over {ROUNDS} rounds of {CALLS} calls each\n")
    print("| Backend | Look | p50 ms, indexed | p99 ms, indexed | p50 ms, no index | p99 ms, no index |")
    print("|---|---|---:|---:|---:|---:|")
    for backend in options.backends:
        with tempfile.TemporaryDirectory() as directory:
            if backend == "sqlite":
                url = f"sqlite:///{Path(directory) / 'runtime.db'}"
            else:
                url = await _fresh_postgres(options.postgres_url)
            found = await _measure(url, options.tasks)
        for look in ("waiting", "running"):
            with_index, without = found[f"{look}, indexed"], found[f"{look}, no index"]
            print(
                f"| {backend} | {look} | {with_index[0]:.2f} | {with_index[1]:.2f} "
                f"| {without[0]:.2f} | {without[1]:.2f} |"
            )


if __name__ == "__main__":
    asyncio.run(main())
