"""The IM service over real gRPC on loopback, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2

from agentim.im.v1 import im_pb2
from tests.conftest import RunningIM, make_world
from tests.identities import as_member, as_unknown, legacy_member_header


async def status_of(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), caught.value.details() or ""


async def send(im: RunningIM, member: str, group: str, content: str, **fields: Any) -> im_pb2.Message:
    response = await im.stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=group, content=content, **fields), metadata=as_member(member)
    )
    return response.message


async def test_workspace_members_and_identity(im: RunningIM) -> None:
    world = await make_world(im.stub, people=2)
    alice, bob = world.members
    got = await im.stub.GetWorkspace(
        im_pb2.GetWorkspaceRequest(workspace_id=world.workspace.id), metadata=world.md(1)
    )
    assert got.workspace.name == world.workspace.name
    listed = await im.stub.ListWorkspaces(im_pb2.ListWorkspacesRequest(), metadata=world.md(0))
    assert [w.id for w in listed.workspaces] == [world.workspace.id]

    members = await im.stub.ListMembers(im_pb2.ListMembersRequest(page_size=1), metadata=world.md(0))
    assert [m.id for m in members.members] == [alice.id] and members.next_page_token
    rest = await im.stub.ListMembers(
        im_pb2.ListMembersRequest(page_size=1, page_token=members.next_page_token), metadata=world.md(0)
    )
    assert [m.id for m in rest.members] == [bob.id] and not rest.next_page_token

    updated = await im.stub.UpdateMember(
        im_pb2.UpdateMemberRequest(
            member=im_pb2.Member(id=bob.id, display_name="Bob", avatar="🤖"),
            update_mask=field_mask_pb2.FieldMask(paths=["display_name", "avatar"]),
        ),
        metadata=world.md(1),
    )
    assert (updated.member.display_name, updated.member.avatar) == ("Bob", "🤖")
    code, message = await status_of(
        im.stub.UpdateMember(
            im_pb2.UpdateMemberRequest(
                member=im_pb2.Member(id=bob.id, display_name="x"),
                update_mask=field_mask_pb2.FieldMask(paths=["display_name"]),
            ),
            metadata=world.md(0),
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED and "only update itself" in message

    code, message = await status_of(im.stub.GetMember(im_pb2.GetMemberRequest(member_id=bob.id)))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in message
    code, _ = await status_of(
        im.stub.GetMember(im_pb2.GetMemberRequest(member_id=bob.id), metadata=as_unknown())
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED
    code, _ = await status_of(
        im.stub.GetMember(im_pb2.GetMemberRequest(member_id=bob.id), metadata=legacy_member_header(bob.id))
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED


async def test_other_workspace_is_not_found(im: RunningIM) -> None:
    ours = await make_world(im.stub, people=2)
    theirs = await make_world(im.stub, people=2)
    group = (
        await im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="secret", member_ids=[theirs.members[1].id]), metadata=theirs.md(0)
        )
    ).group
    message = await send(im, theirs.members[0].id, group.id, "hidden")
    for call in (
        im.stub.GetWorkspace(
            im_pb2.GetWorkspaceRequest(workspace_id=theirs.workspace.id), metadata=ours.md(0)
        ),
        im.stub.GetMember(im_pb2.GetMemberRequest(member_id=theirs.members[0].id), metadata=ours.md(0)),
        im.stub.GetGroup(im_pb2.GetGroupRequest(group_id=group.id), metadata=ours.md(0)),
        im.stub.GetMessage(im_pb2.GetMessageRequest(message_id=message.id), metadata=ours.md(0)),
        im.stub.SendMessage(im_pb2.SendMessageRequest(group_id=group.id, content="hi"), metadata=ours.md(0)),
        im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="x", member_ids=[theirs.members[0].id]), metadata=ours.md(0)
        ),
        im.stub.GetOrCreateDirectGroup(
            im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=theirs.members[0].id), metadata=ours.md(0)
        ),
    ):
        code, _ = await status_of(call)
        assert code == grpc.StatusCode.NOT_FOUND


async def test_groups_membership_and_permissions(im: RunningIM) -> None:
    world = await make_world(im.stub, people=4)
    a, b, c, d = (m.id for m in world.members)
    group = (
        await im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="team", member_ids=[b]), metadata=world.md(0)
        )
    ).group
    assert list(group.member_ids) == [a, b] and group.kind == im_pb2.GROUP_KIND_GROUP

    code, message = await status_of(
        im.stub.GetGroup(im_pb2.GetGroupRequest(group_id=group.id), metadata=world.md(2))
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED and "not in group" in message
    code, _ = await status_of(
        im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=group.id, content="let me in"), metadata=world.md(2)
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED

    added = await im.stub.AddGroupMembers(
        im_pb2.AddGroupMembersRequest(group_id=group.id, member_ids=[c, d]), metadata=world.md(1)
    )
    assert list(added.group.member_ids) == [a, b, c, d]
    renamed = await im.stub.UpdateGroup(
        im_pb2.UpdateGroupRequest(
            group=im_pb2.Group(id=group.id, name="core team"),
            update_mask=field_mask_pb2.FieldMask(paths=["name"]),
        ),
        metadata=world.md(2),
    )
    assert renamed.group.name == "core team"
    code, message = await status_of(
        im.stub.RemoveGroupMembers(
            im_pb2.RemoveGroupMembersRequest(group_id=group.id, member_ids=[c]), metadata=world.md(1)
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED and "creator" in message
    removed = await im.stub.RemoveGroupMembers(
        im_pb2.RemoveGroupMembersRequest(group_id=group.id, member_ids=[d]), metadata=world.md(3)
    )
    assert list(removed.group.member_ids) == [a, b, c]
    mine = await im.stub.ListGroups(im_pb2.ListGroupsRequest(), metadata=world.md(2))
    assert [g.id for g in mine.groups] == [group.id]
    assert not (await im.stub.ListGroups(im_pb2.ListGroupsRequest(), metadata=world.md(3))).groups
    code, _ = await status_of(im.stub.ListGroups(im_pb2.ListGroupsRequest(member_id=a), metadata=world.md(2)))
    assert code == grpc.StatusCode.PERMISSION_DENIED


async def test_direct_group_is_one_per_pair(im: RunningIM) -> None:
    world = await make_world(im.stub, people=3)
    a, b, _ = (m.id for m in world.members)
    first = await im.stub.GetOrCreateDirectGroup(
        im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=b), metadata=world.md(0)
    )
    second = await im.stub.GetOrCreateDirectGroup(
        im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=a), metadata=world.md(1)
    )
    assert first.created and not second.created
    assert first.group.id == second.group.id and first.group.kind == im_pb2.GROUP_KIND_DIRECT
    assert sorted(first.group.member_ids) == sorted([a, b])

    # Both sides at once, from scratch: still one group.
    world2 = await make_world(im.stub, people=2)
    x, y = (m.id for m in world2.members)
    results = await asyncio.gather(
        *[
            im.stub.GetOrCreateDirectGroup(
                im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=peer), metadata=world2.md(side)
            )
            for side, peer in [(0, y), (1, x)] * 4
        ]
    )
    assert len({r.group.id for r in results}) == 1
    assert sum(r.created for r in results) == 1

    code, _ = await status_of(
        im.stub.UpdateGroup(
            im_pb2.UpdateGroupRequest(
                group=im_pb2.Group(id=first.group.id, name="x"),
                update_mask=field_mask_pb2.FieldMask(paths=["name"]),
            ),
            metadata=world.md(0),
        )
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    code, _ = await status_of(
        im.stub.AddGroupMembers(
            im_pb2.AddGroupMembersRequest(group_id=first.group.id, member_ids=[world.members[2].id]),
            metadata=world.md(0),
        )
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    code, _ = await status_of(
        im.stub.GetOrCreateDirectGroup(
            im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=a), metadata=world.md(0)
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def test_send_edit_get_and_idempotent_retries(im: RunningIM) -> None:
    world = await make_world(im.stub, people=2)
    a, b = (m.id for m in world.members)
    group = (
        await im.stub.CreateGroup(im_pb2.CreateGroupRequest(name="g", member_ids=[b]), metadata=world.md(0))
    ).group
    first = await send(im, a, group.id, "hello @b", mentions=[b], request_id="req-1")
    assert uuid.UUID(first.id).version == 7
    assert first.sender_id == a and list(first.mentions) == [b] and first.send_time.seconds > 0
    reply = await send(
        im,
        b,
        group.id,
        "```py\nprint(1)\n```",
        content_type=im_pb2.CONTENT_TYPE_CODE,
        reply_to_message_id=first.id,
    )
    assert reply.reply_to_message_id == first.id and reply.content_type == im_pb2.CONTENT_TYPE_CODE

    # Concurrent retries of one request give one message.
    retries = await asyncio.gather(
        *[send(im, a, group.id, "once", request_id="req-2", mentions=[b]) for _ in range(8)]
    )
    assert len({m.id for m in retries}) == 1
    history = await im.stub.ListMessages(im_pb2.ListMessagesRequest(group_id=group.id), metadata=world.md(1))
    assert [m.content for m in history.messages] == ["hello @b", reply.content, "once"]

    code, message = await status_of(
        im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=group.id, content="other", request_id="req-1"),
            metadata=world.md(0),
        )
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS and "req-1" in message

    edited = await im.stub.EditMessage(
        im_pb2.EditMessageRequest(message_id=first.id, content="hello again"), metadata=world.md(0)
    )
    assert edited.message.content == "hello again" and edited.message.HasField("edit_time")
    fetched = await im.stub.GetMessage(im_pb2.GetMessageRequest(message_id=first.id), metadata=world.md(1))
    assert fetched.message.content == "hello again"
    code, _ = await status_of(
        im.stub.EditMessage(
            im_pb2.EditMessageRequest(message_id=first.id, content="mine now"), metadata=world.md(1)
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED


async def test_metadata_round_trips(im: RunningIM) -> None:
    world = await make_world(im.stub, people=2)
    group = (
        await im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="g", member_ids=[world.members[1].id]), metadata=world.md(0)
        )
    ).group
    request = im_pb2.SendMessageRequest(
        group_id=group.id, content="task", content_type=im_pb2.CONTENT_TYPE_TASK
    )
    request.metadata.update({"task": {"id": "t1", "priority": 2, "tags": ["a", "b"]}})
    sent = (await im.stub.SendMessage(request, metadata=world.md(0))).message
    fetched = (
        await im.stub.GetMessage(im_pb2.GetMessageRequest(message_id=sent.id), metadata=world.md(1))
    ).message
    assert fetched.metadata == request.metadata


async def test_bad_input_gets_clear_errors(im_factory: Any) -> None:
    im: RunningIM = await im_factory(
        IM_MAX_CONTENT_BYTES="100", IM_MAX_MENTIONS="1", IM_MAX_GROUP_MEMBERS="3"
    )
    world = await make_world(im.stub, people=4)
    a, b, c, d = (m.id for m in world.members)
    group = (
        await im.stub.CreateGroup(im_pb2.CreateGroupRequest(name="g", member_ids=[b]), metadata=world.md(0))
    ).group
    cases = [
        (
            im_pb2.SendMessageRequest(group_id="nope", content="x"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "group_id",
        ),
        (im_pb2.SendMessageRequest(group_id=group.id, content=""), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (
            im_pb2.SendMessageRequest(group_id=group.id, content="x" * 101),
            grpc.StatusCode.INVALID_ARGUMENT,
            "limit",
        ),
        (
            im_pb2.SendMessageRequest(group_id=group.id, content="x", mentions=[a, b]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "mentions",
        ),
        (
            im_pb2.SendMessageRequest(group_id=group.id, content="x", mentions=[c]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not in the group",
        ),
        (
            im_pb2.SendMessageRequest(group_id=group.id, content="x", reply_to_message_id=str(uuid.uuid4())),
            grpc.StatusCode.INVALID_ARGUMENT,
            "reply_to",
        ),
        (
            im_pb2.SendMessageRequest(group_id=str(uuid.uuid4()), content="x"),
            grpc.StatusCode.NOT_FOUND,
            "not found",
        ),
        (
            im_pb2.SendMessageRequest(
                group_id=group.id, content="x", content_type=im_pb2.ContentType.ValueType(99)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "content_type",
        ),
    ]
    for request, expected, words in cases:
        code, message = await status_of(im.stub.SendMessage(request, metadata=world.md(0)))
        assert (code, words in message) == (expected, True), (request, code, message)

    code, message = await status_of(
        im.stub.AddGroupMembers(
            im_pb2.AddGroupMembersRequest(group_id=group.id, member_ids=[c, d]), metadata=world.md(0)
        )
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 3" in message
    code, _ = await status_of(
        im.stub.CreateGroup(im_pb2.CreateGroupRequest(name="big", member_ids=[b, c, d]), metadata=world.md(0))
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    code, _ = await status_of(
        im.stub.ListMessages(
            im_pb2.ListMessagesRequest(group_id=group.id, page_token="garbage"), metadata=world.md(0)
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = await status_of(
        im.stub.ListMessages(
            im_pb2.ListMessagesRequest(group_id=group.id, page_size=-1), metadata=world.md(0)
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = await status_of(
        im.stub.CreateWorkspace(im_pb2.CreateWorkspaceRequest(name="", creator_display_name="x"))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = await status_of(
        im.stub.CreateMember(im_pb2.CreateMemberRequest(display_name="no kind"), metadata=world.md(0))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # Nothing half-done: the group still has its two members and no message.
    after = await im.stub.GetGroup(im_pb2.GetGroupRequest(group_id=group.id), metadata=world.md(0))
    assert list(after.group.member_ids) == [a, b]
    history = await im.stub.ListMessages(im_pb2.ListMessagesRequest(group_id=group.id), metadata=world.md(0))
    assert not history.messages


async def test_request_size_limit(im_factory: Any) -> None:
    im: RunningIM = await im_factory(GRPC_MAX_MESSAGE_BYTES="4096", IM_MAX_CONTENT_BYTES="100000")
    world = await make_world(im.stub, people=2)
    group = (
        await im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="g", member_ids=[world.members[1].id]), metadata=world.md(0)
        )
    ).group
    code, _ = await status_of(
        im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=group.id, content="x" * 5000), metadata=world.md(0)
        )
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await send(im, world.members[0].id, group.id, "x" * 3000)).content == "x" * 3000


async def test_history_pages_both_ways(im: RunningIM) -> None:
    world = await make_world(im.stub, people=2)
    group = (
        await im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="g", member_ids=[world.members[1].id]), metadata=world.md(0)
        )
    ).group
    sent = [await send(im, world.members[i % 2].id, group.id, f"m{i}") for i in range(7)]
    ids = [m.id for m in sent]

    backwards: list[str] = []
    token = ""
    while True:
        page = await im.stub.ListMessages(
            im_pb2.ListMessagesRequest(group_id=group.id, page_size=3, page_token=token), metadata=world.md(0)
        )
        backwards = [m.id for m in page.messages] + backwards
        assert [m.id for m in page.messages] == sorted(m.id for m in page.messages)
        token = page.next_page_token
        if not token:
            break
    assert backwards == ids

    forwards: list[str] = []
    page = await im.stub.ListMessages(
        im_pb2.ListMessagesRequest(group_id=group.id, page_size=2, after_message_id=ids[0]),
        metadata=world.md(1),
    )
    forwards += [m.id for m in page.messages]
    while page.next_page_token:
        page = await im.stub.ListMessages(
            im_pb2.ListMessagesRequest(group_id=group.id, page_size=2, page_token=page.next_page_token),
            metadata=world.md(1),
        )
        forwards += [m.id for m in page.messages]
    assert forwards == ids[1:]
    before = await im.stub.ListMessages(
        im_pb2.ListMessagesRequest(group_id=group.id, page_size=2, before_message_id=ids[3]),
        metadata=world.md(1),
    )
    assert [m.id for m in before.messages] == ids[1:3]


async def test_unread_read_state_and_chat_list(im: RunningIM) -> None:
    world = await make_world(im.stub, people=3)
    a, b, c = (m.id for m in world.members)
    team = (
        await im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="team", member_ids=[b, c]), metadata=world.md(0)
        )
    ).group
    direct = (
        await im.stub.GetOrCreateDirectGroup(
            im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=b), metadata=world.md(2)
        )
    ).group
    m1 = await send(im, a, team.id, "one")
    m2 = await send(im, c, direct.id, "two")
    m3 = await send(im, b, team.id, "my own")
    m4 = await send(im, a, team.id, "four")

    unread = await im.stub.GetAllUnread(im_pb2.GetAllUnreadRequest(), metadata=world.md(1))
    assert [m.id for m in unread.messages] == [m1.id, m2.id, m4.id] and unread.remaining_count == 0
    capped = await im.stub.GetAllUnread(im_pb2.GetAllUnreadRequest(page_size=2), metadata=world.md(1))
    assert [m.id for m in capped.messages] == [m1.id, m2.id] and capped.remaining_count == 1

    chats = await im.stub.ListChats(im_pb2.ListChatsRequest(), metadata=world.md(1))
    assert [(ch.group.id, ch.unread_count, ch.last_message.id) for ch in chats.chats] == [
        (team.id, 2, m4.id),
        (direct.id, 1, m2.id),
    ]

    marked = await im.stub.MarkRead(
        im_pb2.MarkReadRequest(group_id=team.id, up_to_message_id=m4.id), metadata=world.md(1)
    )
    assert marked.read_state.last_read_message_id == m4.id and marked.read_state.unread_count == 0
    # Moving back is ignored: the position only moves forward.
    back = await im.stub.MarkRead(
        im_pb2.MarkReadRequest(group_id=team.id, up_to_message_id=m1.id), metadata=world.md(1)
    )
    assert back.read_state.last_read_message_id == m4.id
    unread = await im.stub.GetAllUnread(im_pb2.GetAllUnreadRequest(), metadata=world.md(1))
    assert [m.id for m in unread.messages] == [m2.id]
    del m3

    m5 = await send(im, c, direct.id, "five")
    chats = await im.stub.ListChats(im_pb2.ListChatsRequest(page_size=1), metadata=world.md(1))
    assert [(ch.group.id, ch.unread_count) for ch in chats.chats] == [(direct.id, 2)]
    assert chats.chats[0].last_message.id == m5.id
    rest = await im.stub.ListChats(
        im_pb2.ListChatsRequest(page_size=1, page_token=chats.next_page_token), metadata=world.md(1)
    )
    assert [(ch.group.id, ch.unread_count) for ch in rest.chats] == [
        (team.id, 0)
    ] and not rest.next_page_token

    code, _ = await status_of(
        im.stub.MarkRead(
            im_pb2.MarkReadRequest(group_id=team.id, up_to_message_id=m2.id), metadata=world.md(1)
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def test_idempotent_creates(im: RunningIM) -> None:
    first = await im.stub.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(name="w", creator_display_name="z", request_id=f"ws-{uuid.uuid4()}")
    )
    rid = f"ws-{uuid.uuid4()}"
    one, two = await asyncio.gather(
        *[
            im.stub.CreateWorkspace(
                im_pb2.CreateWorkspaceRequest(name="w", creator_display_name="z", request_id=rid)
            )
            for _ in range(2)
        ]
    )
    assert one.workspace.id == two.workspace.id and one.creator.id == two.creator.id
    code, _ = await status_of(
        im.stub.CreateWorkspace(
            im_pb2.CreateWorkspaceRequest(name="other", creator_display_name="z", request_id=rid)
        )
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS

    md = as_member(first.creator.id)
    member_requests = [
        im.stub.CreateMember(
            im_pb2.CreateMemberRequest(kind=im_pb2.MEMBER_KIND_AGENT, display_name="bot", request_id="m1"),
            metadata=md,
        )
        for _ in range(3)
    ]
    members = await asyncio.gather(*member_requests)
    assert len({m.member.id for m in members}) == 1
    groups = await asyncio.gather(
        *[
            im.stub.CreateGroup(
                im_pb2.CreateGroupRequest(name="g", member_ids=[members[0].member.id], request_id="g1"),
                metadata=md,
            )
            for _ in range(3)
        ]
    )
    assert len({g.group.id for g in groups}) == 1


async def test_concurrent_sends_across_workspaces_mixing_valid_and_invalid(im: RunningIM) -> None:
    """Sends that arrive together are written together; each is judged on its own."""
    worlds = [await make_world(im.stub, people=3) for _ in range(2)]
    groups = [
        (
            await im.stub.CreateGroup(
                im_pb2.CreateGroupRequest(name="g", member_ids=[world.members[1].id]), metadata=world.md(0)
            )
        ).group
        for world in worlds
    ]
    streams = [im.stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=world.md(1)) for world in worlds]
    for stream in streams:
        await asyncio.wait_for(stream.wait_for_connection(), 5)

    def attempt(index: int) -> Any:
        world, group = worlds[index % 2], groups[index % 2]
        outsider = world.members[2].id
        request = im_pb2.SendMessageRequest(group_id=group.id, content=f"m{index}", request_id=f"r{index}")
        if index % 5 == 3:
            request.mentions.append(outsider)  # not in the group: refused
        return im.stub.SendMessage(request, metadata=world.md(0))

    results = await asyncio.gather(*[attempt(i) for i in range(40)], return_exceptions=True)
    for index, result in enumerate(results):
        if index % 5 == 3:
            assert isinstance(result, grpc.aio.AioRpcError), index
            assert result.code() == grpc.StatusCode.INVALID_ARGUMENT
        else:
            assert not isinstance(result, BaseException), (index, result)
            assert result.message.content == f"m{index}"
    for side, stream in enumerate(streams):
        events = [await asyncio.wait_for(stream.read(), 5) for _ in range(16)]
        sequences = [e.sequence for e in events]
        assert sequences == list(range(sequences[0], sequences[0] + 16)), sequences
        got = sorted(e.message_created.message.content for e in events)
        assert got == sorted(f"m{i}" for i in range(side, 40, 2) if i % 5 != 3)
        stream.cancel()
    # A retry of each stored request returns the stored message, not a new one.
    again = await attempt(0)
    assert again.message.id == results[0].message.id  # type: ignore[union-attr]
