"""What the IM's identity handlers share: who the caller is, issuing tokens,
sessions, and request_id replays (`AuthBase`)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime

from uuid_utils.compat import uuid7

from services.common import audit
from services.common.identity import Caller
from services.common.tokens import AccessClaims, KeyRing, PrincipalKind, Scope, sign
from services.im.domain import access
from services.im.domain.accounts import IssuedAccess, IssuedTokens, RefreshToken
from services.im.domain.errors import Conflict, NotAllowed, Unauthenticated
from services.im.domain.model import Member, MemberKind
from services.im.service_layer.auth_ports import Passwords
from services.im.service_layer.handlers.deps import Deps, member_actor, utc_now
from services.im.service_layer.ports import DuplicateRequest, Transaction, UnitOfWorkFactory

logger = logging.getLogger(__name__)

Clock = Callable[[], datetime]
WRONG_LOGIN = "the login or password is wrong"


class AuthBase:
    """What every identity handler shares: the unit of work, keys, limits, clock.

    Args:
        uow: makes a new transaction.
        keys: the key ring access tokens are signed with.
        passwords: hashes and checks passwords.
        limits: lifetimes and limits.
        clock: current time, replaceable in tests.
        audit_log: where records made outside a change's transaction go
            (refused sign-ins, service tokens) and are listed from.
        audit_settings: the window in which refusals are counted together.
    """

    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        keys: KeyRing,
        passwords: Passwords,
        limits: access.AuthLimits | None = None,
        clock: Clock = utc_now,
        audit_log: audit.AuditLog | None = None,
        audit_settings: audit.AuditSettings | None = None,
    ) -> None:
        self._audit_log = audit_log
        self._audit_settings = audit_settings or audit.AuditSettings()
        self._uow = uow
        self._keys = keys
        self._passwords = passwords
        self.limits = limits or access.AuthLimits()
        self._clock = clock

    # -- callers ------------------------------------------------------------------

    async def _member(self, tx: Transaction, caller: Caller | None) -> Member:
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

    @staticmethod
    def _authority(caller: Caller | None) -> access.Authority:
        if caller is None:
            return access.Authority()
        return access.Authority(can_write=caller.can_write, via_personal_token=caller.via_personal_token)

    # -- the audit log ----------------------------------------------------------------

    def _action(
        self,
        caller: Caller | None,
        member: Member,
        action: str,
        target: audit.Target,
        *,
        request_id: str | None = "",
        details: Mapping[str, object] | None = None,
    ) -> audit.AuditRecord:
        """The record of a member's successful action, to store with the change."""
        return audit.succeeded(
            caller,
            workspace_id=member.workspace_id,
            action=action,
            target=target,
            at=self._clock(),
            request_id=request_id,
            details=details,
        )

    def _member_action(
        self,
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
            at=self._clock(),
            request_id=request_id,
            details=details,
        )

    async def _record_refusal(self, record: audit.AuditRecord) -> None:
        if self._audit_log is None:
            return
        try:
            await self._audit_log.record_refusal(record, window=self._audit_settings.refusal_window)
        except Exception:
            logger.warning("could not record a refused %s in the audit log", record.action, exc_info=True)

    # -- tokens -------------------------------------------------------------------

    def _now(self) -> datetime:
        # Tokens carry whole seconds: what we say expires when is what they say.
        return self._clock().replace(microsecond=0)

    def _access(
        self,
        member: Member,
        *,
        scope: Scope = Scope.READ_WRITE,
        host: str | None = None,
        personal_token_id: uuid.UUID | None = None,
        not_after: datetime | None = None,
    ) -> IssuedAccess:
        now = self._now()
        claims = AccessClaims(
            kind=PrincipalKind.AGENT if member.kind is MemberKind.AGENT else PrincipalKind.HUMAN,
            member_id=member.id,
            workspace_id=member.workspace_id,
            roles=(member.role.value,),
            scope=scope,
            host=host,
            personal_token_id=personal_token_id,
        ).stamped(now=now, lifetime=self.limits.access_token_lifetime)
        assert claims.expires_at is not None
        if not_after is not None and claims.expires_at > not_after:
            claims = replace(claims, expires_at=not_after.replace(microsecond=0))
        assert claims.expires_at is not None
        return IssuedAccess(token=sign(claims, self._keys), expires_at=claims.expires_at, member=member)

    async def _new_session(
        self, tx: Transaction, member: Member, *, family_id: uuid.UUID | None = None
    ) -> tuple[str, RefreshToken]:
        """A refresh token for the member (of a new session, or the next of one)."""
        now = self._now()
        secret = access.new_secret(access.REFRESH_TOKEN_PREFIX)
        token = RefreshToken(
            id=uuid7(),
            family_id=family_id or uuid7(),
            member_id=member.id,
            token_hash=access.secret_hash(secret),
            created_at=now,
            expires_at=now + self.limits.refresh_token_lifetime,
        )
        await tx.add_refresh_token(token)
        return secret, token

    def _tokens(self, member: Member, secret: str, refresh: RefreshToken) -> IssuedTokens:
        return IssuedTokens(
            access=self._access(member),
            refresh_token=secret,
            refresh_expires_at=refresh.expires_at,
            member=member,
        )

    async def _signed_in_again(self, member: Member, password: str) -> IssuedTokens:
        """A new session for a member whose password is checked here."""
        async with self._uow(write=False) as tx:
            account = await tx.get_account(member.id)
        if (
            account is None
            or account.password_hash is None
            or not await self._passwords.verify(account.password_hash, password)
        ):
            raise Unauthenticated(WRONG_LOGIN)
        async with self._uow() as tx:
            secret, refresh = await self._new_session(tx, member)
            await tx.commit()
        return self._tokens(member, secret, refresh)

    # -- idempotency --------------------------------------------------------------

    # What an earlier call with this request_id created, if any (as for the IM's other use cases).
    _replay = staticmethod(Deps.replay)

    @staticmethod
    async def _remember(
        tx: Transaction, scope: uuid.UUID, request_id: str | None, fingerprint: str, resource: uuid.UUID
    ) -> None:
        if request_id is None:
            return
        try:
            await tx.remember_request(scope, request_id, fingerprint, resource)
        except DuplicateRequest:
            raise Conflict(f"another call with request_id {request_id!r} got there first; retry") from None
