"""Per-member rate limits: token buckets in front of the RPCs that send or create.

Each member has a bucket per kind of call (sending messages, creating
things), refilled at a steady rate up to a burst. A call that finds its
bucket empty is refused with `RESOURCE_EXHAUSTED` (`RateLimited`), saying
when to try again in words and as a `google.rpc.RetryInfo` detail (the
gateway turns it into `429` with `Retry-After`). A zero rate turns a kind of
limit off. The interceptor must sit inside the error-mapping one (as
`GrpcServer` places the interceptors it is given), which makes the status.

Buckets are keyed by the verified caller (`services.common.authn`, which
must run before this interceptor): the member of a person's or agent's
token, or the service of a service token. A call with no caller (creating
a workspace) counts against its peer's address instead. Buckets live in the process: behind several
replicas a member gets up to that many times the rate, which bounds abuse
all the same; the buckets of members not seen for a while are dropped, so
memory stays bounded.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from services.common.authn import current_caller
from services.common.errors import ResourceExhausted
from services.common.identity import Caller
from services.common.settings import EnvReader


@dataclass(frozen=True, slots=True)
class Rate:
    """`per_second` tokens a second, up to `burst`; zero `per_second`: no limit."""

    per_second: float
    burst: int

    @property
    def limited(self) -> bool:
        return self.per_second > 0


@dataclass(frozen=True, slots=True)
class RateLimits:
    """The rates of each kind of call (see `read_rate_limits`)."""

    send: Rate = Rate(50.0, 200)
    create: Rate = Rate(5.0, 100)


def read_rate_limits(env: EnvReader) -> RateLimits:
    """`LIMIT_SEND_PER_SECOND`, `LIMIT_SEND_BURST`, `LIMIT_CREATE_PER_SECOND`,
    `LIMIT_CREATE_BURST` (a rate of 0 turns that limit off)."""
    default = RateLimits()

    def rate(kind: str, fallback: Rate) -> Rate:
        per_second = env.number(f"LIMIT_{kind}_PER_SECOND", fallback.per_second)
        burst = env.integer(f"LIMIT_{kind}_BURST", fallback.burst, minimum=1)
        return Rate(per_second, burst)

    return RateLimits(send=rate("SEND", default.send), create=rate("CREATE", default.create))


class TokenBuckets:
    """Buckets by key; `take` spends a token or says how long until one is there.

    Args:
        max_keys: buckets kept; the least recently used go first (a bucket
            dropped is full again when its key comes back, which only errs
            towards letting a call through).
        clock: monotonic seconds.
    """

    def __init__(self, *, max_keys: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self._max_keys = max_keys
        self._clock = clock
        # key -> (tokens, when they were counted)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, key: str, rate: Rate) -> float:
        """0 if a token was spent; else the seconds until one will be there."""
        if not rate.limited:
            return 0.0
        now = self._clock()
        tokens, then = self._buckets.pop(key, (float(rate.burst), now))
        tokens = min(float(rate.burst), tokens + (now - then) * rate.per_second)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / rate.per_second
        self._buckets[key] = (tokens, now)
        while len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)
        return wait


class RateLimited(ResourceExhausted):
    """A member called too often; `retry_after_seconds` says when to come back
    (the error interceptor sends it as `google.rpc.RetryInfo`)."""


def retry_after_seconds(trailing_metadata: Iterable[tuple[str, Any]] | None) -> float | None:
    """The RetryInfo delay of a status's details (in its trailing metadata), if any."""
    for key, value in trailing_metadata or ():
        if key != "grpc-status-details-bin":
            continue
        detail = status_pb2.Status.FromString(value)
        for item in detail.details:
            if item.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                info = error_details_pb2.RetryInfo()
                item.Unpack(info)
                return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None


_WORDS = {"send": "send messages", "create": "create things"}


def _bucket_owner(caller: Caller | None) -> str | None:
    """Whose bucket a call spends from: its member, else its service, else nobody."""
    if caller is None:
        return None
    if caller.member_id is not None:
        return str(caller.member_id)
    return f"service:{caller.service}" if caller.service is not None else None


class RateLimitInterceptor(grpc.aio.ServerInterceptor):
    """Spends a token of the caller's bucket before each call of a limited method.

    Args:
        kinds: full method name (`/pkg.Service/Method`) -> the kind of call
            (`"send"` or `"create"`); other methods are not limited.
        limits: the rate of each kind.
        buckets: where the tokens are counted.
    """

    def __init__(
        self, kinds: Mapping[str, str], limits: RateLimits, *, buckets: TokenBuckets | None = None
    ) -> None:
        rates = {"send": limits.send, "create": limits.create}
        self._kinds = {method: (kind, rates[kind]) for method, kind in kinds.items() if rates[kind].limited}
        self._buckets = buckets or TokenBuckets()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        limited_kind = self._kinds.get(handler_call_details.method)
        if handler is None or limited_kind is None or handler.unary_unary is None:
            return handler
        kind, rate = limited_kind
        inner = handler.unary_unary

        async def limited(request: Any, context: grpc.aio.ServicerContext) -> Any:
            # Read here, in the handler's task, where authentication put it.
            # A member's token spends the member's bucket, a service's the service's.
            who = _bucket_owner(current_caller()) or "peer " + context.peer().rpartition(":")[0]
            wait = self._buckets.take(f"{who} {kind}", rate)
            if wait > 0:
                raise RateLimited(
                    f"too many calls that {_WORDS[kind]}: at most {rate.per_second:g} a second"
                    f" (bursts of {rate.burst}); try again in {wait:.1f} s",
                    retry_after_seconds=wait,
                )
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            limited,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
