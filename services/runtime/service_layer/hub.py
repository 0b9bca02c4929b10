"""Live agent events for watchers, in this process.

Completed steps are in the store; the hub carries what is live (run and
state changes, step starts, deltas, completions) and remembers each agent's
step in flight, so that a watcher joining mid-step can be given what it
missed of it before the live deltas.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from typing import cast

from services.runtime.domain.errors import HubClosed, WatcherFellBehind
from services.runtime.domain.model import (
    Emitted,
    RunEnded,
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


class Watcher:
    """One watcher's queue of live events; bounded so a stuck reader cannot grow it forever."""

    def __init__(self, hub: AgentHub, agent_ids: frozenset[uuid.UUID] | None, max_backlog: int) -> None:
        self._hub = hub
        self.agent_ids = agent_ids
        self._queue: asyncio.Queue[object] = asyncio.Queue(maxsize=max_backlog)
        self.overflowed = False
        self._closed = False

    def wants(self, agent_id: uuid.UUID) -> bool:
        return self.agent_ids is None or agent_id in self.agent_ids

    def put(self, item: object) -> None:
        if self._closed:
            return  # nothing may follow the end of the queue
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            # Too slow: end this watch at once (what is queued is dropped); the
            # client resumes from its last completed step.
            self.overflowed = True
            while not self._queue.empty():
                self._queue.get_nowait()
            self.close()
            self._hub.unwatch(self)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                self._queue.put_nowait(_CLOSED)
                return
            except asyncio.QueueFull:
                self._queue.get_nowait()

    async def events(self) -> AsyncGenerator[Emitted, None]:
        """Live events until the hub closes.

        Raises:
            WatcherFellBehind: the queue overflowed.
            HubClosed: the hub closed (the runtime is shutting down).
        """
        try:
            while True:
                waiting = [await self._queue.get()]
                # What queued up while the last event was being sent goes out
                # merged: a watcher slower than the model gets fewer, longer deltas.
                while not self._queue.empty():
                    waiting.append(self._queue.get_nowait())
                closed = waiting[-1] is _CLOSED
                if closed:
                    waiting.pop()
                for emitted in merge_deltas(cast(list[Emitted], waiting)):
                    yield emitted
                if closed:
                    if self.overflowed:
                        raise WatcherFellBehind(
                            f"this watch fell more than {self._queue.maxsize} events behind and was ended;"
                            " watch again with after_sequence set to the last step received"
                        )
                    raise HubClosed(
                        "the runtime is shutting down; watch again (another replica, or this one once it"
                        " is back, will answer)"
                    )
        finally:
            self._hub.unwatch(self)


class AgentHub:
    """Fans agent events out to watchers; remembers steps in flight."""

    def __init__(self, *, max_backlog: int = 10_000) -> None:
        self._watchers: set[Watcher] = set()
        self._in_flight: dict[uuid.UUID, InFlight] = {}
        self._max_backlog = max_backlog
        self._closed = False

    def publish(self, emitted: Emitted) -> None:
        event = emitted.event
        if isinstance(event, StepStarted):
            self._in_flight[emitted.agent_id] = InFlight(emitted)
        elif isinstance(event, StepDelta):
            flight = self._in_flight.get(emitted.agent_id)
            if flight is not None:
                flight.deltas.append(emitted)
        elif isinstance(event, StepCompleted | RunEnded):
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
