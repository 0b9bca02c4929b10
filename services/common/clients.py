"""Outgoing gRPC channels: every call between services carries a deadline."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc


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


def open_channel(
    target: str, *, default_timeout_seconds: float = 10.0, max_message_bytes: int = 4 * 1024 * 1024
) -> grpc.aio.Channel:
    """An insecure channel to another service whose unary calls always have a deadline."""
    return grpc.aio.insecure_channel(
        target,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
        interceptors=[DefaultDeadlineInterceptor(default_timeout_seconds)],
    )
