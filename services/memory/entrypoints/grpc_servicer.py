"""The MemoryService gRPC servicer: proto in, use case, proto out."""

from __future__ import annotations

from typing import Any, TypeAlias

from agentim.memory.v1 import memory_pb2 as pb
from agentim.memory.v1 import memory_pb2_grpc
from services.common.authn import current_caller
from services.memory.domain.errors import InvalidRequest
from services.memory.domain.scope import ForgetTarget
from services.memory.entrypoints import mappers
from services.memory.service_layer.handlers import Caller, Memory

# grpc.aio.ServicerContext; grpc has no type information.
Context: TypeAlias = Any


class MemoryServicer(memory_pb2_grpc.MemoryServiceServicer):
    """Thin translation between the wire and the use cases."""

    def __init__(self, memory: Memory) -> None:
        self._memory = memory

    def _caller(self, context: Context) -> Caller:
        # Verified by the AuthenticationInterceptor: an access token (a
        # person's, an agent's the runtime holds, or a service's own).
        verified = current_caller()
        if verified is None:
            return Caller(member_id=None)
        member = str(verified.member_id) if verified.member_id is not None else None
        # Reading through an agent's eyes lends the reader none of its roles.
        roles = tuple(verified.claims.roles) if verified.view_as is None else ()
        return Caller(member_id=member, is_service=verified.is_service, roles=roles)

    async def ArchiveRun(self, request: pb.ArchiveRunRequest, context: Context) -> pb.ArchiveRunResponse:
        caller = self._caller(context)
        if not request.HasField("run"):
            raise InvalidRequest("run is required")
        result = await self._memory.archive_run(caller, mappers.run_in(request.run))
        return pb.ArchiveRunResponse(segment_count=result.segment_count, changed=result.changed)

    async def Retrieve(self, request: pb.RetrieveRequest, context: Context) -> pb.RetrieveResponse:
        retrieved = await self._memory.retrieve(
            self._caller(context),
            mappers.scope_in(request),
            query=request.query,
            limit=request.limit,
            filters=mappers.filters_in(request.filters),
            prefer_recent=request.prefer_recent,
        )
        return pb.RetrieveResponse(
            results=[mappers.ranked_out(r) for r in retrieved.results],
            pending_embeddings=retrieved.pending_embeddings,
        )

    async def Expand(self, request: pb.ExpandRequest, context: Context) -> pb.ExpandResponse:
        expanded = await self._memory.expand(
            self._caller(context),
            mappers.scope_in(request),
            ref=request.ref,
            before=request.before,
            after=request.after,
        )
        return pb.ExpandResponse(
            focus=mappers.segment_out(expanded.focus),
            before=[mappers.segment_out(s) for s in expanded.before],
            after=[mappers.segment_out(s) for s in expanded.after],
            run=mappers.run_info_out(expanded.run),
        )

    async def Forget(self, request: pb.ForgetRequest, context: Context) -> pb.ForgetResponse:
        which = request.WhichOneof("target")
        if which is None or not getattr(request, which):
            raise InvalidRequest("name what to forget: one of run_id, session_id, agent_id, workspace_id")
        target = ForgetTarget(
            before=mappers.optional_time_in(request, "before", "before"), **{which: getattr(request, which)}
        )
        deleted = await self._memory.forget(self._caller(context), target)
        return pb.ForgetResponse(deleted_segments=deleted)

    async def GetMemoryStats(
        self, request: pb.GetMemoryStatsRequest, context: Context
    ) -> pb.GetMemoryStatsResponse:
        which = request.WhichOneof("scope")
        stats = await self._memory.stats(
            self._caller(context),
            agent_id=request.agent_id if which == "agent_id" else "",
            workspace_id=request.workspace_id if which == "workspace_id" else "",
        )
        return mappers.stats_out(stats)
