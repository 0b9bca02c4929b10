"""Replica fault 3: a runtime replica cut off from PostgreSQL and Redis (a
network partition) while its link to the IM stays.

r1 and r2 reach the database and Redis only through `CuttingProxy`s of their
own; r0 (which the client talks to), the IM and the model directly. Under
load (`asking`), once an agent r1 or r2 runs is mid-run, that replica's
proxies go silent (a black hole, not a reset: it learns of the cut only from
its own clock) until the others own every agent it ran, past the leases'
time to live; then the cut heals and what it sent meanwhile reaches the
database late.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass
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
    ims: tuple[RunningIM, RunningIM], own_runtime_url: str, redis_url: str, tmp_path: Path
) -> None:
    """Cut off mid-run from PostgreSQL and Redis for longer than its leases
    live, a replica gives them up by its own clock and stops its runners
    while still cut off (nobody tells it); the others own its agents; what
    its runners still try to write is refused, what it sent into the cut
    reaches the database late, and every token reaches Bea exactly once."""
    im = ims[0]
    if own_runtime_url.startswith("sqlite"):
        pytest.skip("replicas share a PostgreSQL database")
    cuts = scaled(2, long=8)
    slow = DecidingLLM(delay=0.15)  # runs long enough to cut one mid-stream
    await slow.start()
    done: list[Cut] = []
    try:
        with contextlib.ExitStack() as proxies:
            # r1 and r2 each through proxies of their own (either may run no
            # agent at a given moment); r0, which the client talks to, directly.
            links = {
                i: (
                    proxies.enter_context(CuttingProxy(target_of(own_runtime_url))),
                    proxies.enter_context(CuttingProxy(target_of(redis_url))),
                )
                for i in (1, 2)
            }
            only = {
                i: {
                    "RUNTIME_DATABASE_URL": through(own_runtime_url, db),
                    "REDIS_URL": through(redis_url, link),
                }
                for i, (db, link) in links.items()
            }
            async with cluster(
                ims, own_runtime_url, redis_url, slow, tmp_path, only=only, LOG_LEVEL="INFO"
            ) as replicas:
                async with asking(im, replicas):
                    for _ in range(cuts):
                        index, ran = await mid_run(replicas, list(links))
                        victim, cut_at = replicas.processes[index], time.time()
                        for proxy in links[index]:
                            proxy.cut()
                        owned_after = await owned_elsewhere(replicas, victim, ran)
                        # Past the leases' life whatever the machine's speed.
                        await asyncio.sleep(max(0.0, cut_at + TTL_SECONDS + 2 - time.time()))
                        for proxy in links[index]:
                            proxy.heal()
                        done.append(Cut(victim, cut_at, time.time(), owned_after))
                counters, settled_in = await settled(im, replicas)
                for cut in done:
                    cut.read_log()
            late = sum(database.delivered_late for database, _ in links.values())
    finally:
        await slow.stop()
    for cut in done:
        print(f"{cut.victim.env['RUNTIME_REPLICA_ID']} cut at {cut.at:.3f}: its log {cut.victim.log_path}")
    refused = sum(cut.refused for cut in done)
    said = summary(
        "replica cut",
        f"{cuts} cuts from PostgreSQL and Redis of {max(c.healed - c.at for c in done):.1f} s at most"
        f" (leases live {TTL_SECONDS:g} s); the victim gave its leases up"
        f" {max(c.gave_up for c in done):.2f} s at most after a cut, its runners ended"
        f" {max(c.ended for c in done):.2f} s at most after it, its agents owned elsewhere"
        f" {max(c.owned_after for c in done):.2f} s at most after it; {refused} stale writes refused,"
        f" 0 accepted (the ledger below); {late} bytes it sent into the cuts delivered late",
        counters,
        settled_in,
    )
    print(said)
    # By its own clock, while cut off: nobody could have told it.
    assert all(c.gave_up < c.healed - c.at for c in done), said
    assert refused > 0, said
    assert_nothing_lost_or_doubled(counters, said)


@dataclass
class Cut:
    """One cut: its victim, when it began and healed, and what the victim's log says of it."""

    victim: ServiceProcess
    at: float
    healed: float
    owned_after: float
    gave_up: float = math.inf
    ended: float = math.inf
    refused: int = 0

    def read_log(self) -> None:
        lines = [line for line in self.victim.log().splitlines() if logged_at(line) >= self.at]
        self.gave_up = first_after(lines, _PROOF_GONE, self.at) - self.at
        self.ended = first_after(lines, _RUNNERS_ENDED, self.at + self.gave_up) - self.at
        until = self.at + self.ended
        self.refused = sum(_STOPPED_BY_PROOF in line and logged_at(line) <= until for line in lines)


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


async def mid_run(replicas: Cluster, candidates: list[int]) -> tuple[int, list[int]]:
    """Waits until an agent that one of the `candidates` (replica indexes)
    runs is RUNNING; returns that replica and the desks of every agent it runs."""
    names = {replicas.processes[i].env["RUNTIME_REPLICA_ID"]: i for i in candidates}
    async with asyncio.timeout(30):
        while True:
            ran: dict[int, list[int]] = {i: [] for i in candidates}
            running: set[int] = set()
            for index, desk in enumerate(replicas.desks):
                got = await call(
                    replicas.runtime.GetAgent, rpb.GetAgentRequest(agent_id=desk.agent.id), desk.world.md(0)
                )
                agent = got.agent  # type: ignore[attr-defined]
                if agent.replica in names:
                    ran[names[agent.replica]].append(index)
                    if agent.state == rpb.AGENT_STATE_RUNNING:
                        running.add(names[agent.replica])
            if running:
                victim = min(running)
                return victim, ran[victim]
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
