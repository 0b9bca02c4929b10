"""An in-memory lease table with a clock the test moves."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from services.common import errors
from services.runtime.service_layer.leases import LeaseStore, LeaseView, ReplicaReport
from services.runtime.service_layer.relay import Deliver, EventRelay, Relayed


@dataclass
class Clock:
    now: float = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Row:
    owner: str | None = None
    epoch: int = 0
    expires_at: float = 0.0


@dataclass
class InMemoryLeases(LeaseStore):
    clock: Clock
    rows: dict[int, Row] = field(default_factory=dict)
    replicas: dict[str, float] = field(default_factory=dict)
    reports: dict[str, ReplicaReport] = field(default_factory=dict)
    down: bool = False

    def _check(self) -> None:
        if self.down:
            raise errors.Unavailable("the database is down")

    async def prepare(self, shard_count: int) -> None:
        self._check()
        for shard in range(shard_count):
            self.rows.setdefault(shard, Row())

    async def renew(self, replica: str, address: str, ttl_seconds: float, report: str = "") -> dict[int, int]:
        self._check()
        self.replicas[replica] = self.clock.now + ttl_seconds
        earlier = self.reports.get(replica)
        started = earlier.started_at if earlier is not None else self.clock.now
        self.reports[replica] = ReplicaReport(replica, address, started, self.clock.now, report)
        held = {}
        for shard, row in self.rows.items():
            if row.owner == replica:
                row.expires_at = self.clock.now + ttl_seconds
                held[shard] = row.epoch
        return held

    async def live_replicas(self) -> list[ReplicaReport]:
        self._check()
        now = self.clock.now
        return [
            self.reports[r] for r, until in sorted(self.replicas.items()) if until > now and r in self.reports
        ]

    async def view(self) -> LeaseView:
        self._check()
        now = self.clock.now
        return LeaseView(
            replicas=tuple(sorted(r for r, until in self.replicas.items() if until > now)),
            owners={
                s: row.owner for s, row in self.rows.items() if row.owner is not None and row.expires_at > now
            },
            now=now,
        )

    async def take(self, replica: str, shards: Collection[int], ttl_seconds: float) -> dict[int, int]:
        self._check()
        taken = {}
        for shard in shards:
            row = self.rows[shard]
            if row.owner is None or row.expires_at <= self.clock.now:
                row.owner, row.epoch, row.expires_at = replica, row.epoch + 1, self.clock.now + ttl_seconds
                taken[shard] = row.epoch
        return taken

    async def release(self, replica: str, shards: Collection[int]) -> None:
        self._check()
        for shard in shards:
            row = self.rows[shard]
            if row.owner == replica:
                row.owner, row.epoch, row.expires_at = None, row.epoch + 1, self.clock.now

    async def leave(self, replica: str) -> None:
        await self.release(replica, [s for s, row in self.rows.items() if row.owner == replica])
        self.replicas.pop(replica, None)


class LoopbackRelays:
    """Replicas' `EventRelay`s in one process: what one sends reaches, at
    once and in order, every relay following the shard (its sender too, as
    Redis does). `losing` drops what matches it, as an outage would."""

    def __init__(self) -> None:
        self.relays: list[LoopbackRelay] = []
        self.losing: Callable[[Relayed], bool] = lambda _: False

    def relay(self) -> LoopbackRelay:
        relay = LoopbackRelay(self)
        self.relays.append(relay)
        return relay

    def carry(self, relayed: Relayed) -> None:
        if self.losing(relayed):
            return
        for relay in self.relays:
            if relay.following[relayed.shard] > 0:
                relay.deliver(relayed)


class LoopbackRelay(EventRelay):
    def __init__(self, relays: LoopbackRelays) -> None:
        self._relays = relays
        self.deliver: Deliver = lambda _: None
        self.following: Counter[int] = Counter()
        self.sent: list[Relayed] = []

    def serve(self, deliver: Deliver) -> None:
        self.deliver = deliver

    def send(self, relayed: Relayed) -> None:
        self.sent.append(relayed)
        self._relays.carry(relayed)

    async def follow(self, shard: int) -> None:
        self.following[shard] += 1

    def unfollow(self, shard: int) -> None:
        self.following[shard] -= 1
