"""Tokens for programs: personal access tokens, service tokens, agent tokens.

A program a person runs holds a personal access token and exchanges it for
short access tokens of its scope. A service (the runtime, the memory) holds
a service credential from the IM's configuration and exchanges it for a
service access token; with that token it gets access tokens for the agents
it hosts, and for no one else.
"""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime

from uuid_utils.compat import uuid7

from services.common import audit
from services.common.identity import Caller
from services.common.status import status_name
from services.common.tokens import AccessClaims, KeyRing, PrincipalKind, Scope, sign
from services.im.domain import access, rules
from services.im.domain.accounts import IssuedAccess, PersonalToken, PersonalTokenScope
from services.im.domain.errors import InvalidRequest, NotAllowed, NotFound, Unauthenticated
from services.im.domain.model import MemberKind
from services.im.service_layer.auth_ports import Passwords
from services.im.service_layer.handlers.auth_common import AuthBase, Clock
from services.im.service_layer.handlers.deps import Page, utc_now
from services.im.service_layer.ports import Transaction, UnitOfWorkFactory

logger = logging.getLogger(__name__)

BAD_PERSONAL_TOKEN = "the personal access token is not valid (unknown, revoked or expired)"


class MachineAccess(AuthBase):
    """Personal access tokens and the tokens of services and the agents they host.

    Args:
        services: service name -> SHA-256 hex of its secret (read from
            `AUTH_SERVICE_CREDENTIALS_FILE`); a callable so that a reload
            (SIGHUP) takes effect.
        page_limits: the IM's page sizes.
        (the rest as `AuthBase`)
    """

    def __init__(
        self,
        *,
        services: Callable[[], Mapping[str, str]],
        uow: UnitOfWorkFactory,
        keys: KeyRing,
        passwords: Passwords,
        limits: access.AuthLimits | None = None,
        page_limits: rules.Limits | None = None,
        clock: Clock = utc_now,
        audit_log: audit.AuditLog | None = None,
        audit_settings: audit.AuditSettings | None = None,
    ) -> None:
        super().__init__(
            uow=uow,
            keys=keys,
            passwords=passwords,
            limits=limits,
            clock=clock,
            audit_log=audit_log,
            audit_settings=audit_settings,
        )
        self._services = services
        self._page_limits = page_limits or rules.Limits()

    # -- personal access tokens ----------------------------------------------------

    async def create_personal_token(
        self,
        caller: Caller | None,
        *,
        name: str,
        scope: PersonalTokenScope | None,
        expire_time: datetime | None,
        request_id: str,
    ) -> tuple[PersonalToken, str]:
        """A personal access token and its secret (shown this once)."""
        name = rules.check_name(name, "name", required=True)
        if scope is None:
            raise InvalidRequest("scope is required (READ or WRITE)")
        rid = rules.check_request_id(request_id)
        authority = self._authority(caller)
        secret = access.new_secret(access.PERSONAL_TOKEN_PREFIX)
        digest = access.secret_hash(secret)
        async with self._uow() as tx:
            member = await self._member(tx, caller)
            access.require_session(authority, "create personal access tokens")
            access.require_write(authority, "create personal access tokens")
            if member.kind is not MemberKind.HUMAN:
                raise NotAllowed("only people have personal access tokens")
            now = self._now()
            expires = access.personal_token_expiry(expire_time, now, self.limits)
            fingerprint = rules.request_fingerprint(
                op="create_personal_token",
                name=name,
                scope=scope.value,
                expires=expire_time.isoformat() if expire_time is not None else None,
            )
            existing = await self._replay(tx, member.id, rid, fingerprint)
            if existing is not None:
                # The first response may have been lost: the same token, a new secret.
                token = await self._own_token(tx, member.id, existing)
                await tx.replace_personal_token_secret(token.id, digest)
                await tx.add_audit(
                    self._action(
                        caller,
                        member,
                        "CreatePersonalToken",
                        audit.Target("personal_token", str(token.id)),
                        request_id=rid,
                        details={"name": token.name, "repeated": "a new secret for the same request_id"},
                    )
                )
                await tx.commit()
                return replace(token, secret_hash=digest), secret
            token = PersonalToken(
                id=uuid7(),
                member_id=member.id,
                workspace_id=member.workspace_id,
                name=name,
                scope=scope,
                secret_hash=digest,
                created_at=now,
                expires_at=expires,
            )
            await tx.add_personal_token(token)
            await self._remember(tx, member.id, rid, fingerprint, token.id)
            await tx.add_audit(
                self._action(
                    caller,
                    member,
                    "CreatePersonalToken",
                    audit.Target("personal_token", str(token.id)),
                    request_id=rid,
                    details={"name": name, "scope": scope.value, "expire_time": expires.isoformat()},
                )
            )
            await tx.commit()
        logger.info("member %s created personal access token %s", member.id, token.id)
        return token, secret

    async def list_personal_tokens(
        self, caller: Caller | None, *, page_size: int, page_token: str
    ) -> Page[PersonalToken]:
        limit = rules.page_size(page_size, self._page_limits)
        before = None
        if page_token:
            before = rules.parse_id(rules.decode_page_token(page_token, {"before"})["before"], "page_token")
        async with self._uow(write=False) as tx:
            member = await self._member(tx, caller)
            items = await tx.list_personal_tokens(member.id, before=before, limit=limit + 1)
        if len(items) <= limit:
            return Page(items, "")
        items = items[:limit]
        return Page(items, rules.encode_page_token({"before": str(items[-1].id)}))

    async def revoke_personal_token(self, caller: Caller | None, *, personal_token_id: str) -> PersonalToken:
        wanted = rules.parse_id(personal_token_id, "personal_token_id")
        authority = self._authority(caller)
        async with self._uow() as tx:
            member = await self._member(tx, caller)
            access.require_write(authority, "revoke personal access tokens")
            token = await self._own_token(tx, member.id, wanted)
            if token.revoked_at is not None:
                return token
            now = self._now()
            await tx.revoke_personal_token(token.id, now)
            await tx.add_audit(
                self._action(
                    caller,
                    member,
                    "RevokePersonalToken",
                    audit.Target("personal_token", str(token.id)),
                    details={"name": token.name},
                )
            )
            await tx.commit()
        logger.info("member %s revoked personal access token %s", member.id, token.id)
        return replace(token, revoked_at=now)

    @staticmethod
    async def _own_token(tx: Transaction, member_id: uuid.UUID, token_id: uuid.UUID) -> PersonalToken:
        token = await tx.get_personal_token(token_id)
        if token is None or token.member_id != member_id:
            raise NotFound(f"personal access token {token_id} not found")
        return token

    async def exchange_personal_token(self, secret: str) -> IssuedAccess:
        """An access token of the personal token's scope, expiring no later than it."""
        if not access.plausible_secret(secret, access.PERSONAL_TOKEN_PREFIX):
            raise Unauthenticated(BAD_PERSONAL_TOKEN)
        now = self._now()
        async with self._uow() as tx:
            token = await tx.find_personal_token(access.secret_hash(secret))
            if token is None or token.revoked_at is not None or token.expires_at <= now:
                raise Unauthenticated(BAD_PERSONAL_TOKEN)
            member = await tx.get_member(token.member_id)
            if member is None:
                raise Unauthenticated(BAD_PERSONAL_TOKEN)
            await tx.touch_personal_token(token.id, now)
            await tx.commit()
        scope = Scope.READ_WRITE if token.scope is PersonalTokenScope.WRITE else Scope.READ
        return self._access(member, scope=scope, personal_token_id=token.id, not_after=token.expires_at)

    # -- services and the agents they host --------------------------------------------

    async def issue_service_token(self, *, service: str, secret: str) -> IssuedAccess:
        """A service access token for a service's credential.

        Recorded in the audit log with no workspace (a service acts across
        them): kept for the operators, listed by no workspace's admins.
        """
        expected = self._services().get(service)
        presented = access.secret_hash(secret) if len(secret) <= access.MAX_SECRET_CHARS else ""
        target = audit.Target("service", service[:64])
        # Compared in constant time, and compared even for an unknown name.
        if not hmac.compare_digest(expected or "0" * 64, presented) or expected is None:
            refusal = Unauthenticated("the service name or secret is wrong")
            await self._record_refusal(
                audit.refused(
                    audit.ANONYMOUS,
                    workspace_id=None,
                    action="IssueServiceToken",
                    target=target,
                    at=self._clock(),
                    code=status_name(refusal),
                    reason=refusal.message,
                )
            )
            raise refusal
        claims = AccessClaims(kind=PrincipalKind.SERVICE, service=service).stamped(
            now=self._now(), lifetime=self.limits.access_token_lifetime
        )
        assert claims.expires_at is not None
        if self._audit_log is not None:
            await self._audit_log.record(
                audit.succeeded(
                    None,
                    actor=audit.Actor(audit.ActorKind.SERVICE, service=service),
                    workspace_id=None,
                    action="IssueServiceToken",
                    target=target,
                    at=self._clock(),
                )
            )
        return IssuedAccess(token=sign(claims, self._keys), expires_at=claims.expires_at)

    async def issue_agent_tokens(
        self, caller: Caller | None, *, agent_member_ids: list[str]
    ) -> list[IssuedAccess]:
        if caller is None:
            raise Unauthenticated("this call needs a service's access token: authorization: Bearer <token>")
        service = caller.service
        if service is None:
            raise NotAllowed("only a service, with its own access token, gets tokens for agents")
        wanted = rules.parse_ids(agent_member_ids, "agent_member_ids")
        if not wanted:
            raise InvalidRequest("agent_member_ids is empty")
        if len(wanted) > self.limits.max_agent_tokens:
            raise InvalidRequest(f"at most {self.limits.max_agent_tokens} agents per call, got {len(wanted)}")
        async with self._uow(write=False) as tx:
            found = await tx.get_members(list(wanted))
        agents = [access.check_hosted(service, member_id, found.get(member_id)) for member_id in wanted]
        return [self._access(agent, host=service) for agent in agents]
