"""A loopback TCP proxy that can hold back what clients send: a slow network,
faked at the transport, to put a call in flight for as long as a test needs."""

from __future__ import annotations

import asyncio
import contextlib


class HoldingProxy:
    """Forwards connections to `target` (host:port); `hold()` stops forwarding what clients send.

    `held` is set once something a client sent is being held back.
    """

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._open = asyncio.Event()
        self._open.set()
        self.held = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        """Listens on a free loopback port; returns its address."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    def hold(self) -> None:
        self.held.clear()
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        self._writers += [writer, upstream_writer]
        for task in (
            asyncio.create_task(self._pump(reader, upstream_writer, holding=True)),
            asyncio.create_task(self._pump(upstream_reader, writer, holding=False)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, holding: bool
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if holding and not self._open.is_set():
                    self.held.set()
                    await self._open.wait()
                writer.write(data)
                await writer.drain()
        writer.close()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()
