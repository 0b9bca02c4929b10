"""Every IM call authenticated by access tokens, over real gRPC (SQLite and PostgreSQL).

Bad credentials are UNAUTHENTICATED, and so are the retired `x-member-id`
and `x-agentim-service` headers (on the runtime and the memory service
too); valid ones act as their own member and nobody else; services act
only for what their rules allow; and the
attacks of issue 11's "Anyone can be anyone", made with another member's
own valid token, are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2

from agentim.im.v1 import im_pb2
from agentim.memory.v1 import memory_pb2 as mpb
from agentim.runtime.v1 import runtime_pb2 as rpb
from services.common.identity import VIEW_AS_KEY, bearer_metadata
from services.memory.adapters.im_directory import GrpcMemberDirectory
from tests.auth_support import service_secret
from tests.authn_support import (
    Cast,
    Metadata,
    claims_of,
    expired_token,
    foreign_token,
    make_cast,
    read_only,
    tampered_token,
)
from tests.conftest import RunningIM
from tests.identities import legacy_member_header
from tests.integration.memory_harness import migrated_url, start_memory, stop_memory
from tests.integration.test_runtime_grpc import start_runtime, stop_runtime


async def status_of(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), caught.value.details() or ""


@pytest.fixture
async def cast(im: RunningIM) -> Cast:
    return await make_cast(im)


def list_groups() -> im_pb2.ListGroupsRequest:
    return im_pb2.ListGroupsRequest()


async def test_a_call_without_a_credential_is_unauthenticated(im: RunningIM, cast: Cast) -> None:
    code, message = await status_of(im.stub.ListGroups(list_groups()))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in message
    assert len((await im.stub.ListGroups(list_groups(), metadata=cast.member.md)).groups) == 1


async def test_expired_tampered_and_foreign_tokens_are_unauthenticated(
    im: RunningIM, cast: Cast, tmp_path: Path
) -> None:
    claims = claims_of(cast.member, cast.workspace)
    for token in [
        expired_token(claims),
        tampered_token(cast.member.access_token),
        foreign_token(claims, tmp_path / "keys"),
        "not-a-jwt",
    ]:
        code, _ = await status_of(im.stub.ListGroups(list_groups(), metadata=bearer_metadata(token)))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    # A bad token is never passed over for the legacy header beside it.
    both = (*bearer_metadata(tampered_token(cast.member.access_token)), *legacy_member_header(cast.member.id))
    assert (await status_of(im.stub.ListGroups(list_groups(), metadata=both)))[
        0
    ] == grpc.StatusCode.UNAUTHENTICATED


async def test_a_read_only_token_reads_but_does_not_send(im: RunningIM, cast: Cast) -> None:
    reader = await read_only(im, cast.member)
    assert [g.id for g in (await im.stub.ListGroups(list_groups(), metadata=reader)).groups] == [
        cast.group.id
    ]
    code, message = await status_of(
        im.stub.SendMessage(im_pb2.SendMessageRequest(group_id=cast.group.id, content="hi"), metadata=reader)
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED and "read-only" in message


async def test_a_token_acts_as_its_own_member_whatever_else_the_call_names(im: RunningIM, cast: Cast) -> None:
    # The legacy header naming the owner is ignored beside a token: the member sends as itself.
    sent = await im.stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=cast.group.id, content="mine"),
        metadata=(*cast.member.md, *legacy_member_header(cast.owner.id)),
    )
    assert sent.message.sender_id == cast.member.id
    # Naming another member's groups is refused.
    code, _ = await status_of(
        im.stub.ListGroups(im_pb2.ListGroupsRequest(member_id=cast.owner.id), metadata=cast.member.md)
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED


async def test_the_memory_service_reads_the_directory_and_sends_nothing(im: RunningIM, cast: Cast) -> None:
    found = await im.stub.GetMember(im_pb2.GetMemberRequest(member_id=cast.member.id), metadata=cast.memory)
    assert found.member.id == cast.member.id
    for call in [
        im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=cast.group.id, content="x"), metadata=cast.memory
        ),
        im.stub.ListGroups(im_pb2.ListGroupsRequest(member_id=cast.member.id), metadata=cast.memory),
    ]:
        assert (await status_of(call))[0] == grpc.StatusCode.PERMISSION_DENIED


async def test_the_runtime_service_cannot_act_as_a_person(im: RunningIM, cast: Cast) -> None:
    send = im_pb2.SendMessageRequest(group_id=cast.group.id, content="forged")
    # Its own token names no member, and no metadata can name one for it.
    for metadata in [cast.runtime, (*cast.runtime, *legacy_member_header(cast.owner.id))]:
        code, _ = await status_of(im.stub.SendMessage(send, metadata=metadata))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    # It creates agents (hosted by it), never people.
    code, _ = await status_of(
        im.stub.CreateMember(
            im_pb2.CreateMemberRequest(
                kind=im_pb2.MEMBER_KIND_HUMAN, display_name="puppet", workspace_id=cast.workspace.id
            ),
            metadata=cast.runtime,
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    # It renames the agents it hosts, and nobody else.
    rename = im_pb2.UpdateMemberRequest(update_mask=field_mask_pb2.FieldMask(paths=["display_name"]))
    rename.member.display_name = "renamed"
    rename.member.id = cast.agent.id
    renamed = await im.stub.UpdateMember(rename, metadata=cast.runtime)
    assert renamed.member.display_name == "renamed"
    rename.member.id = cast.owner.id
    assert (await status_of(im.stub.UpdateMember(rename, metadata=cast.runtime)))[0] == (
        grpc.StatusCode.PERMISSION_DENIED
    )


async def test_an_agent_token_acts_as_its_agent(im: RunningIM, cast: Cast) -> None:
    sent = await im.stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=cast.group.id, content="beep"), metadata=cast.agent.md
    )
    assert sent.message.sender_id == cast.agent.id


async def test_the_runtime_watches_a_whole_workspace_and_people_do_not(im: RunningIM, cast: Cast) -> None:
    request = im_pb2.WatchEventsRequest(workspace_id=cast.workspace.id)
    stream = im.stub.WatchEvents(request, metadata=cast.runtime)
    assert await stream.initial_metadata() is not None
    stream.cancel()
    refused = im.stub.WatchEvents(request, metadata=cast.owner.md)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await refused.read()
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


def retired(key: str, value: str) -> tuple[tuple[str, str], ...]:
    return ((key, value),)


async def test_the_retired_headers_get_no_call_through_on_any_service(
    im: RunningIM, cast: Cast, database_url: str, tmp_path: Path
) -> None:
    """Issue 11's "done when": no call succeeds without a valid credential.
    The member named by x-member-id exists and may make each call with its token."""
    runtime = await start_runtime(im.address, tmp_path / "runtime.db")
    memory = await start_memory(
        await migrated_url("sqlite" if database_url.startswith("sqlite") else "postgresql", tmp_path),
        directory=GrpcMemberDirectory(im.address, service_secret=lambda: service_secret("memory")),
    )
    try:
        calls: dict[str, Callable[[Metadata], Any]] = {
            "IM": lambda md: im.stub.ListGroups(list_groups(), metadata=md),
            "runtime": lambda md: runtime.stub.ListAgents(rpb.ListAgentsRequest(), metadata=md),
            "memory": lambda md: memory.stub.GetMemoryStats(
                mpb.GetMemoryStatsRequest(workspace_id=cast.workspace.id), metadata=md
            ),
        }
        for service, call in calls.items():
            await call(cast.member.md)  # the member may, with its token
            for key, value in [
                ("x-member-id", cast.member.id),
                ("x-member-id", cast.owner.id),
                ("x-agentim-service", "embedded"),
                ("x-agentim-service", service_secret("runtime")),
            ]:
                code, message = await status_of(call(retired(key, value)))
                assert code == grpc.StatusCode.UNAUTHENTICATED, (service, key)
                assert message == (
                    f"`{key}` is no longer accepted: this call needs"
                    " `authorization: Bearer <access token>` (see docs/security.md)"
                ), (service, key)
            code, message = await status_of(call(()))
            assert (code, message) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "this call needs `authorization: Bearer <access token>`",
            ), service
    finally:
        await stop_memory(memory)
        await stop_runtime(runtime)


async def test_anyone_can_no_longer_be_anyone(im: RunningIM, cast: Cast) -> None:
    """Issue 11's attacks, made by a member of the workspace with their own valid token."""
    intruder = cast.outsider.md
    # Read a private group.
    for call in [
        im.stub.GetGroup(im_pb2.GetGroupRequest(group_id=cast.group.id), metadata=intruder),
        im.stub.ListMessages(im_pb2.ListMessagesRequest(group_id=cast.group.id), metadata=intruder),
        im.stub.GetMessage(im_pb2.GetMessageRequest(message_id=cast.message.id), metadata=intruder),
    ]:
        assert (await status_of(call))[0] == grpc.StatusCode.PERMISSION_DENIED
    # Send into it.
    code, _ = await status_of(
        im.stub.SendMessage(im_pb2.SendMessageRequest(group_id=cast.group.id, content="x"), metadata=intruder)
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    # Edit another's message (even as a member of the group).
    code, _ = await status_of(
        im.stub.EditMessage(
            im_pb2.EditMessageRequest(message_id=cast.message.id, content="forged"), metadata=cast.member.md
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    # Mark read for someone else: the token's member is the only one it marks.
    code, _ = await status_of(
        im.stub.MarkRead(
            im_pb2.MarkReadRequest(group_id=cast.group.id, up_to_message_id=cast.message.id),
            metadata=(*intruder, *legacy_member_header(cast.member.id)),
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    unread = await im.stub.GetAllUnread(im_pb2.GetAllUnreadRequest(), metadata=cast.member.md)
    assert [m.id for m in unread.messages] == [cast.message.id]
    # Add oneself to the group.
    code, _ = await status_of(
        im.stub.AddGroupMembers(
            im_pb2.AddGroupMembersRequest(group_id=cast.group.id, member_ids=[cast.outsider.id]),
            metadata=intruder,
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    members = (
        await im.stub.GetGroup(im_pb2.GetGroupRequest(group_id=cast.group.id), metadata=cast.owner.md)
    ).group
    assert cast.outsider.id not in members.member_ids


async def test_rate_limits_count_against_the_verified_caller(im_factory: Any) -> None:
    limited: RunningIM = await im_factory(LIMIT_SEND_PER_SECOND="0.001", LIMIT_SEND_BURST="1")
    cast = await make_cast(limited)  # the owner spends its one send here
    send = im_pb2.SendMessageRequest(group_id=cast.group.id, content="hi")
    # The member's token spends the member's bucket, whoever the legacy header names beside it.
    await limited.stub.SendMessage(send, metadata=(*cast.member.md, *legacy_member_header(cast.admin.id)))
    code, _ = await status_of(limited.stub.SendMessage(send, metadata=cast.member.md))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    await limited.stub.SendMessage(send, metadata=cast.admin.md)


async def test_an_admin_reads_through_an_agents_eyes_and_nobody_else_does(im: RunningIM, cast: Cast) -> None:
    private = await im.stub.CreateGroup(
        im_pb2.CreateGroupRequest(name="the agent's own", member_ids=[cast.agent.id]), metadata=cast.agent.md
    )

    def view(member: str) -> tuple[tuple[str, str], ...]:
        return ((VIEW_AS_KEY, member),)

    async def group_ids(metadata: Any) -> set[str]:
        listed = await im.stub.ListGroups(list_groups(), metadata=metadata)
        return {group.id for group in listed.groups}

    assert private.group.id not in await group_ids(cast.owner.md)
    assert private.group.id in await group_ids(cast.owner.md + view(cast.agent.id))
    assert private.group.id in await group_ids(cast.admin.md + view(cast.agent.id))
    # A plain member, another kind of token, a write, or a person's view: refused.
    refused = [
        im.stub.ListGroups(list_groups(), metadata=cast.member.md + view(cast.agent.id)),
        im.stub.ListGroups(list_groups(), metadata=cast.agent.md + view(cast.owner.id)),
        im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=private.group.id, content="as the agent?"),
            metadata=cast.owner.md + view(cast.agent.id),
        ),
        im.stub.ListGroups(list_groups(), metadata=cast.owner.md + view(cast.member.id)),
        im.stub.ListGroups(list_groups(), metadata=cast.stranger.md + view(cast.agent.id)),
    ]
    for call in refused:
        code, _ = await status_of(call)
        assert code is grpc.StatusCode.PERMISSION_DENIED
    history = await im.stub.ListMessages(
        im_pb2.ListMessagesRequest(group_id=private.group.id), metadata=cast.agent.md
    )
    assert list(history.messages) == []
