"""The lease keeper against an in-memory lease table and a clock the test moves."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

import pytest

from services.common import errors
from services.runtime.service_layer.leases import LeaseKeeper, LeaseSettings
from tests.unit.lease_fakes import Clock, InMemoryLeases

SHARDS = 32


class Replica:
    def __init__(self, name: str, store: InMemoryLeases, clock: Clock, *, max_moves: int = 64) -> None:
        self.running: set[int] = set()
        self.keeper = LeaseKeeper(
            store=store,
            settings=LeaseSettings(
                replica=name,
                shard_count=SHARDS,
                ttl_seconds=10,
                renew_seconds=2,
                margin_seconds=2,
                max_moves=max_moves,
            ),
            gained=self.gained,
            lost=self.lost,
            monotonic=clock,
        )

    async def gained(self, shards: frozenset[int]) -> None:
        assert not shards & self.running
        self.running |= shards

    async def lost(self, shards: frozenset[int]) -> None:
        assert shards <= self.running
        self.running -= shards


async def joined(*replicas: Replica) -> None:
    """Each replica's first round: it renews and says it is there, and takes
    nothing yet (the others may not have renewed theirs)."""
    for replica in replicas:
        await replica.keeper.round()
        assert replica.running == set()


async def rounds(replicas: list[Replica], clock: Clock, count: int = 4) -> None:
    for _ in range(count):
        for replica in replicas:
            await replica.keeper.round()
        clock.now += 2


def assert_one_owner_each(replicas: list[Replica]) -> None:
    seen: dict[int, int] = {}
    for replica in replicas:
        for shard in replica.running:
            seen[shard] = seen.get(shard, 0) + 1
    assert sorted(seen) == list(range(SHARDS)) and set(seen.values()) == {1}


async def test_replicas_share_the_shards_and_run_each_once() -> None:
    clock = Clock()
    store = InMemoryLeases(clock)
    await store.prepare(SHARDS)
    replicas = [Replica(name, store, clock) for name in "abc"]
    await rounds(replicas, clock)
    assert_one_owner_each(replicas)
    assert sorted(len(r.running) for r in replicas) == [10, 11, 11]
    for replica in replicas:
        assert set(replica.keeper.held) == replica.running
        shard = next(iter(replica.running))
        fence = replica.keeper.fence(shard)
        assert fence is not None and fence.epoch == store.rows[shard].epoch


async def test_a_new_replica_gets_its_share_a_bounded_number_per_round() -> None:
    clock = Clock()
    store = InMemoryLeases(clock)
    await store.prepare(SHARDS)
    replicas = [Replica(name, store, clock, max_moves=2) for name in "abc"]
    # The first to start takes every free shard at once (at its second
    # round, the others not started yet), then gives the others theirs, 2 a round.
    await joined(replicas[0])
    await replicas[0].keeper.round()
    assert len(replicas[0].running) == SHARDS
    await rounds(replicas, clock, count=12)
    assert sorted(len(r.running) for r in replicas) == [10, 11, 11]
    newcomer = Replica("d", store, clock, max_moves=2)
    replicas.append(newcomer)
    await newcomer.keeper.round()
    await rounds(replicas, clock, count=1)
    assert 0 < len(newcomer.running) <= 2 * 3  # up to 2 from each of the three
    await rounds(replicas, clock, count=8)
    assert_one_owner_each(replicas)
    assert len(newcomer.running) == SHARDS // 4


async def test_a_replica_that_cannot_renew_stops_its_runners_before_anyone_else_may_start_them() -> None:
    clock = Clock()
    store = InMemoryLeases(clock)
    await store.prepare(SHARDS)
    a, b = Replica("a", store, clock), Replica("b", store, clock)
    await rounds([a, b], clock)
    held_by_a = set(a.running)
    assert held_by_a
    # a's database goes away (b's does not: the fake has one switch, so b is simply not asked).
    store.down = True
    with pytest.raises(errors.Unavailable):
        await a.keeper.round()
    store.down = False
    # The last renewal was at most 2 s ago; 8 s on (ttl 10 - margin 2), a can no longer prove it.
    clock.now += 6
    assert a.keeper.held == {} and a.keeper.fence(next(iter(held_by_a))) is None
    # ... and that is before the database lets b take them.
    assert set((await store.view()).owners) >= held_by_a
    clock.now += 4
    await b.keeper.round()
    await b.keeper.round()
    assert held_by_a <= b.running


async def test_a_shard_taken_away_is_stopped_at_the_next_renewal() -> None:
    clock = Clock()
    store = InMemoryLeases(clock)
    await store.prepare(SHARDS)
    a = Replica("a", store, clock)
    await joined(a)
    await a.keeper.round()
    assert a.running == set(range(SHARDS))
    # Someone else takes shard 3 (its lease looked expired to the database).
    store.rows[3].expires_at = clock.now
    await store.take("intruder", [3], 10)
    await a.keeper.round()
    assert 3 not in a.running and a.keeper.fence(3) is None
    assert a.keeper.counters.lost == 1


async def test_shards_whose_runners_could_not_start_are_started_at_the_next_round() -> None:
    """The database goes away between a take and the start of the shards'
    runners (which read the shards' agents): the shards are still this
    replica's in the database, and their runners start once it is back."""
    clock = Clock()
    store = InMemoryLeases(clock)
    await store.prepare(SHARDS)
    a = Replica("a", store, clock)
    await joined(a)
    starting = a.gained

    async def database_gone(shards: frozenset[int]) -> None:
        raise errors.Unavailable("the database is down")

    a.keeper.gained = database_gone
    with pytest.raises(errors.Unavailable):
        await a.keeper.round()
    assert a.running == set()
    a.keeper.gained = starting
    await a.keeper.round()
    assert a.running == set(range(SHARDS)) == set(a.keeper.held)
    fence = a.keeper.fence(3)
    assert fence is not None and fence.epoch == store.rows[3].epoch


async def test_closing_releases_every_shard_at_once() -> None:
    clock = Clock()
    store = InMemoryLeases(clock)
    await store.prepare(SHARDS)
    a, b = Replica("a", store, clock), Replica("b", store, clock)
    await rounds([a, b], clock)
    await a.keeper.aclose()
    assert a.running == set() and a.keeper.counters.lost == 0
    # No TTL to wait for: b takes them in its next rounds.
    await b.keeper.round()
    assert b.running == set(range(SHARDS))


def test_renewal_must_come_well_within_the_ttl() -> None:
    with pytest.raises(ValueError, match="renew"):
        LeaseSettings(replica="a", ttl_seconds=10, renew_seconds=9, margin_seconds=2)


async def test_a_shard_that_must_move_while_its_agents_work_waits_for_them_a_few_rounds_at_most() -> None:
    clock = Clock()
    store = InMemoryLeases(clock)
    await store.prepare(SHARDS)
    first = Replica("a", store, clock)
    await joined(first)
    await first.keeper.round()
    assert len(first.running) == SHARDS
    working = {3, 17}
    first.keeper.busy = working.__contains__
    second = Replica("b", store, clock)
    await joined(second)
    await rounds([first, second], clock, count=2)
    # The idle shards the newcomer should have moved at once; the busy ones stayed.
    assert sorted(len(r.running) for r in (first, second)) == [14, 18]
    assert working <= first.running
    working.discard(3)  # its run ended
    await rounds([first, second], clock, count=2)
    assert 3 in second.running and 17 in first.running
    # Still busy after `defer_rounds` rounds: moved all the same (its run is cut).
    await rounds([first, second], clock, count=first.keeper.defer_rounds)
    assert 17 in second.running
    assert sorted(len(r.running) for r in (first, second)) == [16, 16]
    assert_one_owner_each([first, second])


class SilentLeases(InMemoryLeases):
    """Renewals that hear nothing once `silent`, as through a network
    partition; one cancelled gives up only at `let_go`, as a driver closing
    its connection gracefully does (SQLAlchemy's asyncpg adapter waits 2 s)."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.silent = False
        self.let_go = asyncio.Event()

    async def renew(self, replica: str, address: str, ttl_seconds: float, report: str = "") -> dict[int, int]:
        if self.silent:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await asyncio.shield(self.let_go.wait())
                raise
        return await super().renew(replica, address, ttl_seconds, report)


async def test_a_renewal_that_hears_nothing_does_not_keep_the_runners_past_the_proof() -> None:
    store = SilentLeases(Clock())
    lost = asyncio.Event()

    async def gained(_: frozenset[int]) -> None:
        pass

    async def stopped(_: frozenset[int]) -> None:
        lost.set()

    keeper = LeaseKeeper(
        store=store,
        # Real time, a short proof (ttl - margin: 0.3 s).
        settings=LeaseSettings(
            replica="a", shard_count=4, ttl_seconds=0.5, renew_seconds=0.05, margin_seconds=0.2
        ),
        gained=gained,
        lost=stopped,
    )
    await keeper.start()
    await keeper.round()  # the start's round only joined
    assert keeper.held
    store.silent = True
    # The runners stop as the proof ends, not when the silent renewal gives up.
    await asyncio.wait_for(lost.wait(), 10)
    assert keeper.held == {} and not store.let_go.is_set()
    store.let_go.set()
    store.silent = False
    await keeper.aclose()


async def test_arrivals_releases_and_takes_are_announced_to_the_other_replicas() -> None:
    """So that they give a newcomer its share, take released shards and
    learn new owners now rather than at their next renewal."""
    clock = Clock()
    store = InMemoryLeases(clock)
    await store.prepare(SHARDS)
    a, b = Replica("a", store, clock), Replica("b", store, clock)
    told: list[tuple[str, list[str]]] = []
    for replica in (a, b):

        async def announce(others: Collection[str], name: str = replica.keeper.settings.replica) -> None:
            told.append((name, sorted(others)))

        replica.keeper.announce = announce
    await joined(a)
    await a.keeper.round()
    assert told == [], "alone, there is nobody to tell"
    await joined(b)
    assert told == [("b", ["a"])], "a newcomer says so"
    told.clear()
    await a.keeper.round()  # gives b its share
    assert told == [("a", ["b"])]
    told.clear()
    await b.keeper.round()  # takes it
    assert told == [("b", ["a"])]
    told.clear()
    await rounds([a, b], clock)
    assert told == [], "nothing moves once settled"
    await a.keeper.aclose()
    assert told == [("a", ["b"])]


async def test_after_an_outage_past_the_leases_each_replica_gets_its_own_shards_back() -> None:
    """Renewals failed longer than leases live (the database was away): the
    first replica back does not take the shards that only look free, which
    it would hand back as the others return; each renews its own, at the
    same epochs, and nothing changes hands."""
    clock = Clock()
    store = InMemoryLeases(clock)
    await store.prepare(SHARDS)
    replicas = [Replica(name, store, clock) for name in "abc"]
    await joined(*replicas)
    await rounds(replicas, clock)
    before = {name: set(r.running) for name, r in zip("abc", replicas, strict=True)}
    epochs = {shard: row.epoch for shard, row in store.rows.items()}
    store.down = True
    for replica in replicas:
        with pytest.raises(errors.Unavailable):
            await replica.keeper.round()
    clock.now += 30  # every lease and every heartbeat expired
    store.down = False
    await rounds(replicas, clock)
    assert {name: r.running for name, r in zip("abc", replicas, strict=True)} == before
    assert {shard: row.epoch for shard, row in store.rows.items()} == epochs


async def test_a_round_that_finds_other_owners_says_so() -> None:
    clock = Clock()
    store = InMemoryLeases(clock)
    await store.prepare(SHARDS)
    a, b = Replica("a", store, clock), Replica("b", store, clock)
    changes: list[int] = []
    a.keeper.owners_changed = lambda: changes.append(len(a.keeper.held))
    await joined(a, b)
    await rounds([a, b], clock)
    assert changes, "a took shards, then gave b its share"
    changes.clear()
    await rounds([a, b], clock)
    assert changes == [], "settled: nothing changed"
    await b.keeper.aclose()
    await a.keeper.round()
    assert changes == [SHARDS], "b's shards are a's now"
