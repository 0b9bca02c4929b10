"""Who is calling: read from call metadata, the same way in every service.

A member names itself with `x-member-id`. A trusted service (the agent
runtime, the gateway) adds `x-agentim-service` with the shared service
token; it may then act for any member, or with no member at all for
administrative calls. A later issue replaces both with verified tokens
without changing any request message.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.errors import Unauthenticated

MEMBER_ID_KEY = "x-member-id"
SERVICE_TOKEN_KEY = "x-agentim-service"
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
