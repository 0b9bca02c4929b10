"""Server interceptors shared by every gRPC service."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.common.errors import InvalidArgument, ServiceError
from services.common.request_rules import MAX_JSON_DEPTH, check_request

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
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                self._check(request)
                async for item in inner_stream(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=deserializer, response_serializer=handler.response_serializer
            )
        return handler


def _request_type(method: str) -> str:
    # "/agentim.im.v1.IMService/SendMessage" -> "SendMessage request"
    return f"{method.rsplit('/', 1)[-1]} request"
