"""What one runtime replica, among several, runs now and how its leases fare.

`ReplicaStatus` is a snapshot read from the replica's own parts (no I/O):
the shards its `LeaseKeeper` holds and the keeper's counters, the agents its
`Supervisor` runs and their runs in flight, whether its `ReplicaLink` may be
losing messages, and how many of its writes its store refused as fenced.
`ReplicaMonitor` gives it on demand (tests, and whatever exposes it next)
and logs it at INFO once a minute, which is where an operator sees it until
the project has a metrics endpoint; the health service reports the two parts
that can fail (`leases`, `replicas`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from services.runtime.service_layer.leases import LeaseKeeper
from services.runtime.service_layer.replicas import ReplicaLink
from services.runtime.service_layer.store import AgentStore
from services.runtime.service_layer.supervisor import Supervisor

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One replica's shards, agents and runs, and its leases' counters since it started."""

    replica: str
    # Shards it holds and can prove now.
    shards: int
    # Agents whose runner runs here, and how many of them are in a run.
    agents: int
    runs_in_flight: int
    # Whether its last lease renewal reached the database recently enough to
    # prove what it holds (see `LeaseKeeper.proven`).
    leases_proven: bool
    # Whether messages from the other replicas may be lost now (Redis is away).
    link_degraded: bool
    renewals: int
    renewal_failures: int
    shards_taken: int
    shards_released: int
    # Shards whose lease was lost (expired, taken, or unprovable), not given up.
    shards_lost: int
    # Writes of this replica's runners refused as their lease was gone (none stored).
    refused_fenced_writes: int

    def summary(self) -> str:
        """The status as one log line."""
        return (
            f"replica {self.replica}: {self.shards} shards, {self.agents} agents, "
            f"{self.runs_in_flight} runs in flight; "
            f"leases {'proven' if self.leases_proven else 'NOT PROVEN'}, "
            f"link {'DEGRADED' if self.link_degraded else 'up'}; "
            f"renewals {self.renewals} (failed {self.renewal_failures}), "
            f"shards taken {self.shards_taken}, released {self.shards_released}, lost {self.shards_lost}; "
            f"fenced writes refused {self.refused_fenced_writes}"
        )


class ReplicaMonitor:
    """This replica's `ReplicaStatus`, on demand and logged every `log_seconds`.

    `start` begins the log (the first line after `log_seconds`); `aclose`
    ends it. Idempotent.
    """

    def __init__(
        self,
        keeper: LeaseKeeper,
        supervisor: Supervisor,
        link: ReplicaLink,
        store: AgentStore,
        *,
        log_seconds: float = 60.0,
    ) -> None:
        self._keeper = keeper
        self._supervisor = supervisor
        self._link = link
        self._store = store
        self._log_seconds = log_seconds
        self._task: asyncio.Task[None] | None = None

    def status(self) -> ReplicaStatus:
        counters = self._keeper.counters
        return ReplicaStatus(
            replica=self._keeper.settings.replica,
            shards=len(self._keeper.held),
            agents=self._supervisor.agent_count,
            runs_in_flight=self._supervisor.runs_in_flight,
            leases_proven=self._keeper.proven(),
            link_degraded=self._link.degraded,
            renewals=counters.renewals,
            renewal_failures=counters.renewal_failures,
            shards_taken=counters.taken,
            shards_released=counters.released,
            shards_lost=counters.lost,
            refused_fenced_writes=self._store.refused_fenced_writes,
        )

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._log(), name=f"status {self._keeper.settings.replica}")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _log(self) -> None:
        while True:
            # A timer, not a wait for work: the line is due whether or not anything changed.
            await asyncio.sleep(self._log_seconds)
            logger.info("%s", self.status().summary())
