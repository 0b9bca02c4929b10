"""Who is calling: the verified access token a call carries, the same way in every service.

Every call names its caller with `authorization: Bearer <access token>` (see
`services.common.tokens`): a person's, an agent's (which only the service
hosting it holds) or a service's own. `identify` reads it, and
`services.common.authn` runs it for every RPC of every service. The
`x-member-id` and `x-agentim-service` headers of earlier versions name
nobody: a call that sends only them is refused like one that sends nothing
(`RETIRED_KEYS`, named in the refusal so that old clients learn why).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.errors import Unauthenticated
from services.common.tokens import AccessClaims, PrincipalKind, Verifier

AUTHORIZATION_KEY = "authorization"
# Metadata that once named the caller without proof, and is ignored now.
RETIRED_KEYS = ("x-member-id", "x-agentim-service")
# A person's read-only view through an agent's eyes (the web UI's "view as"):
# honoured by the IM alone, for reading calls, for an admin of the agent's
# workspace (see `services.common.authn`).
VIEW_AS_KEY = "x-agentim-view-as"
# Response header of IM WatchEvents: the cursor the stream starts after.
WATCH_START_CURSOR_KEY = "x-agentim-start-cursor"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a call comes from: the verified claims of its access token."""

    claims: AccessClaims
    # The agent whose view a person reads (VIEW_AS_KEY); the call acts as it.
    view_as: uuid.UUID | None = None

    @property
    def member_id(self) -> uuid.UUID | None:
        """The member the call acts as (None for a service's own token)."""
        if self.view_as is not None:
            return self.view_as
        return self.claims.member_id

    @property
    def service(self) -> str | None:
        """The service's name, for a call made with a service's own access token."""
        return self.claims.service if self.claims.kind is PrincipalKind.SERVICE else None

    @property
    def is_service(self) -> bool:
        """A service's own token (which acts as no member)."""
        return self.claims.kind is PrincipalKind.SERVICE

    @property
    def can_write(self) -> bool:
        return self.claims.can_write

    @property
    def via_personal_token(self) -> bool:
        return self.claims.personal_token_id is not None


async def identify(
    metadata: Iterable[tuple[str, str | bytes]] | None, *, verifier: Verifier
) -> Caller | None:
    """The caller the metadata's access token names; None if it sends none.

    Raises:
        Unauthenticated: a malformed header, or a token that does not verify.
        Unavailable: the verifier cannot fetch the keys it needs now.
    """
    raw = next((value for key, value in metadata or () if key.lower() == AUTHORIZATION_KEY), None)
    if raw is None:
        return None
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    scheme, _, token = text.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated(f"{AUTHORIZATION_KEY} must be 'Bearer <access token>'")
    return Caller(claims=await verifier.verify(token.strip()))


def retired_keys_in(metadata: Iterable[tuple[str, str | bytes]] | None) -> list[str]:
    """The retired caller headers the metadata still sends (to say so in a refusal)."""
    sent = {key.lower() for key, _ in metadata or ()}
    return [key for key in RETIRED_KEYS if key in sent]


def bearer_metadata(access_token: str) -> tuple[tuple[str, str], ...]:
    """Metadata for an outgoing call made with an access token."""
    return ((AUTHORIZATION_KEY, f"Bearer {access_token}"),)
