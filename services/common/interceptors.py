"""Server interceptors shared by every gRPC service."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from services.common.errors import InvalidArgument, ServiceError
from services.common.outages import describe, unavailable_error
from services.common.request_rules import MAX_JSON_DEPTH, check_request
from services.common.status import status_name

logger = logging.getLogger(__name__)


async def _abort_for(error: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    unavailable = unavailable_error(error)
    if unavailable is not None:
        # Says which dependency and why; the driver's own words (which may name
        # hosts) go to the log only.
        logger.warning("%s: %s (%s)", method, unavailable.message, describe(error))
        await context.abort(grpc.StatusCode.UNAVAILABLE, unavailable.message)
    if isinstance(error, ServiceError):
        await context.abort(grpc.StatusCode[status_name(error)], error.message, _details(error))
    logger.error("unexpected error in %s", method, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error")


def _details(error: ServiceError) -> tuple[tuple[str, bytes], ...]:
    """The rich status details of an error (google.rpc.RetryInfo, google.rpc.QuotaFailure),
    as trailing metadata."""
    details: list[any_pb2.Any] = []
    if error.retry_after_seconds is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromTimedelta(timedelta(seconds=max(0.0, error.retry_after_seconds)))
        details.append(any_pb2.Any())
        details[-1].Pack(retry)
    if error.quota_violation is not None:
        quota = error_details_pb2.QuotaFailure(
            violations=[
                error_details_pb2.QuotaFailure.Violation(
                    subject=error.quota_violation.subject, description=error.quota_violation.description
                )
            ]
        )
        details.append(any_pb2.Any())
        details[-1].Pack(quota)
    if not details:
        return ()
    status = status_pb2.Status(
        code=grpc.StatusCode[status_name(error)].value[0], message=error.message, details=details
    )
    return rpc_status.to_status(status).trailing_metadata


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns `ServiceError`s into their gRPC status, a dependency's outage (see
    `services.common.outages`) into UNAVAILABLE, and anything else into INTERNAL.

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
        behaviour = handler.unary_unary or handler.unary_stream
        if behaviour is not None and not inspect.isasyncgenfunction(behaviour):
            # A unary handler, or a stream handler that writes with
            # context.write (as the library's health Watch is).
            make = (
                grpc.unary_unary_rpc_method_handler
                if handler.unary_unary is not None
                else grpc.unary_stream_rpc_method_handler
            )

            async def mapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await behaviour(request, context)
                except Exception as error:
                    if _is_abort(error):
                        raise
                    await _abort_for(error, context, method)

            return make(
                mapped,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    async for item in inner_stream(request, context):
                        yield item
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


class Undecodable:
    """What a request's bytes became when they are not a request: the reason, for the caller."""

    def __init__(self, message_type: str, problem: str) -> None:
        self.message_type = message_type
        self.problem = problem


def _problem(error: Exception) -> str:
    # The parser's own words name its internals (upb_DecodeOptions_MaxDepth);
    # the caller gets what they mean.
    text = str(error)
    if "UTF-8" in text:
        return "a string field is not valid UTF-8"
    if "MaxDepth" in text or isinstance(error, RecursionError):
        return "it is nested too deeply"
    return "its bytes are malformed"


def _tolerant(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as error:
            # Whatever the parser raises, the bytes are not a request: the
            # caller's fault, which grpc would otherwise report as UNKNOWN
            # with the exception's class name.
            return Undecodable(method, _problem(error))

    return parse


class RequestRulesInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, as INVALID_ARGUMENT, requests that are undecodable or break the shared rules.

    Undecodable bytes (corrupt, invalid UTF-8 in a string, nested past the
    parser's limit) and requests that break `request_rules` (NUL characters,
    non-finite numbers, unknown enum values, JSON nested too deeply) never
    reach a servicer. Place it after `ErrorMappingInterceptor`, which turns
    its `InvalidArgument` into the status.

    Args:
        max_json_depth: deepest nesting of JSON values (Struct, ListValue).
    """

    def __init__(self, *, max_json_depth: int = MAX_JSON_DEPTH) -> None:
        self._max_json_depth = max_json_depth

    def _check(self, request: Any) -> None:
        if isinstance(request, Undecodable):
            raise InvalidArgument(f"the request is not a valid {request.message_type}: {request.problem}")
        check_request(request, max_json_depth=self._max_json_depth)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        deserializer = _tolerant(handler.request_deserializer, _request_type(method))
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                self._check(request)
                return await inner_unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=deserializer, response_serializer=handler.response_serializer
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                self._check(request)
                async with contextlib.aclosing(inner_stream(request, context)) as items:
                    async for item in items:
                        yield item

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=deserializer, response_serializer=handler.response_serializer
            )
        if handler.unary_stream is not None:
            # A stream handler that writes with context.write (the health Watch).
            inner_writer = handler.unary_stream

            async def writer(request: Any, context: grpc.aio.ServicerContext) -> None:
                self._check(request)
                await inner_writer(request, context)

            return grpc.unary_stream_rpc_method_handler(
                writer, request_deserializer=deserializer, response_serializer=handler.response_serializer
            )
        return handler


def _request_type(method: str) -> str:
    # "/agentim.im.v1.IMService/SendMessage" -> "SendMessage request"
    return f"{method.rsplit('/', 1)[-1]} request"
