"""Server interceptors shared by every gRPC service."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.common.errors import ServiceError
from services.common.outages import describe, unavailable_error

logger = logging.getLogger(__name__)


async def _abort_for(error: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    unavailable = unavailable_error(error)
    if unavailable is not None:
        # Says which dependency and why; the driver's own words (which may name
        # hosts) go to the log only.
        logger.warning("%s: %s (%s)", method, unavailable.message, describe(error))
        await context.abort(unavailable.code, unavailable.message)
    if isinstance(error, ServiceError):
        await context.abort(error.code, error.message)
    logger.error("unexpected error in %s", method, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error")


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
