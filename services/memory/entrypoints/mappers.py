"""Between protos and the memory's domain."""

from __future__ import annotations

from datetime import UTC, datetime

from google.protobuf import timestamp_pb2

from agentim.memory.v1 import memory_pb2 as pb
from services.memory.domain.errors import InvalidRequest
from services.memory.domain.model import (
    ArchivedRun,
    ArchivedStep,
    MemoryStats,
    RankedSegment,
    RunInfo,
    SegmentType,
    StepRole,
    StoredSegment,
    ToolCall,
)
from services.memory.domain.scope import Filters
from services.memory.service_layer.handlers import AgentScopeRequest, ScopeRequest, WorkspaceScopeRequest

# 0001-01-01 and 9999-12-31: what a Timestamp may hold and Python can represent.
_MIN_SECONDS = -62135596800
_MAX_SECONDS = 253402300799


def time_in(value: timestamp_pb2.Timestamp, where: str) -> datetime:
    if not _MIN_SECONDS <= value.seconds <= _MAX_SECONDS or not 0 <= value.nanos < 1_000_000_000:
        raise InvalidRequest(f"{where} is not a valid time")
    return value.ToDatetime(tzinfo=UTC)


def optional_time_in(parent: object, field: str, where: str) -> datetime | None:
    if not parent.HasField(field):  # type: ignore[attr-defined]
        return None
    return time_in(getattr(parent, field), where)


def time_out(value: datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value)
    return stamp


def run_in(value: pb.ArchivedRun) -> ArchivedRun:
    for field in ("start_time", "end_time"):
        if not value.HasField(field):
            raise InvalidRequest(f"run.{field} is required")
    started = time_in(value.start_time, "run.start_time")
    ended = time_in(value.end_time, "run.end_time")
    steps = []
    for index, step in enumerate(value.steps):
        if step.role == pb.STEP_ROLE_UNSPECIFIED:
            raise InvalidRequest(f"run.steps[{index}].role is required")
        created = (
            time_in(step.create_time, f"run.steps[{index}].create_time")
            if step.HasField("create_time")
            else ended
        )
        steps.append(
            ArchivedStep(
                sequence=step.sequence,
                role=StepRole(step.role),
                content=step.content,
                reasoning=step.reasoning,
                tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in step.tool_calls),
                tool_name=step.tool_name,
                group_id=step.group_id,
                created_at=created,
                summary=step.summary,
            )
        )
    conversations: dict[str, frozenset[str]] = {}
    for conversation in value.conversations:
        if conversation.group_id in conversations:
            raise InvalidRequest(f"run.conversations lists group {conversation.group_id} twice")
        members = frozenset(conversation.member_ids)
        if any(not member or len(member) > 128 for member in members):
            raise InvalidRequest(f"run.conversations: group {conversation.group_id} has an invalid member id")
        conversations[conversation.group_id] = members
    return ArchivedRun(
        workspace_id=value.workspace_id,
        agent_id=value.agent_id,
        agent_member_id=value.agent_member_id,
        session_id=value.session_id,
        run_id=value.run_id,
        started_at=started,
        ended_at=ended,
        steps=tuple(steps),
        conversations=conversations,
    )


def scope_in(request: pb.RetrieveRequest | pb.ExpandRequest) -> ScopeRequest | None:
    which = request.WhichOneof("scope")
    if which == "agent":
        return AgentScopeRequest(request.agent.agent_id, tuple(request.agent.audience_member_ids))
    if which == "workspace":
        return WorkspaceScopeRequest(request.workspace.workspace_id)
    return None


def filters_in(value: pb.RetrieveFilters) -> Filters:
    types = set()
    for kind in value.types:
        if kind == pb.SEGMENT_TYPE_UNSPECIFIED:
            raise InvalidRequest("filters.types: SEGMENT_TYPE_UNSPECIFIED is not a type")
        types.add(SegmentType(kind))
    return Filters(
        types=frozenset(types),
        since=optional_time_in(value, "since", "filters.since"),
        until=optional_time_in(value, "until", "filters.until"),
        group_id=value.group_id,
        agent_id=value.agent_id,
        exclude_run_ids=frozenset(value.exclude_run_ids),
    )


def segment_out(value: StoredSegment) -> pb.Segment:
    return pb.Segment(
        anchor=pb.Anchor(
            workspace_id=value.workspace_id,
            agent_id=value.agent_id,
            session_id=value.session_id,
            run_id=value.run_id,
            step_sequence=value.step_sequence,
            segment_index=value.segment_index,
        ),
        type=int(value.type),  # type: ignore[arg-type]
        text=value.text,
        group_id=value.group_id,
        create_time=time_out(value.created_at),
        tool_name=value.tool_name,
        ref=str(value.ref),
    )


def ranked_out(value: RankedSegment) -> pb.RetrievedSegment:
    return pb.RetrievedSegment(
        segment=segment_out(value.segment), score=value.score, duplicates=value.duplicates
    )


def run_info_out(value: RunInfo) -> pb.RunInfo:
    return pb.RunInfo(
        run_id=value.run_id,
        agent_id=value.agent_id,
        session_id=value.session_id,
        start_time=time_out(value.started_at),
        end_time=time_out(value.ended_at),
        segment_count=value.segment_count,
    )


def stats_out(value: MemoryStats) -> pb.GetMemoryStatsResponse:
    response = pb.GetMemoryStatsResponse(
        run_count=value.run_count,
        segment_count=value.segment_count,
        pending_embeddings=value.pending_embeddings,
    )
    if value.oldest is not None:
        response.oldest_time.CopyFrom(time_out(value.oldest))
    if value.newest is not None:
        response.newest_time.CopyFrom(time_out(value.newest))
    return response
