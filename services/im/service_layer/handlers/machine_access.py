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
from dataclasses import replace

from uuid_utils.compat import uuid7

from services.common import audit
from services.common.identity import Caller
from services.common.tokens import AccessClaims, PrincipalKind, Scope, sign
from services.im.domain import access, rules
from services.im.domain.accounts import IssuedAccess, PersonalToken, PersonalTokenScope
from services.im.domain.commands import (
    CreatePersonalToken,
    ExchangePersonalToken,
    IssueAgentTokens,
    IssueServiceToken,
    RevokePersonalToken,
)
from services.im.domain.errors import InvalidRequest, NotAllowed, NotFound, Unauthenticated
from services.im.domain.model import MemberKind
from services.im.service_layer.handlers.auth_deps import (
    AuthDeps,
    access_token,
    authority,
    caller_record,
    calling_member,
    record_refusal,
    remember,
    replay,
)
from services.im.service_layer.handlers.deps import Page
from services.im.service_layer.ports import Transaction

logger = logging.getLogger(__name__)

BAD_PERSONAL_TOKEN = "the personal access token is not valid (unknown, revoked or expired)"


# -- personal access tokens ------------------------------------------------------------


async def create_personal_token(auth: AuthDeps, command: CreatePersonalToken) -> tuple[PersonalToken, str]:
    """A personal access token and its secret (shown this once). A retry with
    the same request_id gives the same token with a new secret (the first
    response may have been lost)."""
    caller, scope, expire_time = command.caller, command.scope, command.expire_time
    name = rules.check_name(command.name, "name", required=True)
    if scope is None:
        raise InvalidRequest("scope is required (READ or WRITE)")
    rid = rules.check_request_id(command.request_id)
    allowed = authority(caller)
    secret = access.new_secret(access.PERSONAL_TOKEN_PREFIX)
    digest = access.secret_hash(secret)
    async with auth.uow() as tx:
        member = await calling_member(tx, caller)
        access.require_session(allowed, "create personal access tokens")
        access.require_write(allowed, "create personal access tokens")
        if member.kind is not MemberKind.HUMAN:
            raise NotAllowed("only people have personal access tokens")
        now = auth.now()
        expires = access.personal_token_expiry(expire_time, now, auth.limits)
        fingerprint = rules.request_fingerprint(
            op="create_personal_token",
            name=name,
            scope=scope.value,
            expires=expire_time.isoformat() if expire_time is not None else None,
        )
        existing = await replay(tx, member.id, rid, fingerprint)
        if existing is not None:
            token = await _own_token(tx, member.id, existing)
            await tx.replace_personal_token_secret(token.id, digest)
            details = {"name": token.name, "repeated": "a new secret for the same request_id"}
            token = replace(token, secret_hash=digest)
        else:
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
            await remember(tx, member.id, rid, fingerprint, token.id)
            details = {"name": name, "scope": scope.value, "expire_time": expires.isoformat()}
        await tx.add_audit(
            caller_record(
                auth,
                caller,
                member,
                "CreatePersonalToken",
                audit.Target("personal_token", str(token.id)),
                request_id=rid,
                details=details,
            )
        )
        await tx.commit()
    if existing is None:
        logger.info("member %s created personal access token %s", member.id, token.id)
    return token, secret


async def list_personal_tokens(
    auth: AuthDeps, caller: Caller | None, *, page_size: int, page_token: str
) -> Page[PersonalToken]:
    """The caller's personal access tokens, newest first."""
    limit = rules.page_size(page_size, auth.im.limits)
    before = None
    if page_token:
        before = rules.parse_id(rules.decode_page_token(page_token, {"before"})["before"], "page_token")
    async with auth.uow(write=False) as tx:
        member = await calling_member(tx, caller)
        items = await tx.list_personal_tokens(member.id, before=before, limit=limit + 1)
    if len(items) <= limit:
        return Page(items, "")
    items = items[:limit]
    return Page(items, rules.encode_page_token({"before": str(items[-1].id)}))


async def revoke_personal_token(auth: AuthDeps, command: RevokePersonalToken) -> PersonalToken:
    """Revokes one of the caller's personal access tokens; one revoked already stays as it was."""
    caller = command.caller
    wanted = rules.parse_id(command.personal_token_id, "personal_token_id")
    allowed = authority(caller)
    async with auth.uow() as tx:
        member = await calling_member(tx, caller)
        access.require_write(allowed, "revoke personal access tokens")
        token = await _own_token(tx, member.id, wanted)
        if token.revoked_at is not None:
            return token
        now = auth.now()
        await tx.revoke_personal_token(token.id, now)
        await tx.add_audit(
            caller_record(
                auth,
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


async def _own_token(tx: Transaction, member_id: uuid.UUID, token_id: uuid.UUID) -> PersonalToken:
    token = await tx.get_personal_token(token_id)
    if token is None or token.member_id != member_id:
        raise NotFound(f"personal access token {token_id} not found")
    return token


async def exchange_personal_token(auth: AuthDeps, command: ExchangePersonalToken) -> IssuedAccess:
    """An access token of the personal token's scope, expiring no later than it."""
    if not access.plausible_secret(command.secret, access.PERSONAL_TOKEN_PREFIX):
        raise Unauthenticated(BAD_PERSONAL_TOKEN)
    now = auth.now()
    async with auth.uow() as tx:
        token = await tx.find_personal_token(access.secret_hash(command.secret))
        if token is None or token.revoked_at is not None or token.expires_at <= now:
            raise Unauthenticated(BAD_PERSONAL_TOKEN)
        member = await tx.get_member(token.member_id)
        if member is None:
            raise Unauthenticated(BAD_PERSONAL_TOKEN)
        await tx.touch_personal_token(token.id, now)
        await tx.commit()
    scope = Scope.READ_WRITE if token.scope is PersonalTokenScope.WRITE else Scope.READ
    return access_token(auth, member, scope=scope, personal_token_id=token.id, not_after=token.expires_at)


# -- services and the agents they host --------------------------------------------------


async def issue_service_token(auth: AuthDeps, command: IssueServiceToken) -> IssuedAccess:
    """A service access token for a service's credential.

    Recorded in the audit log with no workspace (a service acts across
    them): kept for the operators, listed by no workspace's admins.
    """
    service, secret = command.service, command.secret
    expected = auth.services().get(service)
    presented = access.secret_hash(secret) if len(secret) <= access.MAX_SECRET_CHARS else ""
    target = audit.Target("service", service[:64])
    # Compared in constant time, and compared even for an unknown name.
    if not hmac.compare_digest(expected or "0" * 64, presented) or expected is None:
        refusal = Unauthenticated("the service name or secret is wrong")
        await record_refusal(auth, refusal, action="IssueServiceToken", target=target, workspace_id=None)
        raise refusal
    claims = AccessClaims(kind=PrincipalKind.SERVICE, service=service).stamped(
        now=auth.now(), lifetime=auth.limits.access_token_lifetime
    )
    assert claims.expires_at is not None
    if auth.audit_log is not None:
        await auth.audit_log.record(
            audit.succeeded(
                None,
                actor=audit.Actor(audit.ActorKind.SERVICE, service=service),
                workspace_id=None,
                action="IssueServiceToken",
                target=target,
                at=auth.clock(),
            )
        )
    return IssuedAccess(token=sign(claims, auth.keys), expires_at=claims.expires_at)


async def issue_agent_tokens(auth: AuthDeps, command: IssueAgentTokens) -> list[IssuedAccess]:
    """Access tokens for agents that the calling service hosts (all or none)."""
    caller = command.caller
    if caller is None:
        raise Unauthenticated("this call needs a service's access token: authorization: Bearer <token>")
    service = caller.service
    if service is None:
        raise NotAllowed("only a service, with its own access token, gets tokens for agents")
    wanted = rules.parse_ids(command.agent_member_ids, "agent_member_ids")
    if not wanted:
        raise InvalidRequest("agent_member_ids is empty")
    if len(wanted) > auth.limits.max_agent_tokens:
        raise InvalidRequest(f"at most {auth.limits.max_agent_tokens} agents per call, got {len(wanted)}")
    async with auth.uow(write=False) as tx:
        found = await tx.get_members(list(wanted))
    agents = [access.check_hosted(service, member_id, found.get(member_id)) for member_id in wanted]
    return [access_token(auth, agent, host=service) for agent in agents]
