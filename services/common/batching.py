"""Natural batching: concurrent callers share one round trip.

While one batch is being written, new items wait; when it finishes, all of
them go together in the next batch. A lone caller is never delayed (its batch
of one starts at once), and under load each round trip (and each commit
flush) serves many callers: the application-level cousin of a database's
group commit.

A batch is written as a whole (one statement, one transaction), so one bad
item would fail every caller in it. When a flush fails in a way an item may
have caused, the batcher flushes each half of the batch again, down to the
item at fault: that item's caller gets the error and every other item is
written. A failure that is nobody's item (the database is unreachable) fails
the batch at once.
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


def _connection_lost(error: Exception) -> bool:
    return isinstance(error, OSError | TimeoutError)


class NaturalBatcher(Generic[Item, Result]):
    """Runs `flush` over whatever items arrived while the previous flush ran.

    Args:
        flush: writes a batch, all of it or (raising) none of it; returns
            one result per item, in order.
        max_batch: most items per flush.
        not_about_items: tells the failures that no item causes (a lost
            connection): they fail the whole batch at once. Any other
            failure of a batch of several items is isolated by flushing its
            halves again, so that only the items at fault get it.
    """

    def __init__(
        self,
        flush: Callable[[list[Item]], Awaitable[Sequence[Result]]],
        *,
        max_batch: int = 256,
        not_about_items: Callable[[Exception], bool] = _connection_lost,
    ) -> None:
        self._flush = flush
        self._max_batch = max_batch
        self._not_about_items = not_about_items
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
                await self._write(batch)
        finally:
            self._runner = None

    async def _write(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        live = [(item, future) for item, future in batch if not future.cancelled()]
        if not live:
            return
        try:
            results = await self._flush([item for item, _ in live])
        except Exception as error:
            if len(live) > 1 and not self._not_about_items(error):
                # Halves keep arrival order: the first half is written first.
                middle = len(live) // 2
                try:
                    await self._write(live[:middle])
                    await self._write(live[middle:])
                except BaseException as cancelled:  # no half is left waiting
                    _fail(live, cancelled)
                    raise
                return
            _fail(live, error)
            return
        except BaseException as error:  # cancelled: the callers learn it too
            _fail(live, error)
            raise
        for (_, future), result in zip(live, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def aclose(self) -> None:
        """Refuses new items and waits for the batches already accepted. Idempotent."""
        self._closed = True
        runner = self._runner
        if runner is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await runner


def _fail(batch: list[tuple[Item, asyncio.Future[Result]]], error: BaseException) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(error)
