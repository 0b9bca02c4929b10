"""The fake OpenAI server of `tests.fake_openai`, answering by model name, for bench.runtime_bench.

Instead of a script, each request's `model` picks the reply, so that one
server process serves every agent of the benchmark:

- `bench-short`: a short answer whose first content delta is
  `arrived <ns>`, the server's CLOCK_MONOTONIC when the request had fully
  arrived (CLOCK_MONOTONIC is system-wide on Linux: other processes can
  compare it with their own `time.monotonic_ns()`);
- `bench-timed-<n>-<gap_us>`: n content deltas, one every gap_us
  microseconds, each `<ns>;` where ns is taken just before the chunk is
  written to the socket;
- `bench-paced-<n>-<rate>`: n one-character content deltas at `rate` per
  second (0: as fast as the socket takes them), then a last delta
  `[<first ns>,<last ns>]`: when the server wrote the first and the last;
- `bench-stall-<n>-<tag>`: the first n requests naming this model stream one
  content delta `stalled`, then a `.` every STALL_TICK_S seconds (so that no
  idle timeout fires) until the client goes away: they never end by
  themselves. Later requests get the short answer of `bench-short` at once.
  The count is per model name, so a new tag starts a new count.

Anything else gets HTTP 400. Run as `python -m bench.llm_server`; it prints
`fake OpenAI server listening on HOST:PORT` and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tests.fake_openai import FakeOpenAI, Received, Reply, chunk, error_body, usage_chunk

_TIMED = re.compile(r"bench-timed-(\d+)-(\d+)")
_PACED = re.compile(r"bench-paced-(\d+)-(\d+)")
_STALL = re.compile(r"bench-stall-(\d+)-[\w.-]+")
STALL_TICK_S = 5.0
# Paced deltas are written at most this many at a time between drains.
_BATCH = 64


@dataclass
class StreamedReply(Reply):
    """A reply generated while it is written: n deltas, time-stamped or paced."""

    count: int = 0
    gap_seconds: float = 0.0
    paced: bool = False
    rate: float = 0.0


def _sse(payload: Mapping[str, Any]) -> bytes:
    data = f"data: {json.dumps(payload)}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + _sse(
    chunk(role="assistant", content="")
)
_DONE = b"data: [DONE]\n\n"
# The finish reason, the usage, [DONE] and the end of the chunked body.
_TAIL = (
    _sse(chunk(finish="stop"))
    + _sse(usage_chunk(10, 10))
    + f"{len(_DONE):x}\r\n".encode()
    + _DONE
    + b"\r\n0\r\n\r\n"
)


@dataclass
class StalledReply(Reply):
    """A reply that streams one delta, then keeps the stream open until the client leaves."""


class BenchLLMServer(FakeOpenAI):
    """`FakeOpenAI` whose replies follow the request's model instead of a script."""

    def __init__(self) -> None:
        super().__init__()
        # Requests seen per `bench-stall-*` model name.
        self._stalls: Counter[str] = Counter()

    async def _read_request(self, reader: asyncio.StreamReader) -> Received | None:
        request = await super()._read_request(reader)
        if request is not None:
            arrived = time.monotonic_ns()
            # Nothing reads the recorded requests here: keep memory flat.
            self.requests.clear()
            model = str(request.body.get("model", ""))
            if stall := _STALL.fullmatch(model):
                self._stalls[model] += 1
                if self._stalls[model] <= int(stall[1]):
                    self.script(StalledReply())
                    return request
                model = "bench-short"
            self.script(self._reply(model, arrived))
        return request

    @staticmethod
    def _reply(model: str, arrived: int) -> Reply:
        if model == "bench-short":
            return Reply(
                chunks=[
                    chunk(role="assistant", content=""),
                    chunk(content=f"arrived {arrived}"),
                    chunk(content=" ok"),
                    chunk(finish="stop"),
                    usage_chunk(10, 3),
                ]
            )
        if timed := _TIMED.fullmatch(model):
            return StreamedReply(count=int(timed[1]), gap_seconds=int(timed[2]) / 1e6)
        if paced := _PACED.fullmatch(model):
            return StreamedReply(count=int(paced[1]), paced=True, rate=float(paced[2]))
        return Reply(400, body=error_body(f"the benchmark server has no model {model!r}"))

    async def _respond(
        self, reply: Reply, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        if isinstance(reply, StalledReply):
            return await self._stall(reader, writer)
        if not isinstance(reply, StreamedReply):
            return await super()._respond(reply, reader, writer)
        writer.write(_HEAD)
        if reply.paced:
            await self._paced(reply, writer)
        else:
            for _ in range(reply.count):
                await asyncio.sleep(reply.gap_seconds)
                writer.write(_sse(chunk(content=f"{time.monotonic_ns()};")))
                await writer.drain()
        writer.write(_TAIL)
        await writer.drain()
        return True

    @staticmethod
    async def _stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(_HEAD + _sse(chunk(content="stalled")))
        await writer.drain()
        while True:
            try:
                received = await asyncio.wait_for(reader.read(1024), STALL_TICK_S)
            except TimeoutError:
                writer.write(_sse(chunk(content=".")))
                await writer.drain()
                continue
            if not received:
                return False  # the client went away (or was killed)

    @staticmethod
    async def _paced(reply: StreamedReply, writer: asyncio.StreamWriter) -> None:
        piece = _sse(chunk(content="x"))
        first = time.monotonic_ns()
        start, sent = time.perf_counter(), 0
        while sent < reply.count:
            batch = min(_BATCH, reply.count - sent)
            if reply.rate:
                elapsed = time.perf_counter() - start
                due = min(reply.count, int(elapsed * reply.rate) + 1) - sent
                if due <= 0:
                    await asyncio.sleep((sent + 1) / reply.rate - elapsed)
                    continue
                batch = min(batch, due)
            writer.write(piece * batch)
            sent += batch
            await writer.drain()
        last = time.monotonic_ns()
        writer.write(_sse(chunk(content=f"[{first},{last}]")))


async def serve() -> None:
    server = BenchLLMServer()
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"fake OpenAI server listening on {server.url.removeprefix('http://').split('/')[0]}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main() -> None:
    asyncio.run(serve())


if __name__ == "__main__":
    main()
