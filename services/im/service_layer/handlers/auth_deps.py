"""What every identity handler is given (`AuthDeps`), and the blocks they
share: who a token names, issuing access tokens and sessions, audit records,
counting guesses, request_id replays, and the person an invite makes.

Secrets made here (refresh tokens) are returned once and stored as hashes.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime

from uuid_utils.compat import uuid7

from services.common import audit
from services.common.errors import ServiceError
from services.common.identity import Caller
from services.common.status import status_name
from services.common.tokens import AccessClaims, KeyRing, PrincipalKind, Scope, sign
from services.im.domain import access
from services.im.domain.accounts import Account, Invite, IssuedAccess, IssuedTokens, RefreshToken
from services.im.domain.errors import Conflict, NotAllowed, TooManyAttempts, Unauthenticated, WrongState
from services.im.domain.model import Member, MemberKind
from services.im.service_layer.auth_ports import IdTokens, Passwords
from services.im.service_layer.handlers import members
from services.im.service_layer.handlers.deps import Clock, Deps, member_actor
from services.im.service_layer.ports import DuplicateRequest, Transaction, UnitOfWorkFactory

logger = logging.getLogger(__name__)

WRONG_LOGIN = "the login or password is wrong"

# A new session: the refresh token's secret (returned once) and its stored record.
Session = tuple[str, RefreshToken]


def no_services() -> Mapping[str, str]:
    return {}


@dataclass(kw_only=True)
class AuthDeps:
    """What the identity handlers share.

    Attributes:
        im: the other handlers' `Deps`, whose unit of work, clock, page
            sizes and quotas the identity handlers use as well.
        keys: the key ring access tokens are signed with.
        passwords: hashes and checks passwords.
        limits: lifetimes of tokens, and how many guesses a login may take.
        audit_log: where records made outside a change's transaction go
            (refused sign-ins, service tokens) and are listed from.
        audit_settings: the window in which refusals are counted together.
        services: service name -> SHA-256 hex of its secret (read from
            `AUTH_SERVICE_CREDENTIALS_FILE`); a callable so that a reload
            (SIGHUP) takes effect.
        id_tokens: checks the OpenID Connect provider's ID tokens; None
            when no provider is configured.
    """

    im: Deps
    keys: KeyRing
    passwords: Passwords
    limits: access.AuthLimits = field(default_factory=access.AuthLimits)
    audit_log: audit.AuditLog | None = None
    audit_settings: audit.AuditSettings = field(default_factory=audit.AuditSettings)
    services: Callable[[], Mapping[str, str]] = no_services
    id_tokens: IdTokens | None = None

    @property
    def uow(self) -> UnitOfWorkFactory:
        return self.im.uow

    @property
    def clock(self) -> Clock:
        return self.im.clock

    def now(self) -> datetime:
        """The current time in whole seconds, as tokens carry it: what we say
        expires when is what they say."""
        return self.clock().replace(microsecond=0)


# -- callers ------------------------------------------------------------------------


async def calling_member(tx: Transaction, caller: Caller | None) -> Member:
    """The member a call is made as: from its access token."""
    if caller is not None and caller.service is not None:
        raise NotAllowed("this call is made as a member; a service's token names none")
    if caller is None or caller.member_id is None:
        raise Unauthenticated("this call needs the caller: authorization: Bearer <access token>")
    member = await tx.get_member(caller.member_id)
    if member is None:
        raise Unauthenticated(f"member {caller.member_id} does not exist")
    if caller.claims.workspace_id != member.workspace_id:
        raise Unauthenticated("the access token does not match its member")
    return member


def authority(caller: Caller | None) -> access.Authority:
    """What the caller's token allows (a call without one: anything a person may)."""
    if caller is None:
        return access.Authority()
    return access.Authority(can_write=caller.can_write, via_personal_token=caller.via_personal_token)


# -- the audit log ------------------------------------------------------------------


def caller_record(
    auth: AuthDeps,
    caller: Caller | None,
    member: Member,
    action: str,
    target: audit.Target,
    *,
    request_id: str | None = "",
    details: Mapping[str, object] | None = None,
) -> audit.AuditRecord:
    """The record of a calling member's successful action, to store with the change."""
    return audit.succeeded(
        caller,
        workspace_id=member.workspace_id,
        action=action,
        target=target,
        at=auth.clock(),
        request_id=request_id,
        details=details,
    )


def member_record(
    auth: AuthDeps,
    member: Member,
    action: str,
    *,
    target: audit.Target | None = None,
    request_id: str | None = "",
    details: Mapping[str, object] | None = None,
) -> audit.AuditRecord:
    """The record of an action of a member who has no token in the call (signing in or out)."""
    return audit.succeeded(
        None,
        actor=member_actor(member),
        workspace_id=member.workspace_id,
        action=action,
        target=target or audit.Target("member", str(member.id)),
        at=auth.clock(),
        request_id=request_id,
        details=details,
    )


async def record_refusal(
    auth: AuthDeps,
    error: ServiceError,
    *,
    action: str,
    target: audit.Target,
    workspace_id: uuid.UUID | None,
    at: datetime | None = None,
) -> None:
    """Records an anonymous caller's refused action (counted with others of the
    refusal window); a failure to record is logged, never raised."""
    if auth.audit_log is None:
        return
    record = audit.refused(
        audit.ANONYMOUS,
        workspace_id=workspace_id,
        action=action,
        target=target,
        at=at or auth.clock(),
        code=status_name(error),
        reason=error.message,
    )
    try:
        await auth.audit_log.record_refusal(record, window=auth.audit_settings.refusal_window)
    except Exception:
        logger.warning("could not record a refused %s in the audit log", record.action, exc_info=True)


# -- guesses ------------------------------------------------------------------------


async def count_attempts(
    auth: AuthDeps, tx: Transaction, places: list[uuid.UUID], login: str, at: datetime
) -> list[float | None]:
    """Counts one attempt at the login in each place (a workspace, or
    `access.ANY_WORKSPACE`); gives each place's seconds to wait, None where
    the attempt may go on. Counted before the password is checked, so that
    parallel guesses all count."""
    limits = auth.limits
    attempts = [
        await tx.count_sign_in_attempt(place, login, at=at, window=limits.sign_in_window) for place in places
    ]
    return [access.sign_in_retry_after(attempt, at, limits) for attempt in attempts]


def too_many(what: str, wait: float) -> TooManyAttempts:
    """The refusal of one more attempt, saying when the next may come."""
    return TooManyAttempts(
        f"too many {what}; try again in {math.ceil(wait)} seconds", retry_after_seconds=wait
    )


# -- tokens -------------------------------------------------------------------------


def access_token(
    auth: AuthDeps,
    member: Member,
    *,
    scope: Scope = Scope.READ_WRITE,
    host: str | None = None,
    personal_token_id: uuid.UUID | None = None,
    not_after: datetime | None = None,
) -> IssuedAccess:
    """A signed access token for the member, expiring no later than `not_after`."""
    claims = AccessClaims(
        kind=PrincipalKind.AGENT if member.kind is MemberKind.AGENT else PrincipalKind.HUMAN,
        member_id=member.id,
        workspace_id=member.workspace_id,
        roles=(member.role.value,),
        scope=scope,
        host=host,
        personal_token_id=personal_token_id,
    ).stamped(now=auth.now(), lifetime=auth.limits.access_token_lifetime)
    assert claims.expires_at is not None
    if not_after is not None and claims.expires_at > not_after:
        claims = replace(claims, expires_at=not_after.replace(microsecond=0))
    assert claims.expires_at is not None
    return IssuedAccess(token=sign(claims, auth.keys), expires_at=claims.expires_at, member=member)


async def new_session(
    auth: AuthDeps, tx: Transaction, member: Member, *, family_id: uuid.UUID | None = None
) -> Session:
    """A refresh token for the member (of a new session, or the next of one), stored in `tx`."""
    now = auth.now()
    secret = access.new_secret(access.REFRESH_TOKEN_PREFIX)
    token = RefreshToken(
        id=uuid7(),
        family_id=family_id or uuid7(),
        member_id=member.id,
        token_hash=access.secret_hash(secret),
        created_at=now,
        expires_at=now + auth.limits.refresh_token_lifetime,
    )
    await tx.add_refresh_token(token)
    return secret, token


def session_tokens(auth: AuthDeps, member: Member, session: Session) -> IssuedTokens:
    """What a sign-in gives, once its session is committed: a fresh access token and the refresh token."""
    secret, refresh = session
    return IssuedTokens(
        access=access_token(auth, member),
        refresh_token=secret,
        refresh_expires_at=refresh.expires_at,
        member=member,
    )


async def signed_in_again(auth: AuthDeps, member: Member, password: str) -> IssuedTokens:
    """A new session for a member whose password is checked here (a retried
    call whose first response, with its tokens, may have been lost)."""
    async with auth.uow(write=False) as tx:
        account = await tx.get_account(member.id)
    if (
        account is None
        or account.password_hash is None
        or not await auth.passwords.verify(account.password_hash, password)
    ):
        raise Unauthenticated(WRONG_LOGIN)
    async with auth.uow() as tx:
        session = await new_session(auth, tx, member)
        await tx.commit()
    return session_tokens(auth, member, session)


# -- people joining -----------------------------------------------------------------


def new_account(
    member: Member,
    at: datetime,
    *,
    login: str | None = None,
    password_hash: str | None = None,
    email: str | None = None,
) -> Account:
    """The account of a person: a login and password, a provider's email, or both."""
    return Account(
        member_id=member.id,
        workspace_id=member.workspace_id,
        login=login,
        password_hash=password_hash,
        created_at=at,
        password_changed_at=at,
        email=email,
    )


def check_usable(auth: AuthDeps, invite: Invite) -> None:
    """Refuses an invite that was used or has expired."""
    if invite.used_at is not None:
        raise WrongState("the invite has been used already")
    if invite.expires_at <= auth.clock():
        raise WrongState("the invite has expired")


async def join(
    auth: AuthDeps,
    tx: Transaction,
    invite: Invite,
    *,
    display_name: str,
    login: str | None = None,
    password_hash: str | None = None,
    email: str | None = None,
) -> Member:
    """Makes the person an invite takes in, with the invite's role, and spends the invite.

    Raises:
        QuotaExceeded: the workspace has all the people it may have.
        WrongState: the invite was used meanwhile.
        LoginTaken, EmailTaken: the workspace has an account with the
            login or email already (the caller says which, in its words).
    """
    now = auth.now()
    member = Member(
        id=uuid7(),
        workspace_id=invite.workspace_id,
        kind=MemberKind.HUMAN,
        display_name=display_name,
        avatar="",
        created_at=now,
        role=invite.role,
    )
    await members.check_member_quota(auth.im, tx, member.workspace_id, MemberKind.HUMAN)
    if not await tx.use_invite(invite.id, member.id, now):
        raise WrongState("the invite has been used already")
    await tx.add_member(member)
    await tx.add_account(new_account(member, now, login=login, password_hash=password_hash, email=email))
    return member


# -- idempotency --------------------------------------------------------------------

# What an earlier call with this request_id created, if any (as for the IM's other use cases).
replay = Deps.replay


async def remember(
    tx: Transaction, scope: uuid.UUID, request_id: str | None, fingerprint: str, resource: uuid.UUID
) -> None:
    """Remembers what this request_id created; a concurrent call with it made the other one first."""
    if request_id is None:
        return
    try:
        await tx.remember_request(scope, request_id, fingerprint, resource)
    except DuplicateRequest:
        raise Conflict(f"another call with request_id {request_id!r} got there first; retry") from None
