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
import dataclasses
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from services.common.identity import Caller
from services.runtime.domain.errors import NotAllowed
from services.runtime.service_layer.access import AgentAccess
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

    def as_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, replica: str, text: str) -> ReplicaStatus:
        """A replica's report as stored; what it does not say (an older
        replica, or none yet) is zero."""
        try:
            fields = json.loads(text) if text else {}
        except ValueError:
            fields = {}
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = dict.fromkeys(known, 0)
        values |= {"leases_proven": False, "link_degraded": False}
        if isinstance(fields, dict):
            values |= {name: value for name, value in fields.items() if name in known}
        values["replica"] = replica
        return cls(**values)

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


@dataclass(frozen=True, slots=True)
class ListedReplica:
    status: ReplicaStatus
    address: str
    started_at: datetime | None
    reported_at: datetime | None
    answering: bool


class ReplicaViews:
    """ListReplicas: every live replica as it last reported itself (from the
    database, so any replica answers), this one as it is now."""

    def __init__(
        self,
        *,
        access: AgentAccess,
        supervisor: Supervisor | None,
        keeper: LeaseKeeper | None,
        monitor: ReplicaMonitor | None,
    ) -> None:
        self._access = access
        self._supervisor = supervisor
        self._keeper = keeper
        self._monitor = monitor

    async def list(self, principal: Caller | None) -> list[ListedReplica]:
        viewer = self._access.viewer(principal)
        if not viewer.privileged:
            raise NotAllowed("only the workspace's owners and admins see the runtime's replicas")
        if self._keeper is None or self._monitor is None:
            return [self._alone()]
        me = self._keeper.settings.replica
        listed = []
        for row in await self._keeper.store.live_replicas():
            answering = row.replica == me
            status = self._monitor.status() if answering else ReplicaStatus.from_json(row.replica, row.report)
            listed.append(
                ListedReplica(status, row.address, _time(row.started_at), _time(row.reported_at), answering)
            )
        return listed

    def _alone(self) -> ListedReplica:
        supervisor = self._supervisor
        agents = supervisor.agent_count if supervisor is not None else 0
        runs = supervisor.runs_in_flight if supervisor is not None else 0
        status = ReplicaStatus("", 0, agents, runs, False, False, 0, 0, 0, 0, 0, 0)
        return ListedReplica(status, "", None, None, answering=True)


def _time(seconds: float) -> datetime | None:
    return datetime.fromtimestamp(seconds, UTC) if seconds > 0 else None
