"""Replica fault 7: the replicas' PostgreSQL restarted (`immediate`) under load.

Three runtime replicas share a PostgreSQL cluster of the test's own (the
machine's server is shared and never restarted); the IM stays on the test's
database. While people ask the agents to send tokens to Bea (as in
`test_replica_kill`), the cluster is stopped at once, as a crash would stop
it (every connection cut mid-statement, crash recovery at the start), in
turn started again at once and kept down longer than the leases live. The
replicas must ride it out: no process exits, every shard is leased again by
a replica (a shard that changed hands, or was taken anew, with a higher
epoch), every token reaches Bea exactly once, no task or run is left
RUNNING and no agent is in ERROR.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from tests.conftest import RunningIM
from tests.faults.harness import PostgresProcess, scaled
from tests.faults.llm import DecidingLLM
from tests.faults.test_replica_kill import (
    TTL_SECONDS,
    Cluster,
    asking,
    assert_nothing_lost_or_doubled,
    cluster,
    settled,
    settled_owners,
    summary,
)

SHARDS = 32  # cluster()'s RUNTIME_SHARDS
_PROOF_GONE = "can no longer be proven"  # a replica stopping its runners


@dataclass(frozen=True)
class Lease:
    owner: str | None
    epoch: int
    live: bool
    # Whether it was renewed or taken since the server last started.
    since_start: bool


async def leases(url: str) -> dict[int, Lease]:
    """Every shard's lease, as the database has it now."""
    connection = await asyncpg.connect(url, timeout=5)
    try:
        rows = await connection.fetch(
            "SELECT shard, owner, epoch, expires_at > extract(epoch FROM clock_timestamp()) AS live,"
            " expires_at > extract(epoch FROM pg_postmaster_start_time())::float8 + $1 AS since_start"
            " FROM runtime.shard_leases",
            TTL_SECONDS,
        )
    finally:
        await connection.close()
    return {int(r["shard"]): Lease(r["owner"], r["epoch"], r["live"], r["since_start"]) for r in rows}


@dataclass
class Outage:
    """One stop of the server and what the replicas did about it (seconds)."""

    held_down: float  # how long the test kept it down
    down: float  # from the stop until it accepted connections again
    leased: float  # from then until every shard was leased again since the start
    spread: float  # ... and the three replicas each held some again
    moved: list[int]  # shards whose owner changed
    bumped: list[int]  # shards whose epoch went up


def worst(outages: list[Outage]) -> str:
    return (
        f"down {max(o.down for o in outages):.2f} s at most; every shard leased again"
        f" {max(o.leased for o in outages):.2f} s at most after, over the three replicas"
        f" {max(o.spread for o in outages):.2f} s; {max(len(o.bumped) for o in outages)} of {SHARDS} shards"
        f" taken anew (epoch up), {max(len(o.moved) for o in outages)} changed hands"
    )


async def outage(server: PostgresProcess, url: str, replicas: Cluster, *, down_for: float) -> Outage:
    """Stops the server at once, for `down_for` seconds (0: a restart), and
    waits until a live replica holds every shard by a lease renewed or taken
    since the server started again, and each of the three holds some."""
    names = {p.env["RUNTIME_REPLICA_ID"] for p in replicas.processes}
    before = await leases(url)
    stopped_at = time.monotonic()
    await asyncio.to_thread(server.restart, down_for=down_for)
    up_at = time.monotonic()
    leased_at = 0.0
    async with asyncio.timeout(60):
        while True:
            try:
                now = await leases(url)
            except (OSError, asyncpg.PostgresError):
                now = {}  # still starting
            if len(now) == SHARDS and all(
                lease.owner in names and lease.live and lease.since_start for lease in now.values()
            ):
                leased_at = leased_at or time.monotonic()
                if {lease.owner for lease in now.values()} == names:
                    break
            await asyncio.sleep(0.1)
    return Outage(
        held_down=down_for,
        down=up_at - stopped_at,
        leased=leased_at - up_at,
        spread=time.monotonic() - up_at,
        moved=[s for s in now if now[s].owner != before[s].owner],
        bumped=[s for s in now if now[s].epoch > before[s].epoch],
    )


async def create_database(server: PostgresProcess, name: str) -> str:
    admin = await asyncpg.connect(server.url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return server.url.rsplit("/", 1)[0] + f"/{name}"


# The two IM replicas run on the test's PostgreSQL, the runtime replicas on a server of their own.
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
@pytest.mark.timeout(scaled(150, long=400))
async def test_a_database_restarted_at_once_is_ridden_out_with_leases_taken_again(
    ims: tuple[RunningIM, RunningIM],
    private_postgres: PostgresProcess,
    redis_url: str,
    llm: DecidingLLM,
    tmp_path: Path,
) -> None:
    im = ims[0]
    # A restart (down a fraction of a second, leases outlive it) and an
    # outage longer than the leases live, in turn.
    faults = scaled(2, long=6)
    url = await create_database(private_postgres, "agentim_runtime")
    outages: list[Outage] = []
    async with cluster(ims, url, redis_url, llm, tmp_path, LOG_LEVEL="INFO") as replicas:
        await settled_owners(url, len(replicas.processes))
        async with asking(im, replicas) as failed:
            for index in range(faults):
                await asyncio.sleep(1.5)
                down_for = 0.0 if index % 2 == 0 else TTL_SECONDS + 1
                outages.append(await outage(private_postgres, url, replicas, down_for=down_for))
        counters, settled_in = await settled(im, replicas)
        exited = [p for p in replicas.processes if not p.running()]
        stopped = {p.env["RUNTIME_REPLICA_ID"]: p.log().count(_PROOF_GONE) for p in replicas.processes}
    restarts = [o for o in outages if not o.held_down]
    long = [o for o in outages if o.held_down]
    said = summary(
        "database restart",
        f"{len(restarts)} immediate restarts of the replicas' PostgreSQL ({worst(restarts)}),"
        f" {len(long)} immediate stops for {TTL_SECONDS + 1:g} s, longer than leases live ({worst(long)});"
        f" runners stopped for leases no longer proven {sorted(stopped.values())} times per replica,"
        f" {len(exited)} replicas exited, {len(failed)} failed calls",
        counters,
        settled_in,
    )
    print(said)
    assert exited == [], said + "".join(f"\n--- {p.env['RUNTIME_REPLICA_ID']}\n{p.log()}" for p in exited)
    assert failed == [], said
    # A shard never changes hands without its epoch going up (the fence of every write).
    assert all(set(o.moved) <= set(o.bumped) for o in outages), said
    # Down longer than its leases live, the database can prove no lease:
    # every replica stops its runners (and starts them again as it renews).
    assert all(n >= len(long) for n in stopped.values()), said
    assert_nothing_lost_or_doubled(counters, said)
