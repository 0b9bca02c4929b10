"""One way to build, run and stop a gRPC server, for every service.

A `GrpcServer` adds standard health checking (reflecting real readiness),
optional server reflection, the error-mapping interceptor, the request rules
every service shares (`request_rules`), request size limits and refusal of a
port that is already taken. With `stop_on_signals`,
`serve_until` serves until SIGTERM or SIGINT, then stops gracefully, in
this order (`GrpcServer.stop`), all within the grace period:

1. health reports NOT_SERVING (Watch streams hear it, then end UNAVAILABLE);
2. calls arriving from now on are held back, to be refused with UNAVAILABLE
   (see `ShutdownGate`): they never reach a handler;
3. the owners' closers end their long-lived streams with UNAVAILABLE;
4. the calls in flight finish (drain), and the calls clients had already
   sent arrive (settle);
5. grpc's own shutdown sends GOAWAY and closes the port; the held-back
   calls are refused; whatever still runs past the grace is cancelled;
6. the owners' clean-ups stop background work and close pools, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection as grpc_reflection

from services.common.interceptors import ErrorMappingInterceptor, RequestRulesInterceptor, ShutdownGate
from services.common.tls import ServerTls

logger = logging.getLogger(__name__)

ReadinessProbe = Callable[[], Awaitable[bool]]
# Whether a part of a service works now (a local check, no I/O).
ComponentProbe = Callable[[], bool]
Registrar = Callable[[grpc.aio.Server], None]
Cleanup = Callable[[], Awaitable[None]]

_PROBE_TIMEOUT_S = 2.0
# After the grace, grpc's own shutdown still gets this long: held-back calls
# are refused in it (instead of cut off), and nothing else is left by then.
_FINAL_GRACE_S = 0.5
# How long one closer or clean-up step may take before shutdown goes on
# without it (a pool waiting on a connection that will never answer).
_STEP_TIMEOUT_S = 10.0
HEALTH_METHODS = "/grpc.health.v1.Health/"
STOPPING_MESSAGE = (
    "the server is shutting down; retry the call (another replica, or this one once it is back, will answer)"
)


class ReadinessHealthServicer(HealthServicer):
    """The library's health servicer, refreshing its status from a probe on Check.

    Checking readiness on demand (instead of on a timer) keeps an idle server
    idle; Watch subscribers see every change a Check discovers.

    Components are parts whose failure degrades the service without stopping
    it (the IM's cross-replica signals): each has its own name (such as
    `agentim.im.v1.IMService/signals`), SERVING or NOT_SERVING by its probe,
    while the service itself stays as its readiness probe says.
    """

    def __init__(
        self,
        service_names: Sequence[str],
        probe: ReadinessProbe,
        components: Mapping[str, ComponentProbe] | None = None,
    ) -> None:
        super().__init__()
        self._service_names = ["", *service_names]
        self._probe = probe
        self._components = dict(components or {})
        self._shutting_down = False
        # Bumped at every status change; Watch streams wait on it.
        self._version = 0
        self._changes = asyncio.Condition()

    async def refresh(self) -> bool:
        if self._shutting_down:
            return False
        try:
            ready = await asyncio.wait_for(self._probe(), _PROBE_TIMEOUT_S)
        except Exception:
            logger.warning("readiness probe failed", exc_info=True)
            ready = False
        status = _status(ready)
        for name in self._service_names:
            await self.set(name, status)
        for name, works in self._components.items():
            await self.set(name, _status(works()))
        return ready

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await self.refresh()
        return await super().Check(request, context)

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        """Every service and component with its status (the library leaves
        List unimplemented, and reflection advertises it)."""
        await self.refresh()
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in self._server_status.items()
            }
        )

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        await super().set(service, status)
        await self._changed()

    async def enter_graceful_shutdown(self) -> None:
        self._shutting_down = True
        await super().enter_graceful_shutdown()
        await self._changed()

    async def _changed(self) -> None:
        async with self._changes:
            self._version += 1
            self._changes.notify_all()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        """Sends the service's status and every change; at shutdown NOT_SERVING, then UNAVAILABLE.

        The library's Watch never ends: at shutdown it would hold the server
        for the whole grace period and then be cut off with CANCELLED.
        """
        sent: int | None = None
        seen = -1
        while True:
            async with self._changes:
                while self._version == seen:
                    await self._changes.wait()
                seen = self._version
            status = self._server_status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != sent:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                sent = status
            if self._shutting_down:
                await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING_MESSAGE)


def _status(up: bool) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    return health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcServer:
    """A gRPC server with health, reflection, limits and graceful shutdown.

    Args:
        address: host:port to listen on; port 0 picks a free port.
        registrars: callables that add the service's servicers to the server.
        service_names: full names of the services, for health and reflection.
        readiness: probe telling whether the service can do its work
            (for example, its database answers).
        components: health names of degradable parts, with their probes
            (see `ReadinessHealthServicer`).
        reflection: whether to serve server reflection.
        max_message_bytes: limit of a request (and a response) in bytes.
        grace_seconds: how long shutdown lets in-flight calls finish.
        closers: awaited when shutdown begins, before draining: they end
            long-lived streams (with UNAVAILABLE) so that draining need not
            wait for them.
        cleanups: awaited after the server stopped, in order: stop
            background work, then close pools and channels.
        settle_seconds: how long no call may arrive before grpc's own
            shutdown begins (calls clients have sent meanwhile are then held
            back and refused, not cancelled by grpc).
        tls: serve TLS (mutual TLS if it names a client CA); None: plaintext.
        step_timeout_seconds: how long each closer and clean-up may take
            before shutdown logs it and goes on without it.
    """

    def __init__(
        self,
        *,
        address: str,
        registrars: Sequence[Registrar],
        service_names: Sequence[str],
        readiness: ReadinessProbe,
        components: Mapping[str, ComponentProbe] | None = None,
        reflection: bool = True,
        max_message_bytes: int = 4 * 1024 * 1024,
        grace_seconds: float = 5.0,
        closers: Sequence[Cleanup] = (),
        cleanups: Sequence[Cleanup] = (),
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        settle_seconds: float = 0.05,
        tls: ServerTls | None = None,
        step_timeout_seconds: float = _STEP_TIMEOUT_S,
    ) -> None:
        self._address = address
        self._step_timeout = step_timeout_seconds
        self._tls = tls
        self._grace = grace_seconds
        self._settle = settle_seconds
        self._closers = list(closers)
        self._cleanups = list(cleanups)
        self._serving = False
        self._stopped = False
        # Outermost, so that a refused call reaches nothing else.
        self.gate = ShutdownGate(message=STOPPING_MESSAGE, exempt=[HEALTH_METHODS])
        self._server = grpc.aio.server(
            # Error mapping before the rules: it turns their refusals into statuses.
            interceptors=[self.gate, ErrorMappingInterceptor(), RequestRulesInterceptor(), *interceptors],
            options=[
                # Without this a second server silently shares the port.
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        for register in registrars:
            register(self._server)
        self.health = ReadinessHealthServicer(service_names, readiness, components)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        if reflection:
            names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
            grpc_reflection.enable_server_reflection([*names, grpc_reflection.SERVICE_NAME], self._server)
        self.port = 0

    async def start(self) -> int:
        """Binds and starts serving; returns the port.

        Raises:
            OSError: the address cannot be bound (for example, it is taken).
        """
        try:
            if self._tls is None:
                self.port = self._server.add_insecure_port(self._address)
            else:
                self.port = self._server.add_secure_port(self._address, self._tls.credentials())
        except RuntimeError as error:
            raise OSError(f"cannot listen on {self._address}: {error}") from error
        if self.port == 0:
            raise OSError(f"cannot listen on {self._address}: the port is taken or the address is invalid")
        await self._server.start()
        self._serving = True
        await self.health.refresh()
        return self.port

    async def stop(self) -> None:
        """Stops gracefully in the order the module describes, then cleans up. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._grace
        await self.health.enter_graceful_shutdown()
        self.gate.close()
        await _run_all(self._closers, timeout_seconds=self._step_timeout)
        if self._serving:
            try:
                async with asyncio.timeout_at(deadline):
                    await self.gate.drained()
                    await self.gate.settled(self._settle)
            except TimeoutError:
                if self.gate.active:
                    logger.warning(
                        "%d calls still in flight after the %.1f s grace are cancelled",
                        self.gate.active,
                        self._grace,
                    )
        stopping = asyncio.ensure_future(self._server.stop(max(deadline - loop.time(), _FINAL_GRACE_S)))
        # grpc's shutdown sends GOAWAY in its first step; only then are the
        # held-back calls refused, so that their clients retry elsewhere.
        await asyncio.sleep(0)
        self.gate.release()
        await stopping
        if self.gate.refused:
            logger.info("%d calls that arrived while stopping were refused", self.gate.refused)
        await _run_all(self._cleanups, timeout_seconds=self._step_timeout)

    async def serve_until(self, stop: asyncio.Event) -> None:
        """Serves until `stop` is set (or the server ends), then stops gracefully."""
        serving = asyncio.create_task(self._server.wait_for_termination())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            logger.info("shutting down")
            await self.stop()
        finally:
            for task in (serving, stopping):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


@contextlib.contextmanager
def stop_on_signals() -> Iterator[asyncio.Event]:
    """An event set by SIGTERM or SIGINT while the block runs.

    Install it before starting to serve, so that a signal arriving right
    after start-up still leads to a graceful stop.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        yield stop
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


async def _run_all(callbacks: Sequence[Cleanup], *, timeout_seconds: float) -> None:
    """Runs each step in order; a step that fails or outlasts `timeout_seconds`
    is logged and left behind, so that one stuck pool or peer never keeps
    the process from exiting."""
    for callback in callbacks:
        try:
            async with asyncio.timeout(timeout_seconds):
                await callback()
        except TimeoutError:
            logger.warning(
                "shutdown step %s did not finish within %.0f s; going on without it",
                getattr(callback, "__qualname__", callback),
                timeout_seconds,
            )
        except Exception:
            logger.exception("shutdown step failed")
