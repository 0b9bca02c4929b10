"""The audit log on the wire (`agentim.audit.v1`), for every service's servicer."""

from __future__ import annotations

from datetime import UTC, datetime

from google.protobuf import timestamp_pb2

from agentim.audit.v1 import audit_pb2
from services.common.audit import AuditQuery, AuditRecord, OutcomeFilter
from services.common.errors import InvalidArgument

_OUTCOMES = {
    audit_pb2.AUDIT_OUTCOME_FILTER_UNSPECIFIED: OutcomeFilter.ANY,
    audit_pb2.AUDIT_OUTCOME_FILTER_OK: OutcomeFilter.OK,
    audit_pb2.AUDIT_OUTCOME_FILTER_REFUSED: OutcomeFilter.REFUSED,
}


def query_in(query: audit_pb2.AuditQuery) -> AuditQuery:
    """The listing's filters (unknown enum values never get here: the request rules refuse them).

    Raises:
        InvalidArgument: a time outside what a Timestamp may hold.
    """
    return AuditQuery(
        actor=query.actor.strip(),
        action=query.action.strip(),
        target_id=query.target_id.strip(),
        start=_time(query, "start_time"),
        end=_time(query, "end_time"),
        outcome=_OUTCOMES.get(query.outcome, OutcomeFilter.ANY),
    )


def _time(query: audit_pb2.AuditQuery, name: str) -> datetime | None:
    if not query.HasField(name):  # type: ignore[arg-type]
        return None
    value: timestamp_pb2.Timestamp = getattr(query, name)
    if not 0 <= value.nanos < 1_000_000_000:
        raise InvalidArgument(f"query.{name} is not a valid time")
    try:
        return value.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError):
        raise InvalidArgument(f"query.{name} is not a valid time (years 1 to 9999)") from None


def event_out(record: AuditRecord, *, service: str) -> audit_pb2.AuditEvent:
    event = audit_pb2.AuditEvent(
        id=str(record.id),
        workspace_id=str(record.workspace_id) if record.workspace_id else "",
        actor=audit_pb2.AuditActor(
            kind=record.actor.kind,
            member_id=str(record.actor.member_id) if record.actor.member_id else "",
            service=record.actor.service or "",
        ),
        action=record.action,
        target=audit_pb2.AuditTarget(kind=record.target.kind, id=record.target.id),
        outcome=audit_pb2.AuditOutcome(code=record.code, reason=record.reason),
        request_id=record.request_id,
        details=dict(record.details),
        count=record.count,
        service=service,
    )
    event.time.FromDatetime(record.at)
    event.last_time.FromDatetime(record.last_at or record.at)
    return event
