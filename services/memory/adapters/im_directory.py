"""Who a member is, asked of the IM over gRPC and cached for a while.

The memory service asks with its own SERVICE access token, got with its
credential. A member's workspace and kind never change, so a cached answer
stays right; the cache's lifetime only bounds how long a deleted member is
still known.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import grpc

from agentim.im.v1 import im_pb2, im_pb2_grpc
from services.common import errors
from services.common.clients import open_channel
from services.common.identity import bearer_metadata
from services.common.service_auth import AuthClient, SecretSource, ServiceToken, TokenRefused
from services.common.tls import ClientTls
from services.memory.domain.errors import DirectoryUnavailable
from services.memory.service_layer.ports import MemberDirectory, MemberInfo

_NOT_A_MEMBER = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
}


class GrpcMemberDirectory(MemberDirectory):
    """`MemberDirectory` over the IM's GetMember, asked as the memory service.

    Args:
        address: host:port of the IM.
        service_secret: the memory service's credential, exchanged for its
            SERVICE access token, which every call carries.
        deadline_seconds: deadline of each call.
        cache_seconds: how long an answer is reused.
        cache_size: members remembered at once.
    """

    def __init__(
        self,
        address: str,
        *,
        service_secret: SecretSource,
        deadline_seconds: float = 5.0,
        cache_seconds: float = 300.0,
        cache_size: int = 10_000,
        tls: ClientTls | None = None,
    ) -> None:
        self._address = address
        self._channel = open_channel(address, default_timeout_seconds=deadline_seconds, tls=tls)
        self.credentials = ServiceToken(
            service="memory",
            secret=service_secret,
            issue=AuthClient(self._channel, deadline_seconds=deadline_seconds).service_token,
        )
        self._stub = im_pb2_grpc.IMServiceStub(self._channel)
        self._deadline = deadline_seconds
        self._cache_seconds = cache_seconds
        self._cache_size = cache_size
        self._cache: OrderedDict[str, tuple[float, MemberInfo]] = OrderedDict()

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel to the IM (the memory service also fetches the IM's signing keys over it)."""
        return self._channel

    async def member(self, member_id: str) -> MemberInfo | None:
        now = time.monotonic()
        cached = self._cache.get(member_id)
        if cached is not None and now - cached[0] < self._cache_seconds:
            return cached[1]
        try:
            token = await self.credentials.get()
        except (TokenRefused, errors.Unavailable) as failed:
            raise DirectoryUnavailable(f"no service token from the IM at {self._address}: {failed}") from None
        if token is None:
            raise DirectoryUnavailable(
                f"the memory service has no credential for the IM at {self._address} yet"
                " (MEMORY_SERVICE_SECRET or MEMORY_SERVICE_SECRET_FILE)"
            )
        try:
            response = await self._stub.GetMember(
                im_pb2.GetMemberRequest(member_id=member_id),
                metadata=bearer_metadata(token),
                timeout=self._deadline,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in _NOT_A_MEMBER:
                return None
            raise DirectoryUnavailable(
                f"the IM at {self._address}, which says who callers are, is unavailable ({error.code().name})"
            ) from None
        found = MemberInfo(
            member_id=response.member.id,
            workspace_id=response.member.workspace_id,
            is_agent=response.member.kind == im_pb2.MEMBER_KIND_AGENT,
            owner_id=response.member.owner_id,
        )
        self._cache[member_id] = (now, found)
        self._cache.move_to_end(member_id)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return found

    async def aclose(self) -> None:
        await self._channel.close()
