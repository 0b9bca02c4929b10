"""Server interceptors shared by every gRPC service."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from services.common.errors import ServiceError

logger = logging.getLogger(__name__)


async def _abort_for(error: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(error, ServiceError):
        await context.abort(error.code, error.message)
    logger.error("unexpected error in %s", method, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error")


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns `ServiceError`s into their gRPC status, and anything else into INTERNAL.

    This is the one place where exceptions become statuses, so servicers stay
    free of try/except.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await inner_unary(request, context)
                except ServiceError as error:
                    await _abort_for(error, context, method)
                except Exception as error:
                    if _is_abort(error):
                        raise
                    await _abort_for(error, context, method)

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None and not inspect.isasyncgenfunction(handler.unary_stream):
            # A stream handler may also be a coroutine that writes with
            # context.write (as the library's health Watch is).
            inner_writer = handler.unary_stream

            async def writer(request: Any, context: grpc.aio.ServicerContext) -> None:
                try:
                    await inner_writer(request, context)
                except ServiceError as error:
                    await _abort_for(error, context, method)
                except Exception as error:
                    if _is_abort(error):
                        raise
                    await _abort_for(error, context, method)

            return grpc.unary_stream_rpc_method_handler(
                writer,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except ServiceError as error:
                    await _abort_for(error, context, method)
                except Exception as error:
                    if _is_abort(error):
                        raise
                    await _abort_for(error, context, method)

            return grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _is_abort(error: BaseException) -> bool:
    # context.abort() raises grpc.aio.AbortError; it must pass through untouched.
    return isinstance(error, grpc.aio.AbortError)


# A held-back call is refused this long before its deadline at the latest, so
# that its caller sees UNAVAILABLE (which it retries) and not DEADLINE_EXCEEDED.
_DEADLINE_MARGIN_S = 0.1


class ShutdownGate(grpc.aio.ServerInterceptor):
    """Knows the calls in flight; once closed, holds back new calls and refuses them.

    A refused call gets UNAVAILABLE, which clients retry (elsewhere), and
    never reaches its handler, so it has done nothing. Refusals wait for
    `release()`, which the server calls once its own shutdown has begun:
    grpc-core cancels with CANCELLED (a status retry policies do not retry)
    every call that has reached the process but not yet a handler when that
    shutdown begins (grpc/grpc#41785). A client answered at once would send
    its next call straight into that moment; held back, its next call is
    only sent after the server's GOAWAY, which sends it elsewhere.

    Calls to `exempt` methods (health: it keeps answering NOT_SERVING while
    the server drains) and client-streaming calls pass untouched and uncounted.

    Args:
        message: the details of a refusal.
        exempt: prefixes of the full method names that pass untouched.
    """

    def __init__(self, *, message: str, exempt: Sequence[str] = ()) -> None:
        self._message = message
        self._exempt = tuple(exempt)
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._arrived = asyncio.Event()
        self._last_activity = float("-inf")
        self._closed = False
        self._released = asyncio.Event()
        self.refused = 0

    @property
    def active(self) -> int:
        """Calls admitted and not yet finished (their handlers still run)."""
        return self._active

    def close(self) -> None:
        """Admits no more calls: later ones are held back, then refused."""
        self._closed = True

    def release(self) -> None:
        """Refuses the calls held back, and later ones at once."""
        self._released.set()

    async def drained(self) -> None:
        """Waits until no admitted call is in flight."""
        await self._idle.wait()

    async def settled(self, quiet: float) -> None:
        """Waits until no call has arrived or finished for `quiet` seconds.

        Calls already sent (a client's next call after its last answer) take
        a moment to reach a handler; they are held back once they do. A
        server idle for that long already is settled at once.
        """
        loop = asyncio.get_running_loop()
        while (idle := loop.time() - self._last_activity) < quiet:
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(quiet - idle):
                    await self._arrived.wait()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._exempt):
            return handler
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await self._admit(context)
                try:
                    return await inner_unary(request, context)
                finally:
                    self._leave()

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await self._admit(context)
                try:
                    async with contextlib.aclosing(inner_stream(request, context)) as items:
                        async for item in items:
                            yield item
                finally:
                    self._leave()

            return grpc.unary_stream_rpc_method_handler(
                stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_writer = handler.unary_stream

            async def writer(request: Any, context: grpc.aio.ServicerContext) -> None:
                await self._admit(context)
                try:
                    await inner_writer(request, context)
                finally:
                    self._leave()

            return grpc.unary_stream_rpc_method_handler(
                writer,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    async def _admit(self, context: grpc.aio.ServicerContext) -> None:
        self._last_activity = asyncio.get_running_loop().time()
        self._arrived.set()
        if not self._closed:
            self._active += 1
            self._idle.clear()
            return
        self.refused += 1
        remaining = context.time_remaining()
        wait = None if remaining is None else max(0.0, remaining - _DEADLINE_MARGIN_S)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._released.wait(), wait)
        await context.abort(grpc.StatusCode.UNAVAILABLE, self._message)

    def _leave(self) -> None:
        # Its client may send its next call right away: that is activity too.
        self._last_activity = asyncio.get_running_loop().time()
        self._active -= 1
        if self._active == 0:
            self._idle.set()
