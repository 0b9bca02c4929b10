"""Live event delivery: the database is the truth, signals only wake readers.

Per process there is one `EventHub`. For each workspace somebody watches it
keeps one tail that, when signalled, reads the new events from the database
once and hands them to every local subscription. A subscription that starts
from an older cursor (or falls too far behind) reads the missed range from
the database itself, then continues from the tail, with no gap and no
duplicate: sequence numbers are gap-free and in commit order, so "everything
up to N" is a well-defined, final set.

The handlers of this process also `offer` the events they have just
committed, before signalling them: when they follow on from the tail's last
event, the tail hands them out as they are and the signal that follows
finds nothing to read. Anything else (a gap, a signal from another replica,
a read in progress) leaves it to the signal to make the tail read from the
database, which stays the truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncGenerator, Iterable, Sequence
from dataclasses import dataclass

from services.common.identity import Caller
from services.im.domain import rules
from services.im.domain.errors import InvalidRequest, NotAllowed, NotFound, ShuttingDown, Unauthenticated
from services.im.domain.model import (
    GroupChanged,
    MessageCreated,
    MessageEdited,
    ReadUpdated,
    RecordedEvent,
)
from services.im.service_layer.ports import EventLog, EventSignal, TransactionalEventLog, UnitOfWorkFactory

logger = logging.getLogger(__name__)

_CLOSED = object()
_OVERFLOWED = object()


class EventHub:
    """Fans committed events out to this process's subscribers.

    Args:
        signal: the wake-up channel; the hub connects itself to it.
        log: where to read events from.
        uow: transactions to read events with, when no `log` is given.
        batch_size: events read per query.
        max_backlog: events a subscriber may have waiting before it is
            switched to reading from the database (so a slow reader costs
            memory only up to this bound and still loses nothing).
    """

    def __init__(
        self,
        *,
        signal: EventSignal,
        log: EventLog | None = None,
        uow: UnitOfWorkFactory | None = None,
        batch_size: int = 500,
        max_backlog: int = 10_000,
    ) -> None:
        if log is None:
            if uow is None:
                raise ValueError("EventHub needs an event log or a unit of work to read events with")
            log = TransactionalEventLog(uow)
        self._log = log
        self.batch_size = batch_size
        self._max_backlog = max_backlog
        self._tails: dict[uuid.UUID, _Tail] = {}
        self._tail_lock = asyncio.Lock()
        self._closed = False
        signal.connect(self.on_signal)

    def on_signal(self, workspace_id: uuid.UUID | None, sequence: int) -> None:
        """A workspace (or, for None, possibly every workspace) has new events."""
        if workspace_id is None:
            for each in self._tails.values():
                each.look()
            return
        tail = self._tails.get(workspace_id)
        if tail is not None and sequence > tail.last_sequence:
            tail.signalled(sequence)

    def offer(self, events: Sequence[RecordedEvent]) -> None:
        """Events this process has just committed, in sequence order, not yet signalled.

        Handed out at once if they follow on from what the workspace's tail
        has handed out; otherwise ignored, and the signal that must follow
        makes the tail read them.
        """
        if events:
            tail = self._tails.get(events[0].workspace_id)
            if tail is not None:
                tail.offer(events)

    async def read(self, workspace_id: uuid.UUID, *, after: int, up_to: int | None) -> list[RecordedEvent]:
        return await self._log.read(workspace_id, after=after, up_to=up_to, limit=self.batch_size)

    async def last_sequence(self, workspace_id: uuid.UUID) -> int:
        return await self._log.last_sequence(workspace_id)

    async def subscribe(self, workspace_id: uuid.UUID, *, after: int | None) -> Subscription:
        """Subscribes to a workspace's events after sequence `after` (None: from now)."""
        async with self._tail_lock:
            tail = self._tails.get(workspace_id)
            if tail is None:
                last = await self.last_sequence(workspace_id)
                if self._closed:
                    raise ShuttingDown(
                        "the IM service is shutting down; watch again (another replica, or this one"
                        " once it is back, will answer)"
                    )
                tail = _Tail(self, workspace_id, last)
                self._tails[workspace_id] = tail
        start = tail.last_sequence if after is None else after
        subscription = Subscription(self, tail, delivered=start, catch_up=start < tail.last_sequence)
        tail.subscribers.add(subscription)
        # The tail may lag behind the database (a signal in flight); let it look.
        tail.look()
        return subscription

    def _unsubscribe(self, subscription: Subscription) -> None:
        tail = subscription.tail
        tail.subscribers.discard(subscription)
        if not tail.subscribers and self._tails.get(tail.workspace_id) is tail:
            del self._tails[tail.workspace_id]
            tail.stop()

    async def aclose(self) -> None:
        """Ends every subscription (with `ShuttingDown`) and stops every tail. Idempotent."""
        self._closed = True
        tails = list(self._tails.values())
        self._tails.clear()
        for tail in tails:
            for subscription in list(tail.subscribers):
                subscription.close()
            tail.stop()
        for tail in tails:
            await tail.wait_stopped()


class _Tail:
    """Reads one workspace's new events once per wake-up, for all subscribers."""

    def __init__(self, hub: EventHub, workspace_id: uuid.UUID, last_sequence: int) -> None:
        self.hub = hub
        self.workspace_id = workspace_id
        # The last event handed to the subscribers.
        self.last_sequence = last_sequence
        self.subscribers: set[Subscription] = set()
        self.wake = asyncio.Event()
        # The newest sequence signalled, and whether to read even if it is handed out.
        self._signalled = last_sequence
        self._must_read = False
        self._reading = False
        self._task = asyncio.create_task(self._run(), name=f"im-event-tail-{workspace_id}")

    def look(self) -> None:
        """Reads whatever the database has beyond the last event, soon."""
        self._must_read = True
        self.wake.set()

    def signalled(self, sequence: int) -> None:
        """Events up to `sequence` are committed."""
        self._signalled = max(self._signalled, sequence)
        self.wake.set()

    def offer(self, events: Sequence[RecordedEvent]) -> None:
        """Hands out committed events if they follow on from the last one (see `EventHub.offer`)."""
        # While a read is in flight its answer may hold them too: leave them to the signal.
        if (
            not self._reading
            and events[0].sequence == self.last_sequence + 1
            and all(b.sequence == a.sequence + 1 for a, b in itertools.pairwise(events))
        ):
            self._hand_out(list(events))

    def _hand_out(self, batch: list[RecordedEvent]) -> None:
        self.last_sequence = batch[-1].sequence
        for subscription in list(self.subscribers):
            subscription.push(batch)

    async def _run(self) -> None:
        failures = 0
        while True:
            await self.wake.wait()
            self.wake.clear()
            if not self._must_read and self._signalled <= self.last_sequence:
                continue  # handed out already
            self._must_read = False
            self._reading = True
            try:
                while True:
                    batch = await self.hub.read(self.workspace_id, after=self.last_sequence, up_to=None)
                    if not batch:
                        break
                    self._hand_out(batch)
                    if len(batch) < self.hub.batch_size:
                        break  # a short batch is the end: no need to ask again
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception:
                failures += 1
                delay = min(30.0, 0.1 * 2**failures)
                logger.warning(
                    "reading events of workspace %s failed; again in %.1fs",
                    self.workspace_id,
                    delay,
                    exc_info=True,
                )
                self._reading = False
                await asyncio.sleep(delay)
                self.look()
            finally:
                self._reading = False

    def stop(self) -> None:
        self._task.cancel()

    async def wait_stopped(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class Subscription:
    """One subscriber's ordered view of a workspace's events."""

    def __init__(self, hub: EventHub, tail: _Tail, *, delivered: int, catch_up: bool) -> None:
        self.hub = hub
        self.tail = tail
        self.delivered = delivered
        self._catch_up = catch_up
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._backlog = 0
        self._closed = False
        self._subscribed = True

    def push(self, batch: list[RecordedEvent]) -> None:
        if self._catch_up:
            return  # it will read this range from the database
        self._backlog += len(batch)
        if self._backlog > self.hub._max_backlog:
            self._drop_backlog()
            self._catch_up = True
            self._queue.put_nowait(_OVERFLOWED)
            return
        self._queue.put_nowait(batch)

    def _drop_backlog(self) -> None:
        # Empty the queue in place: the reader may be waiting on this very queue.
        while not self._queue.empty():
            self._queue.get_nowait()
        self._backlog = 0
        if self._closed:
            self._queue.put_nowait(_CLOSED)

    def close(self) -> None:
        self._closed = True
        self._queue.put_nowait(_CLOSED)

    def unsubscribe(self) -> None:
        """Stops receiving events. Idempotent."""
        if self._subscribed:
            self._subscribed = False
            self.hub._unsubscribe(self)

    async def events(self) -> AsyncGenerator[RecordedEvent, None]:
        """Yields events in sequence order; unsubscribes at the end.

        Raises:
            ShuttingDown: the hub closed (its message says where to resume).
        """
        try:
            while True:
                if self._catch_up:
                    # From here on the tail queues what comes after `target`.
                    target = self.tail.last_sequence
                    self._catch_up = False
                    self._drop_backlog()
                    while self.delivered < target and not self._closed:
                        batch = await self.hub.read(
                            self.tail.workspace_id, after=self.delivered, up_to=target
                        )
                        if not batch:
                            break
                        for recorded in batch:
                            self.delivered = recorded.sequence
                            yield recorded
                item = await self._queue.get()
                if item is _CLOSED:
                    # Only the hub closes: the service is stopping. The client
                    # resumes elsewhere from the last event of this stream.
                    raise ShuttingDown(
                        "the IM service is shutting down; watch again with"
                        f" after_cursor={self.delivered} to resume with nothing missed"
                    )
                if item is _OVERFLOWED:
                    continue
                assert isinstance(item, list)
                self._backlog -= len(item)
                for recorded in item:
                    if recorded.sequence <= self.delivered:
                        continue
                    self.delivered = recorded.sequence
                    yield recorded
        finally:
            self.unsubscribe()


@dataclass(frozen=True, slots=True)
class Delivery:
    """An event for a watcher, with the watched members it concerns."""

    recorded: RecordedEvent
    member_ids: tuple[uuid.UUID, ...]
    # The sequence of the event delivered before it on the same watch (or
    # the watch's start): a client that saw another missed something.
    previous_sequence: int = 0


class MemberFilter:
    """Decides which watched members an event concerns, tracking their groups."""

    def __init__(self, groups_by_member: dict[uuid.UUID, set[uuid.UUID]]) -> None:
        self._groups = groups_by_member

    def concerned(self, recorded: RecordedEvent) -> tuple[uuid.UUID, ...]:
        event = recorded.event
        match event:
            case ReadUpdated(read_state=state):
                return (state.member_id,) if state.member_id in self._groups else ()
            case GroupChanged(group=group):
                found = []
                for member_id, groups in self._groups.items():
                    if member_id in group.member_ids:
                        groups.add(group.id)
                        found.append(member_id)
                    elif group.id in groups or member_id in event.removed_member_ids:
                        # It concerns the member one last time: it has left.
                        groups.discard(group.id)
                        found.append(member_id)
                return tuple(found)
            case MessageCreated(message=m) | MessageEdited(message=m):
                return tuple(member for member, groups in self._groups.items() if m.group_id in groups)
        return ()


class EventFeed:
    """The WatchEvents use case: who may watch what, and the filtered stream."""

    def __init__(self, *, uow: UnitOfWorkFactory, hub: EventHub) -> None:
        self._uow = uow
        self._hub = hub

    async def watch(
        self,
        caller: Caller | None,
        *,
        member_ids: Iterable[str],
        workspace_id: str,
        after_cursor: str,
    ) -> Watch:
        """Checks the request and subscribes; the caller must `aclose()` the result."""
        watched = rules.parse_ids(member_ids, "member_ids")
        wanted_workspace = rules.parse_optional_id(workspace_id, "workspace_id")
        after = parse_cursor(after_cursor)
        is_service = caller is not None and caller.is_service
        from_now = after is None
        async with self._uow(write=False) as tx:
            if caller is None:
                raise Unauthenticated("this call needs the caller: authorization: Bearer <access token>")
            if wanted_workspace is not None:
                if not is_service:
                    raise NotAllowed("only a trusted service may watch a whole workspace")
                if watched:
                    raise InvalidRequest("set member_ids or workspace_id, not both")
                if await tx.get_workspace(wanted_workspace) is None:
                    raise NotFound(f"workspace {wanted_workspace} not found")
                workspace = wanted_workspace
                member_filter: MemberFilter | None = None
            else:
                if not watched:
                    if caller.member_id is None:
                        raise InvalidRequest("name member_ids or workspace_id to watch")
                    watched = (caller.member_id,)
                if not is_service and watched != (caller.member_id,):
                    raise NotAllowed("a member may only watch its own events")
                found = await tx.get_members(list(watched))
                missing = [m for m in watched if m not in found]
                if missing and not is_service:
                    raise Unauthenticated(f"member {missing[0]} does not exist")
                if missing:
                    raise NotFound(f"member {missing[0]} not found")
                workspaces = {m.workspace_id for m in found.values()}
                if len(workspaces) != 1:
                    raise InvalidRequest("watched members must belong to one workspace")
                workspace = workspaces.pop()
                if after is None:
                    # "From now" is a fixed sequence number taken before the
                    # memberships are read: a group created between the two
                    # reads is then replayed, not lost.
                    after = await tx.last_event_sequence(workspace)
                groups = {m: {ms.group_id for ms in await tx.memberships_of(m)} for m in watched}
                # Start from the memberships as of the cursor by undoing the
                # changes made since. Undoing is right even for changes the read
                # above did not see yet (each statement may see a newer snapshot):
                # only the earliest change after the cursor decides a group.
                for recorded in reversed(await tx.group_changes(workspace, after=after)):
                    change = recorded.event
                    assert isinstance(change, GroupChanged)
                    for member_id, member_groups in groups.items():
                        if member_id in change.added_member_ids:
                            member_groups.discard(change.group.id)
                        if member_id in change.removed_member_ids:
                            member_groups.add(change.group.id)
                member_filter = MemberFilter(groups)
            if after is not None and not from_now and after > await tx.last_event_sequence(workspace):
                raise InvalidRequest(f"after_cursor {after_cursor!r} is ahead of this workspace's events")
        subscription = await self._hub.subscribe(workspace, after=after)
        return Watch(subscription, member_filter)


class Watch:
    """A running watch: iterate for deliveries; `aclose()` ends it (idempotent).

    Closing unsubscribes even if iteration never started, so a caller that
    goes away early leaves nothing behind.
    """

    def __init__(self, subscription: Subscription, member_filter: MemberFilter | None) -> None:
        # The cursor the watch starts after: where a client resumes if the
        # stream breaks before it has received any event.
        self.start_cursor = str(subscription.delivered)
        self._previous = subscription.delivered
        self._subscription = subscription
        self._filter = member_filter
        self._events = subscription.events()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> Delivery:
        while True:
            recorded = await self._events.__anext__()
            if self._filter is None:
                concerned: tuple[uuid.UUID, ...] = ()
            else:
                concerned = self._filter.concerned(recorded)
                if not concerned:
                    continue
            previous, self._previous = self._previous, recorded.sequence
            return Delivery(recorded, concerned, previous)

    async def aclose(self) -> None:
        await self._events.aclose()
        self._subscription.unsubscribe()


# Sequences are 64-bit signed integers in the database.
MAX_CURSOR = 2**63 - 1


def parse_cursor(cursor: str) -> int | None:
    if not cursor:
        return None
    # isdigit() alone admits characters int() refuses, such as "²".
    if not (cursor.isascii() and cursor.isdigit()) or len(cursor) > 19 or int(cursor) > MAX_CURSOR:
        raise InvalidRequest(f"after_cursor is malformed: {cursor[:40]!r}")
    return int(cursor)
