"""The memory port over the memory service's gRPC API.

Calls act as the agent, with its AGENT access token (else the runtime's own
SERVICE token), which the IM client gets. A memory that cannot be reached
within the deadline, or a runtime without its tokens yet, is
`MemoryUnavailable`; any other refusal is `MemoryRefused` with its reason.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import grpc
from google.protobuf import timestamp_pb2

from agentim.memory.v1 import memory_pb2, memory_pb2_grpc
from services.common import errors
from services.common.clients import open_channel
from services.common.identity import bearer_metadata
from services.common.service_auth import AgentTokens, ServiceToken, TokenRefused
from services.common.tls import ClientTls
from services.runtime.domain.errors import MemoryRefused, MemoryUnavailable
from services.runtime.domain.llm import Role
from services.runtime.domain.model import Agent, StepKind
from services.runtime.service_layer.memory_port import Expanded, Memory, MemoryPort, RecallQuery, RunRecord

_UNREACHABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
_ROLES = {
    Role.SYSTEM: memory_pb2.STEP_ROLE_SYSTEM,
    Role.USER: memory_pb2.STEP_ROLE_USER,
    Role.ASSISTANT: memory_pb2.STEP_ROLE_ASSISTANT,
    Role.TOOL: memory_pb2.STEP_ROLE_TOOL,
}
SEGMENT_TYPES = {
    "user_message": memory_pb2.SEGMENT_TYPE_USER_MESSAGE,
    "reasoning": memory_pb2.SEGMENT_TYPE_REASONING,
    "tool_call": memory_pb2.SEGMENT_TYPE_TOOL_CALL,
    "tool_result": memory_pb2.SEGMENT_TYPE_TOOL_RESULT,
    "response": memory_pb2.SEGMENT_TYPE_RESPONSE,
    "summary": memory_pb2.SEGMENT_TYPE_SUMMARY,
}
_TYPE_NAMES = {value: name for name, value in SEGMENT_TYPES.items()}


def _timestamp(at: datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(at.astimezone(UTC))
    return stamp


def archived_run(record: RunRecord) -> memory_pb2.ArchivedRun:
    """The ArchiveRun message of a run record."""
    agent, run = record.agent, record.run
    message = memory_pb2.ArchivedRun(
        workspace_id=str(agent.workspace_id),
        agent_id=str(agent.id),
        agent_member_id=str(agent.member_id),
        session_id=str(run.session_id),
        run_id=str(run.id),
        start_time=_timestamp(run.started_at),
        end_time=_timestamp(run.ended_at or run.started_at),
        conversations=[
            memory_pb2.Conversation(group_id=str(c.group_id), member_ids=[str(m) for m in c.member_ids])
            for c in record.conversations
        ],
    )
    for step, group_id in record.steps:
        chat, origin = step.message, step.origin
        content = chat.content or ""
        if origin is not None and origin.sender_name and origin.task_id is None:
            content = f"{origin.sender_name}: {content}"  # who said it is worth remembering
        message.steps.append(
            memory_pb2.ArchivedStep(
                sequence=step.sequence,
                role=_ROLES[chat.role],
                content=content,
                reasoning=chat.reasoning or "",
                tool_calls=[
                    memory_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in chat.tool_calls
                ],
                tool_name=chat.name or "",
                group_id=str(group_id) if group_id else "",
                create_time=_timestamp(step.created_at),
                summary=step.kind is StepKind.SUMMARY,
            )
        )
    return message


def _memory(result: memory_pb2.Segment, score: float = 0.0, duplicates: int = 0) -> Memory:
    group = result.group_id
    return Memory(
        ref=result.ref,
        type=_TYPE_NAMES.get(result.type, "unknown"),
        text=result.text,
        score=score,
        created_at=result.create_time.ToDatetime(tzinfo=UTC),
        group_id=uuid.UUID(group) if group else None,
        tool_name=result.tool_name,
        duplicates=duplicates,
    )


class GrpcMemory(MemoryPort):
    """`MemoryPort` over a gRPC channel to the memory service."""

    def __init__(
        self,
        address: str,
        *,
        credentials: ServiceToken,
        agent_tokens: AgentTokens,
        deadline_seconds: float = 10.0,
        max_message_bytes: int = 16 * 1024 * 1024,
        tls: ClientTls | None = None,
    ) -> None:
        self._address = address
        # Every call is made as an agent, with its AGENT token (the memory
        # refuses the runtime's own token on every call it makes); the
        # service token only tells "no credential yet" from "not our agent".
        self._credentials = credentials
        self._agent_tokens = agent_tokens
        self._channel = open_channel(
            address, default_timeout_seconds=deadline_seconds, max_message_bytes=max_message_bytes, tls=tls
        )
        self._stub = memory_pb2_grpc.MemoryServiceStub(self._channel)

    async def aclose(self) -> None:
        await self._channel.close()

    async def _metadata(self, as_member: uuid.UUID) -> tuple[tuple[str, str], ...]:
        try:
            token = await self._agent_tokens.get(as_member)
            credential = token is not None or await self._credentials.get() is not None
        except (TokenRefused, errors.Unavailable) as failed:
            raise MemoryUnavailable(f"no service token for the memory at {self._address}: {failed}") from None
        if not credential:
            raise MemoryUnavailable(f"the runtime has no credential for the memory at {self._address} yet")
        if token is None:
            raise MemoryRefused(f"the IM issues no agent token for member {as_member}")
        return bearer_metadata(token)

    async def _call(self, rpc: Callable[..., Any], request: Any, as_member: uuid.UUID) -> Any:
        metadata = await self._metadata(as_member)
        try:
            return await rpc(request, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            reason = f"memory at {self._address}: {error.code().name}: {error.details()}"
            if error.code() in _UNREACHABLE:
                raise MemoryUnavailable(reason) from None
            raise MemoryRefused(error.details() or error.code().name) from None

    async def archive(self, record: RunRecord) -> None:
        request = memory_pb2.ArchiveRunRequest(run=archived_run(record))
        await self._call(self._stub.ArchiveRun, request, record.agent.member_id)

    @staticmethod
    def _scope(agent: Agent, audience: Sequence[uuid.UUID]) -> memory_pb2.AgentScope:
        return memory_pb2.AgentScope(agent_id=str(agent.id), audience_member_ids=[str(m) for m in audience])

    async def recall(self, agent: Agent, audience: Sequence[uuid.UUID], query: RecallQuery) -> list[Memory]:
        filters = memory_pb2.RetrieveFilters(
            types=[SEGMENT_TYPES[t] for t in query.types],
            exclude_run_ids=[str(r) for r in query.exclude_run_ids],
        )
        if query.since is not None:
            filters.since.CopyFrom(_timestamp(query.since))
        if query.until is not None:
            filters.until.CopyFrom(_timestamp(query.until))
        request = memory_pb2.RetrieveRequest(
            agent=self._scope(agent, audience),
            query=query.text,
            limit=query.limit,
            filters=filters,
            prefer_recent=query.prefer_recent,
        )
        response = await self._call(self._stub.Retrieve, request, agent.member_id)
        return [_memory(r.segment, r.score, r.duplicates) for r in response.results]

    async def expand(
        self, agent: Agent, audience: Sequence[uuid.UUID], ref: str, *, before: int, after: int
    ) -> Expanded:
        request = memory_pb2.ExpandRequest(
            agent=self._scope(agent, audience), ref=ref, before=before, after=after
        )
        response = await self._call(self._stub.Expand, request, agent.member_id)
        run = response.run.run_id
        return Expanded(
            focus=_memory(response.focus),
            before=[_memory(s) for s in response.before],
            after=[_memory(s) for s in response.after],
            run_id=uuid.UUID(run) if run else None,
        )
