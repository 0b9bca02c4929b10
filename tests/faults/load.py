"""Client traffic for fault cases: looping callers, followed streams, a health watch.

Everything records what happened and when (monotonic seconds), so that a
case can say afterwards which calls were in flight at a given moment, how
each one ended, and in what order the server said what.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# What a caller waits after a failed call before the next: a retry policy's backoff.
RETRY_PAUSE_S = 0.01
# The details of a refusal by a service that is stopping (services.common.server).
STOPPING = "shutting down"


OK = "OK"
UNAVAILABLE = "UNAVAILABLE"
# What an HTTP client sees of a server that closed its port or the connection.
UNREACHABLE = "UNREACHABLE"


class Failed(Exception):
    """A call that did not succeed: its status name (a gRPC status, or
    UNREACHABLE for an HTTP client) and the details."""

    def __init__(self, code: str, details: str = "") -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True, slots=True)
class Call:
    """One unary call: its key (also its request id), times and status name."""

    key: str
    started: float
    ended: float
    code: str
    details: str

    @property
    def refused_while_stopping(self) -> bool:
        return self.code == UNAVAILABLE and STOPPING in self.details

    @property
    def unreachable(self) -> bool:
        return self.code == UNREACHABLE or (self.code == UNAVAILABLE and not self.refused_while_stopping)


class LoopingCallers:
    """Callers each making one call after another until stopped, as busy clients do.

    Args:
        call: makes one call with the given key (its request id); raises
            `grpc.aio.AioRpcError` or `Failed` when the call fails.
        count: callers.
        prefix: of the keys (each is `<prefix><caller>-<sequence>`).
    """

    def __init__(self, call: Callable[[str], Awaitable[object]], *, count: int, prefix: str = "c") -> None:
        self._call = call
        self._count = count
        self._prefix = prefix
        self.calls: list[Call] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(index)) for index in range(self._count)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _loop(self, index: int) -> None:
        sequence = 0
        while not self._stop.is_set():
            key = f"{self._prefix}{index}-{sequence}"
            sequence += 1
            started = time.monotonic()
            code, details = OK, ""
            try:
                await self._call(key)
            except grpc.aio.AioRpcError as error:
                code, details = error.code().name, error.details() or ""
            except Failed as failure:
                code, details = failure.code, failure.details
            self.calls.append(Call(key, started, time.monotonic(), code, details))
            if code != OK:
                await asyncio.sleep(RETRY_PAUSE_S)

    def with_code(self, code: str) -> list[Call]:
        return [c for c in self.calls if c.code == code]

    def in_flight_at(self, moment: float) -> list[Call]:
        return [c for c in self.calls if c.started <= moment < c.ended]


@dataclass
class StreamEnd:
    """How a followed stream went: messages received, then its status name."""

    received: int = 0
    code: str | None = None
    details: str = ""
    ended: float = 0.0


async def follow(call: Any, end: StreamEnd, first: asyncio.Event) -> None:
    """Reads a gRPC server stream to its end; sets `first` at its first message (or its end)."""
    try:
        async for _ in call:
            end.received += 1
            first.set()
        end.code = OK
    except grpc.aio.AioRpcError as error:
        end.code, end.details = error.code().name, error.details() or ""


async def follow_sse(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], end: StreamEnd, first: asyncio.Event
) -> None:
    """Reads a Server-Sent Events stream to its end as EventSource would.

    `first` is set once the stream has opened; an `event: error` gives the
    end its status and message (an end without one is OK).
    """
    kind = ""
    try:
        async with session.get(url, headers={"Accept": "text/event-stream", **headers}) as response:
            if response.status != 200:
                end.code, end.details = f"HTTP {response.status}", await response.text()
                return
            async for raw in response.content:
                line = raw.decode().rstrip("\n")
                if line == ": open":
                    first.set()
                elif line.startswith("event: "):
                    kind = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    end.received += 1
                    if kind == "error":
                        error = json.loads(line.removeprefix("data: "))["error"]
                        end.code, end.details = error["status"], error["message"]
        if end.code is None:
            end.code = OK
    except aiohttp.ClientError as error:
        end.code, end.details = UNREACHABLE, repr(error)


class Streams:
    """Server streams (gRPC or SSE) followed to their end, each in its own task."""

    def __init__(self) -> None:
        self.ends: list[StreamEnd] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._firsts: list[asyncio.Event] = []

    def open(self, call: Any) -> StreamEnd:
        """Follows a grpc.aio server-streaming call."""
        return self._follow(lambda end, first: follow(call, end, first))

    def open_sse(self, session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> StreamEnd:
        """Follows an SSE stream."""
        return self._follow(lambda end, first: follow_sse(session, url, headers, end, first))

    def _follow(self, reader: Callable[[StreamEnd, asyncio.Event], Awaitable[None]]) -> StreamEnd:
        end = StreamEnd()
        first = asyncio.Event()

        async def run() -> None:
            try:
                await reader(end, first)
            finally:
                end.ended = time.monotonic()
                first.set()

        self.ends.append(end)
        self._firsts.append(first)
        self._tasks.append(asyncio.create_task(run()))
        return end

    async def flowing(self, *, within: float = 15.0) -> None:
        """Waits until every stream has opened or delivered a message (or ended)."""
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in self._firsts)), within)

    async def ended(self, *, within: float = 15.0) -> None:
        """Waits for every stream to end; cancels those still open after `within` seconds."""
        _, pending = await asyncio.wait(self._tasks, timeout=within)
        for task in pending:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pending)


@dataclass
class HealthWatch:
    """A grpc.health.v1 Watch stream: each status with when it came, then how it ended."""

    statuses: list[tuple[float, int]] = field(default_factory=list)
    end: StreamEnd = field(default_factory=StreamEnd)

    def first(self, status: int) -> float | None:
        return next((at for at, seen in self.statuses if seen == status), None)


@contextlib.asynccontextmanager
async def watching_health(address: str, *, within: float = 15.0) -> AsyncIterator[HealthWatch]:
    """Watches the server's overall health on a channel of its own, until the block ends."""
    watch = HealthWatch()
    first = asyncio.Event()
    channel = grpc.aio.insecure_channel(address)

    async def run() -> None:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        try:
            async for response in call:
                watch.statuses.append((time.monotonic(), int(response.status)))
                first.set()
            watch.end.code = OK
        except grpc.aio.AioRpcError as error:
            watch.end.code, watch.end.details = error.code().name, error.details() or ""
        finally:
            watch.end.ended = time.monotonic()
            first.set()

    task = asyncio.create_task(run())
    try:
        await asyncio.wait_for(first.wait(), within)
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await channel.close()


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
