"""The IM's commands: what a caller asks to change, as plain data.

Each command names its result type (`Command[R]`) and has exactly one
handler, which `services.im.service_layer.messagebus.MessageBus` dispatches
to. Reads (get, list, the unread messages, the event watch, the signing
keys, personal tokens and audit records) are not commands: they change
nothing, so the servicers call their handlers directly.

Secrets (passwords, refresh tokens, invites, ID tokens and their nonces)
are left out of a command's repr, so that a logged command shows none.

Field values are as the caller sent them (ids as text, empty for unset);
the handlers check them, so that every client input gets a clear error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from services.im.domain.accounts import Invite, IssuedAccess, IssuedTokens, PersonalToken, PersonalTokenScope
from services.im.domain.model import (
    ContentType,
    Group,
    Member,
    MemberKind,
    Message,
    ReadState,
    Role,
    Workspace,
)

if TYPE_CHECKING:
    from services.common.identity import Caller

R_co = TypeVar("R_co", covariant=True)


class Command(Generic[R_co]):
    """A request to change state, whose handler returns an `R_co`."""

    __slots__ = ()


# -- workspaces and members ---------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateWorkspace(Command[tuple[Workspace, Member, IssuedTokens | None]]):
    """Creates a workspace and its creator (its owner), with the creator's
    account and first tokens when a login is given."""

    name: str
    creator_display_name: str
    creator_kind: MemberKind | None = None
    creator_avatar: str = ""
    request_id: str = ""
    creator_login: str = ""
    creator_password: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateMember(Command[Member]):
    """Adds a person or an agent to the caller's workspace (a service names the workspace)."""

    caller: Caller | None
    workspace_id: str = ""
    kind: MemberKind | None
    display_name: str
    avatar: str = ""
    request_id: str = ""
    # Set only by the service that hosts the agent.
    owner_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateMember(Command[Member]):
    """Changes a member's display name and/or avatar (the fields named)."""

    caller: Caller | None
    member_id: str
    display_name: str = ""
    avatar: str = ""
    fields: Sequence[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class SetAgentOwners(Command[int]):
    """Names the owners of agents the calling service hosts (agent id, owner id);
    gives how many changed."""

    caller: Caller | None
    owners: Sequence[tuple[str, str]]


# -- groups ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateGroup(Command[Group]):
    """Creates a group of the caller and the members named."""

    caller: Caller | None
    name: str
    member_ids: Sequence[str] = ()
    request_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class GetOrCreateDirectGroup(Command[tuple[Group, bool]]):
    """The direct chat of the caller and a peer, created if there is none
    (with whether this call created it)."""

    caller: Caller | None
    peer_member_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RenameGroup(Command[Group]):
    """Renames a group (`fields` must be exactly ["name"])."""

    caller: Caller | None
    group_id: str
    name: str
    fields: Sequence[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class AddGroupMembers(Command[Group]):
    """Adds members to a group."""

    caller: Caller | None
    group_id: str
    member_ids: Sequence[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoveGroupMembers(Command[Group]):
    """Removes members from a group (anyone may leave; its creator removes others)."""

    caller: Caller | None
    group_id: str
    member_ids: Sequence[str]


# -- messages and read state ----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SendMessage(Command[Message]):
    """Sends a message to a group the caller is in."""

    caller: Caller | None
    group_id: str
    content_type: ContentType | None = None
    content: str
    mentions: Sequence[str] = ()
    reply_to_message_id: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    request_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class EditMessage(Command[Message]):
    """Replaces the content of a message the caller sent."""

    caller: Caller | None
    message_id: str
    content: str


@dataclass(frozen=True, slots=True, kw_only=True)
class MarkRead(Command[ReadState]):
    """Moves the caller's read position in a group forward to a message."""

    caller: Caller | None
    group_id: str
    up_to_message_id: str


# -- signing in and sessions ---------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SignIn(Command[IssuedTokens]):
    """Signs in with a login and password: in the workspace named, or (without
    one) in the one workspace whose account the password fits."""

    workspace_id: str = ""
    login: str
    password: str = field(repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class RefreshTokens(Command[IssuedTokens]):
    """Exchanges a refresh token for the next one of its session and a new access token."""

    refresh_token: str = field(repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class SignOut(Command[None]):
    """Ends the session of a refresh token (any token of it)."""

    refresh_token: str = field(repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChangePassword(Command[IssuedTokens]):
    """Changes the caller's password, signing out every session; gives a new one."""

    caller: Caller | None
    old_password: str = field(repr=False)
    new_password: str = field(repr=False)


# -- invites and roles ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateInvite(Command[tuple[Invite, str]]):
    """Makes an invite to the caller's workspace (bound to an email, if one is
    given); gives it with its secret, shown this once."""

    caller: Caller | None
    role: Role | None = None
    ttl: timedelta | None = None
    request_id: str = ""
    email: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class AcceptInvite(Command[IssuedTokens]):
    """Joins a workspace with an invite, as a person with a login and password."""

    invite: str = field(repr=False)
    display_name: str
    login: str
    password: str = field(repr=False)
    request_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class SetMemberRole(Command[Member]):
    """Gives a member of the caller's workspace a role (handing over the
    workspace makes the caller an admin)."""

    caller: Caller | None
    member_id: str
    role: Role | None


# -- tokens for programs ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CreatePersonalToken(Command[tuple[PersonalToken, str]]):
    """Makes a personal access token of the caller's; gives it with its secret, shown this once."""

    caller: Caller | None
    name: str
    scope: PersonalTokenScope | None
    expire_time: datetime | None = None
    request_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RevokePersonalToken(Command[PersonalToken]):
    """Revokes one of the caller's personal access tokens (again: no change)."""

    caller: Caller | None
    personal_token_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ExchangePersonalToken(Command[IssuedAccess]):
    """Exchanges a personal access token for an access token of its scope."""

    secret: str = field(repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class IssueServiceToken(Command[IssuedAccess]):
    """Exchanges a service's credential for a service access token."""

    service: str
    secret: str = field(repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class IssueAgentTokens(Command[list[IssuedAccess]]):
    """Access tokens for agents that the calling service hosts."""

    caller: Caller | None
    agent_member_ids: Sequence[str]


# -- the organisation's OpenID Connect provider ------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SignInWithOidc(Command[tuple[IssuedTokens, bool]]):
    """Signs in with the provider's ID token (joining with the invite if the
    email has no member yet); gives the tokens and whether the member was made now."""

    id_token: str = field(repr=False)
    nonce: str = field(repr=False)
    workspace_id: str = ""
    invite: str = field(default="", repr=False)
    display_name: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkOidcAccount(Command[tuple[Member, str]]):
    """Gives the signed-in caller's account the email the provider's ID token
    verifies; gives the member and the email."""

    caller: Caller | None
    id_token: str = field(repr=False)
    nonce: str = field(repr=False)
