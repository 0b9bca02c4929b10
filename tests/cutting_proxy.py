"""A loopback TCP proxy that cuts a process off from a server, as a network
partition does, and heals the cut."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from urllib.parse import urlsplit

from sqlalchemy.engine import make_url


class CuttingProxy:
    """Forwards connections to `target` (host:port) until `cut()`.

    Cut, it is a black hole, as a partition is: nothing passes either way on
    the connections already open (nobody learns of the cut from a reset, only
    from silence), and new connections are accepted but reach nothing. `heal()`
    lets everything through again, what was sent meanwhile included, as TCP
    delivers what it retransmitted once a partition heals: a request sent
    during the cut reaches the server late.

    It runs on an event loop in a thread of its own, so that a test's blocking
    calls (starting a process that connects through it) do not stall it.
    Use it as a context manager; `address` is where it listens.
    """

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cutting-proxy", daemon=True)
        self._open = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._closed = False
        self.address = ""
        # Bytes the cut-off process sent during a cut, delivered at the heal.
        self.delivered_late = 0

    def __enter__(self) -> CuttingProxy:
        self._thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self._aclose(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def cut(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    async def _start(self) -> str:
        self._open.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        # A connection made during a cut hangs (what it sends waits for the
        # heal), as a connect through a partition does.
        await self._open.wait()
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self._writers.append(upstream_writer)
        if self._closed:  # while it waited or connected
            upstream_writer.close()
            writer.close()
            return
        for pump in (
            asyncio.create_task(self._pump(reader, upstream_writer, outgoing=True)),
            asyncio.create_task(self._pump(upstream_reader, writer, outgoing=False)),
        ):
            self._tasks.add(pump)
            pump.add_done_callback(self._tasks.discard)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, outgoing: bool
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if not self._open.is_set():
                    await self._open.wait()
                    if outgoing:
                        self.delivered_late += len(data)
                writer.write(data)
                await writer.drain()
        # An end (or a reset) during the cut is news that waits for the heal too.
        await self._open.wait()
        writer.close()

    async def _aclose(self) -> None:
        self._closed = True
        self._open.set()  # the connections waiting for a heal end
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()


def target_of(url: str) -> str:
    """The host:port a PostgreSQL or Redis URL points at."""
    parts = urlsplit(url.replace("+asyncpg", ""))
    return f"{parts.hostname}:{parts.port or (6379 if url.startswith('redis') else 5432)}"


def through(url: str, proxy: CuttingProxy) -> str:
    """`url` (PostgreSQL or Redis) with its host and port replaced by the proxy's."""
    host, _, port = proxy.address.rpartition(":")
    if url.startswith("redis"):
        return urlsplit(url)._replace(netloc=f"{host}:{port}").geturl()
    return make_url(url).set(host=host, port=int(port)).render_as_string(hide_password=False)
