"""Replica fault 9: the replicas' clocks disagree; only the database's counts.

Of three runtime replicas, r1 runs 30 s ahead and r2 30 s behind (libfaketime
preloaded: the wall clock and the monotonic clock both, as a process sees
them); r0 keeps the machine's time. Were a lease's expiry computed by a
replica, r1 would find every other lease expired and take it, and r2 would
trust its own long after the database had given it away. Under load
(`asking`), the skewed replicas are frozen mid-run past their leases (so
leases change hands by expiry, the database's clock deciding) and thawed:
the same results as with true clocks.
"""

from __future__ import annotations

import glob
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import RunningIM, unavailable
from tests.faults.harness import ROOT, ServiceProcess, scaled
from tests.faults.llm import DecidingLLM
from tests.faults.test_replica_cut import logged_at
from tests.faults.test_replica_kill import (
    _PROOF_GONE,
    _STOPPED_BY_PROOF,
    REPLICAS,
    TTL_SECONDS,
    asking,
    assert_nothing_lost_or_doubled,
    cluster,
    freeze_mid_run,
    settled,
    settled_owners,
    summary,
)

SKEWS = {1: 30.0, 2: -30.0}  # seconds, by replica index


def libfaketime() -> str:
    """The path of Debian's libfaketime (`make system-deps` installs it)."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    if not found:
        unavailable("libfaketime is not installed (apt-get install libfaketime)")
    return found[0]


def skewed(library: str, seconds: float) -> dict[str, str]:
    """Settings of a process whose clocks run `seconds` off the machine's.

    libfaketime shifts the monotonic clock too unless told not to: asyncio's
    timers and the lease keeper's proof then run on the shifted clock (the
    harsher case: nothing in the process sees the true time).
    """
    return {"LD_PRELOAD": library, "FAKETIME": f"{seconds:+g}s"}


def clock_offset(settings: dict[str, str]) -> float:
    """How far off a Python process started with `settings` finds the time."""
    before = time.time()
    shown = subprocess.run(
        [sys.executable, "-c", "import time; print(time.time())"],
        cwd=ROOT,
        env=settings,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return float(shown) - (before + time.time()) / 2


@pytest.mark.timeout(scaled(150, long=400))
async def test_replicas_whose_clocks_disagree_keep_one_owner_per_agent(
    ims: tuple[RunningIM, RunningIM], own_runtime_url: str, redis_url: str, tmp_path: Path
) -> None:
    """With r1 30 s ahead and r2 30 s behind, frozen in turn past their
    leases and thawed: every lease changes hands when the database says,
    the woken replica stops its runners and its stale writes are refused,
    and every token reaches Bea exactly once."""
    im = ims[0]
    if own_runtime_url.startswith("sqlite"):
        pytest.skip("replicas share a PostgreSQL database")
    library = libfaketime()
    freezes = scaled(2, long=8)
    slow = DecidingLLM(delay=0.15)  # runs long enough to freeze one mid-stream
    await slow.start()
    thaws: list[tuple[ServiceProcess, float]] = []
    try:
        async with cluster(
            ims,
            own_runtime_url,
            redis_url,
            slow,
            tmp_path,
            only={i: skewed(library, s) for i, s in SKEWS.items()},
            LOG_LEVEL="INFO",
        ) as replicas:
            offsets = {i: clock_offset(replicas.processes[i].env) for i in SKEWS}
            async with asking(im, replicas):
                for number in range(freezes):
                    if number:
                        # The last victim back with shards of its own first (see
                        # test_replica_kill): else it could be frozen again holding
                        # nothing, and wake with nothing to say.
                        await settled_owners(own_runtime_url, REPLICAS)
                    thaws.append(await freeze_mid_run(replicas))
            counters, settled_in = await settled(im, replicas)
            logs = {i: replicas.processes[i].log() for i in SKEWS}
            index_of = {id(p): i for i, p in enumerate(replicas.processes)}
    finally:
        await slow.stop()
    stopped_after = []
    for victim, thawed_at in thaws:
        i = index_of[id(victim)]
        # The woken replica's word that its leases are gone, in its own log,
        # by its own clock: off the machine's by its skew.
        words = [logged_at(line) for line in logs[i].splitlines() if _PROOF_GONE in line]
        word = min((t for t in words if t >= thawed_at + SKEWS[i] - 0.5), default=math.inf)
        stopped_after.append(word - SKEWS[i] - thawed_at)
    refused = sum(log.count(_STOPPED_BY_PROOF) for log in logs.values())
    said = summary(
        "clock skew",
        f"r1 {offsets[1]:+.1f} s, r2 {offsets[2]:+.1f} s off the machine's clock (wall and monotonic);"
        f" {freezes} freezes of the skewed replicas of {TTL_SECONDS + 2:.0f} s (leases live"
        f" {TTL_SECONDS:g} s), {refused} stale writes refused, 0 accepted (the ledger below),"
        f" runners stopped {max(stopped_after):.2f} s at most after waking",
        counters,
        settled_in,
    )
    print(said)
    for i in SKEWS:
        print(f"r{i}'s log: {tmp_path / f'r{i}.log'}")
    # The skew took effect: in a process started as the replicas are, and in
    # the replicas themselves (each woken one's word that its leases were
    # gone came, by its clock, its skew after the thaw).
    for i, seconds in SKEWS.items():
        assert abs(offsets[i] - seconds) < 5, said
    assert all(-0.5 <= t < 10 for t in stopped_after), said
    assert refused > 0, said
    assert_nothing_lost_or_doubled(counters, said)
