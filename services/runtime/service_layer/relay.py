"""Agent events across runtime replicas, for WatchAgent and WatchAgents on any of them.

An agent's runner lives in the replica that holds its shard; its watchers
may be anywhere. Each replica hands the events of its agents to an
`EventRelay` (Redis pub/sub, a channel per shard), and follows the shards
its watchers look at. Stored steps come from the database, so the relay
only has to carry what is live, and what it loses (an outage) a watch reads
back from the store (see `watches`).

Across a handoff two replicas publish for one shard: the last owner until it
stops, then the next. Each event carries the epoch of the lease its replica
ran the agent under, and a replica drops an event older than the newest
epoch it has seen of that shard: what a replica frozen past its lease sends
when it wakes is never shown after what its successor sent. A replica that
can no longer prove its lease sends nothing of that shard's runners.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from services.runtime.domain.model import Agent, Emitted
from services.runtime.domain.shards import shard_of
from services.runtime.service_layer.hub import AgentHub
from services.runtime.service_layer.leases import Fence

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Relayed:
    """An event as it travels between replicas."""

    origin: str
    shard: int
    # The lease epoch the agent ran under at `origin`; 0 for an event of a
    # call that replica answered for an agent it does not run (a task
    # submitted there): such events are never stale.
    epoch: int
    emitted: Emitted


Deliver = Callable[[Relayed], None]


class EventRelay(abc.ABC):
    """Events between replicas, by shard."""

    @abc.abstractmethod
    def serve(self, deliver: Deliver) -> None:
        """Hands every event of a followed shard (this replica's own included) to `deliver`."""

    @abc.abstractmethod
    def send(self, relayed: Relayed) -> None:
        """Sends in the background, in order; never waits. What cannot be
        sent (the relay is down) is dropped: watchers read the store."""

    @abc.abstractmethod
    async def follow(self, shard: int) -> None:
        """Starts receiving `shard`'s events (counted: as many `unfollow`s
        end it); returns once they come, or at once while the relay is down."""

    @abc.abstractmethod
    def unfollow(self, shard: int) -> None:
        """Undoes one `follow` (at once; the relay stops receiving in the background)."""

    async def start(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Connects."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Disconnects. Idempotent."""


class RelayedHub(AgentHub):
    """An `AgentHub` whose events reach the watchers of every replica.

    Args:
        relay: the relay between replicas.
        replica: this replica's id.
        shard_count: how many shards the agents are spread over.
        fence: the fence of a shard this replica can prove it holds, else None.
        live: the agent whose runner is in this replica, else None.
    """

    def __init__(
        self,
        relay: EventRelay,
        *,
        replica: str,
        shard_count: int,
        fence: Callable[[int], Fence | None],
        live: Callable[[uuid.UUID], Agent | None],
        max_backlog: int = 10_000,
    ) -> None:
        super().__init__(max_backlog=max_backlog)
        self._relay = relay
        self._replica = replica
        self._shard_count = shard_count
        self._fence = fence
        self._live = live
        self._newest: dict[int, int] = {}
        self._following: Counter[int] = Counter()
        self._remote: dict[uuid.UUID, int] = {}  # agents seen from other replicas -> shard
        self.stale_dropped = 0
        self.unrelayed = 0
        relay.serve(self._delivered)

    def publish(
        self, emitted: Emitted, *, workspace_id: uuid.UUID | None = None, from_runner: bool = False
    ) -> None:
        self._fan_out(emitted)
        agent = self._live(emitted.agent_id)
        workspace = workspace_id or (agent.workspace_id if agent is not None else None)
        if workspace is None:
            self.unrelayed += 1
            return
        shard = shard_of(workspace, self._shard_count)
        epoch = 0
        # A runner's event (also one said as it stops, its shard gone) is
        # only as good as the lease it runs under.
        if from_runner or agent is not None:
            fence = self._fence(shard)
            if fence is None:
                # A runner of a shard this replica cannot prove it holds: its
                # events may already be stale; the watchers of the others
                # learn from the next owner (and from the store).
                self.unrelayed += 1
                return
            epoch = fence.epoch
            self._newest[shard] = max(self._newest.get(shard, 0), epoch)
        self._relay.send(Relayed(self._replica, shard, epoch, emitted))

    def _delivered(self, relayed: Relayed) -> None:
        if relayed.origin == self._replica:
            return  # its watchers had it as it happened
        shard = relayed.shard
        if relayed.epoch:
            if relayed.epoch < self._newest.get(shard, 0):
                self.stale_dropped += 1
                return
            self._newest[shard] = relayed.epoch
        self._remote[relayed.emitted.agent_id] = shard
        self._fan_out(relayed.emitted)

    @contextlib.asynccontextmanager
    async def following(self, workspace_ids: Iterable[uuid.UUID]) -> AsyncIterator[None]:
        shards = sorted({shard_of(w, self._shard_count) for w in workspace_ids})
        followed: list[int] = []
        try:
            for shard in shards:
                self._following[shard] += 1
                followed.append(shard)
                await self._relay.follow(shard)
            yield
        finally:
            for shard in followed:
                self._following[shard] -= 1
                if self._following[shard] <= 0:
                    del self._following[shard]
                    self._forget_remote(shard)
                self._relay.unfollow(shard)

    def _forget_remote(self, shard: int) -> None:
        """A step of another replica's agent seen in flight here stays so only
        while its shard is followed: unfollowed, its end would never come."""
        for agent_id in [a for a, s in self._remote.items() if s == shard]:
            del self._remote[agent_id]
            if self._live(agent_id) is None:
                self._in_flight.pop(agent_id, None)
