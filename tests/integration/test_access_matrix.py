"""Every IMService and AuthService RPC, called by every kind of caller, over real gRPC.

For each RPC one valid request is built (fresh where the call uses it up),
and sent by: the workspace's owner, an admin, a member of the group the
requests are about, a member not in it, a person of another workspace, an
agent hosted by the runtime, the runtime's and the memory service's own
tokens, no token, an expired token and a tampered one. The status each gets
is compared with the expected one: derived from the RPC's `Rule` in
`services/im/entrypoints/policy.py` (public, or who may call it, and
UNAUTHENTICATED for bad credentials), then from the resource rules of the
handlers written below (`RESOURCE`: who may touch this group, message, member).

One IM on SQLite serves the whole module; PostgreSQL is covered by
`test_authn_grpc.py`.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2

from agentim.im.v1 import auth_pb2, im_pb2
from services.common.identity import WATCH_START_CURSOR_KEY, Caller, bearer_metadata
from services.common.tokens import KeyRing, Verifier, keyring_source
from services.im.adapters import migrate
from services.im.adapters.sql import Database
from services.im.entrypoints.policy import AUTH_SERVICE, IM_POLICY, IM_SERVICE
from tests.auth_support import auth_dir, service_secret
from tests.authn_support import (
    BAD_CREDENTIALS,
    PASSWORD,
    Cast,
    Metadata,
    auth_stub,
    claims_of,
    expected_status,
    expired_token,
    make_cast,
    tampered_token,
)
from tests.conftest import RunningIM, start_im, stop_im
from tests.oidc_support import TestIssuer

OK = grpc.StatusCode.OK
DENIED = grpc.StatusCode.PERMISSION_DENIED
NOT_FOUND = grpc.StatusCode.NOT_FOUND
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION

PEOPLE = ("owner", "admin", "member", "outsider", "stranger")
CALLERS = (*PEOPLE, "agent", "runtime", "memory", "no token", "expired", "tampered")

# What the handlers decide once the rule let a caller through (OK unless named).
# The group and message are the cast's (owner, admin, member, agent in it);
# "stranger" is of another workspace, where none of it exists.
IN_GROUP_ONLY = {"outsider": DENIED, "stranger": NOT_FOUND}
OTHER_WORKSPACE = {"stranger": NOT_FOUND}
RESOURCE: dict[str, dict[str, grpc.StatusCode]] = {
    "GetWorkspace": OTHER_WORKSPACE,
    "CreateMember": OTHER_WORKSPACE,
    "GetMember": OTHER_WORKSPACE,
    "ListMembers": OTHER_WORKSPACE,
    "UpdateMember": {p: DENIED for p in ("owner", "admin", "member", "outsider")} | OTHER_WORKSPACE,
    "CreateGroup": OTHER_WORKSPACE,
    "GetOrCreateDirectGroup": OTHER_WORKSPACE,
    "GetGroup": IN_GROUP_ONLY,
    "UpdateGroup": IN_GROUP_ONLY,
    "AddGroupMembers": IN_GROUP_ONLY,
    # Only the group's creator (the owner here) removes others; anyone may leave.
    "RemoveGroupMembers": {"admin": DENIED, "agent": DENIED} | IN_GROUP_ONLY,
    "SendMessage": IN_GROUP_ONLY,
    "EditMessage": {p: DENIED for p in ("admin", "member", "outsider", "agent")} | OTHER_WORKSPACE,
    "GetMessage": IN_GROUP_ONLY,
    "ListMessages": IN_GROUP_ONLY,
    "MarkRead": IN_GROUP_ONLY,
    "WatchEvents": {p: DENIED for p in (*PEOPLE, "agent")},
    "CreateInvite": {"member": DENIED, "outsider": DENIED},
    "SetMemberRole": {"member": DENIED, "outsider": DENIED, "stranger": NOT_FOUND},
    "RevokePersonalToken": {p: NOT_FOUND for p in PEOPLE if p != "owner"},
    # The stranger owns a workspace of its own, whose log it reads.
    "ListAuditEvents": {"member": DENIED, "outsider": DENIED},
}


@dataclass
class Matrix:
    im: RunningIM
    cast: Cast
    metadata: dict[str, Metadata]
    callers: dict[str, Caller]
    issuer: TestIssuer


@pytest.fixture(scope="module")
async def matrix(tmp_path_factory: pytest.TempPathFactory) -> Any:
    url = f"sqlite:///{tmp_path_factory.mktemp('matrix') / 'im.db'}"
    database = Database(url)
    await migrate.upgrade(database)
    await database.aclose()
    issuer = TestIssuer()
    await issuer.start()
    # Many sign-ins of one login are part of the matrix, not an attack.
    im = await start_im(
        url, AUTH_SIGN_IN_MAX_FAILURES="100000", LIMIT_CREATE_PER_SECOND="0", **issuer.environment()
    )
    try:
        cast = await make_cast(im)
        people = {name: getattr(cast, name) for name in (*PEOPLE, "agent")}
        metadata: dict[str, Metadata] = {name: person.md for name, person in people.items()}
        metadata |= {
            "runtime": cast.runtime,
            "memory": cast.memory,
            "no token": (),
            "expired": bearer_metadata(expired_token(claims_of(cast.member, cast.workspace))),
            "tampered": bearer_metadata(tampered_token(cast.member.access_token)),
        }
        verifier = Verifier(keyring_source(KeyRing.load(auth_dir() / "keys")))
        callers = {
            name: Caller(claims=await verifier.verify(md[0][1].removeprefix("Bearer ")))
            for name, md in metadata.items()
            if name not in BAD_CREDENTIALS
        }
        yield Matrix(im, cast, metadata, callers, issuer)
    finally:
        await stop_im(im)
        await issuer.stop()


def expected(service: str, method: str, caller: str, m: Matrix) -> grpc.StatusCode:
    return expected_status(IM_POLICY, f"/{service}/{method}", caller, m.callers, RESOURCE.get(method, {}))


# -- one valid request per RPC: (stub method name, request), built fresh per call ---------

Build = Callable[[Matrix, str], Awaitable[Any]]


async def fresh_group(m: Matrix) -> im_pb2.Group:
    c = m.cast
    group: im_pb2.Group = (
        await m.im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="fresh", member_ids=[c.admin.id, c.member.id, c.agent.id]),
            metadata=c.owner.md,
        )
    ).group
    return group


async def signed_in(m: Matrix) -> im_pb2.Tokens:
    response = await auth_stub(m.im).SignIn(
        auth_pb2.SignInRequest(workspace_id=m.cast.workspace.id, login="ada-owner", password=PASSWORD)
    )
    tokens: im_pb2.Tokens = response.tokens
    return tokens


async def _invite(m: Matrix, _: str) -> Any:
    made = await auth_stub(m.im).CreateInvite(auth_pb2.CreateInviteRequest(), metadata=m.cast.owner.md)
    login = f"joiner-{uuid.uuid4().hex[:8]}"
    return auth_pb2.AcceptInviteRequest(
        invite=made.secret, display_name="Joiner", login=login, password=PASSWORD
    )


async def _oidc_sign_in(m: Matrix, _: str) -> Any:
    # A newcomer joining with an invite bound to their email: every call a fresh one.
    email = f"joiner-{uuid.uuid4().hex[:8]}@example.test"
    made = await auth_stub(m.im).CreateInvite(
        auth_pb2.CreateInviteRequest(email=email), metadata=m.cast.owner.md
    )
    nonce = secrets.token_urlsafe(16)
    return auth_pb2.SignInWithOidcRequest(
        id_token=m.issuer.id_token(email=email, nonce=nonce), nonce=nonce, invite=made.secret
    )


async def _oidc_link(m: Matrix, _: str) -> Any:
    nonce = secrets.token_urlsafe(16)
    email = f"linked-{uuid.uuid4().hex[:8]}@example.test"
    return auth_pb2.LinkOidcAccountRequest(id_token=m.issuer.id_token(email=email, nonce=nonce), nonce=nonce)


async def _pat_secret(m: Matrix, _: str) -> Any:
    made = await auth_stub(m.im).CreatePersonalToken(
        auth_pb2.CreatePersonalTokenRequest(name="ci", scope=auth_pb2.PERSONAL_TOKEN_SCOPE_WRITE),
        metadata=m.cast.owner.md,
    )
    return made


async def _update_member(m: Matrix, _: str) -> Any:
    request = im_pb2.UpdateMemberRequest(update_mask=field_mask_pb2.FieldMask(paths=["display_name"]))
    request.member.id = m.cast.agent.id
    request.member.display_name = "helper"
    return request


async def _update_group(m: Matrix, _: str) -> Any:
    request = im_pb2.UpdateGroupRequest(update_mask=field_mask_pb2.FieldMask(paths=["name"]))
    request.group.id = m.cast.group.id
    request.group.name = "private"
    return request


async def _refresh(m: Matrix, _: str) -> Any:
    return auth_pb2.RefreshTokensRequest(refresh_token=(await signed_in(m)).refresh_token)


async def _sign_out(m: Matrix, _: str) -> Any:
    return auth_pb2.SignOutRequest(refresh_token=(await signed_in(m)).refresh_token)


async def _exchange(m: Matrix, caller: str) -> Any:
    return auth_pb2.ExchangePersonalTokenRequest(secret=(await _pat_secret(m, caller)).secret)


async def _revoke(m: Matrix, caller: str) -> Any:
    made = await _pat_secret(m, caller)
    return auth_pb2.RevokePersonalTokenRequest(personal_token_id=made.personal_token.id)


async def _add_members(m: Matrix, _: str) -> Any:
    group = await fresh_group(m)
    return im_pb2.AddGroupMembersRequest(group_id=group.id, member_ids=[m.cast.outsider.id])


async def _remove_members(m: Matrix, _: str) -> Any:
    group = await fresh_group(m)
    return im_pb2.RemoveGroupMembersRequest(group_id=group.id, member_ids=[m.cast.member.id])


async def _direct_group(m: Matrix, caller: str) -> Any:
    peer = m.cast.member if caller == "admin" else m.cast.admin
    return im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=peer.id)


def fixed(make: Callable[[Cast], Any]) -> Build:
    async def build(m: Matrix, _: str) -> Any:
        return make(m.cast)

    return build


IM_REQUESTS: dict[str, Build] = {
    "CreateWorkspace": fixed(lambda c: im_pb2.CreateWorkspaceRequest(name="ws", creator_display_name="Zed")),
    "GetWorkspace": fixed(lambda c: im_pb2.GetWorkspaceRequest(workspace_id=c.workspace.id)),
    "ListWorkspaces": fixed(lambda c: im_pb2.ListWorkspacesRequest()),
    "CreateMember": fixed(
        lambda c: im_pb2.CreateMemberRequest(
            kind=im_pb2.MEMBER_KIND_AGENT, display_name="bot", workspace_id=c.workspace.id
        )
    ),
    "GetMember": fixed(lambda c: im_pb2.GetMemberRequest(member_id=c.member.id)),
    "ListMembers": fixed(lambda c: im_pb2.ListMembersRequest(workspace_id=c.workspace.id)),
    "UpdateMember": _update_member,
    "CreateGroup": fixed(lambda c: im_pb2.CreateGroupRequest(name="new", member_ids=[c.member.id])),
    "GetOrCreateDirectGroup": _direct_group,
    "GetGroup": fixed(lambda c: im_pb2.GetGroupRequest(group_id=c.group.id)),
    "ListGroups": fixed(lambda c: im_pb2.ListGroupsRequest()),
    "UpdateGroup": _update_group,
    "AddGroupMembers": _add_members,
    "RemoveGroupMembers": _remove_members,
    "SendMessage": fixed(lambda c: im_pb2.SendMessageRequest(group_id=c.group.id, content="hi")),
    "EditMessage": fixed(lambda c: im_pb2.EditMessageRequest(message_id=c.message.id, content="hello")),
    "GetMessage": fixed(lambda c: im_pb2.GetMessageRequest(message_id=c.message.id)),
    "ListMessages": fixed(lambda c: im_pb2.ListMessagesRequest(group_id=c.group.id)),
    "MarkRead": fixed(lambda c: im_pb2.MarkReadRequest(group_id=c.group.id, up_to_message_id=c.message.id)),
    "GetAllUnread": fixed(lambda c: im_pb2.GetAllUnreadRequest()),
    "ListChats": fixed(lambda c: im_pb2.ListChatsRequest()),
    "WatchEvents": fixed(lambda c: im_pb2.WatchEventsRequest(workspace_id=c.workspace.id)),
    "SetAgentOwners": fixed(
        lambda c: im_pb2.SetAgentOwnersRequest(
            agent_owners=[im_pb2.AgentOwner(agent_member_id=c.agent.id, owner_id=c.owner.id)]
        )
    ),
}

AUTH_REQUESTS: dict[str, Build] = {
    "GetSigningKeys": fixed(lambda c: auth_pb2.GetSigningKeysRequest()),
    "SignIn": fixed(
        lambda c: auth_pb2.SignInRequest(workspace_id=c.workspace.id, login="ada-owner", password=PASSWORD)
    ),
    "SignInWithOidc": _oidc_sign_in,
    "LinkOidcAccount": _oidc_link,
    "RefreshTokens": _refresh,
    "SignOut": _sign_out,
    "ChangePassword": fixed(
        lambda c: auth_pb2.ChangePasswordRequest(old_password=PASSWORD, new_password=PASSWORD)
    ),
    "CreateInvite": fixed(lambda c: auth_pb2.CreateInviteRequest()),
    "AcceptInvite": _invite,
    "SetMemberRole": fixed(
        lambda c: auth_pb2.SetMemberRoleRequest(member_id=c.member.id, role=im_pb2.MEMBER_ROLE_MEMBER)
    ),
    "CreatePersonalToken": fixed(
        lambda c: auth_pb2.CreatePersonalTokenRequest(name="mine", scope=auth_pb2.PERSONAL_TOKEN_SCOPE_READ)
    ),
    "ListPersonalTokens": fixed(lambda c: auth_pb2.ListPersonalTokensRequest()),
    "RevokePersonalToken": _revoke,
    "ExchangePersonalToken": _exchange,
    "IssueServiceToken": fixed(
        lambda c: auth_pb2.IssueServiceTokenRequest(service="runtime", secret=service_secret("runtime"))
    ),
    "IssueAgentTokens": fixed(lambda c: auth_pb2.IssueAgentTokensRequest(agent_member_ids=[c.agent.id])),
    "ListAuditEvents": fixed(lambda c: auth_pb2.ListAuditEventsRequest()),
}


def _cases() -> Iterator[Any]:
    for service, requests in ((IM_SERVICE, IM_REQUESTS), (AUTH_SERVICE, AUTH_REQUESTS)):
        for method in requests:
            yield pytest.param(service, method, id=f"{service.rsplit('.', 1)[-1]}.{method}")


async def status_of(
    m: Matrix, service: str, method: str, request: Any, metadata: Metadata
) -> grpc.StatusCode:
    stub = m.im.stub if service == IM_SERVICE else auth_stub(m.im)
    call = getattr(stub, method)(request, metadata=metadata, timeout=10)
    if method == "WatchEvents":
        headers = await call.initial_metadata()
        if any(key == WATCH_START_CURSOR_KEY for key, _ in headers or ()):
            call.cancel()
            return OK
        code: grpc.StatusCode = await call.code()
        return code
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return OK


def test_every_rpc_of_the_im_has_a_request_here() -> None:
    served = {method for method in IM_POLICY if method.startswith((f"/{IM_SERVICE}/", f"/{AUTH_SERVICE}/"))}
    built = {f"/{IM_SERVICE}/{m}" for m in IM_REQUESTS} | {f"/{AUTH_SERVICE}/{m}" for m in AUTH_REQUESTS}
    assert built == served


@pytest.mark.parametrize(("service", "method"), list(_cases()))
async def test_every_caller_gets_what_the_rules_say(matrix: Matrix, service: str, method: str) -> None:
    build = (IM_REQUESTS if service == IM_SERVICE else AUTH_REQUESTS)[method]
    got: dict[str, str] = {}
    want: dict[str, str] = {}
    for caller in CALLERS:
        request = await build(matrix, caller)
        got[caller] = (await status_of(matrix, service, method, request, matrix.metadata[caller])).name
        want[caller] = expected(service, method, caller, matrix).name
    assert got == want
