"""Shard leases: which replica may run which agents, and proof of it.

A replica holds a shard (see `services.runtime.domain.shards`) while its lease
in the database is live. The `LeaseKeeper` renews every lease the replica
holds in one statement per interval, takes and releases shards towards the
target assignment a bounded number per round, and stops the runners of a
shard the moment it can no longer prove its lease: its last successful
renewal, by its own monotonic clock, plus the lease's time to live minus a
safety margin. The database alone says when a lease expires (its clock), so
replicas whose clocks disagree still agree on owners.

Every write a runner makes for a shard carries the shard's `Fence` (its epoch
when taken); the store refuses a write whose epoch is no longer the shard's
(`LeaseLost`), so a stale owner's writes are never accepted.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field

from services.common import errors
from services.runtime.domain.shards import moves_for, shard_of, target_owners

logger = logging.getLogger(__name__)


class LeaseLost(errors.Conflict):
    """A write carried the epoch of a shard lease its replica no longer holds."""

    @classmethod
    def of(cls, fence: Fence) -> LeaseLost:
        return cls(f"shard {fence.shard} is no longer held by {fence.replica} at epoch {fence.epoch}")


@dataclass(frozen=True, slots=True)
class Fence:
    """What a runner's write proves itself with: the shard, the epoch its
    replica took it at, and the replica."""

    shard: int
    epoch: int
    replica: str


@dataclass(frozen=True, slots=True)
class LeaseView:
    """What one read of the lease table shows: the live replicas and the
    owner of every shard whose lease is live, at the database's time `now`."""

    replicas: tuple[str, ...]
    owners: Mapping[int, str]
    now: float


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """A live replica as its row says: its times by the database's clock
    (seconds since the epoch) and its last report (JSON, or empty)."""

    replica: str
    address: str
    started_at: float
    reported_at: float
    report: str


class LeaseStore(abc.ABC):
    """The lease table (one per database), with the database's clock."""

    @abc.abstractmethod
    async def prepare(self, shard_count: int) -> None:
        """Creates the rows of shards 0 .. shard_count - 1 if missing."""

    @abc.abstractmethod
    async def renew(self, replica: str, address: str, ttl_seconds: float, report: str = "") -> dict[int, int]:
        """Marks `replica` live (with its `report` of itself) and extends
        every lease it holds, in one statement; returns the shards it holds
        with their epochs."""

    @abc.abstractmethod
    async def live_replicas(self) -> list[ReplicaReport]:
        """Every live replica with what it last reported, by id."""

    @abc.abstractmethod
    async def view(self) -> LeaseView: ...

    @abc.abstractmethod
    async def take(self, replica: str, shards: Collection[int], ttl_seconds: float) -> dict[int, int]:
        """Takes those of `shards` that nobody holds (free or expired), each
        with its epoch incremented; returns the ones taken with their epochs."""

    @abc.abstractmethod
    async def release(self, replica: str, shards: Collection[int]) -> None:
        """Gives up `shards` (epoch incremented, so older writes are refused)."""

    @abc.abstractmethod
    async def leave(self, replica: str) -> None:
        """Releases every shard of `replica` and forgets it."""


class Fences(abc.ABC):
    """The fence each write of a runner carries, by its agent's workspace."""

    @abc.abstractmethod
    def fence_for(self, workspace_id: uuid.UUID) -> Fence | None:
        """The fence of a write for an agent of `workspace_id`; None where no
        other replica can run the agent (nothing to fence against).

        Raises:
            LeaseLost: this replica cannot prove it holds the agent's shard.
        """


class Unfenced(Fences):
    """One process runs every agent: its writes need no fence."""

    def fence_for(self, workspace_id: uuid.UUID) -> Fence | None:
        return None


ShardsChanged = Callable[[frozenset[int]], Awaitable[None]]


async def _nobody_to_tell(replicas: Collection[str]) -> None:
    return None


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    replica: str
    address: str = ""
    shard_count: int = 1024
    ttl_seconds: float = 10.0
    renew_seconds: float = 2.0
    # How long before the database would expire a lease the replica stops
    # trusting it: covers the time a renewal takes to reach the database.
    margin_seconds: float = 2.0
    max_moves: int = 64
    load_cap: float = 1.0
    # While messages between replicas may be lost (Redis is away), how often
    # each replica reads the database again for what they would have said.
    reconcile_seconds: float = 5.0

    def __post_init__(self) -> None:
        if not self.replica:
            raise ValueError("a replica needs an id")
        if not 0 < self.renew_seconds < self.ttl_seconds - self.margin_seconds:
            raise ValueError(
                "renewal must come well within a lease's time to live (0 < renew < ttl - margin)"
            )


@dataclass
class LeaseCounters:
    renewals: int = 0
    renewal_failures: int = 0
    taken: int = 0
    released: int = 0
    # Shards whose lease was lost (expired, taken, or unprovable), not given up.
    lost: int = 0


@dataclass
class LeaseKeeper(Fences):
    """One replica's leases: renewals, moves towards the target, and the
    runners told when shards come and go."""

    store: LeaseStore
    settings: LeaseSettings
    gained: ShardsChanged
    lost: ShardsChanged
    monotonic: Callable[[], float] = time.monotonic
    counters: LeaseCounters = field(default_factory=LeaseCounters)
    # What the replica reports of itself with each renewal (see `ReplicaReport`).
    report: Callable[[], str] = lambda: ""
    # Whether a shard's agents are in a run: a shard that should move while
    # busy is given up once idle, or after `defer_rounds` rounds all the same.
    busy: Callable[[int], bool] = lambda _: False
    defer_rounds: int = 5
    # Tells the other live replicas that the table changed in a way they act
    # on (shards released or taken, a replica joined or back), so that they
    # run a round now (`nudge`) instead of at their next renewal.
    announce: Callable[[Collection[str]], Awaitable[None]] = _nobody_to_tell
    # Called after a round in which the owners this replica knows changed.
    owners_changed: Callable[[], None] = lambda: None
    _replicas: tuple[str, ...] = ()
    # When the last renewal that reached the database began (monotonic).
    _renewed_at: float | None = None
    _deferred: dict[int, int] = field(default_factory=dict)
    _held: dict[int, int] = field(default_factory=dict)
    # Every shard's owner as the last round saw them.
    _owners: dict[int, str] = field(default_factory=dict)
    _proven_until: float = 0.0
    _task: asyncio.Task[None] | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def held(self) -> Mapping[int, int]:
        """The shards this replica holds (and can prove), with their epochs."""
        return dict(self._held) if self.proven() else {}

    def owner_of(self, workspace_id: uuid.UUID) -> str | None:
        """The replica that runs a workspace's agents, as last seen (None: nobody now)."""
        shard = shard_of(workspace_id, self.settings.shard_count)
        if self.holds(shard):
            return self.settings.replica
        owner = self._owners.get(shard)
        return owner if owner != self.settings.replica else None

    def holds(self, shard: int) -> bool:
        """Whether this replica holds `shard` and can prove it."""
        return shard in self._held and self.proven()

    def proven(self) -> bool:
        return self.monotonic() < self._proven_until

    def fence(self, shard: int) -> Fence | None:
        """The fence of a write for `shard`, or None if this replica cannot
        prove it holds the shard."""
        epoch = self._held.get(shard)
        if epoch is None or not self.proven():
            return None
        return Fence(shard, epoch, self.settings.replica)

    def fence_for(self, workspace_id: uuid.UUID) -> Fence:
        shard = shard_of(workspace_id, self.settings.shard_count)
        fence = self.fence(shard)
        if fence is None:
            raise LeaseLost(f"shard {shard} is not held by {self.settings.replica}")
        return fence

    async def start(self) -> None:
        await self.store.prepare(self.settings.shard_count)
        await self.round()
        self._task = asyncio.create_task(self._keep(), name=f"leases {self.settings.replica}")

    async def aclose(self) -> None:
        """Stops renewing, stops the runners of every shard, and releases them
        so that other replicas take them at once instead of after the TTL."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._lose(set(self._held), given_up=True)
        with contextlib.suppress(errors.Unavailable):
            await self.store.leave(self.settings.replica)
            await self._announce()

    def nudge(self) -> None:
        """Runs the next round now (a replica joined or left)."""
        self._wake.set()

    async def round(self) -> None:
        """One renewal, then at most `max_moves` takes and releases."""
        before = dict(self._owners)
        try:
            await self._round()
        finally:
            if self._owners != before:
                self.owners_changed()

    async def _round(self) -> None:
        settings = self.settings
        started = self.monotonic()
        try:
            renewed = await self.store.renew(
                settings.replica, settings.address, settings.ttl_seconds, self.report()
            )
        except errors.Unavailable:
            self.counters.renewal_failures += 1
            raise
        self.counters.renewals += 1
        self._proven_until = started + settings.ttl_seconds - settings.margin_seconds
        last, self._renewed_at = self._renewed_at, started
        # Just started, or back after its leases ran out (the database or
        # this process was away): the other replicas may not have renewed
        # theirs yet either, and shards that only look free would be taken
        # now and handed back at their next round, starting and stopping
        # their agents for nothing.
        returning = last is None or started - last > settings.ttl_seconds
        await self._lose({shard for shard, epoch in self._held.items() if renewed.get(shard) != epoch})
        # Shards the database says are ours that we did not know of (a take
        # whose answer was lost): ours, at the epoch the database has.
        adopted = {shard: epoch for shard, epoch in renewed.items() if shard not in self._held}
        if adopted:
            await self._gain(adopted)

        view = await self.store.view()
        self._owners = dict(view.owners)
        self._replicas = view.replicas
        if returning:
            # Moves from the next round on; meanwhile the others hear of it.
            await self._announce()
            return
        target = target_owners(settings.shard_count, view.replicas, view.owners, load_cap=settings.load_cap)
        moves = moves_for(settings.replica, target, view.owners, max_moves=settings.max_moves)
        release = self._idle_first(moves.release)
        if release:
            # Runners stop before the lease goes, so the next owner never overlaps them.
            await self._lose(set(release), given_up=True)
            await self.store.release(settings.replica, release)
            self.counters.released += len(release)
            for shard in release:
                self._owners.pop(shard, None)
        if release:
            await self._announce()
        if moves.take:
            taken = await self.store.take(settings.replica, moves.take, settings.ttl_seconds)
            self._owners.update(dict.fromkeys(taken, settings.replica))
            self.counters.taken += len(taken)
            if taken:
                # The others learn the new owner now (their calls and wakes for
                # these agents come here at once) and take what is left free
                # for them, rather than at their next renewal.
                await self._announce()
                await self._gain(taken)

    async def _announce(self) -> None:
        others = [r for r in self._replicas if r != self.settings.replica]
        if others:
            try:
                await self.announce(others)
            except Exception as error:
                # Only a shortcut: they see the change at their next round anyway.
                logger.info("telling the other replicas of a lease change failed: %s", error)

    def _idle_first(self, wanted: Collection[int]) -> list[int]:
        """Of the shards to give up, those whose runs would not be cut: a busy
        one waits for its runs to end, `defer_rounds` rounds at most."""
        wanted = set(wanted)
        self._deferred = {shard: n for shard, n in self._deferred.items() if shard in wanted}
        release = []
        for shard in sorted(wanted):
            waited = self._deferred.get(shard, 0)
            if waited < self.defer_rounds and self.busy(shard):
                self._deferred[shard] = waited + 1
            else:
                self._deferred.pop(shard, None)
                release.append(shard)
        return release

    async def _gain(self, shards: Mapping[int, int]) -> None:
        self._held.update(shards)
        try:
            await self.gained(frozenset(shards))
        except BaseException:
            # Their runners did not all start (the database went away while
            # they read their agents, or the round ran out of time). Forgotten
            # here, the shards are adopted again at the next renewal, which
            # finds them still ours in the database, and their start is retried.
            for shard in shards:
                self._held.pop(shard, None)
            raise

    async def _keep(self) -> None:
        settings = self.settings
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), settings.renew_seconds)
            self._wake.clear()
            renewal = asyncio.ensure_future(self.round())
            try:
                await self._await_renewal(renewal)
            except asyncio.CancelledError:
                renewal.cancel()
                await asyncio.wait({renewal})
                raise

    async def _await_renewal(self, renewal: asyncio.Future[None]) -> None:
        left = self._proven_until - self.monotonic()
        # A renewal that cannot finish while the proof lasts is no renewal.
        await asyncio.wait({renewal}, timeout=max(left, 0.001) if self._held else None)
        answered = renewal.done()
        if not answered:
            renewal.cancel()
            logger.warning("lease renewal failed: no answer while the leases could be proven")
        elif isinstance(renewal.exception(), (errors.Unavailable, TimeoutError)):
            logger.warning("lease renewal failed: %s", renewal.exception())
        else:
            renewal.result()  # anything else is a bug: let it out
        if self._held and not self.proven():
            logger.warning("leases of %d shards can no longer be proven; their agents stop", len(self._held))
            await self._lose(set(self._held))
        if not answered:
            # Only now, once the runners are stopped: a statement cancelled on
            # a connection that hears nothing (a network partition) takes
            # seconds to give up, as the driver first tries to close the
            # connection gracefully (SQLAlchemy's asyncpg adapter waits up to
            # 2 s), while the lease runs out in the database.
            await asyncio.wait({renewal})
            if not renewal.cancelled() and (error := renewal.exception()) is not None:
                logger.warning("the abandoned lease renewal ended with %r", error)

    async def _lose(self, shards: set[int], *, given_up: bool = False) -> None:
        shards &= set(self._held)
        if not shards:
            return
        for shard in shards:
            del self._held[shard]
        if not given_up:
            self.counters.lost += len(shards)
        await self.lost(frozenset(shards))
