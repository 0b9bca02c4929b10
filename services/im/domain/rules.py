"""The IM's rules: validation, limits and idempotency, as pure functions."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.im.domain.errors import InvalidRequest, LimitExceeded, QuotaExceeded
from services.im.domain.model import ContentType

MAX_REQUEST_ID_CHARS = 128
MAX_NAME_CHARS = 200
MAX_AVATAR_CHARS = 2048
# Scope of request_ids sent before the caller has an identity (CreateWorkspace).
NIL_SCOPE = uuid.UUID(int=0)


@dataclass(frozen=True, slots=True)
class Limits:
    """Explicit, configurable limits; every one is enforced and tested."""

    max_content_bytes: int = 64 * 1024
    max_metadata_bytes: int = 16 * 1024
    max_mentions: int = 50
    max_group_members: int = 500
    max_page_size: int = 200
    default_page_size: int = 50
    max_unread_page_size: int = 1000


@dataclass(frozen=True, slots=True)
class Quotas:
    """How many people, agents and groups (named ones: a direct chat is
    bounded by its pair) one workspace may have; 0 means no limit."""

    members: int = 1000
    agents: int = 200
    groups: int = 10_000


def check_quota(what: str, quota: int, current: int) -> None:
    """Refuses one more `what` in a workspace that has `current` of a `quota`.

    Raises:
        QuotaExceeded: the workspace has its quota already.
    """
    if quota and current >= quota:
        raise QuotaExceeded(
            f"this workspace has reached its quota of {quota} {what}; ask its administrator",
            subject=f"workspace:{what}",
            limit=quota,
        )


def parse_id(value: str, field: str) -> uuid.UUID:
    """Parses a required id, rejecting empty and malformed ones."""
    if not value:
        raise InvalidRequest(f"{field} is required")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidRequest(f"{field} is not a valid id: {value[:64]!r}") from None


def parse_optional_id(value: str, field: str) -> uuid.UUID | None:
    return parse_id(value, field) if value else None


def parse_ids(values: Iterable[str], field: str) -> tuple[uuid.UUID, ...]:
    """Parses ids, keeping their first-seen order and dropping repeats."""
    seen: dict[uuid.UUID, None] = {}
    for value in values:
        seen.setdefault(parse_id(value, field), None)
    return tuple(seen)


def check_name(value: str, field: str, *, required: bool) -> str:
    name = value.strip()
    if required and not name:
        raise InvalidRequest(f"{field} is required")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidRequest(f"{field} is {len(name)} characters; the limit is {MAX_NAME_CHARS}")
    return name


def check_avatar(value: str) -> str:
    if len(value) > MAX_AVATAR_CHARS:
        raise InvalidRequest(f"avatar is {len(value)} characters; the limit is {MAX_AVATAR_CHARS}")
    return value


def check_request_id(value: str) -> str | None:
    if not value:
        return None
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id is {len(value)} characters; the limit is {MAX_REQUEST_ID_CHARS}")
    return value


def check_content(content: str, limits: Limits) -> None:
    size = len(content.encode())
    if size > limits.max_content_bytes:
        raise InvalidRequest(f"content is {size} bytes; the limit is {limits.max_content_bytes}")


def check_message(
    *,
    content: str,
    mentions: Sequence[uuid.UUID],
    metadata: dict[str, Any],
    limits: Limits,
) -> None:
    """Checks a message to send against the limits."""
    if not content.strip():
        raise InvalidRequest("content is empty")
    check_content(content, limits)
    if len(mentions) > limits.max_mentions:
        raise InvalidRequest(f"{len(mentions)} mentions; the limit is {limits.max_mentions}")
    metadata_size = len(canonical_json(metadata).encode())
    if metadata_size > limits.max_metadata_bytes:
        raise InvalidRequest(f"metadata is {metadata_size} bytes; the limit is {limits.max_metadata_bytes}")


def check_group_size(size: int, limits: Limits) -> None:
    if size > limits.max_group_members:
        raise LimitExceeded(
            f"a group may have at most {limits.max_group_members} members; this one would have {size}"
        )


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def message_fingerprint(
    *,
    group_id: uuid.UUID,
    content_type: ContentType,
    content: str,
    mentions: Sequence[uuid.UUID],
    reply_to: uuid.UUID | None,
    metadata: dict[str, Any],
) -> str:
    """A digest of what a SendMessage asked for: equal for a true retry only."""
    payload = canonical_json(
        {
            "group": str(group_id),
            "type": content_type.value,
            "content": content,
            "mentions": sorted(str(m) for m in mentions),
            "reply_to": str(reply_to) if reply_to else None,
            "metadata": metadata,
        }
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def request_fingerprint(**fields: Any) -> str:
    """A digest of any create request's fields, for request_id checks."""
    return hashlib.sha256(canonical_json(fields).encode()).hexdigest()


def direct_key(a: uuid.UUID, b: uuid.UUID) -> str:
    """The one key of a pair's direct group, whichever side asks."""
    low, high = sorted((a, b))
    return f"{low}:{high}"


def page_size(requested: int, limits: Limits, *, maximum: int | None = None) -> int:
    """Clamps a requested page size; 0 means the default, negatives are refused."""
    if requested < 0:
        raise InvalidRequest(f"page_size must not be negative, got {requested}")
    cap = maximum if maximum is not None else limits.max_page_size
    if requested == 0:
        return min(limits.default_page_size, cap)
    return min(requested, cap)


def encode_page_token(fields: dict[str, str]) -> str:
    return base64.urlsafe_b64encode(canonical_json(fields).encode()).decode().rstrip("=")


def decode_page_token(token: str, expected_keys: set[str]) -> dict[str, str]:
    """Decodes a token made by `encode_page_token`, refusing anything else."""
    try:
        padded = token + "=" * (-len(token) % 4)
        fields = json.loads(base64.urlsafe_b64decode(padded.encode()))
    except (ValueError, UnicodeDecodeError, RecursionError):  # deep nesting: RecursionError
        raise InvalidRequest("page_token is malformed") from None
    if (
        not isinstance(fields, dict)
        or set(fields) != expected_keys
        or not all(isinstance(v, str) for v in fields.values())
    ):
        raise InvalidRequest("page_token is malformed")
    return fields
