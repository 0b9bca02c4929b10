"""Access tokens for the members tests make, signed with the test IMs' key.

Every call a test makes carries `authorization: Bearer <access token>`, as
every client must. A token names its member's workspace, kind and roles; the
services check the workspace against the member and take the roles from the
token, so a test's token must say what the IM would. Tests learn that where
the members come from: `make_world` records the members it makes, and the
channels of `learning_channel` record every `Member` (and the runtime's `Agent`
members) in the unary answers they get, so that a role changed through
`SetMemberRole` is in the next token too. `as_member(id)` then signs a token
for a known member; a member no test made is an error, and `as_unknown`
signs one for a member that does not exist.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2
from services.common.identity import Caller, bearer_metadata
from services.common.tokens import AccessClaims, KeyRing, PrincipalKind, Scope, sign
from tests.auth_support import auth_dir

Metadata = tuple[tuple[str, str], ...]

# The workspace of a token for a member that does not exist: no workspace has it.
UNKNOWN_WORKSPACE = uuid.UUID(int=0)
# A signed token is reused while it has this long left of its 15 minutes.
_REUSE_SECONDS = 600.0

_ROLES = {
    im_pb2.MEMBER_ROLE_OWNER: "owner",
    im_pb2.MEMBER_ROLE_ADMIN: "admin",
    im_pb2.MEMBER_ROLE_MEMBER: "member",
}


@dataclass(frozen=True, slots=True)
class Identity:
    """What a member's access token says about it."""

    workspace_id: uuid.UUID
    kind: PrincipalKind
    roles: tuple[str, ...] = ("member",)

    def claims(self, member_id: uuid.UUID, *, read_only: bool = False) -> AccessClaims:
        return AccessClaims(
            kind=self.kind,
            member_id=member_id,
            workspace_id=self.workspace_id,
            roles=self.roles,
            scope=Scope.READ if read_only else Scope.READ_WRITE,
            host="runtime" if self.kind is PrincipalKind.AGENT else None,
        )


_KNOWN: dict[uuid.UUID, Identity] = {}
_SIGNED: dict[tuple[uuid.UUID, Identity, bool], tuple[str, float]] = {}


def remember(member_id: str | uuid.UUID, identity: Identity) -> None:
    """Records what a member's tokens must say (the latest news wins)."""
    _KNOWN[uuid.UUID(str(member_id))] = identity


def learn_member(member: im_pb2.Member) -> None:
    """Records an IM member as the IM describes it (kind, workspace, role)."""
    if not member.id or not member.workspace_id:
        return
    kind = PrincipalKind.AGENT if member.kind == im_pb2.MEMBER_KIND_AGENT else PrincipalKind.HUMAN
    role = _ROLES.get(member.role, "member")
    remember(member.id, Identity(uuid.UUID(member.workspace_id), kind, (role,)))


def learn_json_member(body: dict[str, Any]) -> None:
    """`learn_member` for the gateway's JSON form of a Member."""
    try:
        member = im_pb2.Member(
            id=body["id"],
            workspace_id=body["workspaceId"],
            kind=im_pb2.MemberKind.Value(body.get("kind", "MEMBER_KIND_HUMAN")),
            role=im_pb2.MemberRole.Value(body.get("role", "MEMBER_ROLE_MEMBER")),
        )
    except (KeyError, ValueError):
        return
    learn_member(member)


def learn_agent(agent: runtime_pb2.Agent) -> None:
    """Records the IM member of a runtime agent (an agent member, role member)."""
    if agent.member_id and agent.workspace_id and uuid.UUID(agent.member_id) not in _KNOWN:
        remember(agent.member_id, Identity(uuid.UUID(agent.workspace_id), PrincipalKind.AGENT))


def learn_from(message: Message) -> None:
    """Records every Member and Agent a message holds, at any depth."""
    descriptor = message.DESCRIPTOR
    if descriptor is im_pb2.Member.DESCRIPTOR:
        learn_member(message)  # type: ignore[arg-type]
        return
    if descriptor is runtime_pb2.Agent.DESCRIPTOR:
        learn_agent(message)  # type: ignore[arg-type]
        return
    for field in _member_fields(descriptor):
        value = getattr(message, field.name)
        if field.is_repeated:
            entries = field.message_type is not None and field.message_type.GetOptions().map_entry
            for item in value.values() if entries else value:
                if isinstance(item, Message):
                    learn_from(item)
        elif message.HasField(field.name):
            learn_from(value)


@cache
def _member_fields(descriptor: Descriptor) -> tuple[FieldDescriptor, ...]:
    """The message fields of `descriptor` through which a Member or an Agent can be reached."""
    return tuple(
        f
        for f in descriptor.fields
        if f.message_type is not None and _holds_members(f.message_type, frozenset({descriptor.full_name}))
    )


def _holds_members(descriptor: Descriptor, seen: frozenset[str]) -> bool:
    if descriptor in (im_pb2.Member.DESCRIPTOR, runtime_pb2.Agent.DESCRIPTOR):
        return True
    if descriptor.full_name in seen:
        return False
    inner = seen | {descriptor.full_name}
    return any(
        f.message_type is not None and _holds_members(f.message_type, inner) for f in descriptor.fields
    )


def known(member_id: str | uuid.UUID) -> Identity | None:
    return _KNOWN.get(uuid.UUID(str(member_id)))


@cache
def _keys() -> KeyRing:
    return KeyRing.load(auth_dir() / "keys")


def _signed(member: uuid.UUID, identity: Identity, *, read_only: bool) -> str:
    key = (member, identity, read_only)
    held = _SIGNED.get(key)
    now = time.time()
    if held is not None and held[1] > now:
        return held[0]
    token = sign(identity.claims(member, read_only=read_only), _keys())
    _SIGNED[key] = (token, now + _REUSE_SECONDS)
    return token


def member_token(member_id: str | uuid.UUID, *, read_only: bool = False) -> str:
    """An access token for a member a test made, as the IM would issue it.

    Raises:
        LookupError: no test learned the member (make it through
            `make_world` or a `learning_channel`, or `remember` it).
    """
    member = uuid.UUID(str(member_id))
    identity = _KNOWN.get(member)
    if identity is None:
        raise LookupError(
            f"no test knows member {member}: make it with make_world or over a learning_channel,"
            " or use as_unknown for a member that does not exist"
        )
    return _signed(member, identity, read_only=read_only)


def as_member(member_id: str | uuid.UUID, *, read_only: bool = False) -> Metadata:
    """Call metadata acting as a member a test made: its access token."""
    return bearer_metadata(member_token(member_id, read_only=read_only))


def as_unknown(
    member_id: str | uuid.UUID | None = None, *, kind: PrincipalKind = PrincipalKind.HUMAN
) -> Metadata:
    """A genuine token for a member that does not exist (in no workspace)."""
    member = uuid.UUID(str(member_id)) if member_id is not None else uuid.uuid4()
    return bearer_metadata(_signed(member, Identity(UNKNOWN_WORKSPACE, kind), read_only=False))


def as_service(name: str) -> Metadata:
    """Call metadata with a service's own token (benchmarks; tests get theirs
    from IssueServiceToken, as services do)."""
    return bearer_metadata(sign(AccessClaims(kind=PrincipalKind.SERVICE, service=name), _keys()))


def caller_of(
    member_id: uuid.UUID,
    workspace_id: uuid.UUID,
    *,
    kind: PrincipalKind = PrincipalKind.HUMAN,
    roles: Sequence[str] = ("member",),
) -> Caller:
    """The verified caller a member's token makes, for tests of handlers without gRPC."""
    return Caller(claims=Identity(workspace_id, kind, tuple(roles)).claims(member_id))


def service_caller(name: str) -> Caller:
    """The verified caller of a service's own token (runtime, memory)."""
    return Caller(claims=AccessClaims(kind=PrincipalKind.SERVICE, service=name))


class _Learning(grpc.aio.UnaryUnaryClientInterceptor):
    """Records the members in every unary answer (see the module's docstring)."""

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        call = await continuation(client_call_details, request)
        try:
            response = await call
        except grpc.aio.AioRpcError:
            return call
        if isinstance(response, Message):
            learn_from(response)
        return call


def learning_interceptors() -> list[grpc.aio.ClientInterceptor]:
    return [_Learning()]


def learning_channel(address: str, **options: Any) -> grpc.aio.Channel:
    """An insecure channel whose unary answers teach the tests their members."""
    return grpc.aio.insecure_channel(address, interceptors=learning_interceptors(), **options)


def legacy_member_header(member_id: str | uuid.UUID) -> Metadata:
    """The retired `x-member-id` header naming a member, as clients sent it
    before access tokens (the services now ignore it: tests check that)."""
    return (("x-member-id", str(member_id)),)
