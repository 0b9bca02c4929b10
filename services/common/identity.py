"""Who is calling: read from call metadata, the same way in every service.

A member names itself with `x-member-id`. A trusted service (the agent
runtime, the gateway) adds `x-agentim-service` with the shared service
token; it may then act for any member, or with no member at all for
administrative calls. A later issue replaces both with verified tokens
without changing any request message.

Access tokens (`authorization: Bearer <JWT>`, see `services.common.tokens`)
are read by `identify`, which `services.common.authn` runs for every RPC of
every service (the legacy metadata only while `AUTH_TRUST_MEMBER_HEADER`
is on): that is the one place to drop `x-member-id`.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.errors import Unauthenticated
from services.common.tokens import AccessClaims, PrincipalKind, Verifier

AUTHORIZATION_KEY = "authorization"
MEMBER_ID_KEY = "x-member-id"
SERVICE_TOKEN_KEY = "x-agentim-service"
# A person's read-only view through an agent's eyes (the web UI's "view as"):
# honoured by the IM alone, for reading calls, for an admin of the agent's
# workspace (see `services.common.authn`).
VIEW_AS_KEY = "x-agentim-view-as"
# Response header of IM WatchEvents: the cursor the stream starts after.
WATCH_START_CURSOR_KEY = "x-agentim-start-cursor"


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller: a member, a trusted service, or a service acting for a member."""

    member_id: uuid.UUID | None
    is_service: bool = False


def principal_from_metadata(
    metadata: Iterable[tuple[str, str | bytes]] | None,
    *,
    service_token: str | None,
) -> Principal | None:
    """Returns the caller named by the metadata, or None if it names nobody.

    Args:
        metadata: The call's invocation metadata.
        service_token: The token trusted services must present; None accepts
            any value (the embedded default, where every process is local).

    Raises:
        Unauthenticated: a malformed member id or a wrong service token.
    """
    values = {key.lower(): value for key, value in (metadata or ())}
    raw_member = values.get(MEMBER_ID_KEY)
    raw_service = values.get(SERVICE_TOKEN_KEY)
    member_id: uuid.UUID | None = None
    if raw_member is not None:
        text = raw_member.decode() if isinstance(raw_member, bytes) else raw_member
        try:
            member_id = uuid.UUID(text)
        except ValueError:
            raise Unauthenticated(f"{MEMBER_ID_KEY} is not a valid member id") from None
    is_service = False
    if raw_service is not None:
        presented = raw_service.decode() if isinstance(raw_service, bytes) else raw_service
        if service_token is not None and not hmac.compare_digest(presented, service_token):
            raise Unauthenticated(f"{SERVICE_TOKEN_KEY} does not hold the service token")
        is_service = True
    if member_id is None and not is_service:
        return None
    return Principal(member_id=member_id, is_service=is_service)


def caller_metadata(
    *, member_id: uuid.UUID | str | None = None, service_token: str | None = None
) -> tuple[tuple[str, str], ...]:
    """Metadata for an outgoing call made as a member and/or a service."""
    items: list[tuple[str, str]] = []
    if member_id is not None:
        items.append((MEMBER_ID_KEY, str(member_id)))
    if service_token is not None:
        items.append((SERVICE_TOKEN_KEY, service_token))
    return tuple(items)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a call comes from: the verified claims of its access token, or
    (until every service takes access tokens) the `x-member-id` principal."""

    claims: AccessClaims | None = None
    principal: Principal | None = None
    # The agent whose view a person reads (VIEW_AS_KEY); the call acts as it.
    view_as: uuid.UUID | None = None

    @property
    def member_id(self) -> uuid.UUID | None:
        if self.view_as is not None:
            return self.view_as
        if self.claims is not None:
            return self.claims.member_id
        return self.principal.member_id if self.principal is not None else None

    @property
    def service(self) -> str | None:
        """The service's name, for a call made with a service's own access token."""
        if self.claims is not None and self.claims.kind is PrincipalKind.SERVICE:
            return self.claims.service
        return None

    @property
    def is_service(self) -> bool:
        """A service's own token, or the legacy trusted-service metadata (which names no service)."""
        if self.claims is not None:
            return self.claims.kind is PrincipalKind.SERVICE
        return self.principal is not None and self.principal.is_service

    @property
    def can_write(self) -> bool:
        return self.claims.can_write if self.claims is not None else True

    @property
    def via_personal_token(self) -> bool:
        return self.claims is not None and self.claims.personal_token_id is not None


async def identify(
    metadata: Iterable[tuple[str, str | bytes]] | None,
    *,
    verifier: Verifier,
    service_token: str | None,
) -> Caller | None:
    """The caller named by the metadata: a verified access token first, else
    the `x-member-id` principal; None if it names nobody.

    A call that sends `authorization` is judged by it alone: a bad token is
    refused, never passed over for the other headers.

    Raises:
        Unauthenticated: a malformed header, or a token that does not verify.
        Unavailable: the verifier cannot fetch the keys it needs now.
    """
    items = list(metadata or ())
    raw = next((value for key, value in items if key.lower() == AUTHORIZATION_KEY), None)
    if raw is not None:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated(f"{AUTHORIZATION_KEY} must be 'Bearer <access token>'")
        return Caller(claims=await verifier.verify(token.strip()))
    principal = principal_from_metadata(items, service_token=service_token)
    return None if principal is None else Caller(principal=principal)


def bearer_metadata(access_token: str) -> tuple[tuple[str, str], ...]:
    """Metadata for an outgoing call made with an access token."""
    return ((AUTHORIZATION_KEY, f"Bearer {access_token}"),)
