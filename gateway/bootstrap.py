"""Builds the gateway from its settings: the composition root."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from gateway.auth import Authenticator
from gateway.config import Settings
from gateway.http import Gateway
from gateway.oidc import RelyingParty
from gateway.sessions import SessionSealer, load_or_create_key
from gateway.upstream import Upstreams
from services.common.oidc import ProviderClient

logger = logging.getLogger(__name__)


class GatewayApp:
    """The HTTP server with its upstream channels; `start`, then `stop` (idempotent)."""

    def __init__(
        self,
        settings: Settings,
        upstreams: Upstreams,
        authenticator: Authenticator,
        *,
        oidc: RelyingParty | None = None,
    ) -> None:
        self.settings = settings
        self.upstreams = upstreams
        self._oidc = oidc
        self.gateway = Gateway(settings, upstreams, authenticator, oidc=oidc)
        self._runner = web.AppRunner(
            self.gateway.application(),
            # No access log: a logged request line or header could show a
            # credential; errors are logged by the gateway, path only.
            access_log=None,
            # A client that goes away cancels its handler, and so its gRPC call.
            handler_cancellation=True,
            shutdown_timeout=settings.shutdown_grace_seconds,
        )
        self.port = 0
        self._started = False
        self._stopped = False

    async def start(self) -> int:
        """Listens; returns the port.

        Raises:
            OSError: the address cannot be bound (for example, it is taken).
        """
        host, _, port = self.settings.http_address.rpartition(":")
        await self._runner.setup()
        self._started = True
        site = web.TCPSite(self._runner, host.strip("[]"), int(port), reuse_port=False)
        try:
            await site.start()
        except OSError as error:
            raise OSError(
                f"cannot listen on {self.settings.http_address}: {error.strerror or error}"
            ) from error
        self.port = int(self._runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        """Stops accepting, ends SSE streams, lets requests finish, closes the channels. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._started:
            await self._runner.cleanup()
        await self.upstreams.aclose()
        if self._oidc is not None:
            await self._oidc.aclose()

    async def serve_until(self, stop: asyncio.Event) -> None:
        await stop.wait()
        logger.info("shutting down")
        await self.stop()


def build(settings: Settings) -> GatewayApp:
    upstreams = Upstreams(
        {
            "im": settings.im_address,
            # The IM process serves AuthService too.
            "auth": settings.im_address,
            "runtime": settings.runtime_address,
            **({"memory": settings.memory_address} if settings.memory_address else {}),
        },
        call_timeout_seconds=settings.call_timeout_seconds,
        tls=settings.tls.client,
    )
    key = settings.session_key or load_or_create_key(settings.session_key_file)
    sealer = SessionSealer(key)
    authenticator = Authenticator(
        upstreams.channel("auth"),
        sealer,
        refresh_margin_seconds=settings.refresh_margin_seconds,
        call_timeout_seconds=settings.call_timeout_seconds,
    )
    oidc = RelyingParty(ProviderClient(settings.oidc), sealer) if settings.oidc is not None else None
    return GatewayApp(settings, upstreams, authenticator, oidc=oidc)
