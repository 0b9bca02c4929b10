"""The composition root: builds the runtime service from its settings."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
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
from services.runtime.adapters.event_relay import RedisEventRelay
from services.runtime.adapters.im_client import GrpcIM
from services.runtime.adapters.leases import SqlLeases
from services.runtime.adapters.llm.offline import MODEL_NAME as OFFLINE_MODEL
from services.runtime.adapters.llm.offline import OfflineModel
from services.runtime.adapters.llm.openai_provider import OpenAIProvider
from services.runtime.adapters.memory_client import GrpcMemory
from services.runtime.adapters.replica_link import RedisReplicaLink
from services.runtime.adapters.resolver import resolve
from services.runtime.adapters.sql import Database, SqlAgentStore
from services.runtime.adapters.tables import audit_events
from services.runtime.config import Settings
from services.runtime.domain.commands import TellAgentOwners
from services.runtime.domain.etiquette import ChatterGuard
from services.runtime.domain.model import Agent
from services.runtime.entrypoints.grpc_servicer import RuntimeServicer
from services.runtime.entrypoints.policy import RUNTIME_POLICY
from services.runtime.service_layer.access import AgentAccess
from services.runtime.service_layer.agent_audit import AgentAudit
from services.runtime.service_layer.agent_factory import AgentFactory
from services.runtime.service_layer.agent_views import AgentViews
from services.runtime.service_layer.archiver import Archiver
from services.runtime.service_layer.endpoint_guard import EndpointGuard
from services.runtime.service_layer.handlers import agents as agent_handlers
from services.runtime.service_layer.handlers import control
from services.runtime.service_layer.handlers import history as history_handlers
from services.runtime.service_layer.handlers import tasks as task_handlers
from services.runtime.service_layer.history_views import HistoryViews
from services.runtime.service_layer.hub import AgentHub
from services.runtime.service_layer.im_port import IMPort
from services.runtime.service_layer.leases import Fences, LeaseKeeper, Unfenced
from services.runtime.service_layer.llm_port import LLM
from services.runtime.service_layer.llm_router import ModelRouter
from services.runtime.service_layer.memory_port import MemoryPort
from services.runtime.service_layer.messagebus import MessageBus
from services.runtime.service_layer.read_positions import ReadPositions
from services.runtime.service_layer.relay import EventRelay, RelayedHub
from services.runtime.service_layer.replica_status import ReplicaMonitor, ReplicaViews
from services.runtime.service_layer.replicas import ReplicaLink, ReplicaRunners
from services.runtime.service_layer.runner import (
    AgentRunner,
    Directory,
    HistoryCache,
    LoopSettings,
    RunnerEnv,
)
from services.runtime.service_layer.runners import Runners
from services.runtime.service_layer.store import AgentStore
from services.runtime.service_layer.supervisor import Sharding, Supervisor
from services.runtime.service_layer.tasks import RetryPolicy, StoredTaskQueue, TaskViews
from services.runtime.service_layer.tools import ToolRegistry, default_registry
from services.runtime.service_layer.watches import AgentWatches

logger = logging.getLogger(__name__)

SERVICE_NAME = runtime_pb2.DESCRIPTOR.services_by_name["RuntimeService"].full_name
# Among replicas, the health of the parts that can fail while the service
# still serves: SERVING while the replica can prove its shard leases (its
# last renewal reached the database within their time to live, less the
# margin; holding none is fine), and while its link to the other replicas
# (Redis) loses no messages.
LEASES_HEALTH_NAME = f"{SERVICE_NAME}/leases"
REPLICAS_HEALTH_NAME = f"{SERVICE_NAME}/replicas"
# The lease keeper's own pool (as many again at a peak): a round is a few
# statements, one after another.
LEASE_CONNECTIONS = 1
# The calls each member may make only so often (see services.common.ratelimit).
RATE_LIMITED = {
    f"/{SERVICE_NAME}/{m}": "create"
    for m in ("CreateAgent", "SubmitTask", "CreateCheckpoint", "ForkFromStep", "AddNote")
}


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(eq=False, repr=False)
class RuntimeApp:
    """Everything the running runtime service is made of, wired together.

    `async with build(settings) as app:` starts it (the gRPC server, when
    built with one, and every agent's runner) and stops it; `start` and
    `stop` do the same by hand. `stop` is idempotent.
    """

    settings: Settings
    store: AgentStore
    im: IMPort
    llm: LLM
    hub: AgentHub
    tools: ToolRegistry
    factory: AgentFactory
    runners: Runners
    # The runners of this process (None: the caller's `runners` stand in).
    supervisor: Supervisor | None
    agents: AgentViews
    watches: AgentWatches
    history: HistoryViews
    queue: StoredTaskQueue
    tasks: TaskViews
    bus: MessageBus
    servicer: RuntimeServicer
    # What `stop` closes, in order, once the server (if any) has stopped:
    # what `build` opened, never what the caller passed in.
    cleanups: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    database: Database | None = None
    archiver: Archiver | None = None
    audit_pruner: AuditPruner | None = None
    # The shard leases of this replica, among several (None: it runs every agent).
    leases: LeaseKeeper | None = None
    # The link to the other replicas (None: there are none).
    link: ReplicaLink | None = None
    # Agents' events between replicas (None: there are none).
    relay: EventRelay | None = None
    # This replica's status among the others (None: there are none).
    monitor: ReplicaMonitor | None = None
    grpc_server: GrpcServer | None = None
    _owners: asyncio.Task[None] | None = None
    _stopped: bool = False

    @property
    def server(self) -> GrpcServer:
        """The gRPC server (built unless `build(..., serve=False)`)."""
        if self.grpc_server is None:
            raise RuntimeError("this runtime was built without a server (serve=False)")
        return self.grpc_server

    def runner(self, agent_id: uuid.UUID) -> AgentRunner | None:
        """The agent's runner, if it runs in this process (for tests and benchmarks)."""
        return self.supervisor.runner(agent_id) if self.supervisor is not None else None

    async def start(self) -> tuple[int, int]:
        """Starts serving (if it serves) and every agent's runner; returns
        (port, agents started), port 0 without a server."""
        if self.leases is None and self.database is not None and not self.database.is_sqlite:
            await refuse_beside_replicas(self.database)
        port = await self.grpc_server.start() if self.grpc_server is not None else 0
        agents = await self.supervisor.start() if self.supervisor is not None else 0
        if self.relay is not None:
            await self.relay.start()
        if self.link is not None:
            await self.link.start()
        if isinstance(self.runners, ReplicaRunners):
            self.runners.start()
        if self.leases is not None:
            await self.leases.start()  # the runners of the shards it takes start meanwhile
            agents = self.supervisor.agent_count if self.supervisor is not None else 0
        if self.monitor is not None:
            self.monitor.start()
        if self.archiver is not None:
            self.archiver.start()
        if self.audit_pruner is not None:
            self.audit_pruner.start()
        self._owners = asyncio.create_task(tell_owners(self.bus), name="tell-owners")
        return port, agents

    async def stop(self) -> None:
        """Stops serving (draining the calls in flight), then every runner, then
        closes what `build` opened. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._owners is not None:
            self._owners.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._owners
        if self.grpc_server is not None:
            await self.grpc_server.stop()  # then its cleanups: the same as below
            return
        self.hub.close()
        for cleanup in self.cleanups:
            await cleanup()

    async def __aenter__(self) -> RuntimeApp:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


async def tell_owners(bus: MessageBus, *, attempts: int = 6) -> None:
    """Tells the IM the owners of the agents hosted here, at start-up: the IM
    may not be up yet, so a few tries, further apart each time."""
    for attempt in range(attempts):
        try:
            changed = await bus.handle(TellAgentOwners())
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


class BesideReplicas(Exception):
    """A runtime that runs every agent itself would share them with live replicas."""


async def refuse_beside_replicas(database: Database) -> None:
    """Refuses to start a runtime that runs every agent (no REDIS_URL) on a
    database where replicas run them: each agent would run twice.

    Raises:
        BesideReplicas: replicas are live on the database.
    """
    live = (await SqlLeases(database).view()).replicas
    if live:
        raise BesideReplicas(
            f"runtime replicas {', '.join(live)} are live on this database; a runtime without"
            " REDIS_URL runs every agent itself and would run theirs a second time: give it REDIS_URL"
            " to join them"
        )


def open_database(settings: Settings) -> Database:
    """The database engine (no connection yet); makes the embedded default's directory."""
    url = make_url(settings.database_url)
    if url.get_backend_name() == "sqlite" and url.database:
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    return Database(settings.database_url, pool_size=settings.db_pool_size)


def build(
    settings: Settings,
    *,
    store: AgentStore | None = None,
    im: IMPort | None = None,
    llm: LLM | None = None,
    clock: Callable[[], datetime] | None = None,
    memory: MemoryPort | None = None,
    runners: Runners | None = None,
    fences: Fences | None = None,
    jitter: Callable[[], float] = random.random,
    serve: bool = True,
) -> RuntimeApp:
    """Wires the service; connects nothing until `RuntimeApp.start`.

    Each adapter left None is the real one the settings describe; tests pass
    fakes. The real ones `build` makes are closed by `RuntimeApp.stop`.

    Args:
        memory: long-term memory (the real client only if MEMORY_ADDRESS is set).
        runners: the agents' runners; None runs them here (`Supervisor`).
        fences: what the runners' writes prove themselves with; None: nothing
            (this process runs every agent).
        jitter: a source of numbers in [0, 1) for the tasks' retry backoff.
        serve: whether to build the gRPC server (which needs the real IM client,
            whose signing keys check the callers' tokens).
    """
    clock = clock or utc_now
    cleanups: list[Callable[[], Awaitable[None]]] = []
    database: Database | None = None
    if store is None:
        database = open_database(settings)
        store = SqlAgentStore(database)
        cleanups += [store.aclose, database.aclose]
    grpc_im: GrpcIM | None = None
    if im is None:
        im = grpc_im = GrpcIM(
            settings.im_address,
            deadline_seconds=settings.im_call_timeout_seconds,
            tls=settings.tls.client,
            service_name="runtime",
            service_secret=settings.service_secret.source(),
        )
        cleanups.insert(0, grpc_im.aclose)
    endpoints = EndpointGuard(settings.llm_allowed_hosts, resolve)
    if llm is None:
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
        cleanups.insert(0, llm.aclose)
    # Long-term memory, unless MEMORY_ADDRESS is empty.
    if memory is None and settings.memory_address and grpc_im is not None:
        memory = GrpcMemory(
            settings.memory_address,
            deadline_seconds=settings.memory_call_timeout_seconds,
            tls=settings.tls.client,
            credentials=grpc_im.service_token,
            agent_tokens=grpc_im.agent_tokens,
        )
        cleanups.insert(0, memory.aclose)
    archiver = _archiver(settings, store=store, memory=memory, im=im, clock=clock, cleanups=cleanups)
    tools = default_registry(
        timeout_seconds=settings.tool_timeout_seconds,
        ask_human_timeout_seconds=settings.ask_human_timeout_seconds,
    )
    read_positions = _read_positions(settings, im, cleanups)
    factory = AgentFactory(store=store, im=im, tools=tools, clock=clock)
    # Among several replicas, this one runs the agents of the shards it holds.
    leases = _lease_keeper(settings, database, lambda: supervisor, cleanups)
    hub, relay = _hub(settings, leases, lambda: supervisor, cleanups)
    queue = StoredTaskQueue(
        store=store,
        hub=hub,
        clock=clock,
        retry=RetryPolicy(
            max_attempts=settings.task_max_attempts,
            base_seconds=settings.task_retry_base_seconds,
            max_seconds=settings.task_retry_max_seconds,
        ),
        jitter=jitter,
    )
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
            unread_batch=settings.unread_batch,
            max_reply_bytes=settings.max_reply_bytes,
            auto_recall=settings.auto_recall,
            recall_timeout_seconds=settings.recall_timeout_seconds,
            recall_min_score=settings.recall_min_score,
            default_model=settings.llm_model,
            unconfigured_model=settings.llm_model if settings.llm_base_url else OFFLINE_MODEL,
            context_tokens=settings.context_tokens,
            stream_cut_retries=settings.llm_max_retries,
            stream_cut_backoff_seconds=settings.llm_stream_cut_backoff_seconds,
        ),
        create_sub_agent=factory.create_child,
        clock=clock,
        history=HistoryCache(settings.history_cache_steps),
        tasks=queue,
        memory=memory,
        run_ended=archiver.notify if archiver is not None else lambda: None,
        read_positions=read_positions,
        fences=fences if fences is not None else (leases or Unfenced()),
    )
    supervisor: Supervisor | None = None
    link: ReplicaLink | None = None
    if runners is None:
        runners, supervisor, link = _runners(settings, env, leases, store, cleanups)
    monitor = _monitor(leases, supervisor, link, store, cleanups)
    audit_log = SqlAuditLog(database, audit_events) if database is not None else None
    audit_pruner = AuditPruner(audit_log, settings.audit) if audit_log is not None else None
    if audit_pruner is not None:
        cleanups.insert(0, audit_pruner.aclose)
    access = AgentAccess(store=store, runners=runners)
    agents = AgentViews(store=store, runners=runners, access=access, tools=tools, audit_log=audit_log)
    watches = AgentWatches(store=store, runners=runners, hub=hub, access=access)
    history = HistoryViews(store=store, access=access)
    tasks = TaskViews(store=store, queue=queue, access=access, clock=clock)
    bus = _message_bus(
        settings,
        store=store,
        im=im,
        factory=factory,
        runners=runners,
        hub=hub,
        queue=queue,
        tasks=tasks,
        access=access,
        clock=clock,
        endpoints=endpoints,
    )
    replicas = ReplicaViews(access=access, supervisor=supervisor, keeper=leases, monitor=monitor)
    servicer = RuntimeServicer(
        agents=agents, watches=watches, history=history, tasks=tasks, bus=bus, replicas=replicas
    )
    app = RuntimeApp(
        settings=settings,
        store=store,
        im=im,
        llm=llm,
        hub=hub,
        tools=tools,
        factory=factory,
        runners=runners,
        supervisor=supervisor,
        agents=agents,
        watches=watches,
        history=history,
        queue=queue,
        tasks=tasks,
        bus=bus,
        servicer=servicer,
        cleanups=cleanups,
        database=database,
        archiver=archiver,
        audit_pruner=audit_pruner,
        leases=leases,
        link=link,
        relay=relay,
        monitor=monitor,
    )
    if serve:
        if grpc_im is None or database is None or audit_log is None:
            raise ValueError("serving needs the real IM client and store (serve=False with fakes)")
        app.grpc_server = _server(settings, app, grpc_im, database, audit_log)
    return app


def _archiver(
    settings: Settings,
    *,
    store: AgentStore,
    memory: MemoryPort | None,
    im: IMPort,
    clock: Callable[[], datetime],
    cleanups: list[Callable[[], Awaitable[None]]],
) -> Archiver | None:
    """What sends each ended run to long-term memory; None without memory."""
    if memory is None:
        return None
    archiver = Archiver(
        store,
        memory,
        im,
        clock=clock,
        retry_initial_seconds=settings.archive_retry_seconds,
        retry_max_seconds=settings.archive_retry_max_seconds,
    )
    cleanups.insert(0, archiver.stop)
    return archiver


def _read_positions(
    settings: Settings, im: IMPort, cleanups: list[Callable[[], Awaitable[None]]]
) -> ReadPositions | None:
    """Where the agents' read positions move in batches; None (a delay of 0)
    moves each at once, in the agent's run."""
    if settings.read_position_delay_seconds <= 0:
        return None
    positions = ReadPositions(im, delay_seconds=settings.read_position_delay_seconds)
    cleanups.insert(0, positions.aclose)
    return positions


def _runners(
    settings: Settings,
    env: RunnerEnv,
    leases: LeaseKeeper | None,
    store: AgentStore,
    cleanups: list[Callable[[], Awaitable[None]]],
) -> tuple[Runners, Supervisor, ReplicaLink | None]:
    """This process's runners, and (among replicas) the way to the others'."""
    sharding = Sharding(leases.settings.shard_count, leases.holds) if leases is not None else None
    supervisor = Supervisor(env, cursor_save_delay=settings.cursor_save_delay_seconds, sharding=sharding)
    # Runners stop before what they use closes.
    cleanups.insert(0, supervisor.aclose)
    if leases is None:
        return supervisor, supervisor, None
    link = RedisReplicaLink(
        settings.redis_url,
        replica=leases.settings.replica,
        reconcile_seconds=leases.settings.reconcile_seconds,
    )
    runners = ReplicaRunners(
        supervisor,
        link,
        owner_of=leases.owner_of,
        replica=leases.settings.replica,
        store=store,
        reconcile_seconds=leases.settings.reconcile_seconds,
        leases_changed=leases.nudge,
    )
    leases.announce = runners.announce_leases
    leases.owners_changed = runners.owners_changed

    async def close_link() -> None:
        await runners.aclose()
        await link.aclose()

    # First of all: the runners stop, then the leases go, so that other
    # replicas take the shards at once instead of after the leases' time;
    # then the link closes.
    cleanups.insert(1, close_link)
    cleanups.insert(0, leases.aclose)

    async def drain() -> None:
        await supervisor.drain(settings.shutdown_grace_seconds)

    # Before the leases go: the runs in flight end first, where they can.
    cleanups.insert(0, drain)
    return runners, supervisor, link


def _monitor(
    leases: LeaseKeeper | None,
    supervisor: Supervisor | None,
    link: ReplicaLink | None,
    store: AgentStore,
    cleanups: list[Callable[[], Awaitable[None]]],
) -> ReplicaMonitor | None:
    """What reports this replica's status among the others; None for a lone runtime."""
    if leases is None or supervisor is None or link is None:
        return None
    monitor = ReplicaMonitor(leases, supervisor, link, store)
    # Each renewal writes this replica's report, which any replica answers ListReplicas with.
    leases.report = lambda: monitor.status().as_json()
    cleanups.insert(0, monitor.aclose)
    return monitor


def _hub(
    settings: Settings,
    leases: LeaseKeeper | None,
    supervisor: Callable[[], Supervisor | None],
    cleanups: list[Callable[[], Awaitable[None]]],
) -> tuple[AgentHub, EventRelay | None]:
    """Where watchers hear agents' events: this process's, and among replicas every replica's."""
    if leases is None:
        return AgentHub(), None
    relay = RedisEventRelay(settings.redis_url, replica=leases.settings.replica)

    def live(agent_id: uuid.UUID) -> Agent | None:
        runs = supervisor()
        return runs.live(agent_id) if runs is not None else None

    hub = RelayedHub(
        relay,
        replica=leases.settings.replica,
        shard_count=leases.settings.shard_count,
        fence=leases.fence,
        live=live,
    )
    cleanups.append(relay.aclose)  # last: what the runners said as they stopped goes out first
    return hub, relay


def _lease_keeper(
    settings: Settings,
    database: Database | None,
    supervisor: Callable[[], Supervisor | None],
    cleanups: list[Callable[[], Awaitable[None]]],
) -> LeaseKeeper | None:
    """The keeper of this replica's shard leases, which starts and stops the
    `supervisor`'s runners as shards come and go; None for a lone runtime.

    Its statements have connections of their own: a renewal queued behind
    thousands of runners for the shared pool would come too late, and every
    runner would stop for it."""
    if settings.leases is None or database is None:
        return None
    own = Database(
        settings.database_url, pool_size=LEASE_CONNECTIONS, application_name="agentim-runtime-leases"
    )
    cleanups.append(own.aclose)  # after the keeper has released its leases

    async def gained(shards: frozenset[int]) -> None:
        if (runs := supervisor()) is not None:
            await runs.shards_gained(shards)

    async def lost(shards: frozenset[int]) -> None:
        if (runs := supervisor()) is not None:
            await runs.shards_lost(shards)

    def busy(shard: int) -> bool:
        runs = supervisor()
        return runs is not None and runs.busy(shard)

    return LeaseKeeper(store=SqlLeases(own), settings=settings.leases, gained=gained, lost=lost, busy=busy)


def _message_bus(
    settings: Settings,
    *,
    store: AgentStore,
    im: IMPort,
    factory: AgentFactory,
    runners: Runners,
    hub: AgentHub,
    queue: StoredTaskQueue,
    tasks: TaskViews,
    access: AgentAccess,
    clock: Callable[[], datetime],
    endpoints: EndpointGuard,
) -> MessageBus:
    """The bus, with every command's handler bound to what it uses."""
    agent_audit = AgentAudit(store=store, clock=clock)
    agent_deps = agent_handlers.Agents(
        store=store,
        im=im,
        factory=factory,
        runners=runners,
        access=access,
        audit=agent_audit,
        clock=clock,
        endpoints=endpoints,
    )
    return MessageBus(
        {
            **agent_handlers.handlers(agent_deps),
            **history_handlers.handlers(
                history_handlers.History(
                    store=store,
                    runners=runners,
                    hub=hub,
                    access=access,
                    audit=agent_audit,
                    agents=agent_deps,
                    clock=clock,
                )
            ),
            **control.handlers(
                control.Control(
                    access=access, audit=agent_audit, runners=runners, clear_queue=queue.clear_queue
                )
            ),
            **task_handlers.handlers(
                task_handlers.Tasks(
                    store=store,
                    queue=queue,
                    views=tasks,
                    runners=runners,
                    access=access,
                    audit=agent_audit,
                    clock=clock,
                    max_input_bytes=settings.max_task_input_bytes,
                    cancel_wait_seconds=settings.task_cancel_wait_seconds,
                )
            ),
        }
    )


def _server(
    settings: Settings, app: RuntimeApp, im: GrpcIM, database: Database, audit_log: SqlAuditLog
) -> GrpcServer:
    """The gRPC server of `app`: its servicer behind audit, authentication and rate limits."""

    async def ready() -> bool:
        return await database.ping()

    async def close_hub() -> None:
        app.hub.close()

    components: dict[str, Callable[[], bool]] = {}
    if app.leases is not None:
        components[LEASES_HEALTH_NAME] = app.leases.proven
    if (link := app.link) is not None:
        components[REPLICAS_HEALTH_NAME] = lambda: not link.degraded

    return GrpcServer(
        address=settings.grpc_address,
        registrars=[lambda s: runtime_pb2_grpc.add_RuntimeServiceServicer_to_server(app.servicer, s)],
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
        components=components,
        reflection=settings.reflection,
        max_message_bytes=settings.max_message_bytes,
        grace_seconds=settings.shutdown_grace_seconds,
        # Runners (and their IM watches) stop only once the calls in flight
        # have drained, since those calls use them; a run cut short resumes
        # at the next start, as after a crash.
        closers=[close_hub],
        cleanups=app.cleanups,
    )
