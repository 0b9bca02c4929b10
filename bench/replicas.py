"""Runtime replicas for the benchmarks: the processes, the lease table, and
what one lease round costs the database.

Replicas are started as the replica fault tests start them
(`tests.faults.harness.ServiceProcess`, `python -m services.runtime serve`
from the working tree, one shared PostgreSQL database and Redis), with the
benchmark backend's environment (`bench.harness.Backend.runtime_env`): they
can be killed with SIGKILL, stopped with SIGTERM and started again on the
same address. `desks` makes agents to ask, each in a workspace of its own,
and `submit`/`until_task` give them tasks. `LeaseTable` reads `runtime.shard_leases` and the database's
statistics; `RoundCost` runs a replica's renewal and lease read as its
keeper does, in transactions that roll back, counting their statements.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Collection, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from agentim.runtime.v1 import runtime_pb2 as rpb
from agentim.runtime.v1 import runtime_pb2_grpc
from bench.calls import CALL_TIMEOUT_S, CREATE_CONCURRENCY, bounded, create_agent, new_workspace
from bench.harness import Backend, BenchError, Clients
from services.runtime.adapters.leases import SqlLeases
from services.runtime.adapters.sql import Database
from services.runtime.domain.shards import shard_of
from tests.faults.harness import ServiceProcess
from tests.faults.test_im_kill import FAST_RECONNECT, RETRYABLE
from tests.identities import as_member

SHARDS = 1024
LEASE_TTL_S = 10.0
LEASE_RENEW_S = 2.0
LEASE_MARGIN_S = 2.0
SETTLE_TIMEOUT_S = 120.0
# PostgreSQL here allows 100 connections for every session on the machine:
# each replica and the IM keep at most twice this many (pool and overflow).
DB_POOL_SIZE = "6"
# How long a replica with thousands of agents may take to exit after SIGTERM before it is killed.
STOP_LIMIT_S = 120.0
TASK_LIMIT_S = 60.0


@dataclass
class Replica:
    """One runtime replica process and a channel to it (which reconnects
    when the process comes back on the same address)."""

    process: ServiceProcess
    stub: Any = None
    channel: grpc.aio.Channel | None = None

    @property
    def id(self) -> str:
        return self.process.env["RUNTIME_REPLICA_ID"]

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class ReplicaSet:
    """Runtime replicas on one backend (PostgreSQL and Redis), named
    `r<index>-<tag>`; `settings` are added to every replica's environment."""

    backend: Backend
    logs: Path
    redis_url: str
    settings: Mapping[str, str] = field(default_factory=dict)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    replicas: list[Replica] = field(default_factory=list)

    def env(self, index: int) -> dict[str, str]:
        return self.backend.runtime_env(
            REDIS_URL=self.redis_url,
            RUNTIME_REPLICA_ID=f"r{index}-{self.tag}",
            RUNTIME_SHARDS=str(SHARDS),
            RUNTIME_LEASE_TTL_SECONDS=str(LEASE_TTL_S),
            RUNTIME_LEASE_RENEW_SECONDS=str(LEASE_RENEW_S),
            RUNTIME_LEASE_MARGIN_SECONDS=str(LEASE_MARGIN_S),
            RUNTIME_DB_POOL_SIZE=DB_POOL_SIZE,
            **self.settings,
        )

    async def add(self) -> Replica:
        index = len(self.replicas)
        replica = Replica(ServiceProcess("services.runtime", self.env(index), self.logs / f"r{index}.log"))
        self.replicas.append(replica)
        await self.start(replica)
        return replica

    async def start(self, replica: Replica) -> None:
        """Starts (or starts again) a replica and waits for its listening line."""
        await asyncio.to_thread(replica.process.start)
        replica.process.pin_address("RUNTIME_GRPC_ADDRESS")
        if replica.channel is None:
            replica.channel = grpc.aio.insecure_channel(replica.process.address, options=FAST_RECONNECT)
            replica.stub = runtime_pb2_grpc.RuntimeServiceStub(replica.channel)

    async def kill(self, replica: Replica) -> None:
        await asyncio.to_thread(replica.process.kill)

    async def terminate(self, replica: Replica, *, limit_s: float = 30.0) -> int | None:
        """SIGTERM, then waits up to `limit_s` for the exit; the exit code, or
        None if it had to be killed then."""
        try:
            return await asyncio.to_thread(replica.process.terminate, timeout=limit_s)
        except subprocess.TimeoutExpired:
            await self.kill(replica)
            return None

    def clients(self, replica: Replica) -> Clients:
        return Clients(self.backend.im_stub, replica.stub)

    def ids(self) -> set[str]:
        return {r.id for r in self.replicas}

    def problems(self) -> Counter[str]:
        """Warnings and errors the replicas logged, counted by replica and level."""
        found: Counter[str] = Counter()
        for replica in self.replicas:
            for line in replica.process.log().splitlines():
                for level in ("WARNING", "ERROR", "CRITICAL"):
                    if f" {level} " in line:
                        found[f"{replica.id}: {level} {line.split(level, 1)[1].strip()[:160]}"] += 1
        return found

    async def aclose(self) -> None:
        """SIGTERM to every replica still running (they release their leases), then closes the channels."""
        await asyncio.gather(
            *(self.terminate(r) for r in self.replicas if r.process.running()), return_exceptions=True
        )
        for replica in self.replicas:
            replica.process.kill()
            if replica.channel is not None:
                await replica.channel.close()


@contextlib.asynccontextmanager
async def replica_set(
    backend: Backend, logs: Path, redis_url: str, count: int, **settings: str
) -> AsyncIterator[ReplicaSet]:
    """`count` replicas for the block, every shard held once they are yielded."""
    replicas = ReplicaSet(backend, logs, redis_url, settings)
    try:
        for _ in range(count):
            await replicas.add()
        async with LeaseTable(backend.runtime_url) as table:
            await table.settled(replicas.ids())
        yield replicas
    finally:
        await replicas.aclose()


async def call(method: Any, request: Any, metadata: Any, *, limit_s: float = CALL_TIMEOUT_S) -> Any:
    """A call that changes nothing (or is idempotent), made again while its
    replica is away or the agent's shard is between replicas."""
    async with asyncio.timeout(limit_s):
        while True:
            try:
                return await method(request, metadata=metadata, timeout=CALL_TIMEOUT_S, wait_for_ready=True)
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRYABLE:
                    raise
                await asyncio.sleep(0.02)


async def owner(replica: Replica, person: str, agent_id: str) -> str:
    """The replica that runs the agent, as `replica` last saw the leases."""
    got = await call(replica.stub.GetAgent, rpb.GetAgentRequest(agent_id=agent_id), as_member(person))
    return str(got.agent.replica)


# --- agents and their tasks ------------------------------------------------------------------


@dataclass
class Desk:
    """An agent and the person of its workspace, who asks it."""

    person: str
    agent: str
    shard: int


async def desks(replicas: ReplicaSet, count: int, prefix: str) -> list[Desk]:
    """`count` agents, each in a workspace of its own (so their shards spread)."""
    clients = replicas.clients(replicas.replicas[0])

    async def one(index: int) -> Desk:
        person = await new_workspace(clients, f"{prefix}-{index}")
        agent = await create_agent(clients, person, f"agent-{index}")
        return Desk(person, agent.id, shard_of(uuid.UUID(agent.workspace_id), SHARDS))

    made, errors = await bounded([partial(one, i) for i in range(count)], CREATE_CONCURRENCY)
    if errors:
        raise BenchError(f"creating the agents failed: {dict(errors)}")
    return made


async def submit(via: Replica, desk: Desk, name: str) -> str:
    got = await call(
        via.stub.SubmitTask,
        rpb.SubmitTaskRequest(agent_id=desk.agent, input=f"{name}: say ok", request_id=name),
        as_member(desk.person),
    )
    return str(got.task.id)


async def until_task(via: Replica, desk: Desk, task_id: str, *, done: bool) -> rpb.Task:
    """The task once it has started (or, with `done`, ended), read through `via`."""
    async with asyncio.timeout(TASK_LIMIT_S):
        while True:
            got = await call(via.stub.GetTask, rpb.GetTaskRequest(task_id=task_id), as_member(desk.person))
            task: rpb.Task = got.task
            if task.HasField("end_time" if done else "start_time"):
                return task
            await asyncio.sleep(0.01)


def started_at(task: rpb.Task) -> float:
    """The task's stored start, in seconds since the epoch."""
    return task.start_time.ToMicroseconds() / 1e6


# --- the lease table and the database's counters ---------------------------------------------


class LeaseTable:
    """Reads `runtime.shard_leases` and the database's statistics (asyncpg, one connection)."""

    def __init__(self, url: str) -> None:
        self._url = url.replace("postgresql+asyncpg://", "postgresql://")
        self._connection: asyncpg.Connection | None = None

    async def __aenter__(self) -> LeaseTable:
        self._connection = await asyncpg.connect(self._url)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._connection is not None:
            await self._connection.close()

    @property
    def _db(self) -> asyncpg.Connection:
        assert self._connection is not None
        return self._connection

    async def owners(self) -> dict[int, str]:
        """Each shard's owner, among the shards whose lease is live by the database's clock."""
        rows = await self._db.fetch(
            "SELECT shard, owner FROM runtime.shard_leases WHERE owner IS NOT NULL"
            " AND expires_at > extract(epoch FROM clock_timestamp())"
        )
        return {int(r["shard"]): str(r["owner"]) for r in rows}

    async def settled(self, replicas: Collection[str]) -> float:
        """Seconds until every shard is held by one of `replicas`, each of them
        holds some, and nothing has moved for two renewal intervals and a half
        (each replica moves shards once per interval, each at its own moment)."""
        steady_reads = int(2.5 * LEASE_RENEW_S / 0.5)
        started = time.monotonic()
        last: dict[int, str] = {}
        steady = 0
        wanted = set(replicas)
        try:
            async with asyncio.timeout(SETTLE_TIMEOUT_S):
                while steady < steady_reads:
                    owners = await self.owners()
                    complete = len(owners) == SHARDS and set(owners.values()) == wanted
                    steady = steady + 1 if complete and owners == last else 0
                    last = owners
                    await asyncio.sleep(0.5)
        except TimeoutError:
            held = Counter(last.values())
            raise BenchError(f"the shards did not settle on {sorted(wanted)} in time: {dict(held)}") from None
        return time.monotonic() - started

    async def until_held(self, replicas: Collection[str], *, since: float) -> float:
        """Seconds from `since` (monotonic) until every shard is held by one of
        `replicas`, each holding some."""
        wanted = set(replicas)
        async with asyncio.timeout(SETTLE_TIMEOUT_S):
            while True:
                owners = await self.owners()
                if len(owners) == SHARDS and set(owners.values()) == wanted:
                    return time.monotonic() - since
                await asyncio.sleep(0.05)

    async def agents_by_owner(self) -> Counter[str]:
        """Live agents per replica, by their workspace's shard and its owner."""
        owners = await self.owners()
        rows = await self._db.fetch("SELECT workspace_id FROM runtime.agents WHERE NOT deleted")
        return Counter(owners.get(shard_of(uuid.UUID(str(r["workspace_id"])), SHARDS), "") for r in rows)

    async def counters(self) -> dict[str, int]:
        """The database's cumulative counters that lease rounds and reconciling move.

        PostgreSQL updates them when a session goes idle, at most once a
        second (and a session idle longer may hold up to 10 s of them): read
        over a window of tens of seconds, they are good to a few percent.
        """
        database = await self._db.fetchrow(
            "SELECT xact_commit + xact_rollback AS transactions FROM pg_stat_database"
            " WHERE datname = current_database()"
        )
        assert database is not None
        tables = await self._db.fetch(
            "SELECT relname, n_tup_ins + n_tup_upd AS written,"
            " coalesce(seq_scan, 0) + coalesce(idx_scan, 0) AS scans,"
            " coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) AS rows_read"
            " FROM pg_stat_user_tables WHERE schemaname = 'runtime'"
        )
        found = {"transactions": int(database["transactions"])}
        for row in tables:
            for name in ("written", "scans", "rows_read"):
                found[f"{row['relname']}.{name}"] = int(row[name])
        return found


# --- one lease round, measured ---------------------------------------------------------------


class _RolledBack(Database):
    """The runtime's database whose write transactions roll back, counting
    the statements sent: a renewal measured this way changes nothing."""

    statements: int = 0

    def __init__(self, url: str) -> None:
        super().__init__(url, pool_size=1)
        sa.event.listen(self.engine.sync_engine, "before_cursor_execute", self._count)

    def _count(self, *_: object) -> None:
        self.statements += 1

    @contextlib.asynccontextmanager
    async def transaction(self, *, write: bool = True) -> AsyncIterator[AsyncConnection]:
        if not write:
            async with super().transaction(write=False) as conn:
                yield conn
            return
        async with self.engine.connect() as conn:
            transaction = await conn.begin()
            try:
                yield conn
            finally:
                await transaction.rollback()


@dataclass
class RoundCost:
    """What a replica's lease round sends: statements and client-side time of
    the renewal (one statement for every shard the replica holds) and of the
    read of the table that follows it (`LeaseKeeper.round`)."""

    shards: int
    renew_statements: float
    renew_ms: list[float]
    view_statements: float
    view_ms: list[float]


async def round_cost(url: str, replica: str, address: str, *, repeats: int) -> RoundCost:
    """Runs `replica`'s renewal (rolled back) and lease read `repeats` times, as its keeper does."""
    database = _RolledBack(url)
    leases = SqlLeases(database)
    renew_ms: list[float] = []
    view_ms: list[float] = []
    shards = 0
    renew_statements = view_statements = 0
    try:
        for _ in range(repeats):
            before = database.statements
            started = time.perf_counter()
            shards = len(await leases.renew(replica, address, LEASE_TTL_S))
            renew_ms.append((time.perf_counter() - started) * 1000)
            renew_statements += database.statements - before
            before = database.statements
            started = time.perf_counter()
            await leases.view()
            view_ms.append((time.perf_counter() - started) * 1000)
            view_statements += database.statements - before
    finally:
        await database.engine.dispose()
    return RoundCost(shards, renew_statements / repeats, renew_ms, view_statements / repeats, view_ms)
