"""Live events: `EventHub`, `Subscription`, `MemberFilter` and `EventFeed` against the fakes."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest

from services.common.identity import Caller
from services.im.adapters import codec
from services.im.domain.commands import (
    EditMessage,
    GetOrCreateDirectGroup,
    MarkRead,
    RemoveGroupMembers,
    RenameGroup,
)
from services.im.domain.errors import InvalidRequest, NotAllowed, NotFound, ShuttingDown, Unauthenticated
from services.im.domain.model import (
    ContentType,
    Event,
    Group,
    GroupChanged,
    GroupKind,
    Member,
    Message,
    MessageCreated,
    MessageEdited,
    ReadState,
    ReadUpdated,
    RecordedEvent,
    as_recorded,
)
from services.im.service_layer.events import EventFeed, EventHub, MemberFilter, Subscription, Watch
from tests.unit.fakes import FakeTransaction
from tests.unit.support import SERVICE, World, me, unique

TIMEOUT = 2.0
T = TypeVar("T")

HubFactory = Callable[..., Awaitable[EventHub]]


@pytest.fixture
async def world() -> AsyncIterator[World]:
    async with World.make() as made:
        yield made


@pytest.fixture
async def make_hub(world: World) -> AsyncIterator[HubFactory]:
    """Makes event hubs on the world's store and signal; closes them after the test."""
    hubs: list[EventHub] = []

    async def make(**options: Any) -> EventHub:
        hub = EventHub(uow=world.store.transaction, signal=world.signal, **options)
        hubs.append(hub)
        return hub

    yield make
    for hub in hubs:
        await asyncio.wait_for(hub.aclose(), TIMEOUT)


async def within(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, TIMEOUT)


async def take(events: AsyncIterator[T], count: int) -> list[T]:
    return [await within(anext(events)) for _ in range(count)]


async def drain(events: AsyncIterator[T]) -> list[T]:
    """Everything until the stream ends (which must happen within the timeout)."""

    async def collect() -> list[T]:
        return [item async for item in events]

    return await within(collect())


def sequences(events: list[RecordedEvent]) -> list[int]:
    return [e.sequence for e in events]


async def team(world: World, size: int = 2) -> tuple[list[Member], Group]:
    """A workspace's members and a group of all of them."""
    _, creator = await world.workspace(unique("ws"))
    members = [creator]
    for index in range(1, size):
        members.append(await world.member(creator, f"member-{index}"))
    group = await world.group(creator, *members[1:])
    return members, group


async def chatter(world: World, sender: Member, group: Group, count: int) -> list[Message]:
    return [await world.send(sender, group, f"message {i}") for i in range(count)]


# -- EventHub and Subscription ----------------------------------------------------


async def test_live_delivery_after_subscribe(world: World, make_hub: HubFactory) -> None:
    (alice, bob), group = await team(world)
    await world.send(alice, group, "before")
    hub = await make_hub()
    workspace = alice.workspace_id
    subscription = await hub.subscribe(workspace, after=None)
    async with contextlib.aclosing(subscription.events()) as events:
        sent = await world.send(bob, group, "live")
        (first,) = await take(events, 1)
        assert first.sequence == 3
        assert first.workspace_id == workspace
        assert first.group_id == group.id
        assert isinstance(first.event, MessageCreated)
        assert first.event.message.id == sent.id
        assert first.event.message.content == "live"
        more = await chatter(world, alice, group, 3)
        assert [e.event.message.id for e in await take(events, 3) if isinstance(e.event, MessageCreated)] == [
            m.id for m in more
        ]


async def test_resume_from_an_older_cursor_has_no_gap_and_no_duplicate(
    world: World, make_hub: HubFactory
) -> None:
    (alice, bob), group = await team(world)
    await chatter(world, alice, group, 6)  # sequences 2..7
    hub = await make_hub(batch_size=2)
    subscription = await hub.subscribe(alice.workspace_id, after=2)
    async with contextlib.aclosing(subscription.events()) as events:
        got = await take(events, 2)
        # New events committed while the subscriber is still catching up.
        await chatter(world, bob, group, 3)  # 8..10
        got += await take(events, 6)
        await chatter(world, alice, group, 2)  # 11, 12
        got += await take(events, 2)
        assert sequences(got) == list(range(3, 13))
        assert [e.event for e in got] == [e.event for e in world.store.events_of(alice.workspace_id)[2:]]
        # Nothing extra is waiting: the next event is the next one sent.
        await world.send(bob, group, "sentinel")
        assert sequences(await take(events, 1)) == [13]


async def test_subscribing_with_the_current_cursor_gets_only_new_events(
    world: World, make_hub: HubFactory
) -> None:
    (alice, _), group = await team(world)
    await chatter(world, alice, group, 2)
    hub = await make_hub()
    subscription = await hub.subscribe(
        alice.workspace_id, after=world.store.last_sequence(alice.workspace_id)
    )
    async with contextlib.aclosing(subscription.events()) as events:
        await world.send(alice, group, "new")
        assert sequences(await take(events, 1)) == [4]


async def test_concurrent_subscribers_see_identical_sequences() -> None:
    world = World.make(yield_on_call=True)
    (alice, bob), group = await team(world)
    hub = EventHub(uow=world.store.transaction, signal=world.signal, batch_size=3)
    try:
        start = world.store.last_sequence(alice.workspace_id)
        first = await hub.subscribe(alice.workspace_id, after=None)
        second = await hub.subscribe(alice.workspace_id, after=start)
        assert first.tail is second.tail

        async def consume(subscription: Subscription, count: int) -> list[RecordedEvent]:
            async with contextlib.aclosing(subscription.events()) as events:
                return await take(events, count)

        consumers = [asyncio.create_task(consume(s, 40)) for s in (first, second)]
        await asyncio.gather(
            *(world.send(m, group, f"{m.display_name} {i}") for i in range(20) for m in (alice, bob))
        )
        one, two = await within(asyncio.gather(*consumers))
        assert sequences(one) == list(range(start + 1, start + 41))
        assert one == two
        assert [e.event for e in one] == [e.event for e in world.store.events_of(alice.workspace_id)[start:]]
    finally:
        await hub.aclose()


async def test_a_slow_subscriber_is_switched_to_catch_up_and_loses_nothing(
    world: World, make_hub: HubFactory
) -> None:
    (alice, bob), group = await team(world)
    hub = await make_hub(batch_size=2, max_backlog=3)
    slow = await hub.subscribe(alice.workspace_id, after=None)
    fast = await hub.subscribe(alice.workspace_id, after=None)
    async with (
        contextlib.aclosing(slow.events()) as slow_events,
        contextlib.aclosing(fast.events()) as fast_events,
    ):
        await world.send(alice, group, "first")
        assert sequences(await take(slow_events, 1)) == [2]
        assert sequences(await take(fast_events, 1)) == [2]
        # The slow one reads nothing while ten events arrive in batches of two.
        fast_got: list[RecordedEvent] = []
        for _ in range(5):
            await chatter(world, bob, group, 2)
            fast_got += await take(fast_events, 2)
        assert sequences(fast_got) == list(range(3, 13))
        got = await take(slow_events, 10)
        assert sequences(got) == list(range(3, 13))
        await world.send(alice, group, "after")
        assert sequences(await take(slow_events, 1)) == [13]
        assert sequences(await take(fast_events, 1)) == [13]


async def test_a_waiting_subscriber_overflowed_by_one_batch_still_gets_everything(
    world: World, make_hub: HubFactory
) -> None:
    (alice, bob), group = await team(world)
    hub = await make_hub(max_backlog=3)
    subscription = await hub.subscribe(alice.workspace_id, after=None)
    received: asyncio.Queue[RecordedEvent] = asyncio.Queue()

    async def consume() -> None:
        async with contextlib.aclosing(subscription.events()) as events:
            async for recorded in events:
                await received.put(recorded)

    consumer = asyncio.create_task(consume())
    try:
        await world.send(alice, group, "first")
        assert (await within(received.get())).sequence == 2
        # The consumer now waits for its next event; five arrive in one read.
        await chatter(world, bob, group, 5)
        got = [await within(received.get()) for _ in range(5)]
        assert sequences(got) == [3, 4, 5, 6, 7]
    finally:
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer


async def test_a_lost_signal_only_delays_delivery(world: World, make_hub: HubFactory) -> None:
    (alice, bob), group = await team(world)
    hub = await make_hub()
    subscription = await hub.subscribe(alice.workspace_id, after=None)
    async with contextlib.aclosing(subscription.events()) as events:
        await world.send(alice, group, "signalled")
        assert sequences(await take(events, 1)) == [2]
        world.signal.forward = False
        await chatter(world, bob, group, 2)
        world.signal.forward = True
        # A signal for every workspace (as after a Redis reconnect) makes the hub look.
        world.signal.deliver(None, 0)
        assert sequences(await take(events, 2)) == [3, 4]


async def test_a_cursor_ahead_of_a_lagging_tail_gets_no_duplicates(
    world: World, make_hub: HubFactory
) -> None:
    (alice, bob), group = await team(world)
    hub = await make_hub()
    early = await hub.subscribe(alice.workspace_id, after=None)
    async with contextlib.aclosing(early.events()) as early_events:
        await world.send(alice, group, "seen by the tail")
        assert sequences(await take(early_events, 1)) == [2]
        # The tail misses these signals, so it lags behind the database.
        world.signal.forward = False
        await chatter(world, bob, group, 3)  # 3..5
        world.signal.forward = True
        late = await hub.subscribe(alice.workspace_id, after=4)
        async with contextlib.aclosing(late.events()) as late_events:
            assert sequences(await take(late_events, 1)) == [5]
            assert sequences(await take(early_events, 3)) == [3, 4, 5]
            await world.send(alice, group, "next")
            assert sequences(await take(late_events, 1)) == [6]
            assert sequences(await take(early_events, 1)) == [6]


async def test_a_failing_read_is_retried(world: World, make_hub: HubFactory) -> None:
    (alice, bob), group = await team(world)
    hub = await make_hub()
    subscription = await hub.subscribe(alice.workspace_id, after=None)
    failures: list[int] = []

    def fail_once(tx: FakeTransaction) -> None:
        if not failures:
            failures.append(1)
            raise ConnectionError("database restarting")

    async with contextlib.aclosing(subscription.events()) as events:
        world.store.hooks["read_events"] = fail_once
        await world.send(bob, group, "eventually")
        assert sequences(await take(events, 1)) == [2]
    assert failures == [1]


async def test_aclose_ends_every_subscription_saying_where_to_resume(
    world: World, make_hub: HubFactory
) -> None:
    (alice, _), group = await team(world)
    hub = await make_hub(batch_size=2)
    live = await hub.subscribe(alice.workspace_id, after=None)
    live_events = live.events()
    await world.send(alice, group, "one")
    assert sequences(await take(live_events, 1)) == [2]
    # This one has not started reading its backlog yet.
    behind = await hub.subscribe(alice.workspace_id, after=0)

    await within(hub.aclose())
    # Ended with an error (UNAVAILABLE), never as if the stream were complete.
    with pytest.raises(ShuttingDown, match="after_cursor=2 "):
        await drain(live_events)
    with pytest.raises(ShuttingDown, match="after_cursor=0 "):
        await drain(behind.events())
    with pytest.raises(ShuttingDown):
        await hub.subscribe(alice.workspace_id, after=None)
    await within(hub.aclose())  # idempotent


async def test_unsubscribing_the_last_subscriber_stops_the_tail(world: World, make_hub: HubFactory) -> None:
    (alice, bob), group = await team(world)
    hub = await make_hub()
    first = await hub.subscribe(alice.workspace_id, after=None)
    second = await hub.subscribe(alice.workspace_id, after=None)
    tail = first.tail
    first_events, second_events = first.events(), second.events()
    await world.send(alice, group, "both")
    await take(first_events, 1)
    await take(second_events, 1)

    await first_events.aclose()
    await world.send(bob, group, "second only")
    assert sequences(await take(second_events, 1)) == [3]

    await second_events.aclose()
    await within(tail.wait_stopped())
    # A new subscriber starts a new tail, which works.
    again = await hub.subscribe(alice.workspace_id, after=None)
    assert again.tail is not tail
    async with contextlib.aclosing(again.events()) as events:
        await world.send(bob, group, "new tail")
        assert sequences(await take(events, 1)) == [4]


async def test_workspaces_are_separate(world: World, make_hub: HubFactory) -> None:
    (alice, _), group = await team(world)
    (zed, _), other = await team(world)
    hub = await make_hub()
    subscription = await hub.subscribe(alice.workspace_id, after=None)
    async with contextlib.aclosing(subscription.events()) as events:
        await world.send(zed, other, "elsewhere")
        await world.send(alice, group, "here")
        (got,) = await take(events, 1)
        assert got.workspace_id == alice.workspace_id
        assert isinstance(got.event, MessageCreated)
        assert got.event.message.content == "here"


# -- events offered by this process's handlers ------------------------------------------


def event_reads(world: World) -> int:
    """How many times the event log was read."""
    return world.store.calls.count("read_events")


async def test_events_committed_here_are_handed_out_without_a_read(world: World) -> None:
    hub = world.app.hub
    (alice, bob), group = await team(world)
    subscription = await hub.subscribe(alice.workspace_id, after=None)
    async with contextlib.aclosing(subscription.events()) as events:
        await world.send(bob, group, "settle")
        await take(events, 1)
        settled = event_reads(world)
        # Every kind of event, with what the log does not keep (request ids, a direct key).
        sent = await world.send(alice, group, "with a request id", request_id="r-1", metadata={"k": [1]})
        await world.bus.handle(
            MarkRead(caller=me(bob), group_id=str(group.id), up_to_message_id=str(sent.id))
        )
        await world.bus.handle(EditMessage(caller=me(alice), message_id=str(sent.id), content="edited"))
        await world.bus.handle(
            RenameGroup(caller=me(alice), group_id=str(group.id), name="renamed", fields=["name"])
        )
        await world.bus.handle(GetOrCreateDirectGroup(caller=me(alice), peer_member_id=str(bob.id)))
        got = await take(events, 5)
        assert event_reads(world) == settled
        # Exactly what a read would have given.
        stored = world.store.events_of(alice.workspace_id)
        assert got == stored[-5:]
        assert [type(e.event) for e in got] == [
            MessageCreated,
            ReadUpdated,
            MessageEdited,
            GroupChanged,
            GroupChanged,
        ]


async def test_offered_events_after_a_gap_are_read_instead(world: World) -> None:
    hub = world.app.hub
    # Another replica on the same store: its commits reach this hub only by its
    # signal, which is connected to nothing here (as if lost).
    elsewhere = World.make_beside(world)
    (alice, bob), group = await team(world)
    subscription = await hub.subscribe(alice.workspace_id, after=None)
    async with contextlib.aclosing(subscription.events()) as events:
        await world.send(bob, group, "settle")
        start = (await take(events, 1))[0].sequence
        await elsewhere.send(bob, group, "unheard")
        reads = event_reads(world)
        await world.send(alice, group, "after the gap")
        got = await take(events, 2)
        assert sequences(got) == [start + 1, start + 2]
        assert [e.event.message.content for e in got if isinstance(e.event, MessageCreated)] == [
            "unheard",
            "after the gap",
        ]
        assert event_reads(world) > reads
        await world.send(alice, group, "next")
        assert sequences(await take(events, 1)) == [start + 3]


async def test_an_offer_during_a_read_is_left_to_the_read(world: World) -> None:
    hub = world.app.hub
    (alice, bob), group = await team(world)
    subscription = await hub.subscribe(alice.workspace_id, after=None)
    async with contextlib.aclosing(subscription.events()) as events:
        await world.send(bob, group, "settle")
        start = (await take(events, 1))[0].sequence
        entered, release = asyncio.Event(), asyncio.Event()

        async def block_once(tx: FakeTransaction) -> None:
            world.store.hooks.pop("read_events")
            entered.set()
            await release.wait()

        world.store.hooks["read_events"] = block_once
        world.signal.deliver(None, 0)  # the tail starts a read, which blocks
        await within(entered.wait())
        await world.send(alice, group, "offered while reading")
        release.set()
        got = await take(events, 1)
        assert sequences(got) == [start + 1]
        await world.send(alice, group, "next")
        assert sequences(await take(events, 1)) == [start + 2]


def test_as_recorded_is_what_the_event_log_gives_back() -> None:
    member, other = uuid.uuid4(), uuid.uuid4()
    message = Message(
        id=uuid.uuid4(),
        workspace_id=WORKSPACE,
        group_id=uuid.uuid4(),
        sender_id=member,
        content_type=ContentType.CODE,
        content="x = 1",
        mentions=(other,),
        reply_to=uuid.uuid4(),
        metadata={"k": ["v", 1, None]},
        sent_at=NOW,
        edited_at=NOW,
        request_id="r",
        request_hash="h" * 64,
    )
    group = Group(
        id=uuid.uuid4(),
        workspace_id=WORKSPACE,
        name="",
        kind=GroupKind.DIRECT,
        creator_id=member,
        created_at=NOW,
        member_ids=(member, other),
        direct_key=f"{member}:{other}",
    )
    events: list[Event] = [
        MessageCreated(message=message),
        MessageEdited(message=message),
        MessageCreated(message=replace(message, request_id=None, request_hash=None)),
        GroupChanged(group=group, added_member_ids=(other,)),
        GroupChanged(group=replace(group, direct_key=None), removed_member_ids=(other,)),
        ReadUpdated(read_state=ReadState(group.id, member, message.id, 3)),
    ]
    for event in events:
        assert as_recorded(event) == codec.decode_event(*codec.encode_event(event))


# -- MemberFilter -------------------------------------------------------------------


WORKSPACE = uuid.uuid4()
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def recorded(event: Event, sequence: int = 1) -> RecordedEvent:
    return RecordedEvent(workspace_id=WORKSPACE, sequence=sequence, recorded_at=NOW, event=event)


def a_group(group_id: uuid.UUID, *member_ids: uuid.UUID) -> Group:
    return Group(
        id=group_id,
        workspace_id=WORKSPACE,
        name="g",
        kind=GroupKind.GROUP,
        creator_id=member_ids[0] if member_ids else uuid.uuid4(),
        created_at=NOW,
        member_ids=member_ids,
    )


def a_message(group_id: uuid.UUID, sender: uuid.UUID) -> MessageCreated:
    return MessageCreated(
        Message(
            id=uuid.uuid4(),
            workspace_id=WORKSPACE,
            group_id=group_id,
            sender_id=sender,
            content_type=ContentType.TEXT,
            content="x",
            mentions=(),
            reply_to=None,
            metadata={},
            sent_at=NOW,
        )
    )


def test_member_filter_message_events_only_for_members_of_the_group() -> None:
    alice, bob, carol = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    shared, bobs = uuid.uuid4(), uuid.uuid4()
    watch = MemberFilter({alice: {shared}, bob: {shared, bobs}})
    assert set(watch.concerned(recorded(a_message(shared, carol)))) == {alice, bob}
    assert watch.concerned(recorded(a_message(bobs, carol))) == (bob,)
    assert watch.concerned(recorded(a_message(uuid.uuid4(), alice))) == ()
    edited = MessageEdited(a_message(bobs, bob).message)
    assert watch.concerned(recorded(edited)) == (bob,)


def test_member_filter_tracks_added_and_removed_members() -> None:
    alice, bob = uuid.uuid4(), uuid.uuid4()
    group = uuid.uuid4()
    watch = MemberFilter({alice: set(), bob: {group}})
    # Alice is added: she gets the change and then the group's messages.
    assert set(
        watch.concerned(recorded(GroupChanged(a_group(group, alice, bob), added_member_ids=(alice,))))
    ) == {
        alice,
        bob,
    }
    assert set(watch.concerned(recorded(a_message(group, bob)))) == {alice, bob}
    # Bob is removed: he hears of it once, then nothing more of that group.
    assert set(watch.concerned(recorded(GroupChanged(a_group(group, alice), removed_member_ids=(bob,))))) == {
        alice,
        bob,
    }
    assert watch.concerned(recorded(a_message(group, alice))) == (alice,)
    assert watch.concerned(recorded(GroupChanged(a_group(group, alice)))) == (alice,)
    # A group created with only others concerns nobody watched.
    assert watch.concerned(recorded(GroupChanged(a_group(uuid.uuid4(), uuid.uuid4())))) == ()


def test_member_filter_read_updates_only_for_the_member_itself() -> None:
    alice, bob = uuid.uuid4(), uuid.uuid4()
    group = uuid.uuid4()
    watch = MemberFilter({alice: {group}, bob: {group}})
    state = ReadState(group_id=group, member_id=alice, last_read_message_id=uuid.uuid4(), unread_count=0)
    assert watch.concerned(recorded(ReadUpdated(state))) == (alice,)
    stranger = ReadState(
        group_id=group, member_id=uuid.uuid4(), last_read_message_id=uuid.uuid4(), unread_count=0
    )
    assert watch.concerned(recorded(ReadUpdated(stranger))) == ()


# -- EventFeed.watch ------------------------------------------------------------------


@pytest.fixture
async def feed(world: World, make_hub: HubFactory) -> EventFeed:
    return EventFeed(uow=world.store.transaction, hub=await make_hub(batch_size=2))


async def watch(
    feed: EventFeed,
    principal: Caller | None,
    *,
    members: tuple[Member, ...] = (),
    workspace_id: uuid.UUID | None = None,
    cursor: str = "",
) -> Watch:
    return await feed.watch(
        principal,
        member_ids=[str(m.id) for m in members],
        workspace_id=str(workspace_id) if workspace_id else "",
        after_cursor=cursor,
    )


async def test_a_member_watches_its_own_events(world: World, feed: EventFeed) -> None:
    (alice, bob, carol), group = await team(world, 3)
    bob_and_carol = await world.group(bob, carol, name="without alice")
    async with contextlib.aclosing(await watch(feed, me(alice))) as stream:
        await world.send(bob, bob_and_carol, "not for alice")
        mine = await world.send(bob, group, "for alice")
        await world.bus.handle(
            MarkRead(caller=me(carol), group_id=str(group.id), up_to_message_id=str(mine.id))
        )
        state = await world.bus.handle(
            MarkRead(caller=me(alice), group_id=str(group.id), up_to_message_id=str(mine.id))
        )
        first, second = await take(stream, 2)
        assert first.member_ids == (alice.id,)
        assert isinstance(first.recorded.event, MessageCreated)
        assert first.recorded.event.message.id == mine.id
        assert second.recorded.event == ReadUpdated(state)
    async with contextlib.aclosing(await watch(feed, me(alice), members=(alice,))) as stream:
        await world.send(bob, group, "named explicitly")
        (delivery,) = await take(stream, 1)
        assert delivery.member_ids == (alice.id,)


async def test_a_member_follows_its_group_changes(world: World, feed: EventFeed) -> None:
    (alice, bob, carol), group = await team(world, 3)
    async with contextlib.aclosing(await watch(feed, me(carol))) as stream:
        await world.bus.handle(
            RemoveGroupMembers(caller=me(alice), group_id=str(group.id), member_ids=[str(carol.id)])
        )
        await world.send(alice, group, "after carol left")
        later = await world.group(bob, carol, name="new")
        await world.send(bob, later, "in the new group")
        got = await take(stream, 3)
        kinds = [type(d.recorded.event) for d in got]
        assert kinds == [GroupChanged, GroupChanged, MessageCreated]
        removed = got[0].recorded.event
        assert isinstance(removed, GroupChanged)
        assert removed.removed_member_ids == (carol.id,)
        added = got[1].recorded.event
        assert isinstance(added, GroupChanged)
        assert added.group.id == later.id


async def test_a_group_created_while_a_watch_starts_reaches_it(world: World, feed: EventFeed) -> None:
    (alice, bob), _ = await team(world)
    meanwhile: list[Group] = []

    async with contextlib.aclosing(await watch(feed, SERVICE, workspace_id=alice.workspace_id)) as everything:

        async def create_a_group_after_the_memberships_are_read(_tx: FakeTransaction) -> None:
            del world.store.hooks["memberships_of"]
            meanwhile.append(await world.group(bob, alice, name="meanwhile"))
            # The workspace's tail reads it, so "now" moves past its creation.
            await take(everything, 1)

        world.store.hooks["memberships_of"] = create_a_group_after_the_memberships_are_read
        async with contextlib.aclosing(await watch(feed, me(alice))) as stream:
            sent = await world.send(bob, meanwhile[0], "in the new group")
            created, message = await take(stream, 2)
    assert isinstance(created.recorded.event, GroupChanged)
    assert created.recorded.event.group.id == meanwhile[0].id
    assert isinstance(message.recorded.event, MessageCreated)
    assert message.recorded.event.message.id == sent.id


async def test_a_member_may_watch_only_itself(world: World, feed: EventFeed) -> None:
    (alice, bob), _ = await team(world)
    with pytest.raises(NotAllowed):
        await watch(feed, me(alice), members=(bob,))
    with pytest.raises(NotAllowed):
        await watch(feed, me(alice), members=(alice, bob))
    with pytest.raises(NotAllowed):
        await watch(feed, me(alice), workspace_id=alice.workspace_id)
    with pytest.raises(Unauthenticated):
        await watch(feed, None)


async def test_a_service_watches_a_workspace(world: World, feed: EventFeed) -> None:
    (alice, bob), group = await team(world)
    (zed, _), other = await team(world)
    async with contextlib.aclosing(await watch(feed, SERVICE, workspace_id=alice.workspace_id)) as stream:
        await world.send(zed, other, "elsewhere")
        await world.send(alice, group, "one")
        side = await world.group(bob, name="bob alone")
        got = await take(stream, 2)
        assert [d.member_ids for d in got] == [(), ()]
        assert sequences([d.recorded for d in got]) == [2, 3]
        last = got[1].recorded.event
        assert isinstance(last, GroupChanged)
        assert last.group.id == side.id


async def test_a_service_watches_a_set_of_members(world: World, feed: EventFeed) -> None:
    (alice, bob, carol), group = await team(world, 3)
    pair = await world.group(alice, bob, name="pair")
    async with contextlib.aclosing(await watch(feed, SERVICE, members=(bob, carol))) as stream:
        await world.send(alice, pair, "bob only")
        await world.send(alice, group, "both")
        first, second = await take(stream, 2)
        assert first.member_ids == (bob.id,)
        assert set(second.member_ids) == {bob.id, carol.id}


async def test_watch_request_errors(world: World, feed: EventFeed) -> None:
    (alice, _), _ = await team(world)
    (zed, _), _ = await team(world)
    with pytest.raises(InvalidRequest):
        await watch(feed, SERVICE)
    with pytest.raises(InvalidRequest):
        await watch(feed, SERVICE, members=(alice,), workspace_id=alice.workspace_id)
    with pytest.raises(InvalidRequest):
        await watch(feed, SERVICE, members=(alice, zed))
    with pytest.raises(NotFound):
        await watch(feed, SERVICE, workspace_id=uuid.uuid4())
    with pytest.raises(InvalidRequest):
        await feed.watch(SERVICE, member_ids=["nope"], workspace_id="", after_cursor="")
    with pytest.raises(NotFound):
        await feed.watch(SERVICE, member_ids=[str(uuid.uuid4())], workspace_id="", after_cursor="")


async def test_watch_cursor_ahead_of_the_workspace_is_refused(world: World, feed: EventFeed) -> None:
    (alice, _), _ = await team(world)
    last = world.store.last_sequence(alice.workspace_id)
    with pytest.raises(InvalidRequest):
        await watch(feed, me(alice), cursor=str(last + 1))
    with pytest.raises(InvalidRequest):
        await watch(feed, SERVICE, workspace_id=alice.workspace_id, cursor=str(last + 1))
    async with contextlib.aclosing(await watch(feed, me(alice), cursor=str(last))):
        pass


@pytest.mark.parametrize("cursor", ["abc", "-1", "1.5", " 1", "1e3", "1" * 20, "²", "١٢"])
async def test_watch_malformed_cursor_is_refused(world: World, feed: EventFeed, cursor: str) -> None:
    (alice, _), _ = await team(world)
    with pytest.raises(InvalidRequest):
        await watch(feed, me(alice), cursor=cursor)


async def test_watch_resumes_from_a_cursor(world: World, feed: EventFeed) -> None:
    (alice, bob), group = await team(world)
    sent = await chatter(world, bob, group, 4)  # sequences 2..5
    async with contextlib.aclosing(await watch(feed, me(alice), cursor="3")) as stream:
        got = await take(stream, 2)
        messages = [d.recorded.event.message.id for d in got if isinstance(d.recorded.event, MessageCreated)]
        assert messages == [m.id for m in sent[2:]]
        live = await world.send(bob, group, "live")
        (delivery,) = await take(stream, 1)
        assert isinstance(delivery.recorded.event, MessageCreated)
        assert delivery.recorded.event.message.id == live.id


async def test_resuming_before_leaving_a_group_replays_that_groups_messages(
    world: World, feed: EventFeed
) -> None:
    (alice, bob), group = await team(world)
    cursor = world.store.last_sequence(alice.workspace_id)
    missed = await world.send(alice, group, "sent while bob was a member")
    await world.bus.handle(
        RemoveGroupMembers(caller=me(alice), group_id=str(group.id), member_ids=[str(bob.id)])
    )
    async with contextlib.aclosing(await watch(feed, me(bob), cursor=str(cursor))) as stream:
        (first,) = await take(stream, 1)
        assert isinstance(first.recorded.event, MessageCreated)
        assert first.recorded.event.message.id == missed.id


async def test_a_watch_closed_before_reading_leaves_no_subscription(
    world: World, make_hub: HubFactory
) -> None:
    hub = await make_hub()
    feed = EventFeed(uow=world.store.transaction, hub=hub)
    (alice, _bob), _group = await team(world)
    stream = await watch(feed, me(alice))
    assert hub._tails, "watching subscribes at once"
    await stream.aclose()
    assert not hub._tails, "closing an unread watch must unsubscribe it"
    await stream.aclose()  # idempotent
