"""The RuntimeService gRPC servicer: proto in, use case, proto out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeAlias

from agentim.runtime.v1 import runtime_pb2 as pb
from agentim.runtime.v1 import runtime_pb2_grpc
from services.common.audit_proto import event_out, query_in
from services.common.authn import current_caller
from services.common.identity import Caller
from services.runtime.domain.commands import (
    CreateAgent,
    DeleteAgent,
    InterruptAgent,
    PauseAgent,
    ResumeAgent,
    StartAgent,
    TerminateAgent,
    UpdateAgent,
    WakeAgent,
)
from services.runtime.domain.model import AgentDraft
from services.runtime.entrypoints import mappers
from services.runtime.entrypoints.history_rpcs import HistoryRpcs
from services.runtime.entrypoints.task_rpcs import TaskRpcs
from services.runtime.service_layer.agent_views import AgentViews
from services.runtime.service_layer.history_views import HistoryViews
from services.runtime.service_layer.messagebus import MessageBus
from services.runtime.service_layer.replica_status import ReplicaViews
from services.runtime.service_layer.tasks import TaskViews
from services.runtime.service_layer.watches import AgentWatches

# grpc.aio.ServicerContext; grpc has no type information.
Context: TypeAlias = Any


def _draft(value: pb.Agent | pb.CreateAgentRequest) -> AgentDraft:
    """The settings a CreateAgent request or an UpdateAgent's agent asks for."""
    return AgentDraft(
        name=value.name,
        role=value.role,
        system_prompt=value.system_prompt,
        model=mappers.model_settings_in(value.model),
        tools=tuple(value.tools),
        token_budget=value.token_budget,
        auto_recall=value.auto_recall if value.HasField("auto_recall") else None,
    )


class RuntimeServicer(HistoryRpcs, TaskRpcs, runtime_pb2_grpc.RuntimeServiceServicer):
    """Thin translation between the wire and the use cases: a request that
    changes something becomes a command for the bus."""

    def __init__(
        self,
        *,
        agents: AgentViews,
        watches: AgentWatches,
        history: HistoryViews,
        tasks: TaskViews,
        bus: MessageBus,
        replicas: ReplicaViews,
    ) -> None:
        self._agents = agents
        self._replicas = replicas
        self._watches = watches
        self._bus = bus
        self._history = history
        self._tasks = tasks

    async def _caller(self, context: Context) -> Caller | None:
        # Verified by the AuthenticationInterceptor from the access token.
        return current_caller()

    async def CreateAgent(self, request: pb.CreateAgentRequest, context: Context) -> pb.CreateAgentResponse:
        created = await self._bus.handle(
            CreateAgent(
                caller=await self._caller(context),
                draft=_draft(request),
                workspace_id=request.workspace_id,
                parent_id=request.parent_id,
                request_id=request.request_id,
            )
        )
        return pb.CreateAgentResponse(agent=mappers.agent(created))

    async def GetAgent(self, request: pb.GetAgentRequest, context: Context) -> pb.GetAgentResponse:
        found = await self._agents.get_agent(await self._caller(context), request.agent_id)
        return pb.GetAgentResponse(agent=mappers.agent(found, replica=self._agents.replica_of(found)))

    async def ListTools(self, request: pb.ListToolsRequest, context: Context) -> pb.ListToolsResponse:
        specs = await self._agents.list_tools(await self._caller(context))
        return pb.ListToolsResponse(tools=[pb.Tool(name=t.name, description=t.description) for t in specs])

    async def ListReplicas(
        self, request: pb.ListReplicasRequest, context: Context
    ) -> pb.ListReplicasResponse:
        listed = await self._replicas.list(await self._caller(context))
        return pb.ListReplicasResponse(replicas=[mappers.replica(r) for r in listed])

    async def ListAgents(self, request: pb.ListAgentsRequest, context: Context) -> pb.ListAgentsResponse:
        agents, token = await self._agents.list_agents(
            await self._caller(context),
            page_size=request.page_size,
            page_token=request.page_token,
            parent_id=request.parent_id,
        )
        return pb.ListAgentsResponse(
            agents=[mappers.agent(a, replica=self._agents.replica_of(a)) for a in agents],
            next_page_token=token,
        )

    async def UpdateAgent(self, request: pb.UpdateAgentRequest, context: Context) -> pb.UpdateAgentResponse:
        updated = await self._bus.handle(
            UpdateAgent(
                caller=await self._caller(context),
                agent_id=request.agent.id,
                draft=_draft(request.agent),
                fields=tuple(request.update_mask.paths),
            )
        )
        return pb.UpdateAgentResponse(agent=mappers.agent(updated))

    async def DeleteAgent(self, request: pb.DeleteAgentRequest, context: Context) -> pb.DeleteAgentResponse:
        await self._bus.handle(DeleteAgent(caller=await self._caller(context), agent_id=request.agent_id))
        return pb.DeleteAgentResponse()

    async def WakeAgent(self, request: pb.WakeAgentRequest, context: Context) -> pb.WakeAgentResponse:
        woken = await self._bus.handle(
            WakeAgent(caller=await self._caller(context), agent_id=request.agent_id)
        )
        return pb.WakeAgentResponse(agent=mappers.agent(woken))

    async def ListRuns(self, request: pb.ListRunsRequest, context: Context) -> pb.ListRunsResponse:
        runs, token = await self._agents.list_runs(
            await self._caller(context),
            request.agent_id,
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return pb.ListRunsResponse(runs=[mappers.run(r) for r in runs], next_page_token=token)

    async def ListSteps(self, request: pb.ListStepsRequest, context: Context) -> pb.ListStepsResponse:
        steps, more = await self._agents.list_steps(
            await self._caller(context),
            request.agent_id,
            after_sequence=request.after_sequence,
            page_size=request.page_size,
            run_id=request.run_id,
            session_id=request.session_id,
        )
        return pb.ListStepsResponse(steps=[mappers.step(s) for s in steps], has_more=more)

    async def WatchAgent(
        self, request: pb.WatchAgentRequest, context: Context
    ) -> AsyncIterator[pb.WatchAgentResponse]:
        events = await self._watches.watch_agent(
            await self._caller(context),
            request.agent_id,
            after_sequence=request.after_sequence,
            live_only=request.live_only,
        )
        try:
            await context.send_initial_metadata(())
            async for emitted in events:
                yield pb.WatchAgentResponse(event=mappers.event(emitted))
        finally:
            await events.aclose()

    async def WatchAgents(
        self, request: pb.WatchAgentsRequest, context: Context
    ) -> AsyncIterator[pb.WatchAgentsResponse]:
        events = await self._watches.watch_agents(
            await self._caller(context), agent_ids=list(request.agent_ids), workspace_id=request.workspace_id
        )
        try:
            await context.send_initial_metadata(())
            async for emitted in events:
                yield pb.WatchAgentsResponse(event=mappers.event(emitted))
        finally:
            await events.aclose()

    # -- lifecycle -----------------------------------------------------------

    async def StartAgent(self, request: pb.StartAgentRequest, context: Context) -> pb.StartAgentResponse:
        agent = await self._bus.handle(
            StartAgent(caller=await self._caller(context), agent_id=request.agent_id)
        )
        return pb.StartAgentResponse(agent=mappers.agent(agent))

    async def PauseAgent(self, request: pb.PauseAgentRequest, context: Context) -> pb.PauseAgentResponse:
        agent = await self._bus.handle(
            PauseAgent(caller=await self._caller(context), agent_id=request.agent_id)
        )
        return pb.PauseAgentResponse(agent=mappers.agent(agent))

    async def ResumeAgent(self, request: pb.ResumeAgentRequest, context: Context) -> pb.ResumeAgentResponse:
        agent = await self._bus.handle(
            ResumeAgent(caller=await self._caller(context), agent_id=request.agent_id)
        )
        return pb.ResumeAgentResponse(agent=mappers.agent(agent))

    async def InterruptAgent(
        self, request: pb.InterruptAgentRequest, context: Context
    ) -> pb.InterruptAgentResponse:
        agent = await self._bus.handle(
            InterruptAgent(caller=await self._caller(context), agent_id=request.agent_id)
        )
        return pb.InterruptAgentResponse(agent=mappers.agent(agent))

    async def TerminateAgent(
        self, request: pb.TerminateAgentRequest, context: Context
    ) -> pb.TerminateAgentResponse:
        agent = await self._bus.handle(
            TerminateAgent(
                caller=await self._caller(context),
                agent_id=request.agent_id,
                clear_queue=request.queue_policy == pb.QUEUE_POLICY_CLEAR,
            )
        )
        return pb.TerminateAgentResponse(agent=mappers.agent(agent))

    async def ListAuditEvents(
        self, request: pb.ListAuditEventsRequest, context: Context
    ) -> pb.ListAuditEventsResponse:
        records, token = await self._agents.list_audit_events(
            await self._caller(context),
            query_in(request.query),
            page_size=request.page_size,
            page_token=request.page_token,
        )
        return pb.ListAuditEventsResponse(
            audit_events=[event_out(r, service="runtime") for r in records], next_page_token=token
        )
