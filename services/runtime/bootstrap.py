"""The composition root: builds the runtime service from its settings."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy.engine import make_url

from agentim.runtime.v1 import runtime_pb2, runtime_pb2_grpc
from services.common import errors
from services.common.audit_boundary import AuditInterceptor, AuditPruner
from services.common.audit_sql import SqlAuditLog
from services.common.authn import AuthenticationInterceptor, im_signing_keys
from services.common.ratelimit import RateLimitInterceptor
from services.common.server import GrpcServer
from services.common.tokens import Verifier
from services.runtime.adapters.im_client import GrpcIM
from services.runtime.adapters.llm.offline import MODEL_NAME as OFFLINE_MODEL
from services.runtime.adapters.llm.offline import OfflineModel
from services.runtime.adapters.llm.openai_provider import OpenAIProvider
from services.runtime.adapters.memory_client import GrpcMemory
from services.runtime.adapters.resolver import resolve
from services.runtime.adapters.sql import Database, SqlAgentStore
from services.runtime.adapters.tables import audit_events
from services.runtime.config import Settings
from services.runtime.domain.etiquette import ChatterGuard
from services.runtime.domain.model import Agent
from services.runtime.entrypoints.grpc_servicer import RuntimeServicer
from services.runtime.entrypoints.policy import RUNTIME_POLICY
from services.runtime.service_layer.agents import AgentService
from services.runtime.service_layer.archiver import Archiver
from services.runtime.service_layer.endpoint_guard import EndpointGuard
from services.runtime.service_layer.history import HistoryService
from services.runtime.service_layer.hub import AgentHub
from services.runtime.service_layer.lifecycle import LifecycleService
from services.runtime.service_layer.llm_port import LLM
from services.runtime.service_layer.llm_router import ModelRouter
from services.runtime.service_layer.read_positions import ReadPositions
from services.runtime.service_layer.runner import Directory, HistoryCache, LoopSettings, RunnerEnv
from services.runtime.service_layer.supervisor import Supervisor
from services.runtime.service_layer.tasks import RetryPolicy, TaskService
from services.runtime.service_layer.tools import default_registry

logger = logging.getLogger(__name__)

SERVICE_NAME = runtime_pb2.DESCRIPTOR.services_by_name["RuntimeService"].full_name
# The calls each member may make only so often (see services.common.ratelimit).
RATE_LIMITED = {
    f"/{SERVICE_NAME}/{m}": "create"
    for m in ("CreateAgent", "SubmitTask", "CreateCheckpoint", "ForkFromStep", "AddNote")
}


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class RuntimeApp:
    """Everything the running runtime service is made of, wired together."""

    settings: Settings
    database: Database
    im: GrpcIM
    llm: LLM
    hub: AgentHub
    supervisor: Supervisor
    service: AgentService
    server: GrpcServer

    archiver: Archiver | None = None
    audit_pruner: AuditPruner | None = None
    _owners: asyncio.Task[None] | None = None

    async def start(self) -> tuple[int, int]:
        """Starts serving and every agent's runner; returns (port, agents started)."""
        port = await self.server.start()
        agents = await self.supervisor.start()
        if self.archiver is not None:
            self.archiver.start()
        if self.audit_pruner is not None:
            self.audit_pruner.start()
        self._owners = asyncio.create_task(tell_owners(self.service), name="tell-owners")
        return port, agents

    async def stop(self) -> None:
        if self._owners is not None:
            self._owners.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._owners
        await self.server.stop()


async def tell_owners(service: AgentService, *, attempts: int = 6) -> None:
    """Tells the IM the owners of the agents hosted here, at start-up: the IM
    may not be up yet, so a few tries, further apart each time."""
    for attempt in range(attempts):
        try:
            changed = await service.tell_owners()
        except errors.Unavailable:
            await asyncio.sleep(2**attempt)
            continue
        except errors.ServiceError as error:
            logger.warning("the IM did not take the agents' owners: %s", error.message)
            return
        if changed:
            logger.info("told the IM the owners of %d agents", changed)
        return
    logger.warning("could not tell the IM the agents' owners (it stayed unavailable); next start tries again")


def open_database(settings: Settings) -> Database:
    """The database engine (no connection yet); makes the embedded default's directory."""
    url = make_url(settings.database_url)
    if url.get_backend_name() == "sqlite" and url.database:
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    return Database(settings.database_url)


def build(settings: Settings) -> RuntimeApp:
    """Wires the service; connects nothing until `RuntimeApp.start`."""
    database = open_database(settings)
    store = SqlAgentStore(database)
    im = GrpcIM(
        settings.im_address,
        deadline_seconds=settings.im_call_timeout_seconds,
        tls=settings.tls.client,
        service_name="runtime",
        service_secret=settings.service_secret.source(),
    )
    endpoints = EndpointGuard(settings.llm_allowed_hosts, resolve)
    llm = ModelRouter(
        offline=OfflineModel(),
        endpoint=lambda url: OpenAIProvider(
            base_url=url,
            api_key=settings.llm_api_key or "",
            model=settings.llm_model,
            request_timeout=settings.llm_timeout_seconds,
            max_retries=settings.llm_max_retries,
        ),
        default_base_url=settings.llm_base_url,
        guard=endpoints,
    )
    # Long-term memory, unless MEMORY_ADDRESS is empty.
    memory = (
        GrpcMemory(
            settings.memory_address,
            deadline_seconds=settings.memory_call_timeout_seconds,
            tls=settings.tls.client,
            credentials=im.service_token,
            agent_tokens=im.agent_tokens,
        )
        if settings.memory_address
        else None
    )
    archiver = Archiver(store, memory, im, clock=utc_now) if memory is not None else None
    hub = AgentHub()
    tools = default_registry(
        timeout_seconds=settings.tool_timeout_seconds,
        ask_human_timeout_seconds=settings.ask_human_timeout_seconds,
    )
    services: list[AgentService] = []

    async def create_sub_agent(
        parent: Agent, name: str, role: str, system_prompt: str, request_id: str
    ) -> Agent:
        return await services[0].create_child(parent, name, role, system_prompt, request_id=request_id)

    read_positions = ReadPositions(im, delay_seconds=settings.read_position_delay_seconds)
    env = RunnerEnv(
        store=store,
        im=im,
        llm=llm,
        tools=tools,
        hub=hub,
        guard=ChatterGuard(settings.agent_chatter_limit),
        directory=Directory(im),
        settings=LoopSettings(
            max_iterations=settings.max_iterations,
            group_policy=settings.group_policy,
            default_token_budget=settings.token_budget,
            max_reply_bytes=settings.max_reply_bytes,
            auto_recall=settings.auto_recall,
            recall_timeout_seconds=settings.recall_timeout_seconds,
            recall_min_score=settings.recall_min_score,
            default_model=settings.llm_model,
            unconfigured_model=settings.llm_model if settings.llm_base_url else OFFLINE_MODEL,
            context_tokens=settings.context_tokens,
            stream_cut_retries=settings.llm_max_retries,
        ),
        create_sub_agent=create_sub_agent,
        clock=utc_now,
        history=HistoryCache(settings.history_cache_steps),
        memory=memory,
        run_ended=archiver.notify if archiver is not None else lambda: None,
        read_positions=read_positions,
    )
    supervisor = Supervisor(env)
    audit_log = SqlAuditLog(database, audit_events)
    audit_pruner = AuditPruner(audit_log, settings.audit)
    service = AgentService(
        store=store,
        im=im,
        runners=supervisor,
        hub=hub,
        tools=tools,
        clock=utc_now,
        endpoints=endpoints,
        audit_log=audit_log,
    )
    services.append(service)
    history = HistoryService(store=store, runners=supervisor, hub=hub, im=im, agents=service, clock=utc_now)
    tasks = TaskService(
        store=store,
        runners=supervisor,
        hub=hub,
        agents=service,
        clock=utc_now,
        retry=RetryPolicy(
            max_attempts=settings.task_max_attempts,
            base_seconds=settings.task_retry_base_seconds,
            max_seconds=settings.task_retry_max_seconds,
        ),
        max_input_bytes=settings.max_task_input_bytes,
    )
    supervisor.use_tasks(tasks)
    lifecycle = LifecycleService(agents=service, runners=supervisor, clear_queue=tasks.clear_queue)
    servicer = RuntimeServicer(
        service,
        history=history,
        tasks=tasks,
        lifecycle=lifecycle,
    )

    async def ready() -> bool:
        return await database.ping()

    async def close_hub() -> None:
        hub.close()

    server = GrpcServer(
        address=settings.grpc_address,
        registrars=[lambda s: runtime_pb2_grpc.add_RuntimeServiceServicer_to_server(servicer, s)],
        tls=settings.tls.server,
        interceptors=[
            # Outside authentication: it records the refusals made there too.
            AuditInterceptor(RUNTIME_POLICY, audit_log, settings=settings.audit),
            AuthenticationInterceptor(
                RUNTIME_POLICY,
                Verifier(im_signing_keys(im.channel, timeout_seconds=settings.im_call_timeout_seconds)),
            ),
            RateLimitInterceptor(RATE_LIMITED, settings.rate_limits),
        ],
        service_names=[SERVICE_NAME],
        readiness=ready,
        reflection=settings.reflection,
        max_message_bytes=settings.max_message_bytes,
        grace_seconds=settings.shutdown_grace_seconds,
        # Runners (and their IM watches) stop only once the calls in flight
        # have drained, since those calls use them; a run cut short resumes
        # at the next start, as after a crash.
        closers=[close_hub],
        cleanups=[
            audit_pruner.aclose,
            supervisor.aclose,
            read_positions.aclose,
            *([archiver.stop, memory.aclose] if archiver is not None and memory is not None else []),
            llm.aclose,
            im.aclose,
            store.aclose,
            database.aclose,
        ],
    )
    return RuntimeApp(
        settings=settings,
        database=database,
        im=im,
        llm=llm,
        hub=hub,
        supervisor=supervisor,
        service=service,
        archiver=archiver,
        server=server,
        audit_pruner=audit_pruner,
    )
