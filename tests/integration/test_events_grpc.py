"""WatchEvents over real gRPC: live delivery, resume, several subscribers, replicas."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from agentim.im.v1 import im_pb2
from services.common.identity import bearer_metadata
from tests.authn_support import service_token, tampered_token
from tests.conftest import RunningIM, World, make_world, next_event
from tests.faults.harness import RedisProcess
from tests.identities import as_member


async def make_group(im: RunningIM, world: World, *members: int) -> im_pb2.Group:
    response = await im.stub.CreateGroup(
        im_pb2.CreateGroupRequest(name="g", member_ids=[world.members[i].id for i in members]),
        metadata=world.md(0),
    )
    return response.group


async def send(im: RunningIM, world: World, sender: int, group: str, content: str) -> im_pb2.Message:
    response = await im.stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=group, content=content), metadata=world.md(sender)
    )
    return response.message


def contents(events: list[im_pb2.WatchEventsResponse]) -> list[str]:
    return [e.message_created.message.content for e in events if e.WhichOneof("event") == "message_created"]


async def read_n(stream: Any, n: int) -> list[im_pb2.WatchEventsResponse]:
    return [await next_event(stream) for _ in range(n)]


async def test_member_sees_its_groups_events_live(im: RunningIM) -> None:
    world = await make_world(im.stub, people=3)
    stream = im.stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=world.md(1))
    await asyncio.wait_for(stream.wait_for_connection(), 5)
    group = await make_group(im, world, 1)
    other = await make_group(im, world, 2)  # member 1 is not in it
    await send(im, world, 2, other.id, "not for member 1")
    sent = await send(im, world, 0, group.id, "hello")
    changed, created = await read_n(stream, 2)
    assert changed.WhichOneof("event") == "group_changed" and changed.group_changed.group.id == group.id
    assert list(changed.member_ids) == [world.members[1].id]
    assert created.message_created.message.id == sent.id
    assert created.sequence > changed.sequence and created.cursor == str(created.sequence)
    # The headers said after which cursor the stream starts: just before the group.
    headers = dict(await stream.initial_metadata())
    assert headers["x-agentim-start-cursor"] == str(changed.sequence - 1)
    # Each event names the one before it on this stream, across the events
    # skipped (the other group's), so that a client can tell it missed none.
    assert changed.previous_sequence == int(headers["x-agentim-start-cursor"])
    assert created.previous_sequence == changed.sequence
    assert created.sequence - changed.sequence > 1

    await im.stub.EditMessage(
        im_pb2.EditMessageRequest(message_id=sent.id, content="hello!"), metadata=world.md(0)
    )
    edited = await next_event(stream)
    assert edited.message_edited.message.content == "hello!"
    await im.stub.MarkRead(
        im_pb2.MarkReadRequest(group_id=group.id, up_to_message_id=sent.id), metadata=world.md(1)
    )
    read = await next_event(stream)
    assert read.read_updated.read_state.member_id == world.members[1].id
    assert read.read_updated.read_state.unread_count == 0
    stream.cancel()


async def test_disconnect_and_resume_without_loss_or_duplicates(im: RunningIM) -> None:
    world = await make_world(im.stub, people=2)
    group = await make_group(im, world, 1)
    stream = im.stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=world.md(1))
    await asyncio.wait_for(stream.wait_for_connection(), 5)
    await send(im, world, 0, group.id, "m0")
    await send(im, world, 0, group.id, "m1")
    seen = await read_n(stream, 2)
    cursor = seen[-1].cursor
    stream.cancel()

    for i in range(2, 6):
        await send(im, world, 0, group.id, f"m{i}")
    resumed = im.stub.WatchEvents(im_pb2.WatchEventsRequest(after_cursor=cursor), metadata=world.md(1))
    missed = await read_n(resumed, 4)
    await send(im, world, 0, group.id, "m6")
    live = await next_event(resumed)
    got = seen + missed + [live]
    assert contents(got) == [f"m{i}" for i in range(7)]
    # Resumed, the chain goes on from the cursor.
    assert [e.previous_sequence for e in got[1:]] == [e.sequence for e in got[:-1]]
    sequences = [e.sequence for e in got]
    assert sequences == sorted(set(sequences))
    resumed.cancel()


async def test_two_concurrent_subscribers_see_the_same_stream(im: RunningIM) -> None:
    world = await make_world(im.stub, people=3)
    group = await make_group(im, world, 1, 2)
    streams = [im.stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=world.md(i)) for i in (1, 2)]
    for stream in streams:
        await asyncio.wait_for(stream.wait_for_connection(), 5)
    await asyncio.gather(*[send(im, world, i % 3, group.id, f"c{i}") for i in range(10)])
    first, second = [await read_n(stream, 10) for stream in streams]
    assert [e.sequence for e in first] == [e.sequence for e in second]
    assert sorted(contents(first)) == sorted(f"c{i}" for i in range(10))
    for stream in streams:
        stream.cancel()


async def test_sequences_are_gap_free_under_concurrent_writers(im: RunningIM) -> None:
    world = await make_world(im.stub, people=2)
    groups = [await make_group(im, world, 1) for _ in range(3)]
    stream = im.stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=world.md(1))
    await asyncio.wait_for(stream.wait_for_connection(), 5)
    await asyncio.gather(*[send(im, world, i % 2, groups[i % 3].id, f"x{i}") for i in range(30)])
    events = await read_n(stream, 30)
    sequences = [e.sequence for e in events]
    assert sequences == list(range(sequences[0], sequences[0] + 30))
    stream.cancel()


async def test_watch_permissions_and_bad_cursors(im: RunningIM) -> None:
    world = await make_world(im.stub, people=2)

    async def code_of(request: im_pb2.WatchEventsRequest, metadata: Any) -> grpc.StatusCode:
        stream = im.stub.WatchEvents(request, metadata=metadata)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stream.read()
        return caught.value.code()

    other = world.members[0].id
    assert (
        await code_of(im_pb2.WatchEventsRequest(member_ids=[other]), world.md(1))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    assert (
        await code_of(im_pb2.WatchEventsRequest(workspace_id=world.workspace.id), world.md(1))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    assert (
        await code_of(im_pb2.WatchEventsRequest(after_cursor="abc"), world.md(1))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        await code_of(im_pb2.WatchEventsRequest(after_cursor="999999"), world.md(1))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert await code_of(im_pb2.WatchEventsRequest(), ()) == grpc.StatusCode.UNAUTHENTICATED


async def test_service_watches_a_set_of_members_and_a_workspace(im: RunningIM) -> None:
    world = await make_world(im.stub, people=3)
    service = await service_token(im, "runtime")
    agents = im.stub.WatchEvents(
        im_pb2.WatchEventsRequest(member_ids=[world.members[1].id, world.members[2].id]), metadata=service
    )
    everything = im.stub.WatchEvents(
        im_pb2.WatchEventsRequest(workspace_id=world.workspace.id), metadata=service
    )
    await asyncio.wait_for(agents.wait_for_connection(), 5)
    await asyncio.wait_for(everything.wait_for_connection(), 5)
    group = await make_group(im, world, 2)
    await send(im, world, 0, group.id, "to member 2")
    changed, created = await read_n(agents, 2)
    assert list(created.member_ids) == [world.members[2].id]
    assert created.message_created.message.content == "to member 2"
    all_events = await read_n(everything, 2)
    assert [e.sequence for e in all_events] == [changed.sequence, created.sequence]
    agents.cancel()
    everything.cancel()


async def test_only_a_services_genuine_token_watches_a_workspace(im: RunningIM) -> None:
    world = await make_world(im.stub, people=1)
    service = await service_token(im, "runtime")
    forged = bearer_metadata(tampered_token(service[0][1].removeprefix("Bearer ")))
    for metadata, code in [
        (forged, grpc.StatusCode.UNAUTHENTICATED),
        (world.md(0), grpc.StatusCode.PERMISSION_DENIED),
    ]:
        stream = im.stub.WatchEvents(
            im_pb2.WatchEventsRequest(workspace_id=world.workspace.id), metadata=metadata
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stream.read()
        assert caught.value.code() == code
    ok = im.stub.WatchEvents(im_pb2.WatchEventsRequest(workspace_id=world.workspace.id), metadata=service)
    await asyncio.wait_for(ok.wait_for_connection(), 5)
    await im.stub.CreateGroup(im_pb2.CreateGroupRequest(name="g"), metadata=world.md(0))
    assert (await next_event(ok)).WhichOneof("event") == "group_changed"
    ok.cancel()


async def test_idle_watchers_do_not_poll_the_database(im: RunningIM) -> None:
    world = await make_world(im.stub, people=2)
    group = await make_group(im, world, 1)
    hub = im.app.hub
    reads = 0
    original = hub.read

    async def counting_read(*args: Any, **kwargs: Any) -> Any:
        nonlocal reads
        reads += 1
        return await original(*args, **kwargs)

    hub.read = counting_read  # type: ignore[method-assign]
    stream = im.stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=world.md(1))
    await asyncio.wait_for(stream.wait_for_connection(), 5)
    await send(im, world, 0, group.id, "wake")
    await next_event(stream)
    settled = reads
    await asyncio.sleep(0.5)
    assert reads == settled, "the hub read the database while nothing happened"
    await send(im, world, 0, group.id, "again")
    await next_event(stream)
    # Committed by this very process: handed out without reading it back.
    assert reads == settled
    stream.cancel()


async def test_events_committed_elsewhere_are_read_not_skipped(im_factory: Any) -> None:
    # Two processes on one database and no Redis: one does not hear the
    # other's signals. When its own next event does not follow on from what
    # its watchers have, it must read the gap from the database, in order.
    here: RunningIM = await im_factory()
    there: RunningIM = await im_factory()
    world = await make_world(here.stub, people=2)
    group = await make_group(here, world, 1)
    stream = here.stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=world.md(1))
    await asyncio.wait_for(stream.wait_for_connection(), 5)
    await send(here, world, 0, group.id, "one")
    first = await next_event(stream)
    await send(there, world, 0, group.id, "two (unheard)")
    await send(here, world, 0, group.id, "three")
    second, third = await read_n(stream, 2)
    assert contents([first, second, third]) == ["one", "two (unheard)", "three"]
    assert [e.sequence for e in (second, third)] == [first.sequence + 1, first.sequence + 2]
    stream.cancel()


async def test_replicas_share_events_through_redis(
    database_url: str, redis_url: str, im_factory: Any
) -> None:
    first: RunningIM = await im_factory(REDIS_URL=redis_url)
    second: RunningIM = await im_factory(REDIS_URL=redis_url)
    world = await make_world(first.stub, people=2)
    group = await make_group(first, world, 1)
    stream = first.stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=world.md(1))
    await asyncio.wait_for(stream.wait_for_connection(), 5)
    for i in range(3):
        await send(second, world, 0, group.id, f"via second {i}")
    assert contents(await read_n(stream, 3)) == [f"via second {i}" for i in range(3)]
    stream.cancel()


async def test_redis_outage_loses_no_event(
    database_url: str, private_redis: RedisProcess, im_factory: Any
) -> None:
    listening: RunningIM = await im_factory(REDIS_URL=private_redis.url)
    # A replica whose Redis is down: its messages commit but nobody is signalled.
    cut_off: RunningIM = await im_factory(REDIS_URL="redis://127.0.0.1:1/0")
    world = await make_world(listening.stub, people=2)
    group = await make_group(listening, world, 1)
    stream = listening.stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=world.md(1))
    await asyncio.wait_for(stream.wait_for_connection(), 5)
    sent = await send(cut_off, world, 0, group.id, "during the outage")
    assert sent.id

    # Losing its own Redis connection, the listener reads every workspace (and
    # does again when the connection comes back). A private Redis: killing the
    # shared one's subscribers would disturb everyone else's.
    private_redis.kill()
    private_redis.start()
    event = await next_event(stream, within=10)
    assert event.message_created.message.id == sent.id
    stream.cancel()
    # A reconnecting subscriber gets it from the database in any case.
    resumed = listening.stub.WatchEvents(
        im_pb2.WatchEventsRequest(after_cursor=str(event.sequence - 1)),
        metadata=as_member(world.members[1].id),
    )
    assert (await next_event(resumed)).message_created.message.id == sent.id
    resumed.cancel()


async def test_a_stopping_im_ends_watches_unavailable_saying_which_cursor_to_resume_after(
    im: RunningIM,
) -> None:
    world = await make_world(im.stub, people=2)
    group = await make_group(im, world, 1)
    stream = im.stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=world.md(1))
    await asyncio.wait_for(stream.wait_for_connection(), 5)
    await send(im, world, 0, group.id, "before the stop")
    last = (await read_n(stream, 1))[-1]
    await im.app.stop()
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        await next_event(stream)
    # UNAVAILABLE, which clients retry, and not a normal end, which says the stream is complete.
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"after_cursor={last.cursor} " in (ended.value.details() or "")
