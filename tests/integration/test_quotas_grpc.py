"""Per-workspace quotas on people, agents and groups, over real gRPC with real tokens.

Over quota: RESOURCE_EXHAUSTED with a readable message and a
`google.rpc.QuotaFailure` detail; concurrent creates on PostgreSQL never
overshoot.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from agentim.im.v1 import auth_pb2, im_pb2
from tests.authn_support import PASSWORD, Person, auth_stub, invite, service_token, sign_up
from tests.conftest import ImFactory, RunningIM, start_im, stop_im


def quota_failure(error: grpc.aio.AioRpcError) -> error_details_pb2.QuotaFailure:
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                if detail.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
                    failure = error_details_pb2.QuotaFailure()
                    detail.Unpack(failure)
                    return failure
    raise AssertionError(f"no QuotaFailure in {error}")


async def refusal(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def agent_member(im: RunningIM, workspace_id: str, runtime: Any, name: str = "bot") -> Any:
    return im.stub.CreateMember(
        im_pb2.CreateMemberRequest(
            kind=im_pb2.MEMBER_KIND_AGENT, display_name=name, workspace_id=workspace_id
        ),
        metadata=runtime,
    )


async def test_people_over_the_quota_are_refused_with_a_quota_failure(im_factory: ImFactory) -> None:
    im = await im_factory(QUOTA_MEMBERS_PER_WORKSPACE="3")
    auth = auth_stub(im)
    workspace, ada = await sign_up(im, "Ada")
    await invite(im, ada, "Bea")
    await invite(im, ada, "Cy")
    made = await auth.CreateInvite(auth_pb2.CreateInviteRequest(), metadata=ada.md)
    error = await refusal(
        auth.AcceptInvite(
            auth_pb2.AcceptInviteRequest(
                invite=made.secret, display_name="Dee", login="dee", password=PASSWORD
            )
        )
    )
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == "this workspace has reached its quota of 3 people; ask its administrator"
    violation = quota_failure(error).violations[0]
    assert (violation.subject, violation.description) == ("workspace:people", "at most 3")
    # The invite is not used up: it works once there is room again (not here), and
    # a person made any other way counts the same.
    direct = await refusal(
        im.stub.CreateMember(
            im_pb2.CreateMemberRequest(kind=im_pb2.MEMBER_KIND_HUMAN, display_name="Eli"), metadata=ada.md
        )
    )
    assert direct.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    listed = await im.stub.ListMembers(im_pb2.ListMembersRequest(workspace_id=workspace.id), metadata=ada.md)
    assert len(listed.members) == 3
    # Agents have their own quota; another workspace has its own room.
    runtime = await service_token(im, "runtime")
    await agent_member(im, workspace.id, runtime)
    _, eve = await sign_up(im, "Eve")
    await invite(im, eve, "Fay")


async def test_agents_and_groups_over_their_quotas(im_factory: ImFactory) -> None:
    im = await im_factory(QUOTA_AGENTS_PER_WORKSPACE="2", QUOTA_GROUPS_PER_WORKSPACE="2")
    workspace, ada = await sign_up(im, "Ada")
    bea = await invite(im, ada, "Bea")
    runtime = await service_token(im, "runtime")
    for name in ("one", "two"):
        await agent_member(im, workspace.id, runtime, name)
    error = await refusal(agent_member(im, workspace.id, runtime, "three"))
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota of 2 agents" in (error.details() or "")
    assert quota_failure(error).violations[0].subject == "workspace:agents"

    for name in ("g1", "g2"):
        await im.stub.CreateGroup(im_pb2.CreateGroupRequest(name=name, member_ids=[bea.id]), metadata=ada.md)
    error = await refusal(
        im.stub.CreateGroup(im_pb2.CreateGroupRequest(name="g3", member_ids=[bea.id]), metadata=bea.md)
    )
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert quota_failure(error).violations[0].subject == "workspace:groups"
    # A direct chat is bounded by its pair, not by the quota.
    direct = await im.stub.GetOrCreateDirectGroup(
        im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=bea.id), metadata=ada.md
    )
    assert direct.group.kind == im_pb2.GROUP_KIND_DIRECT


async def test_zero_means_no_quota(im_factory: ImFactory) -> None:
    im = await im_factory(QUOTA_MEMBERS_PER_WORKSPACE="0", QUOTA_GROUPS_PER_WORKSPACE="0")
    _, ada = await sign_up(im, "Ada")
    for index in range(4):
        await invite(im, ada, f"P{index}")
        await im.stub.CreateGroup(im_pb2.CreateGroupRequest(name=f"g{index}"), metadata=ada.md)


async def test_concurrent_creates_on_postgresql_never_overshoot(postgres_url: str) -> None:
    im = await start_im(
        postgres_url,
        QUOTA_AGENTS_PER_WORKSPACE="5",
        QUOTA_MEMBERS_PER_WORKSPACE="4",
        QUOTA_GROUPS_PER_WORKSPACE="3",
        LIMIT_CREATE_PER_SECOND="0",
    )
    try:
        auth = auth_stub(im)
        workspace, ada = await sign_up(im, "Ada")
        runtime = await service_token(im, "runtime")
        agents = await asyncio.gather(
            *(agent_member(im, workspace.id, runtime, f"a{i}") for i in range(20)),
            return_exceptions=True,
        )
        made = [a for a in agents if not isinstance(a, BaseException)]
        refused = [a for a in agents if isinstance(a, grpc.aio.AioRpcError)]
        assert len(made) == 5 and len(refused) == 15
        assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}

        invites = [
            (await auth.CreateInvite(auth_pb2.CreateInviteRequest(), metadata=ada.md)).secret
            for _ in range(8)
        ]
        accepted = await asyncio.gather(
            *(
                auth.AcceptInvite(
                    auth_pb2.AcceptInviteRequest(
                        invite=secret, display_name=f"P{i}", login=f"person-{i}", password=PASSWORD
                    )
                )
                for i, secret in enumerate(invites)
            ),
            return_exceptions=True,
        )
        # The owner and three more.
        assert len([a for a in accepted if not isinstance(a, BaseException)]) == 3

        groups = await asyncio.gather(
            *(
                im.stub.CreateGroup(im_pb2.CreateGroupRequest(name=f"g{i}"), metadata=ada.md)
                for i in range(12)
            ),
            return_exceptions=True,
        )
        assert len([g for g in groups if not isinstance(g, BaseException)]) == 3
        members = await im.stub.ListMembers(
            im_pb2.ListMembersRequest(workspace_id=workspace.id), metadata=ada.md
        )
        kinds = [m.kind for m in members.members]
        assert (kinds.count(im_pb2.MEMBER_KIND_AGENT), kinds.count(im_pb2.MEMBER_KIND_HUMAN)) == (5, 4)
    finally:
        await stop_im(im)


async def test_a_refused_invite_can_be_used_once_there_is_room(im_factory: ImFactory) -> None:
    im = await im_factory(QUOTA_MEMBERS_PER_WORKSPACE="2")
    auth = auth_stub(im)
    _, ada = await sign_up(im, "Ada")
    await invite(im, ada, "Bea")
    made = await auth.CreateInvite(auth_pb2.CreateInviteRequest(), metadata=ada.md)
    request = auth_pb2.AcceptInviteRequest(
        invite=made.secret, display_name="Cy", login="cyd", password=PASSWORD
    )
    assert (await refusal(auth.AcceptInvite(request))).code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    second = await im_factory(QUOTA_MEMBERS_PER_WORKSPACE="3")
    accepted = await auth_stub(second).AcceptInvite(request)
    assert Person(accepted.tokens.member, accepted.tokens.access_token).member.display_name == "Cy"
