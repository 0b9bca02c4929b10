"""The audit log: who did which privileged action to what, when, and how it went.

Each service keeps its own log in its own schema (the IM: sign-ins, tokens,
invites, roles, members; the runtime: agents and everything done to them),
under the same rules, which live here:

- A successful action is recorded by its handler, in the same transaction as
  the change where the service has one, so that no change exists without its
  record (`succeeded`).
- A refusal or failure of an audited RPC (marked `audited` in the service's
  policy table) is recorded at the boundary by `AuditInterceptor`
  (`services.common.audit_boundary`), when the
  caller's workspace is known (a verified token). Refusals of the same
  actor, action, target and outcome within `AuditSettings.refusal_window` are
  counted in one record, so that a caller hammering a refused call cannot
  fill the table.
- Reads are never recorded, and no secret ever is: `details` are facts the
  handler chooses, and `safe_details` drops any key that looks like a secret.
- Records older than `AuditSettings.retention` are pruned (`AuditPruner` in
  `services.common.audit_boundary`, on a long timer).
"""

from __future__ import annotations

import abc
import base64
import binascii
import dataclasses
import json
import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from uuid_utils.compat import uuid7

from services.common.errors import InvalidArgument, PermissionDenied
from services.common.identity import Caller
from services.common.settings import EnvReader
from services.common.tokens import PrincipalKind

logger = logging.getLogger(__name__)

OK = "OK"
# Outcomes that say the service could not answer, not that the caller was
# refused: nothing happened, and the log may be as unreachable as the rest.
NOT_RECORDED = frozenset({"UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED"})
MAX_REASON_CHARS = 300
MAX_DETAIL_CHARS = 200
# A detail whose key says it holds one of these is never stored.
_SECRET_KEY = re.compile(r"pass|secret|token|api[_-]?key|credential|authorization", re.IGNORECASE)
# What a refusal's reason may quote of a request and must not keep: a URL's
# credentials, a bearer token, this system's secrets (aim_pat_..., aim_rt_...).
_SECRET_TEXT = (
    (re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/@\s'\"]+@", re.IGNORECASE), r"\1***@"),
    (re.compile(r"(bearer\s+)[^\s;,'\"]+", re.IGNORECASE), r"\1***"),
    (re.compile(r"\baim_[a-z]+_[A-Za-z0-9_-]+"), "aim_***"),
)


def scrubbed(text: str) -> str:
    """`text` with what looks like a credential masked (a refusal's reason may quote the request)."""
    for pattern, replacement in _SECRET_TEXT:
        text = pattern.sub(replacement, text)
    return text


class ActorKind:
    """Who acts (AuditActor.kind)."""

    HUMAN = "human"
    AGENT = "agent"
    SERVICE = "service"
    ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Actor:
    """Who did an action: a member (person or agent), a service, or nobody known."""

    kind: str
    member_id: uuid.UUID | None = None
    service: str | None = None

    @property
    def key(self) -> str:
        """One string naming the actor (as the `actor` filter takes it)."""
        if self.member_id is not None:
            return str(self.member_id)
        if self.service is not None:
            return f"service:{self.service}"
        return self.kind


ANONYMOUS = Actor(ActorKind.ANONYMOUS)


@dataclass(frozen=True, slots=True)
class Target:
    """What an action was done to: a kind (`member`, `agent`, ...) and an id."""

    kind: str
    id: str = ""


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One record of the audit log.

    Attributes:
        workspace_id: where it happened (None: no workspace, such as a
            service getting its token; such records are not listed by any
            workspace's admins).
        code: `OK`, or the gRPC status name of a refusal or failure.
        reason: why it was refused or failed, in a few words.
        count: refusals this record stands for (see the module docstring).
        last_at: when the last of them happened.
    """

    id: uuid.UUID
    workspace_id: uuid.UUID | None
    actor: Actor
    action: str
    target: Target
    at: datetime
    code: str = OK
    reason: str = ""
    request_id: str = ""
    details: Mapping[str, str] = field(default_factory=dict)
    count: int = 1
    last_at: datetime | None = None

    @property
    def ok(self) -> bool:
        return self.code == OK


def actor_of(caller: Caller | None) -> Actor:
    """The actor of a call from its verified caller (a view as an agent acts as the person)."""
    if caller is None:
        return ANONYMOUS
    claims = caller.claims
    if claims.kind is PrincipalKind.SERVICE:
        return Actor(ActorKind.SERVICE, service=claims.service)
    kind = ActorKind.AGENT if claims.kind is PrincipalKind.AGENT else ActorKind.HUMAN
    return Actor(kind, member_id=claims.member_id)


def safe_details(details: Mapping[str, object] | None) -> dict[str, str]:
    """The details as short strings, without any key that could hold a secret
    (and credentials in a value masked)."""
    kept: dict[str, str] = {}
    for key, value in (details or {}).items():
        if _SECRET_KEY.search(key):
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        kept[key[:64]] = scrubbed(text)[:MAX_DETAIL_CHARS]
    return kept


def succeeded(
    caller: Caller | None,
    *,
    workspace_id: uuid.UUID | None,
    action: str,
    target: Target,
    at: datetime,
    request_id: str | None = "",
    details: Mapping[str, object] | None = None,
    actor: Actor | None = None,
) -> AuditRecord:
    """The record of an action that succeeded, for its handler to store with the change."""
    return AuditRecord(
        id=uuid7(),
        workspace_id=workspace_id,
        actor=actor or actor_of(caller),
        action=action,
        target=target,
        at=at,
        request_id=request_id or "",
        details=safe_details(details),
        last_at=at,
    )


def refused(
    actor: Actor,
    *,
    workspace_id: uuid.UUID | None,
    action: str,
    target: Target,
    at: datetime,
    code: str,
    reason: str,
    request_id: str = "",
) -> AuditRecord:
    """The record of a refused or failed action."""
    return AuditRecord(
        id=uuid7(),
        workspace_id=workspace_id,
        actor=actor,
        action=action,
        target=target,
        at=at,
        code=code,
        reason=scrubbed(reason)[:MAX_REASON_CHARS],
        request_id=request_id,
        last_at=at,
    )


# -- listing ------------------------------------------------------------------


class OutcomeFilter:
    """Which outcomes a listing keeps."""

    ANY = "any"
    OK = "ok"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class AuditQuery:
    """A listing's filters (each None or empty keeps everything)."""

    actor: str = ""
    action: str = ""
    target_id: str = ""
    start: datetime | None = None
    end: datetime | None = None
    outcome: str = OutcomeFilter.ANY


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a page ended: the last record's time and id (newest first)."""

    at: datetime
    id: uuid.UUID


MAX_FILTER_CHARS = 200


def check_query(query: AuditQuery) -> AuditQuery:
    """The query, if its filters are well formed.

    Raises:
        InvalidArgument: a filter too long, or a time range that ends before it starts.
    """
    for name in ("actor", "action", "target_id"):
        if len(getattr(query, name)) > MAX_FILTER_CHARS:
            raise InvalidArgument(f"query.{name} is limited to {MAX_FILTER_CHARS} characters")
    if query.start is not None and query.end is not None and query.end <= query.start:
        raise InvalidArgument("query.end_time must be after query.start_time")
    return query


def encode_cursor(cursor: Cursor, query: AuditQuery) -> str:
    """A page token: the cursor, bound to the query it was made for."""
    body = {"at": cursor.at.isoformat(), "id": str(cursor.id), "q": _query_key(query)}
    return base64.urlsafe_b64encode(json.dumps(body).encode()).decode().rstrip("=")


def decode_cursor(token: str, query: AuditQuery) -> Cursor | None:
    """The cursor of a page token made by `encode_cursor` for the same query.

    Raises:
        InvalidArgument: a malformed token, or one made for another query.
    """
    if not token:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        body = json.loads(raw)
        cursor = Cursor(at=datetime.fromisoformat(body["at"]).astimezone(UTC), id=uuid.UUID(body["id"]))
        made_for = body["q"]
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise InvalidArgument("page_token is malformed") from None
    if made_for != _query_key(query):
        raise InvalidArgument("page_token was made for another query; start again without it")
    return cursor


def _query_key(query: AuditQuery) -> str:
    values = dataclasses.asdict(query)
    return json.dumps(values, default=str, sort_keys=True)


def page_size(requested: int, *, default: int = 50, maximum: int = 200) -> int:
    """The number of records to return."""
    if requested < 0:
        raise InvalidArgument("page_size must not be negative")
    return min(requested or default, maximum)


class NotAnAdmin(PermissionDenied):
    """Only the workspace's owner and admins read its audit log."""


ADMIN_ROLES = frozenset({"owner", "admin"})


# -- storage port ---------------------------------------------------------------


class AuditLog(abc.ABC):
    """Where a service keeps its audit records (outside the changes' transactions)."""

    @abc.abstractmethod
    async def record_refusal(self, record: AuditRecord, *, window: timedelta) -> None:
        """Counts the refusal in the newest record of the same workspace, actor,
        action, target and outcome begun less than `window` before it, or stores it."""

    @abc.abstractmethod
    async def record(self, record: AuditRecord) -> None:
        """Stores a record on its own (for changes that had no transaction of the service's)."""

    @abc.abstractmethod
    async def list(
        self, workspace_id: uuid.UUID, query: AuditQuery, *, after: Cursor | None, limit: int
    ) -> list[AuditRecord]:
        """The workspace's records that fit the query, newest first, older than `after`."""

    @abc.abstractmethod
    async def prune(self, *, before: datetime) -> int:
        """Deletes the records of actions before `before`; returns how many."""


@dataclass(frozen=True, slots=True)
class AuditSettings:
    """`AUDIT_RETENTION_DAYS` (0: keep forever), `AUDIT_REFUSAL_WINDOW_SECONDS`,
    `AUDIT_PRUNE_INTERVAL_SECONDS`."""

    retention: timedelta | None = timedelta(days=365)
    refusal_window: timedelta = timedelta(minutes=10)
    prune_interval: timedelta = timedelta(hours=6)


def read_audit_settings(env: EnvReader) -> AuditSettings:
    days = env.integer("AUDIT_RETENTION_DAYS", 365, minimum=0)
    window = env.integer("AUDIT_REFUSAL_WINDOW_SECONDS", 600, minimum=0)
    interval = env.integer("AUDIT_PRUNE_INTERVAL_SECONDS", 6 * 3600, minimum=60)
    return AuditSettings(
        retention=timedelta(days=days) if days else None,
        refusal_window=timedelta(seconds=window),
        prune_interval=timedelta(seconds=interval),
    )


async def list_page(
    log: AuditLog, workspace_id: uuid.UUID, query: AuditQuery, *, page_token: str, size: int
) -> tuple[list[AuditRecord], str]:
    """One page of the workspace's records and the token of the next."""
    query = check_query(query)
    limit = page_size(size)
    after = decode_cursor(page_token, query)
    found = await log.list(workspace_id, query, after=after, limit=limit + 1)
    if len(found) <= limit:
        return found, ""
    page = found[:limit]
    return page, encode_cursor(Cursor(page[-1].at, page[-1].id), query)
