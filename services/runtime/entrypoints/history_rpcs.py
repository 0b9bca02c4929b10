"""RuntimeService RPCs of an agent's history: a mixin of `RuntimeServicer`."""

from __future__ import annotations

from typing import Any, TypeAlias

from agentim.runtime.v1 import runtime_pb2 as pb
from services.common.identity import Caller
from services.runtime.domain.commands import (
    AddNote,
    CreateCheckpoint,
    DeleteStep,
    ForkFromStep,
    RestoreCheckpoint,
    RetryFromStep,
    SetMainSession,
    UpdateStep,
)
from services.runtime.domain.llm import Role
from services.runtime.entrypoints import mappers
from services.runtime.service_layer.history_views import HistoryViews
from services.runtime.service_layer.messagebus import MessageBus

Context: TypeAlias = Any

_NOTE_ROLES = {pb.STEP_ROLE_SYSTEM: Role.SYSTEM, pb.STEP_ROLE_USER: Role.USER}


class HistoryRpcs:
    """UpdateStep, DeleteStep, AddNote, checkpoints, sessions, RetryFromStep, ForkFromStep."""

    _history: HistoryViews
    _bus: MessageBus

    async def _caller(self, context: Context) -> Caller | None:
        raise NotImplementedError  # RuntimeServicer's

    async def UpdateStep(self, request: pb.UpdateStepRequest, context: Context) -> pb.UpdateStepResponse:
        step = await self._bus.handle(
            UpdateStep(
                caller=await self._caller(context),
                agent_id=request.agent_id,
                sequence=request.sequence,
                content=request.content,
            )
        )
        return pb.UpdateStepResponse(step=mappers.step(step))

    async def DeleteStep(self, request: pb.DeleteStepRequest, context: Context) -> pb.DeleteStepResponse:
        await self._bus.handle(
            DeleteStep(
                caller=await self._caller(context), agent_id=request.agent_id, sequence=request.sequence
            )
        )
        return pb.DeleteStepResponse()

    async def AddNote(self, request: pb.AddNoteRequest, context: Context) -> pb.AddNoteResponse:
        step = await self._bus.handle(
            AddNote(
                caller=await self._caller(context),
                agent_id=request.agent_id,
                role=_NOTE_ROLES.get(request.role),
                content=request.content,
            )
        )
        return pb.AddNoteResponse(step=mappers.step(step))

    async def CreateCheckpoint(
        self, request: pb.CreateCheckpointRequest, context: Context
    ) -> pb.CreateCheckpointResponse:
        checkpoint = await self._bus.handle(
            CreateCheckpoint(caller=await self._caller(context), agent_id=request.agent_id, name=request.name)
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
        agent = await self._bus.handle(
            RestoreCheckpoint(
                caller=await self._caller(context),
                agent_id=request.agent_id,
                checkpoint_id=request.checkpoint_id,
            )
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
        agent = await self._bus.handle(
            SetMainSession(
                caller=await self._caller(context), agent_id=request.agent_id, session_id=request.session_id
            )
        )
        return pb.SetMainSessionResponse(agent=mappers.agent(agent))

    async def RetryFromStep(
        self, request: pb.RetryFromStepRequest, context: Context
    ) -> pb.RetryFromStepResponse:
        agent = await self._bus.handle(
            RetryFromStep(
                caller=await self._caller(context), agent_id=request.agent_id, sequence=request.sequence
            )
        )
        return pb.RetryFromStepResponse(agent=mappers.agent(agent))

    async def ForkFromStep(
        self, request: pb.ForkFromStepRequest, context: Context
    ) -> pb.ForkFromStepResponse:
        session, agent = await self._bus.handle(
            ForkFromStep(
                caller=await self._caller(context),
                agent_id=request.agent_id,
                sequence=request.sequence,
                new_agent=request.new_agent,
                name=request.name,
            )
        )
        return pb.ForkFromStepResponse(
            session=mappers.session(session, main=True), agent=mappers.agent(agent)
        )
