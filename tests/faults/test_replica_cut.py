"""Replica fault 3: one of three runtime replicas cut off from PostgreSQL and
Redis (a network partition) while its link to the IM stays.

The victim reaches the database and Redis only through `CuttingProxy`s; the
others, the IM and the model directly. Under load (`asking`), once an agent
the victim runs is mid-run, both proxies go silent (a black hole, not a
reset: the victim learns of the cut only from its own clock) until the
others own every agent the victim ran, past the leases' time to live; then
the cut heals and what the victim sent meanwhile reaches the database late.
"""

from __future__ import annotations

import asyncio
import math
import time
from datetime import datetime
from pathlib import Path

import pytest

from agentim.runtime.v1 import runtime_pb2 as rpb
from tests.conftest import RunningIM
from tests.cutting_proxy import CuttingProxy, target_of, through
from tests.faults.harness import ServiceProcess, scaled
from tests.faults.llm import DecidingLLM
from tests.faults.test_replica_kill import (
    _PROOF_GONE,
    _STOPPED_BY_PROOF,
    TTL_SECONDS,
    Cluster,
    asking,
    assert_nothing_lost_or_doubled,
    call,
    cluster,
    owner,
    settled,
    summary,
)

_RUNNERS_ENDED = "shards lost:"  # logged once the runners of the shards have ended


@pytest.mark.timeout(scaled(150, long=400))
async def test_a_replica_cut_off_from_its_database_stops_by_its_own_clock_and_is_refused(
    im: RunningIM, own_runtime_url: str, redis_url: str, tmp_path: Path
) -> None:
    """Cut off mid-run from PostgreSQL and Redis for longer than its leases
    live, a replica gives them up by its own clock and stops its runners
    while still cut off (nobody tells it); the others own its agents; what
    its runners still try to write is refused, what it sent into the cut
    reaches the database late, and every token reaches Bea exactly once."""
    if own_runtime_url.startswith("sqlite"):
        pytest.skip("replicas share a PostgreSQL database")
    cuts = scaled(2, long=8)
    slow = DecidingLLM(delay=0.15)  # runs long enough to cut one mid-stream
    await slow.start()
    spans: list[tuple[float, float]] = []  # (cut, healed), by the wall clock the logs use
    owned_after: list[float] = []
    try:
        with (
            CuttingProxy(target_of(own_runtime_url)) as database,
            CuttingProxy(target_of(redis_url)) as link,
        ):
            victim_settings = {
                "RUNTIME_DATABASE_URL": through(own_runtime_url, database),
                "REDIS_URL": through(redis_url, link),
            }
            async with cluster(
                im, own_runtime_url, redis_url, slow, tmp_path, only={1: victim_settings}, LOG_LEVEL="INFO"
            ) as replicas:
                victim = replicas.processes[1]
                async with asking(im, replicas):
                    for _ in range(cuts):
                        ran = await mid_run(replicas, victim)
                        cut_at = time.time()
                        database.cut()
                        link.cut()
                        owned_after.append(await owned_elsewhere(replicas, victim, ran))
                        # Past the leases' life whatever the machine's speed.
                        await asyncio.sleep(max(0.0, cut_at + TTL_SECONDS + 2 - time.time()))
                        database.heal()
                        link.heal()
                        spans.append((cut_at, time.time()))
                counters, settled_in = await settled(im, replicas)
                log = victim.log()
            late = database.delivered_late
    finally:
        await slow.stop()
    print(f"the victim's log: {victim.log_path}")
    since_cut = [line for line in log.splitlines() if logged_at(line) >= spans[0][0]]
    refused = sum(_STOPPED_BY_PROOF in line for line in since_cut)
    gave_up = [first_after(since_cut, _PROOF_GONE, cut) - cut for cut, _ in spans]
    ended = [
        first_after(since_cut, _RUNNERS_ENDED, cut + g) - cut
        for (cut, _), g in zip(spans, gave_up, strict=True)
    ]
    said = summary(
        "replica cut",
        f"{cuts} cuts from PostgreSQL and Redis of {max(h - c for c, h in spans):.1f} s at most"
        f" (leases live {TTL_SECONDS:g} s); the victim gave its leases up {max(gave_up):.2f} s at most"
        f" after a cut, its runners ended {max(ended):.2f} s at most after it, its agents owned elsewhere"
        f" {max(owned_after):.2f} s at most after it; {refused} stale writes refused, 0 accepted (the ledger"
        f" below); {late} bytes it sent into the cuts delivered late",
        counters,
        settled_in,
    )
    print(said)
    # By its own clock, while cut off: nobody could have told it.
    assert all(g < h - c for (c, h), g in zip(spans, gave_up, strict=True)), said
    assert refused > 0, said
    assert_nothing_lost_or_doubled(counters, said)


def logged_at(line: str) -> float:
    """When a log line was written (wall clock); 0 for a line without a time."""
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return 0.0


def first_after(lines: list[str], text: str, since: float) -> float:
    """When the first line with `text` logged at `since` or later was written; inf if none."""
    return min(
        (logged_at(line) for line in lines if text in line and logged_at(line) >= since), default=math.inf
    )


async def mid_run(replicas: Cluster, victim: ServiceProcess) -> list[int]:
    """Waits until an agent the victim runs is RUNNING; returns the desks of every agent it runs."""
    name = victim.env["RUNTIME_REPLICA_ID"]
    async with asyncio.timeout(30):
        while True:
            ran = []
            running = False
            for index, desk in enumerate(replicas.desks):
                got = await call(
                    replicas.runtime.GetAgent, rpb.GetAgentRequest(agent_id=desk.agent.id), desk.world.md(0)
                )
                agent = got.agent  # type: ignore[attr-defined]
                if agent.replica == name:
                    ran.append(index)
                    running = running or agent.state == rpb.AGENT_STATE_RUNNING
            if running:
                return ran
            await asyncio.sleep(0.05)


async def owned_elsewhere(replicas: Cluster, victim: ServiceProcess, ran: list[int]) -> float:
    """Waits until other replicas own every agent the victim ran; returns how long that took."""
    name = victim.env["RUNTIME_REPLICA_ID"]
    started = time.monotonic()
    async with asyncio.timeout(30):
        for index in ran:
            while await owner(replicas.runtime, replicas.desks[index]) in ("", name):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    return time.monotonic() - started
