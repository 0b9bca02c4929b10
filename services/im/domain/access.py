"""Who may do what with accounts, roles and tokens, as pure functions.

Roles: one owner per workspace (its creator, until it hands ownership
over), admins, members. Owners and admins (people only) invite and change
roles; nobody takes the owner's role away, only the owner makes another
person the owner (and becomes an admin); an agent is always a plain member.
A read-only token changes nothing; what a personal access token may not
do (create another one, change the password) needs a signed-in person.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import unicodedata
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from services.im.domain.accounts import SignInFailures
from services.im.domain.errors import InvalidRequest, NotAllowed
from services.im.domain.model import Member, MemberKind, Role

# Secrets are 256 random bits; a prefix tells what a leaked one is.
SECRET_BYTES = 32
REFRESH_TOKEN_PREFIX = "aim_rt_"
INVITE_PREFIX = "aim_inv_"
PERSONAL_TOKEN_PREFIX = "aim_pat_"
# Longer than any secret we make: anything longer is refused unread.
MAX_SECRET_CHARS = 128
MAX_PASSWORD_CHARS = 1024
_LOGIN = re.compile(r"^[a-z0-9._@-]{3,64}$")
# RFC 5321's limit on a path; anything longer cannot be delivered to.
MAX_EMAIL_CHARS = 254
_EMAIL = re.compile(r"^[^\s@]{1,64}@[^\s@]+$")
# Sign-in attempts without a workspace count under this key too (a login
# tried across every workspace is throttled as one).
ANY_WORKSPACE = uuid.UUID(int=0)


@dataclass(frozen=True, slots=True)
class AuthLimits:
    """Configurable lifetimes and limits of accounts and tokens."""

    password_min_length: int = 10
    access_token_lifetime: timedelta = timedelta(minutes=15)
    refresh_token_lifetime: timedelta = timedelta(days=30)
    sign_in_max_failures: int = 5
    sign_in_window: timedelta = timedelta(minutes=15)
    # A sign-in without a workspace checks the password of at most this many
    # accounts with the login (each check is a slow hash); more: name the workspace.
    sign_in_max_workspaces: int = 10
    invite_default_lifetime: timedelta = timedelta(days=7)
    invite_max_lifetime: timedelta = timedelta(days=30)
    personal_token_default_lifetime: timedelta = timedelta(days=90)
    personal_token_max_lifetime: timedelta = timedelta(days=365)
    max_agent_tokens: int = 100


@dataclass(frozen=True, slots=True)
class Authority:
    """What the caller's credentials allow, whoever the caller is.

    Attributes:
        can_write: the token's scope includes write.
        via_personal_token: the token was exchanged for a personal access token.
    """

    can_write: bool = True
    via_personal_token: bool = False


# -- secrets ---------------------------------------------------------------------------


def new_secret(prefix: str) -> str:
    """A fresh 256-bit secret, URL-safe, with its kind's prefix."""
    return prefix + secrets.token_urlsafe(SECRET_BYTES)


def secret_hash(secret: str) -> str:
    """SHA-256 of a random secret: enough for 256 random bits, and searchable."""
    return hashlib.sha256(secret.encode()).hexdigest()


def plausible_secret(secret: str, prefix: str) -> bool:
    """Whether a presented secret could be one of ours (cheap check before any lookup)."""
    return secret.startswith(prefix) and len(secret) <= MAX_SECRET_CHARS


# -- logins and passwords --------------------------------------------------------------


def normalize_login(login: str) -> str:
    """The stored form of a login: NFKC, trimmed, case-folded; ASCII letters,
    digits, '.', '_', '-' and '@', 3-64 characters."""
    value = unicodedata.normalize("NFKC", login[:200]).strip().casefold()
    if not _LOGIN.match(value):
        raise InvalidRequest("login must be 3-64 characters: ASCII letters, digits, '.', '_', '-' or '@'")
    return value


def normalize_email(email: str, *, field: str = "email") -> str:
    """The stored form of an email: trimmed and lower-cased, so that two
    spellings of one address are one (compared ignoring case)."""
    value = unicodedata.normalize("NFKC", email[: MAX_EMAIL_CHARS + 1]).strip().lower()
    if len(value) > MAX_EMAIL_CHARS or not _EMAIL.match(value) or not value.isprintable():
        raise InvalidRequest(f"{field} must be an email address (at most {MAX_EMAIL_CHARS} characters)")
    return value


def check_password(password: str, limits: AuthLimits, *, field: str = "password") -> None:
    """A new password's length; the message never repeats the password."""
    if len(password) < limits.password_min_length:
        raise InvalidRequest(f"{field} must be at least {limits.password_min_length} characters")
    if len(password) > MAX_PASSWORD_CHARS:
        raise InvalidRequest(f"{field} must be at most {MAX_PASSWORD_CHARS} characters")


# -- roles -----------------------------------------------------------------------------


def manages(member: Member) -> bool:
    """Owners and admins (people only) manage the workspace's members."""
    return member.kind is MemberKind.HUMAN and member.role in (Role.OWNER, Role.ADMIN)


def require_write(authority: Authority, action: str) -> None:
    if not authority.can_write:
        raise NotAllowed(f"a read-only token cannot {action}")


def require_session(authority: Authority, action: str) -> None:
    if authority.via_personal_token:
        raise NotAllowed(f"only a signed-in person can {action}, not a personal access token")


def check_invite(caller: Member, role: Role) -> None:
    """Whether the caller may invite people with the role."""
    if not manages(caller):
        raise NotAllowed("only the workspace's owner and admins may invite people")
    if role is Role.OWNER:
        raise InvalidRequest(
            "an invite gives the role ADMIN or MEMBER; the owner hands ownership over with SetMemberRole"
        )


def role_changes(caller: Member, target: Member, role: Role) -> list[tuple[uuid.UUID, Role]]:
    """The (member, new role) changes that setting target's role means; [] if none.

    Making another person the owner hands ownership over: the caller (the
    owner) becomes an admin in the same change, so there is always one owner.
    """
    if not manages(caller):
        raise NotAllowed("only the workspace's owner and admins may change roles")
    if target.role is Role.OWNER:
        if role is Role.OWNER:
            return []
        raise NotAllowed("the owner's role cannot be taken away; the owner may hand ownership to someone")
    if target.kind is not MemberKind.HUMAN and role is not Role.MEMBER:
        raise InvalidRequest("an agent is always a plain member")
    if role is Role.OWNER:
        if caller.role is not Role.OWNER:
            raise NotAllowed("only the owner may make another member the owner")
        return [(target.id, Role.OWNER), (caller.id, Role.ADMIN)]
    if target.role is role:
        return []
    return [(target.id, role)]


# -- lifetimes -------------------------------------------------------------------------


def invite_expiry(ttl: timedelta | None, now: datetime, limits: AuthLimits) -> datetime:
    if ttl is None:
        return now + limits.invite_default_lifetime
    if ttl <= timedelta(0):
        raise InvalidRequest("ttl must be positive")
    if ttl > limits.invite_max_lifetime:
        raise InvalidRequest(f"ttl may be at most {limits.invite_max_lifetime.days} days")
    return now + ttl


def personal_token_expiry(requested: datetime | None, now: datetime, limits: AuthLimits) -> datetime:
    if requested is None:
        return now + limits.personal_token_default_lifetime
    if requested <= now:
        raise InvalidRequest("expire_time must be in the future")
    if requested > now + limits.personal_token_max_lifetime:
        raise InvalidRequest(
            f"expire_time may be at most {limits.personal_token_max_lifetime.days} days from now"
        )
    return requested


# -- sign-in throttling ----------------------------------------------------------------


def sign_in_retry_after(failures: SignInFailures, now: datetime, limits: AuthLimits) -> float | None:
    """Seconds until the login may be tried again, or None if it may be now.

    `failures` counts every attempt of the window including the one being
    made (it is counted before the password is checked, so that parallel
    attempts cannot pass the limit), and a success clears it.
    """
    if failures.count <= limits.sign_in_max_failures:
        return None
    ends = failures.window_start + limits.sign_in_window
    return max(1.0, (ends - now).total_seconds())


# -- service identities ----------------------------------------------------------------


def check_hosted(service: str, member_id: uuid.UUID, member: Member | None) -> Member:
    """The agent, if the service hosts it; the same refusal for anyone else."""
    if member is None or member.kind is not MemberKind.AGENT or member.host != service:
        raise NotAllowed(f"service {service!r} does not host an agent with id {member_id}")
    return member
