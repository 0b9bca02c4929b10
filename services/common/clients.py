"""Outgoing gRPC channels: every call between services carries a deadline,
and goes over TLS when the service is configured for it (`services.common.tls`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from services.common.tls import ClientTls


class DefaultDeadlineInterceptor(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    """Gives every call without a timeout a default one.

    Streaming calls (live feeds) are meant to stay open, so they get their
    deadline only when the caller sets one.
    """

    def __init__(self, timeout_seconds: float) -> None:
        self._timeout = timeout_seconds

    def _with_deadline(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        if details.timeout is not None:
            return details
        return grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=self._timeout,
            metadata=details.metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        return await continuation(self._with_deadline(client_call_details), request)

    async def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        return await continuation(client_call_details, request)


def make_channel(
    target: str,
    *,
    tls: ClientTls | None,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """A channel to `target`: over TLS with `tls` (mutual when it holds a certificate), else plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options), interceptors=list(interceptors))
    return grpc.aio.secure_channel(
        target,
        tls.credentials(),
        options=[*options, *tls.options()],
        interceptors=list(interceptors),
    )


def open_channel(
    target: str,
    *,
    default_timeout_seconds: float = 10.0,
    max_message_bytes: int = 4 * 1024 * 1024,
    tls: ClientTls | None = None,
) -> grpc.aio.Channel:
    """A channel to another service whose unary calls always have a deadline."""
    return make_channel(
        target,
        tls=tls,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
        interceptors=[DefaultDeadlineInterceptor(default_timeout_seconds)],
    )
