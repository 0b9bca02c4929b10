"""What proves who a caller is: accounts, refresh tokens, invites, personal tokens.

Plain data, no I/O. Every secret is kept only as its hash (`*_hash`
fields: argon2id for passwords, SHA-256 for the 256-bit random secrets);
the secrets themselves exist only in the response that hands them out.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from datetime import datetime

from services.im.domain.model import Member, Role


class PersonalTokenScope(enum.StrEnum):
    """What a personal access token may do."""

    READ = "read"
    WRITE = "write"


@dataclass(frozen=True, slots=True)
class Account:
    """How a person signs in: a login and password, an email the organisation's
    OpenID Connect provider vouches for, or both.

    The login and the email are stored normalized (`access.normalize_login`,
    `access.normalize_email`), each unique in the workspace. A person who
    joined through the provider has no login and no password.
    """

    member_id: uuid.UUID
    workspace_id: uuid.UUID
    login: str | None
    password_hash: str | None = field(repr=False)
    created_at: datetime
    password_changed_at: datetime
    email: str | None = None


@dataclass(frozen=True, slots=True)
class RefreshToken:
    """One refresh token of a session. A session (a sign-in) is a family of
    them: each use makes the next and marks this one used."""

    id: uuid.UUID
    family_id: uuid.UUID
    member_id: uuid.UUID
    token_hash: str = field(repr=False)
    created_at: datetime
    expires_at: datetime
    used_at: datetime | None = None
    revoked_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Invite:
    """A one-time invite to a workspace with a role."""

    id: uuid.UUID
    workspace_id: uuid.UUID
    role: Role
    secret_hash: str = field(repr=False)
    created_by: uuid.UUID
    created_at: datetime
    expires_at: datetime
    used_at: datetime | None = None
    used_by: uuid.UUID | None = None
    # Bound to one email (normalized): only that person may accept it.
    email: str | None = None


@dataclass(frozen=True, slots=True)
class PersonalToken:
    """A member's personal access token, exchanged for access tokens by programs."""

    id: uuid.UUID
    member_id: uuid.UUID
    workspace_id: uuid.UUID
    name: str
    scope: PersonalTokenScope
    secret_hash: str = field(repr=False)
    created_at: datetime
    expires_at: datetime
    last_used_at: datetime | None = None
    revoked_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class SignInFailures:
    """Failed sign-ins for one login of a workspace within the current window.

    Kept for logins with no account too, so that being refused says
    nothing about whether an account exists.
    """

    workspace_id: uuid.UUID
    login: str
    count: int
    window_start: datetime


@dataclass(frozen=True, slots=True)
class IssuedAccess:
    """A signed access token, when it expires, and the member it is for (None for a service)."""

    token: str
    expires_at: datetime
    member: Member | None = None


@dataclass(frozen=True, slots=True)
class IssuedTokens:
    """What a sign-in gives: an access token and the refresh token of its session."""

    access: IssuedAccess
    refresh_token: str
    refresh_expires_at: datetime
    member: Member
