"""RuntimeService RPCs of `HistoryService`: a mixin of `RuntimeServicer`."""

from __future__ import annotations

from typing import Any, TypeAlias

from agentim.runtime.v1 import runtime_pb2 as pb
from services.common.identity import Caller
from services.runtime.domain.llm import Role
from services.runtime.entrypoints import mappers
from services.runtime.service_layer.history import HistoryService

Context: TypeAlias = Any

_NOTE_ROLES = {pb.STEP_ROLE_SYSTEM: Role.SYSTEM, pb.STEP_ROLE_USER: Role.USER}


class HistoryRpcs:
    """UpdateStep, DeleteStep, AddNote, checkpoints, sessions, RetryFromStep, ForkFromStep."""

    _history: HistoryService

    async def _caller(self, context: Context) -> Caller | None:
        raise NotImplementedError  # RuntimeServicer's

    async def UpdateStep(self, request: pb.UpdateStepRequest, context: Context) -> pb.UpdateStepResponse:
        step = await self._history.update_step(
            await self._caller(context), request.agent_id, request.sequence, request.content
        )
        return pb.UpdateStepResponse(step=mappers.step(step))

    async def DeleteStep(self, request: pb.DeleteStepRequest, context: Context) -> pb.DeleteStepResponse:
        await self._history.delete_step(await self._caller(context), request.agent_id, request.sequence)
        return pb.DeleteStepResponse()

    async def AddNote(self, request: pb.AddNoteRequest, context: Context) -> pb.AddNoteResponse:
        step = await self._history.add_note(
            await self._caller(context), request.agent_id, _NOTE_ROLES.get(request.role), request.content
        )
        return pb.AddNoteResponse(step=mappers.step(step))

    async def CreateCheckpoint(
        self, request: pb.CreateCheckpointRequest, context: Context
    ) -> pb.CreateCheckpointResponse:
        checkpoint = await self._history.create_checkpoint(
            await self._caller(context), request.agent_id, request.name
        )
        return pb.CreateCheckpointResponse(checkpoint=mappers.checkpoint(checkpoint))

    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: Context
    ) -> pb.ListCheckpointsResponse:
        checkpoints, token = await self._history.list_checkpoints(
            await self._caller(context),
            request.agent_id,
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return pb.ListCheckpointsResponse(
            checkpoints=[mappers.checkpoint(c) for c in checkpoints], next_page_token=token
        )

    async def RestoreCheckpoint(
        self, request: pb.RestoreCheckpointRequest, context: Context
    ) -> pb.RestoreCheckpointResponse:
        agent = await self._history.restore_checkpoint(
            await self._caller(context), request.agent_id, request.checkpoint_id
        )
        return pb.RestoreCheckpointResponse(agent=mappers.agent(agent))

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: Context
    ) -> pb.ListSessionsResponse:
        agent, sessions = await self._history.list_sessions(await self._caller(context), request.agent_id)
        return pb.ListSessionsResponse(
            sessions=[
                mappers.session(s, main=s.id == agent.session_id, step_count=count) for s, count in sessions
            ]
        )

    async def SetMainSession(
        self, request: pb.SetMainSessionRequest, context: Context
    ) -> pb.SetMainSessionResponse:
        agent = await self._history.set_main_session(
            await self._caller(context), request.agent_id, request.session_id
        )
        return pb.SetMainSessionResponse(agent=mappers.agent(agent))

    async def RetryFromStep(
        self, request: pb.RetryFromStepRequest, context: Context
    ) -> pb.RetryFromStepResponse:
        agent = await self._history.retry_from_step(
            await self._caller(context), request.agent_id, request.sequence
        )
        return pb.RetryFromStepResponse(agent=mappers.agent(agent))

    async def ForkFromStep(
        self, request: pb.ForkFromStepRequest, context: Context
    ) -> pb.ForkFromStepResponse:
        session, agent = await self._history.fork_from_step(
            await self._caller(context),
            request.agent_id,
            request.sequence,
            new_agent=request.new_agent,
            name=request.name,
        )
        return pb.ForkFromStepResponse(
            session=mappers.session(session, main=True), agent=mappers.agent(agent)
        )
