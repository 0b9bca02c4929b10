"""Real callers of a running IM, each with a real access token, and forged tokens.

A `Cast` is a workspace with an owner, an admin, a member and a non-member
of one group (all people who signed up through invites), an agent the
runtime hosts, a person of another workspace, and the runtime's and the
memory service's own tokens: every kind of caller the access rules name.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc

from agentim.im.v1 import auth_pb2, auth_pb2_grpc, im_pb2
from services.common.authn import Policy
from services.common.identity import Caller, bearer_metadata
from services.common.tokens import AccessClaims, KeyRing, PrincipalKind, sign
from tests.auth_support import auth_dir, service_secret
from tests.conftest import RunningIM

PASSWORD = "correct horse battery"
Metadata = tuple[tuple[str, str], ...]


@dataclass
class Person:
    """A signed-in member: who it is and its access token."""

    member: im_pb2.Member
    access_token: str

    @property
    def md(self) -> Metadata:
        return bearer_metadata(self.access_token)

    @property
    def id(self) -> str:
        return str(self.member.id)


@dataclass
class Cast:
    workspace: im_pb2.Workspace
    owner: Person
    admin: Person
    member: Person
    outsider: Person
    stranger: Person
    agent: Person
    runtime: Metadata
    memory: Metadata
    # Owner, admin, member and agent are in it; the outsider is not.
    group: im_pb2.Group
    # Sent by the owner in the group.
    message: im_pb2.Message


def auth_stub(im: RunningIM) -> auth_pb2_grpc.AuthServiceStub:
    return auth_pb2_grpc.AuthServiceStub(im.channel)


async def sign_up(im: RunningIM, name: str = "Ada") -> tuple[im_pb2.Workspace, Person]:
    """A new workspace and its owner, signed in."""
    created = await im.stub.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(
            name=f"ws-{uuid.uuid4().hex[:6]}",
            creator_display_name=name,
            creator_login=f"{name.lower()}-owner",
            creator_password=PASSWORD,
        )
    )
    return created.workspace, Person(created.creator, created.tokens.access_token)


async def invite(
    im: RunningIM, by: Person, name: str, role: im_pb2.MemberRole.ValueType = im_pb2.MEMBER_ROLE_UNSPECIFIED
) -> Person:
    """A person who joined through an invite `by` made, signed in."""
    auth = auth_stub(im)
    made = await auth.CreateInvite(auth_pb2.CreateInviteRequest(role=role), metadata=by.md)
    tokens = (
        await auth.AcceptInvite(
            auth_pb2.AcceptInviteRequest(
                invite=made.secret, display_name=name, login=f"{name.lower()}-login", password=PASSWORD
            )
        )
    ).tokens
    return Person(tokens.member, tokens.access_token)


async def service_token(im: RunningIM, name: str) -> Metadata:
    issued = await auth_stub(im).IssueServiceToken(
        auth_pb2.IssueServiceTokenRequest(service=name, secret=service_secret(name))
    )
    return bearer_metadata(issued.access_token)


async def read_only(im: RunningIM, person: Person) -> Metadata:
    """An access token of `person` exchanged for a read-only personal access token."""
    auth = auth_stub(im)
    made = await auth.CreatePersonalToken(
        auth_pb2.CreatePersonalTokenRequest(name="reader", scope=auth_pb2.PERSONAL_TOKEN_SCOPE_READ),
        metadata=person.md,
    )
    exchanged = await auth.ExchangePersonalToken(auth_pb2.ExchangePersonalTokenRequest(secret=made.secret))
    return bearer_metadata(exchanged.access_token)


async def make_cast(im: RunningIM) -> Cast:
    workspace, owner = await sign_up(im, "Ada")
    admin = await invite(im, owner, "Bea", im_pb2.MEMBER_ROLE_ADMIN)
    member = await invite(im, owner, "Cy")
    outsider = await invite(im, owner, "Dee")
    _, stranger = await sign_up(im, "Eve")
    runtime = await service_token(im, "runtime")
    memory = await service_token(im, "memory")
    agent_member = (
        await im.stub.CreateMember(
            im_pb2.CreateMemberRequest(
                kind=im_pb2.MEMBER_KIND_AGENT, display_name="helper", workspace_id=workspace.id
            ),
            metadata=runtime,
        )
    ).member
    issued = await auth_stub(im).IssueAgentTokens(
        auth_pb2.IssueAgentTokensRequest(agent_member_ids=[agent_member.id]), metadata=runtime
    )
    agent = Person(agent_member, issued.agent_tokens[0].access_token)
    group = (
        await im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="private", member_ids=[admin.id, member.id, agent.id]),
            metadata=owner.md,
        )
    ).group
    message = (
        await im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=group.id, content="hello"), metadata=owner.md
        )
    ).message
    return Cast(workspace, owner, admin, member, outsider, stranger, agent, runtime, memory, group, message)


def claims_of(person: Person, workspace: im_pb2.Workspace) -> AccessClaims:
    return AccessClaims(
        kind=PrincipalKind.HUMAN,
        member_id=uuid.UUID(person.id),
        workspace_id=uuid.UUID(workspace.id),
        roles=("member",),
    )


def expired_token(claims: AccessClaims) -> str:
    """Signed by the IM's own key, expired an hour ago (far past the leeway)."""
    long_ago = datetime.now(UTC) - timedelta(hours=2)
    return sign(claims, KeyRing.load(auth_dir() / "keys"), now=long_ago, lifetime=timedelta(hours=1))


def tampered_token(token: str) -> str:
    """The token with one byte of its signature flipped."""
    head, body, signature = token.split(".")
    raw = bytearray(base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4)))
    raw[0] ^= 0x01
    return ".".join([head, body, base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()])


def foreign_token(claims: AccessClaims, directory: Path) -> str:
    """Well-formed and valid, but signed by a key the IM never published."""
    KeyRing.generate(directory)
    return sign(claims, KeyRing.load(directory))


# The access matrices' callers whose credential is no good.
BAD_CREDENTIALS = ("no token", "expired", "tampered")


def expected_status(
    policy: Policy,
    method: str,
    caller: str,
    callers: Mapping[str, Caller],
    resource: Mapping[str, grpc.StatusCode],
) -> grpc.StatusCode:
    """What `caller` should get from the RPC `method` (a full path): the
    policy's rule first, then the handlers' resource rule (`resource`, by
    caller; OK where it names none)."""
    rule = policy.rule_for(method)
    assert rule is not None, f"no rule for {method}"
    if rule.public:
        return grpc.StatusCode.OK
    if caller in BAD_CREDENTIALS:
        return grpc.StatusCode.UNAUTHENTICATED
    if rule.refusal(callers[caller]) is not None:
        return grpc.StatusCode.PERMISSION_DENIED
    return resource.get(caller, grpc.StatusCode.OK)
