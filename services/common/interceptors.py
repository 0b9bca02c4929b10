"""Server interceptors shared by every gRPC service."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
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
