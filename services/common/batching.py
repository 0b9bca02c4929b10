"""Natural batching: concurrent callers share one round trip.

While one batch is being written, new items wait; when it finishes, all of
them go together in the next batch. A lone caller is never delayed (its batch
of one starts at once), and under load each round trip (and each commit
flush) serves many callers: the application-level cousin of a database's
group commit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class BatcherClosed(Exception):
    """The batcher was closed; nothing more is accepted."""


class NaturalBatcher(Generic[Item, Result]):
    """Runs `flush` over whatever items arrived while the previous flush ran.

    Args:
        flush: writes a batch; returns one result per item, in order. If it
            raises, every caller of that batch gets the exception.
        max_batch: most items per flush.
    """

    def __init__(
        self, flush: Callable[[list[Item]], Awaitable[Sequence[Result]]], *, max_batch: int = 256
    ) -> None:
        self._flush = flush
        self._max_batch = max_batch
        self._waiting: list[tuple[Item, asyncio.Future[Result]]] = []
        self._runner: asyncio.Task[None] | None = None
        self._closed = False

    async def submit(self, item: Item) -> Result:
        """Adds an item to the next batch and waits for its result."""
        if self._closed:
            raise BatcherClosed("the batcher is closed")
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._runner is None:
            self._runner = asyncio.create_task(self._run(), name="natural-batcher")
        return await future

    async def _run(self) -> None:
        try:
            while self._waiting:
                batch = self._waiting[: self._max_batch]
                del self._waiting[: self._max_batch]
                live = [(item, future) for item, future in batch if not future.cancelled()]
                if not live:
                    continue
                try:
                    results = await self._flush([item for item, _ in live])
                except BaseException as error:
                    for _, future in live:
                        if not future.done():
                            future.set_exception(error)
                    if isinstance(error, asyncio.CancelledError):
                        raise
                    continue
                for (_, future), result in zip(live, results, strict=True):
                    if not future.done():
                        future.set_result(result)
        finally:
            self._runner = None

    async def aclose(self) -> None:
        """Refuses new items and waits for the batches already accepted. Idempotent."""
        self._closed = True
        runner = self._runner
        if runner is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await runner
