"""Live agent events for watchers, in this process.

Completed steps are in the store; the hub carries what is live (run and
state changes, step starts, deltas, completions) and remembers each agent's
step in flight, so that a watcher joining mid-step can be given what it
missed of it before the live deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import cast

from services.runtime.domain.errors import HubClosed, WatcherFellBehind
from services.runtime.domain.model import (
    Emitted,
    RunEnded,
    StepAborted,
    StepCompleted,
    StepDelta,
    StepStarted,
    merge_deltas,
)


@dataclass(slots=True)
class InFlight:
    """The step an agent is streaming: its start and the deltas so far."""

    started: Emitted
    deltas: list[Emitted] = field(default_factory=list)


_CLOSED = object()

# A watcher with more events than this waiting is behind: what waits is
# compacted as it is sent (a step's deltas dropped when its completion waits too).
COMPACT_FROM = 64


class Watcher:
    """One watcher's backlog of live events; bounded so a stuck reader cannot grow it forever.

    A watch is sent one message at a time (one per turn of the event loop),
    while a hundred busy runners publish many events per turn: a watcher can
    fall behind although its client reads promptly. What waits goes out with
    each step's deltas joined; once more than `COMPACT_FROM` events wait (and
    before the backlog would overflow) it is compacted (`compacted`): the
    deltas of a step whose completion waits too are dropped (the completed
    step carries the whole of them). Every other event stays, in order. So a
    watcher that keeps up sees every step stream in, and one that cannot is
    not cut off.
    """

    def __init__(self, hub: AgentHub, agent_ids: frozenset[uuid.UUID] | None, max_backlog: int) -> None:
        self._hub = hub
        self.agent_ids = agent_ids
        self._max_backlog = max_backlog
        self._backlog: deque[object] = deque()
        self._ready = asyncio.Event()
        self.overflowed = False
        self._closed = False

    def wants(self, agent_id: uuid.UUID) -> bool:
        return self.agent_ids is None or agent_id in self.agent_ids

    def put(self, item: object) -> None:
        if self._closed:
            return  # nothing may follow the end of the backlog
        self._backlog.append(item)
        self._ready.set()
        if len(self._backlog) <= self._max_backlog:
            return
        self._backlog = deque(compacted(cast(list[Emitted], list(self._backlog))))
        # Still mostly full: compacting again at every event would cost more and more.
        if len(self._backlog) > self._max_backlog * 3 // 4:
            # Too slow: end this watch at once (what is queued is dropped); the
            # client watches again and reads what it missed.
            self.overflowed = True
            self._backlog.clear()
            self.close()
            self._hub.unwatch(self)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._backlog.append(_CLOSED)
        self._ready.set()

    async def events(self) -> AsyncGenerator[Emitted, None]:
        """Live events until the hub closes.

        Raises:
            WatcherFellBehind: the backlog overflowed.
            HubClosed: the hub closed (the runtime is shutting down).
        """
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                # What queued up while the last event was being sent goes out
                # merged: a watcher slower than the model gets fewer, longer
                # deltas; far behind, none of a step whose completion it gets too.
                waiting = list(self._backlog)
                self._backlog.clear()
                closed = bool(waiting) and waiting[-1] is _CLOSED
                if closed:
                    waiting.pop()
                send = compacted if len(waiting) > COMPACT_FROM else merge_deltas
                for emitted in send(cast(list[Emitted], waiting)):
                    yield emitted
                if closed:
                    if self.overflowed:
                        raise WatcherFellBehind(
                            f"this watch fell more than {self._max_backlog} events behind and was ended;"
                            " watch again, and read what changed meanwhile (WatchAgent resumes with"
                            " after_sequence set to the last step received; ListTasks has the tasks)"
                        )
                    raise HubClosed(
                        "the runtime is shutting down; watch again (another replica, or this one once it"
                        " is back, will answer)"
                    )
        finally:
            self._hub.unwatch(self)


def compacted(backlog: list[Emitted]) -> list[Emitted]:
    """A backlog with fewer events and the same outcome for its reader: the
    deltas of a step whose completion follows are dropped, and each agent's
    deltas of one step joined until another event of that agent comes."""
    completed = {(e.agent_id, e.event.step.sequence) for e in backlog if isinstance(e.event, StepCompleted)}
    kept: list[Emitted] = []
    joining: dict[uuid.UUID, int] = {}  # agent -> index in `kept` of its delta being joined
    for emitted in backlog:
        event = emitted.event
        if not isinstance(event, StepDelta):
            joining.pop(emitted.agent_id, None)  # its later deltas must not move before this
            kept.append(emitted)
            continue
        if (emitted.agent_id, event.sequence) in completed:
            continue
        at = joining.get(emitted.agent_id)
        if at is not None:
            joined = merge_deltas([kept[at], emitted])
            if len(joined) == 1:
                kept[at] = joined[0]
                continue
        joining[emitted.agent_id] = len(kept)
        kept.append(emitted)
    return kept


class AgentHub:
    """Fans agent events out to watchers; remembers steps in flight."""

    def __init__(self, *, max_backlog: int = 10_000) -> None:
        self._watchers: set[Watcher] = set()
        self._in_flight: dict[uuid.UUID, InFlight] = {}
        self._max_backlog = max_backlog
        self._closed = False

    def publish(
        self, emitted: Emitted, *, workspace_id: uuid.UUID | None = None, from_runner: bool = False
    ) -> None:
        """Tells the watchers of an event of this process. `workspace_id` is
        the agent's, for the replicas that may watch it elsewhere, and
        `from_runner` says its runner sent it (see `relay.RelayedHub`);
        where the workspace is not given and the agent's runner is not here,
        the event stays in this process."""
        self._fan_out(emitted)

    @contextlib.asynccontextmanager
    async def following(self, workspace_ids: Iterable[uuid.UUID]) -> AsyncIterator[None]:
        """While open, the events of these workspaces' agents that happen in
        other processes come to this hub's watchers too (when it opens, from
        then on). One process runs every agent here: nothing to follow."""
        yield

    def _fan_out(self, emitted: Emitted) -> None:
        event = emitted.event
        if isinstance(event, StepStarted):
            self._in_flight[emitted.agent_id] = InFlight(emitted)
        elif isinstance(event, StepDelta):
            flight = self._in_flight.get(emitted.agent_id)
            if flight is not None:
                flight.deltas.append(emitted)
        elif isinstance(event, StepCompleted | StepAborted | RunEnded):
            self._in_flight.pop(emitted.agent_id, None)
        for watcher in list(self._watchers):
            if watcher.wants(emitted.agent_id):
                watcher.put(emitted)

    def watch(self, agent_ids: Iterable[uuid.UUID] | None) -> tuple[Watcher, list[InFlight]]:
        """Starts a watch; returns it with the steps in flight at this moment.

        Both are taken at once, so the watcher's queue holds exactly what
        happens after the in-flight snapshot.

        Raises:
            HubClosed: the hub is closed.
        """
        if self._closed:
            raise HubClosed("the runtime is shutting down; watch again (another replica will answer)")
        wanted = frozenset(agent_ids) if agent_ids is not None else None
        watcher = Watcher(self, wanted, self._max_backlog)
        self._watchers.add(watcher)
        flights = [
            InFlight(f.started, list(f.deltas))
            for agent_id, f in self._in_flight.items()
            if watcher.wants(agent_id)
        ]
        return watcher, flights

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def close(self) -> None:
        """Ends every watch with `HubClosed` and refuses new ones (shutdown). Idempotent."""
        self._closed = True
        for watcher in self._watchers:
            watcher.close()
        self._watchers.clear()
