"""The gRPC side: channels to the IM and the runtime, calls by route, health."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.routes import Route
from services.common.clients import open_channel
from services.common.tls import ClientTls

Metadata = tuple[tuple[str, str], ...]


def message_class(descriptor: Any) -> type[Message]:
    cls: type[Message] = message_factory.GetMessageClass(descriptor)
    return cls


class Upstreams:
    """One channel per upstream service; every unary call has a deadline.

    Args:
        addresses: host:port of each service, by the route table's service key.
        call_timeout_seconds: the default deadline of unary calls.
    """

    def __init__(
        self, addresses: Mapping[str, str], *, call_timeout_seconds: float, tls: ClientTls | None = None
    ) -> None:
        self.addresses = dict(addresses)
        # One channel per address (the IM serves two of the route table's services).
        by_address: dict[str, grpc.aio.Channel] = {}
        for address in self.addresses.values():
            if address not in by_address:
                by_address[address] = open_channel(
                    address, default_timeout_seconds=call_timeout_seconds, tls=tls
                )
        self._channels = {name: by_address[address] for name, address in self.addresses.items()}
        self._callables: dict[tuple[str, str], Any] = {}

    def channel(self, service: str) -> grpc.aio.Channel:
        """The channel to a service (by the route table's service key)."""
        return self._channels[service]

    def serves(self, route: Route) -> bool:
        """Whether the route's service has an address (memory may have none)."""
        return route.service in self._channels

    def new_request(self, route: Route) -> Message:
        return message_class(route.descriptor.input_type)()

    def _callable(self, route: Route) -> Any:
        key = (route.service, route.rpc)
        found = self._callables.get(key)
        if found is None:
            method: MethodDescriptor = route.descriptor
            path = f"/{method.containing_service.full_name}/{method.name}"
            request_cls = message_class(method.input_type)
            response_cls = message_class(method.output_type)
            make = (
                self._channels[route.service].unary_stream
                if method.server_streaming
                else self._channels[route.service].unary_unary
            )
            found = make(
                path,
                request_serializer=request_cls.SerializeToString,
                response_deserializer=response_cls.FromString,
            )
            self._callables[key] = found
        return found

    async def unary(self, route: Route, request: Message, metadata: Metadata) -> Message:
        """Calls a unary RPC (with the channel's default deadline).

        Raises:
            grpc.aio.AioRpcError: the call failed.
        """
        response: Message = await self._callable(route)(request, metadata=metadata)
        return response

    def stream(self, route: Route, request: Message, metadata: Metadata) -> Any:
        """Starts a server-streaming RPC; returns the grpc.aio call (no deadline)."""
        return self._callable(route)(request, metadata=metadata)

    async def health(self, *, timeout_seconds: float = 2.0) -> dict[str, str]:
        """Each upstream's grpc.health.v1 status name (or the error that prevented asking)."""
        # A service sharing another's channel (AuthService, in the IM) is asked once, by the first name.
        first: dict[int, str] = {}
        for name, channel in self._channels.items():
            first.setdefault(id(channel), name)
        names: Sequence[str] = list(first.values())

        async def check(name: str) -> str:
            stub = health_pb2_grpc.HealthStub(self._channels[name])
            try:
                response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_seconds)
            except grpc.aio.AioRpcError as error:
                return str(error.code().name)
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

        statuses = await asyncio.gather(*(check(n) for n in names))
        return dict(zip(names, statuses, strict=True))

    async def aclose(self) -> None:
        """Closes every channel (ending calls still open). Idempotent."""
        for channel in set(self._channels.values()):
            await channel.close()
