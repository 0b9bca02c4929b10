"""The composition root: builds the IM service from its settings."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from agentim.im.v1 import im_pb2, im_pb2_grpc
from services.common.ratelimit import RateLimitInterceptor
from services.common.server import GrpcServer
from services.im.adapters.message_log import open_message_log
from services.im.adapters.read_path import open_read_path
from services.im.adapters.signals import InProcessSignal, RedisSignal
from services.im.adapters.sql import Database
from services.im.config import Settings
from services.im.entrypoints.grpc_servicer import IMServicer
from services.im.service_layer.events import EventFeed, EventHub
from services.im.service_layer.handlers import IMService
from services.im.service_layer.ports import EventSignal

logger = logging.getLogger(__name__)

SERVICE_NAME = im_pb2.DESCRIPTOR.services_by_name["IMService"].full_name
# The calls each member may make only so often (see services.common.ratelimit).
RATE_LIMITED = {
    **{f"/{SERVICE_NAME}/{m}": "send" for m in ("SendMessage", "EditMessage")},
    **{
        f"/{SERVICE_NAME}/{m}": "create"
        for m in (
            "CreateWorkspace",
            "CreateMember",
            "CreateGroup",
            "GetOrCreateDirectGroup",
            "AddGroupMembers",
        )
    },
}
# Health of the cross-replica event signals: NOT_SERVING while Redis is
# unreachable (delivery then reads the database at intervals); the service stays SERVING.
SIGNALS_HEALTH_NAME = f"{SERVICE_NAME}/signals"


@dataclass
class IMApp:
    """Everything the running IM service is made of, wired together."""

    settings: Settings
    database: Database
    signal: EventSignal
    hub: EventHub
    service: IMService
    server: GrpcServer

    async def start(self) -> int:
        """Connects signalling and starts serving; returns the bound port."""
        await self.signal.start()
        return await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()


def open_database(settings: Settings) -> Database:
    """The database engine (no connection yet); makes the embedded default's directory."""
    if settings.sqlite_path:
        Path(settings.sqlite_path).parent.mkdir(parents=True, exist_ok=True)
    return Database(settings.database_url, pool_size=settings.db_pool_size)


def build(settings: Settings) -> IMApp:
    """Wires the service; connects nothing until `IMApp.start`."""
    database = open_database(settings)
    signal: EventSignal = (
        RedisSignal(
            settings.redis_url,
            reconnect_max_seconds=settings.redis_reconnect_max_seconds,
            fallback_interval_seconds=settings.redis_fallback_poll_seconds,
        )
        if settings.redis_url
        else InProcessSignal()
    )
    read_path = open_read_path(database)
    hub = EventHub(log=read_path, signal=signal)
    message_log = open_message_log(database)
    service = IMService(
        uow=database.transaction,
        messages=message_log,
        inbox=read_path,
        on_committed=hub.offer,
        signal=signal,
        limits=settings.limits,
    )
    feed = EventFeed(uow=database.transaction, hub=hub)
    servicer = IMServicer(service, feed, service_token=settings.service_token)

    async def ready() -> bool:
        return await database.ping()

    server = GrpcServer(
        address=settings.grpc_address,
        registrars=[lambda s: im_pb2_grpc.add_IMServiceServicer_to_server(servicer, s)],
        tls=settings.tls.server,
        interceptors=[RateLimitInterceptor(RATE_LIMITED, settings.rate_limits)],
        service_names=[SERVICE_NAME],
        readiness=ready,
        components={SIGNALS_HEALTH_NAME: lambda: not signal.degraded},
        reflection=settings.reflection,
        max_message_bytes=settings.max_message_bytes,
        grace_seconds=settings.shutdown_grace_seconds,
        closers=[hub.aclose],
        cleanups=[message_log.aclose, read_path.aclose, signal.aclose, database.aclose],
    )
    return IMApp(settings=settings, database=database, signal=signal, hub=hub, service=service, server=server)
