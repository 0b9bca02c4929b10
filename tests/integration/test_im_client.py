"""The runtime's IM adapter (`GrpcIM`) against a real IM server on SQLite.

The client calls with the runtime's credentials: its service token, and the
tokens of the agents it creates (the only members it may act as). What
people do in these tests they do over the IM's API with their own tokens.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from agentim.im.v1 import auth_pb2, im_pb2
from services.common.status import status_name
from services.common.tokens import PrincipalKind
from services.im.adapters import migrate
from services.im.adapters.sql import Database
from services.runtime.adapters.im_client import GrpcIM
from services.runtime.domain.errors import IMError, IMUnavailable
from services.runtime.service_layer.im_port import IMEvent, IMMember
from tests.auth_support import service_secret
from tests.conftest import RunningIM, World, make_world, start_im, stop_im
from tests.identities import Identity, as_member, remember

WAIT_S = 5.0

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float = WAIT_S) -> T:
    return await asyncio.wait_for(awaitable, seconds)


def make_client(address: str, *, secret: str | None = None, deadline: float = 2.0) -> GrpcIM:
    """A client with the runtime's credential (or `secret` instead)."""
    held = secret or service_secret("runtime")
    return GrpcIM(
        address,
        deadline_seconds=deadline,
        reconnect_initial_seconds=0.01,
        reconnect_max_seconds=0.05,
        service_name="runtime",
        service_secret=lambda: held,
    )


@pytest.fixture
async def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'im.db'}"
    database = Database(url)
    await migrate.upgrade(database)
    await database.aclose()
    return url


@pytest.fixture
async def server(sqlite_url: str) -> AsyncIterator[RunningIM]:
    running = await start_im(sqlite_url)
    yield running
    await stop_im(running)


@pytest.fixture
async def client(server: RunningIM) -> AsyncIterator[GrpcIM]:
    im = make_client(server.address)
    yield im
    await im.aclose()


@pytest.fixture
async def world(server: RunningIM) -> World:
    return await make_world(server.stub, people=3)


def member(world: World, index: int) -> uuid.UUID:
    return uuid.UUID(world.members[index].id)


async def hosted(client: GrpcIM, world: World, name: str = "helper") -> IMMember:
    """An agent member the client creates, so hosts, and may act as (tests may too)."""
    agent = await client.create_agent_member(workspace(world), name)
    remember(agent.id, Identity(agent.workspace_id, PrincipalKind.AGENT))
    return agent


async def person_creates_group(server: RunningIM, who: uuid.UUID, name: str, *others: uuid.UUID) -> uuid.UUID:
    response = await server.stub.CreateGroup(
        im_pb2.CreateGroupRequest(name=name, member_ids=[str(o) for o in others]), metadata=as_member(who)
    )
    return uuid.UUID(response.group.id)


async def person_sends(
    server: RunningIM, who: uuid.UUID, group: uuid.UUID, content: str, *, mentions: Sequence[uuid.UUID] = ()
) -> uuid.UUID:
    response = await server.stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=str(group), content=content, mentions=[str(m) for m in mentions]),
        metadata=as_member(who),
    )
    return uuid.UUID(response.message.id)


def workspace(world: World) -> uuid.UUID:
    return uuid.UUID(world.workspace.id)


async def refusal(awaitable: Awaitable[Any]) -> IMError:
    with pytest.raises(IMError) as caught:
        await within(awaitable)
    return caught.value


class Watcher:
    """Runs `GrpcIM.watch` in a task, collecting its events (or its error) in a queue."""

    def __init__(
        self,
        client: GrpcIM,
        workspace_id: uuid.UUID,
        *,
        member_ids: Sequence[uuid.UUID] = (),
        after_cursor: str = "",
    ) -> None:
        self.subscriptions = 0
        self.start_cursors: list[str] = []
        self._subscribed = asyncio.Event()
        self._items: asyncio.Queue[IMEvent | Exception] = asyncio.Queue()
        self.task = asyncio.create_task(
            self._run(
                client.watch(
                    workspace_id,
                    member_ids=member_ids,
                    after_cursor=after_cursor,
                    on_subscribed=self._on_subscribed,
                )
            )
        )

    def _on_subscribed(self, cursor: str) -> None:
        self.subscriptions += 1
        self.start_cursors.append(cursor)
        self._subscribed.set()

    async def _run(self, events: AsyncIterator[IMEvent]) -> None:
        try:
            async for event in events:
                self._items.put_nowait(event)
        except Exception as error:
            self._items.put_nowait(error)

    async def subscribed(self, count: int = 1) -> None:
        async def reached() -> None:
            while self.subscriptions < count:
                self._subscribed.clear()
                await self._subscribed.wait()

        await within(reached())

    async def take(self, n: int) -> list[IMEvent]:
        events: list[IMEvent] = []
        for _ in range(n):
            item = await within(self._items.get())
            if isinstance(item, Exception):
                raise item
            events.append(item)
        return events

    def pending(self) -> int:
        return self._items.qsize()

    async def stop(self) -> None:
        self.task.cancel()
        await within(asyncio.gather(self.task, return_exceptions=True), 1.0)


def contents(events: list[IMEvent]) -> list[str]:
    return [e.message.content for e in events]


# -- members ----------------------------------------------------------------------


async def test_agent_members_are_created_once_and_renamed(
    client: GrpcIM, server: RunningIM, world: World
) -> None:
    agent = await client.create_agent_member(workspace(world), "helper", avatar="🤖", request_id="agent-1")
    assert (agent.kind, agent.display_name, agent.workspace_id) == ("agent", "helper", workspace(world))
    again = await client.create_agent_member(workspace(world), "helper", avatar="🤖", request_id="agent-1")
    assert again == agent

    renamed = await client.rename_member(agent.id, "Helper Bot")
    assert (renamed.id, renamed.display_name, renamed.kind) == (agent.id, "Helper Bot", "agent")
    remember(agent.id, Identity(agent.workspace_id, PrincipalKind.AGENT))
    seen = await server.stub.GetMember(im_pb2.GetMemberRequest(member_id=str(agent.id)), metadata=world.md(1))
    assert seen.member.display_name == "Helper Bot"

    refused = await refusal(client.create_agent_member(uuid.uuid4(), "lost"))
    assert status_name(refused) == "NOT_FOUND" and "not found" in refused.message
    refused = await refusal(client.rename_member(agent.id, ""))
    assert status_name(refused) == "INVALID_ARGUMENT"


async def test_members_are_read_as_a_member(client: GrpcIM, server: RunningIM, world: World) -> None:
    agent = await client.create_agent_member(workspace(world), "helper")
    human = await client.get_member(agent.id, member(world, 2))
    assert (human.id, human.kind, human.display_name) == (member(world, 2), "human", "member-2")
    listed = await client.list_members(agent.id)
    assert [m.id for m in listed] == [member(world, 0), member(world, 1), member(world, 2), agent.id]

    refused = await refusal(client.get_member(agent.id, uuid.uuid4()))
    assert status_name(refused) == "NOT_FOUND" and "not found" in refused.message
    stranger = await make_world(server.stub, people=1)
    refused = await refusal(client.get_member(agent.id, member(stranger, 0)))
    assert status_name(refused) == "NOT_FOUND"


async def test_member_and_group_lists_are_read_past_the_page_size(sqlite_url: str) -> None:
    small_pages = await start_im(sqlite_url, IM_MAX_PAGE_SIZE="2")
    im = make_client(small_pages.address)
    try:
        world = await make_world(small_pages.stub, people=5)
        agent = await hosted(im, world)
        everyone = [member(world, i) for i in range(5)]
        assert [m.id for m in await im.list_members(agent.id)] == [*everyone, agent.id]
        made = [await im.create_group(agent.id, f"g{i}", everyone[1:]) for i in range(5)]
        assert [g.id for g in await im.list_groups(agent.id)] == [g.id for g in made]
    finally:
        await im.aclose()
        await stop_im(small_pages)


# -- groups -----------------------------------------------------------------------


async def test_groups_named_and_direct(client: GrpcIM, server: RunningIM, world: World) -> None:
    agent = await hosted(client, world)
    peer = await hosted(client, world, "peer")
    team = await client.create_group(agent.id, "team", [member(world, 0), member(world, 1)])
    assert (team.name, team.kind) == ("team", "group")
    assert set(team.member_ids) == {agent.id, member(world, 0), member(world, 1)}
    assert await client.get_group(agent.id, team.id) == team

    direct = await client.get_or_create_direct_group(agent.id, peer.id)
    assert (direct.kind, direct.name, set(direct.member_ids)) == ("direct", "", {agent.id, peer.id})
    # Asked from the other side: the same group (the IM does not promise an order of member_ids).
    same = await client.get_or_create_direct_group(peer.id, agent.id)
    assert (same.id, same.kind, set(same.member_ids)) == (direct.id, "direct", set(direct.member_ids))
    assert [g.id for g in await client.list_groups(agent.id)] == [team.id, direct.id]
    assert [g.id for g in await client.list_groups(peer.id)] == [direct.id]

    refused = await refusal(client.get_group(peer.id, team.id))
    assert status_name(refused) == "PERMISSION_DENIED"
    assert refused.message == f"member {peer.id} is not in group {team.id}"
    missing = uuid.uuid4()
    refused = await refusal(client.get_group(agent.id, missing))
    assert (status_name(refused), refused.message) == ("NOT_FOUND", f"group {missing} not found")
    refused = await refusal(client.create_group(agent.id, "bad", [uuid.uuid4()]))
    assert status_name(refused) == "NOT_FOUND"
    refused = await refusal(client.get_or_create_direct_group(agent.id, agent.id))
    assert status_name(refused) == "INVALID_ARGUMENT"


# -- messages and read state ------------------------------------------------------


async def test_messages_history_unread_and_read_state(
    client: GrpcIM, server: RunningIM, world: World
) -> None:
    agent = await hosted(client, world)
    human = member(world, 0)
    group_id = await person_creates_group(server, human, "team", agent.id)
    first_id = await person_sends(server, human, group_id, "hi @helper", mentions=[agent.id])
    (first,) = await client.list_messages(agent.id, group_id)
    assert (first.id, first.sender_id, first.group_id, first.content_type) == (
        first_id,
        human,
        group_id,
        "text",
    )
    assert first.mentions == (agent.id,)
    assert first.sent_at.tzinfo is not None and abs(time.time() - first.sent_at.timestamp()) < 60
    group = await client.get_group(agent.id, group_id)
    reply = await client.send_message(agent.id, group.id, "hello", reply_to=first.id, request_id="r-1")
    assert (reply.sender_id, reply.reply_to) == (agent.id, first.id)
    assert (
        await client.send_message(agent.id, group.id, "hello", reply_to=first.id, request_id="r-1") == reply
    )
    later_ids = [await person_sends(server, human, group.id, f"m{i}") for i in range(3)]

    history = await client.list_messages(agent.id, group.id)
    assert [m.id for m in history] == [first.id, reply.id, *later_ids]
    later = history[2:]
    newest = await client.list_messages(agent.id, group.id, limit=2)
    assert [m.content for m in newest] == ["m1", "m2"]
    older = await client.list_messages(agent.id, group.id, limit=2, before=newest[0].id)
    assert [m.content for m in older] == ["hello", "m0"]

    unread = await client.get_all_unread(agent.id)
    assert [m.id for m in unread] == [first.id, *(m.id for m in later)]
    assert [m.id for m in await client.get_all_unread(agent.id, limit=2)] == [first.id, later[0].id]
    await client.mark_read(agent.id, group.id, later[1].id)
    assert [m.id for m in await client.get_all_unread(agent.id)] == [later[2].id]
    await client.mark_read(agent.id, group.id, later[2].id)
    assert await client.get_all_unread(agent.id) == []

    refused = await refusal(client.mark_read(agent.id, group.id, uuid.uuid4()))
    assert status_name(refused) == "INVALID_ARGUMENT"


async def test_sending_refusals_carry_the_ims_status_and_message(
    client: GrpcIM, server: RunningIM, world: World
) -> None:
    agent = await hosted(client, world)
    others = await person_creates_group(server, member(world, 0), "others", member(world, 1))
    refused = await refusal(client.send_message(agent.id, others, "let me in"))
    assert status_name(refused) == "PERMISSION_DENIED"
    assert refused.message == f"member {agent.id} is not in group {others}"
    assert str(refused) == refused.message

    missing = uuid.uuid4()
    refused = await refusal(client.send_message(agent.id, missing, "anyone?"))
    assert (status_name(refused), refused.message) == ("NOT_FOUND", f"group {missing} not found")

    mine = await client.create_group(agent.id, "mine", [member(world, 0)])
    refused = await refusal(client.send_message(agent.id, mine.id, ""))
    assert status_name(refused) == "INVALID_ARGUMENT" and refused.message
    refused = await refusal(client.send_message(agent.id, mine.id, "hi", mentions=[member(world, 2)]))
    assert status_name(refused) == "INVALID_ARGUMENT" and str(member(world, 2)) in refused.message
    await client.send_message(agent.id, mine.id, "once", request_id="same")
    refused = await refusal(client.send_message(agent.id, mine.id, "twice", request_id="same"))
    assert status_name(refused) == "ALREADY_EXISTS"
    assert not isinstance(refused, IMUnavailable)


# -- identity -----------------------------------------------------------------------


async def test_a_wrong_credential_is_refused(server: RunningIM, world: World) -> None:
    async with make_client(server.address, secret="not-the-secret") as im:
        refused = await refusal(im.create_agent_member(workspace(world), "helper"))
        assert status_name(refused) == "UNAUTHENTICATED"
        assert (
            "refused the runtime's credential" in refused.message and "not-the-secret" not in refused.message
        )
        refused = await refusal(im.list_members(uuid.uuid4()))
        assert status_name(refused) == "UNAUTHENTICATED"


async def test_the_client_acts_only_as_the_agents_it_hosts(server: RunningIM, world: World) -> None:
    async with make_client(server.address) as im:
        agent = await hosted(im, world)
        assert [m.id for m in await im.list_members(agent.id)][-1] == agent.id
        # A person, or an agent the runtime did not create: no token, so no call as them.
        person_made = await server.stub.CreateMember(
            im_pb2.CreateMemberRequest(kind=im_pb2.MEMBER_KIND_AGENT, display_name="stray"),
            metadata=world.md(0),
        )
        for someone in (member(world, 0), uuid.UUID(person_made.member.id)):
            refused = await refusal(im.list_members(someone))
            assert status_name(refused) == "UNAUTHENTICATED"
            assert f"no access token for member {someone}" in refused.message


# -- deadlines ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_nothing_listening_is_unavailable_within_the_deadline() -> None:
    async with make_client(f"127.0.0.1:{free_port()}", deadline=1.0) as im:
        started = time.monotonic()
        with pytest.raises(IMUnavailable) as caught:
            await within(im.get_member(uuid.uuid4(), uuid.uuid4()))
        assert time.monotonic() - started < 1.5
        assert status_name(caught.value) == "UNAVAILABLE" and caught.value.message


async def test_a_silent_server_is_unavailable_at_the_deadline() -> None:
    # Accepts connections and never answers: only the deadline ends the call.
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    try:
        async with make_client(f"127.0.0.1:{port}", deadline=0.5) as im:
            started = time.monotonic()
            with pytest.raises(IMUnavailable) as caught:
                await within(im.list_groups(uuid.uuid4()))
            assert 0.4 <= time.monotonic() - started < 1.5
            # The first call the client makes is for its token, and that one times out.
            assert status_name(caught.value) == "UNAVAILABLE" and "DEADLINE_EXCEEDED" in caught.value.message
    finally:
        for writer in held:
            writer.close()
        silent.close()
        await within(silent.wait_closed())


async def test_a_call_the_server_cancels_is_unavailable_not_a_refusal() -> None:
    # grpc cancels calls on an overloaded channel: worth a retry, unlike a refusal.
    async def cancel(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        await context.abort(grpc.StatusCode.CANCELLED, "dropped under load")
        raise AssertionError("abort raises")

    async def issue(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        response = auth_pb2.IssueServiceTokenResponse(access_token="a-token")
        response.access_expire_time.FromSeconds(int(time.time()) + 900)
        return response.SerializeToString()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "agentim.im.v1.IMService", {"CreateMember": grpc.unary_unary_rpc_method_handler(cancel)}
            ),
            grpc.method_handlers_generic_handler(
                "agentim.im.v1.AuthService", {"IssueServiceToken": grpc.unary_unary_rpc_method_handler(issue)}
            ),
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with make_client(f"127.0.0.1:{port}") as im:
            with pytest.raises(IMUnavailable) as caught:
                await within(im.create_agent_member(uuid.uuid4(), "helper"))
            assert status_name(caught.value) == "UNAVAILABLE" and "CANCELLED" in caught.value.message
    finally:
        await server.stop(None)


async def test_a_closed_client_refuses_calls_and_closes_once(server: RunningIM, world: World) -> None:
    im = make_client(server.address)
    agent = await hosted(im, world)
    await im.list_members(agent.id)
    await im.aclose()
    await im.aclose()
    with pytest.raises(IMUnavailable):
        await within(im.list_members(agent.id))
    with pytest.raises(IMUnavailable):
        await within(anext(im.watch(workspace(world))))


# -- watch ------------------------------------------------------------------------------


async def test_watch_passes_on_new_messages_only(client: GrpcIM, server: RunningIM, world: World) -> None:
    sender, peer = (await hosted(client, world)).id, (await hosted(client, world, "peer")).id
    before = await client.create_group(sender, "before", [peer])
    await client.send_message(sender, before.id, "sent before the watch")
    watcher = Watcher(client, workspace(world))
    try:
        await watcher.subscribed()
        group = await client.create_group(sender, "team", [peer])  # group_changed: skipped
        first = await client.send_message(sender, group.id, "one")
        await server.stub.EditMessage(  # message_edited: skipped
            im_pb2.EditMessageRequest(message_id=str(first.id), content="one!"),
            metadata=as_member(sender),
        )
        await client.mark_read(peer, group.id, first.id)  # read_updated: skipped
        second = await client.send_message(peer, group.id, "two", mentions=[sender])
        events = await watcher.take(2)
        assert [e.message for e in events] == [first, second]
        assert all(e.cursor for e in events) and events[0].cursor != events[1].cursor
        assert watcher.pending() == 0 and watcher.subscriptions == 1
        # It started after the events before it: the last one was the message sent then.
        (start,) = watcher.start_cursors
        assert int(start) == int(events[0].cursor) - 2  # then came the group's creation and "one"
        # Each event passed on names the one passed on before it, over those
        # skipped: nothing was lost between them.
        assert [e.previous_sequence for e in events] == [int(start), events[0].sequence]
        assert events[1].sequence - events[0].sequence == 3
    finally:
        await watcher.stop()


async def test_watch_resumes_after_a_cursor(client: GrpcIM, world: World) -> None:
    sender = (await hosted(client, world)).id
    group = await client.create_group(sender, "team", [member(world, 1)])
    watcher = Watcher(client, workspace(world))
    await watcher.subscribed()
    for i in range(2):
        await client.send_message(sender, group.id, f"m{i}")
    seen = await watcher.take(2)
    await watcher.stop()

    for i in range(2, 5):
        await client.send_message(sender, group.id, f"m{i}")
    resumed = Watcher(client, workspace(world), after_cursor=seen[-1].cursor)
    try:
        again = await resumed.take(3)
        assert contents(again) == ["m2", "m3", "m4"]
        assert again[0].previous_sequence == seen[-1].sequence
        await client.send_message(sender, group.id, "m5")
        assert contents(await resumed.take(1)) == ["m5"]
        assert resumed.pending() == 0
    finally:
        await resumed.stop()


async def test_watch_of_members_passes_on_their_groups_messages(client: GrpcIM, world: World) -> None:
    sender, watched = (await hosted(client, world)).id, member(world, 1)
    theirs = await client.create_group(sender, "theirs", [watched])
    others = await client.create_group(sender, "others", [member(world, 2)])
    watcher = Watcher(client, workspace(world), member_ids=[watched])
    try:
        await watcher.subscribed()
        await client.send_message(sender, others.id, "not for the watched member")
        sent = await client.send_message(sender, theirs.id, "for the watched member")
        (event,) = await watcher.take(1)
        assert (event.message, event.member_ids) == (sent, (watched,))
    finally:
        await watcher.stop()


async def test_watch_of_members_of_another_workspace_is_refused(
    client: GrpcIM, server: RunningIM, world: World
) -> None:
    stranger = await make_world(server.stub, people=2)
    watcher = Watcher(client, workspace(world), member_ids=[member(stranger, 1)])
    try:
        await watcher.subscribed()
        group = await person_creates_group(server, member(stranger, 0), "g", member(stranger, 1))
        await person_sends(server, member(stranger, 0), group, "elsewhere")
        with pytest.raises(IMError) as caught:
            await watcher.take(1)
        assert status_name(caught.value) == "INVALID_ARGUMENT"
    finally:
        await watcher.stop()


async def test_watch_refusals_are_raised(client: GrpcIM, world: World) -> None:
    unknown = uuid.uuid4()
    refused = await refusal(anext(client.watch(unknown)))
    assert (status_name(refused), refused.message) == ("NOT_FOUND", f"workspace {unknown} not found")
    refused = await refusal(anext(client.watch(workspace(world), after_cursor="not-a-cursor")))
    assert status_name(refused) == "INVALID_ARGUMENT" and "after_cursor" in refused.message
    refused = await refusal(anext(client.watch(workspace(world), after_cursor="999999")))
    assert status_name(refused) == "INVALID_ARGUMENT"
    refused = await refusal(anext(client.watch(workspace(world), member_ids=[uuid.uuid4()])))
    assert status_name(refused) == "NOT_FOUND"


async def test_watch_with_a_wrong_credential_is_refused(server: RunningIM, world: World) -> None:
    async with make_client(server.address, secret="not-the-secret") as im:
        refused = await refusal(anext(im.watch(workspace(world))))
        assert status_name(refused) == "UNAUTHENTICATED"


async def test_cancelling_the_consumer_ends_the_watch_promptly(client: GrpcIM, world: World) -> None:
    watcher = Watcher(client, workspace(world))
    await watcher.subscribed()
    started = time.monotonic()
    watcher.task.cancel()
    await within(asyncio.gather(watcher.task, return_exceptions=True), 1.0)
    assert watcher.task.cancelled() and time.monotonic() - started < 0.5
    # The client stays usable.
    assert len(await client.list_members((await hosted(client, world)).id)) == 4


async def test_closing_the_client_ends_running_watches(server: RunningIM, world: World) -> None:
    im = make_client(server.address)
    watcher = Watcher(im, workspace(world))
    await watcher.subscribed()
    await im.aclose()
    await within(watcher.task, 1.0)
    assert watcher.pending() == 0 and not watcher.task.cancelled()


async def start_on_port(url: str, port: int) -> RunningIM:
    """Starts an IM server on a port just given up by another, retrying the bind briefly."""
    for _ in range(50):
        try:
            return await start_im(url, IM_GRPC_ADDRESS=f"127.0.0.1:{port}")
        except OSError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"port {port} did not become free")


async def test_watch_keeps_going_across_a_server_restart(sqlite_url: str) -> None:
    first = await start_im(sqlite_url)
    port = first.port
    second: RunningIM | None = None
    im = make_client(first.address)
    try:
        world = await make_world(first.stub, people=2)
        sender, peer = (await hosted(im, world)).id, (await hosted(im, world, "peer")).id
        group = await im.create_group(sender, "team", [peer])
        watcher = Watcher(im, workspace(world))
        await watcher.subscribed()
        for i in range(2):
            await im.send_message(sender, group.id, f"m{i}")
        assert contents(await watcher.take(2)) == ["m0", "m1"]

        await stop_im(first)  # graceful: the IM ends the stream with OK
        await asyncio.sleep(0.1)  # the watcher now finds nothing listening, and backs off
        second = await start_on_port(sqlite_url, port)
        # Sent before or after the watcher is back: it must get them either way.
        for i in range(2, 4):
            await second.stub.SendMessage(
                im_pb2.SendMessageRequest(group_id=str(group.id), content=f"m{i}"),
                metadata=as_member(sender),
            )
        await watcher.subscribed(2)
        # The same client's unary calls reach the new server too.
        for i in range(4, 6):
            await im.send_message(peer, group.id, f"m{i}")
        events = await watcher.take(4)
        assert contents(events) == ["m2", "m3", "m4", "m5"]
        assert len({e.message.id for e in events}) == 4
        assert watcher.pending() == 0 and watcher.subscriptions == 2
        await watcher.stop()
    finally:
        await im.aclose()
        await stop_im(first)
        if second is not None:
            await stop_im(second)


async def test_a_message_over_the_sending_rate_is_sent_again_after_the_wait_the_im_names(
    sqlite_url: str,
) -> None:
    # One message at once, then one every 50 ms: sent back to back, most are refused at first.
    running = await start_im(sqlite_url, LIMIT_SEND_PER_SECOND="20", LIMIT_SEND_BURST="1")
    try:
        world = await make_world(running.stub, people=1)
        async with make_client(running.address) as im:
            agent = await hosted(im, world)
            chat = await im.create_group(agent.id, "busy", [member(world, 0)])
            sent = [
                await within(im.send_message(agent.id, chat.id, f"answer {i}", request_id=f"answer-{i}"))
                for i in range(5)
            ]
            assert [m.content for m in sent] == [f"answer {i}" for i in range(5)]
            history = await im.list_messages(agent.id, chat.id, limit=50)
            assert sorted(m.content for m in history if m.sender_id == agent.id) == [
                f"answer {i}" for i in range(5)
            ]
            # Without a request id a retry could send twice: the refusal is the caller's, with the wait.
            refused = await refusal(im.send_message(agent.id, chat.id, "no key"))
            assert status_name(refused) == "RESOURCE_EXHAUSTED"
            assert refused.retry_after_seconds is not None and 0 < refused.retry_after_seconds <= 0.05
    finally:
        await stop_im(running)
