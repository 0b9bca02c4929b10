"""NaturalBatcher: lone callers go at once, concurrent callers share a flush, and a
bad item fails alone."""

from __future__ import annotations

import asyncio
import sqlite3
import tempfile
from pathlib import Path

import asyncpg
import pytest

from services.common.batching import BatcherClosed, NaturalBatcher
from services.common.sql import database_unavailable
from tests.unit.test_outages import locked


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_with: Exception | None = None

    async def flush(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        await self.gate.wait()
        if self.fail_with is not None:
            raise self.fail_with
        return [item * 10 for item in items]


async def test_a_lone_item_is_flushed_alone_and_at_once() -> None:
    recorder = Recorder()
    batcher = NaturalBatcher(recorder.flush)
    assert await asyncio.wait_for(batcher.submit(1), 1) == 10
    assert recorder.batches == [[1]]


async def test_items_arriving_during_a_flush_share_the_next_one() -> None:
    recorder = Recorder()
    recorder.gate.clear()
    batcher = NaturalBatcher(recorder.flush, max_batch=3)
    first = asyncio.ensure_future(batcher.submit(1))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    rest = [asyncio.ensure_future(batcher.submit(n)) for n in range(2, 7)]
    await asyncio.sleep(0)
    recorder.gate.set()
    assert await asyncio.wait_for(asyncio.gather(first, *rest), 1) == [10, 20, 30, 40, 50, 60]
    assert recorder.batches == [[1], [2, 3, 4], [5, 6]]


async def test_a_failed_flush_fails_its_callers_only() -> None:
    recorder = Recorder()
    recorder.gate.clear()
    batcher = NaturalBatcher(recorder.flush)
    first = asyncio.ensure_future(batcher.submit(1))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    recorder.fail_with = RuntimeError("database gone")
    recorder.gate.set()
    with pytest.raises(RuntimeError, match="database gone"):
        await asyncio.wait_for(first, 1)
    recorder.fail_with = None
    assert await asyncio.wait_for(batcher.submit(2), 1) == 20


async def test_a_cancelled_caller_is_left_out() -> None:
    recorder = Recorder()
    recorder.gate.clear()
    batcher = NaturalBatcher(recorder.flush)
    first = asyncio.ensure_future(batcher.submit(1))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    gone = asyncio.ensure_future(batcher.submit(2))
    kept = asyncio.ensure_future(batcher.submit(3))
    await asyncio.sleep(0)
    gone.cancel()
    recorder.gate.set()
    assert list(await asyncio.wait_for(asyncio.gather(first, kept), 1)) == [10, 30]
    assert recorder.batches == [[1], [3]]


async def test_close_waits_for_accepted_items_then_refuses() -> None:
    recorder = Recorder()
    recorder.gate.clear()
    batcher = NaturalBatcher(recorder.flush)
    pending = asyncio.ensure_future(batcher.submit(1))
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(batcher.aclose())
    await asyncio.sleep(0)
    assert not closing.done()
    recorder.gate.set()
    await asyncio.wait_for(closing, 1)
    assert pending.result() == 10
    with pytest.raises(BatcherClosed):
        await batcher.submit(2)
    await batcher.aclose()


class Poisoned:
    """A flush that, like one SQL statement, fails whole when any item is poison (negative)."""

    def __init__(self, failure: type[Exception] = ValueError) -> None:
        self.batches: list[list[int]] = []
        self.written: list[int] = []
        self._failure = failure

    async def flush(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        poison = [item for item in items if item < 0]
        if poison:
            raise self._failure(f"cannot store {poison[0]}")
        self.written += items
        return [item * 10 for item in items]


async def submit_together(batcher: NaturalBatcher[int, int], items: list[int]) -> list[int | Exception]:
    """Submits all items while one item's flush is held, so that they share the next batch."""
    gate = asyncio.ensure_future(batcher.submit(0))
    await asyncio.sleep(0)
    results = await asyncio.gather(*(batcher.submit(item) for item in items), return_exceptions=True)
    await gate
    return [r if isinstance(r, int | Exception) else Exception(repr(r)) for r in results]


async def test_a_poisoned_item_fails_alone_and_the_rest_are_written() -> None:
    poisoned = Poisoned()
    batcher = NaturalBatcher(poisoned.flush)
    items = [1, 2, 3, -4, 5, 6, 7, 8]
    results = await asyncio.wait_for(submit_together(batcher, items), 1)
    assert [r for r in results if isinstance(r, int)] == [10, 20, 30, 50, 60, 70, 80]
    (failure,) = [r for r in results if isinstance(r, Exception)]
    assert isinstance(failure, ValueError) and str(failure) == "cannot store -4"
    assert results[3] is failure
    # Written in arrival order; the poison was found in log2(8) splits.
    assert poisoned.written == [0, 1, 2, 3, 5, 6, 7, 8]
    assert len(poisoned.batches) <= 1 + 2 * 3 + 1


async def test_several_poisoned_items_each_fail_alone() -> None:
    poisoned = Poisoned()
    batcher = NaturalBatcher(poisoned.flush)
    items = [-1, 2, 3, 4, 5, 6, 7, -8, 9, -10]
    results = await asyncio.wait_for(submit_together(batcher, items), 1)
    failed = [item for item, result in zip(items, results, strict=True) if isinstance(result, Exception)]
    assert failed == [-1, -8, -10]
    assert sorted(poisoned.written) == [0, 2, 3, 4, 5, 6, 7, 9]


async def test_a_failure_that_is_no_items_fault_fails_the_batch_at_once() -> None:
    poisoned = Poisoned(failure=ConnectionResetError)
    batcher = NaturalBatcher(poisoned.flush)
    results = await asyncio.wait_for(submit_together(batcher, [1, -2, 3, 4]), 1)
    assert all(isinstance(r, ConnectionResetError) for r in results)
    assert poisoned.batches == [[0], [1, -2, 3, 4]]


async def test_the_caller_says_which_failures_are_no_items_fault() -> None:
    poisoned = Poisoned(failure=RuntimeError)
    batcher = NaturalBatcher(poisoned.flush, not_about_items=lambda e: isinstance(e, RuntimeError))
    results = await asyncio.wait_for(submit_together(batcher, [1, -2, 3]), 1)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert len(poisoned.batches) == 2


def locked_sqlite_error() -> sqlite3.OperationalError:
    with tempfile.TemporaryDirectory() as directory:
        return locked(Path(directory) / "locked.db")


@pytest.mark.parametrize(
    ("error", "unavailable"),
    [
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (asyncpg.exceptions.AdminShutdownError(), True),
        (asyncpg.exceptions.ConnectionDoesNotExistError(), True),
        (locked_sqlite_error(), True),
        (asyncpg.exceptions.CharacterNotInRepertoireError(), False),
        (asyncpg.exceptions.NumericValueOutOfRangeError(), False),
        (sqlite3.IntegrityError(), False),
        (OverflowError("Python int too large to convert to SQLite INTEGER"), False),
        (UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"), False),
    ],
)
def test_the_databases_own_failures_are_told_from_an_items(error: Exception, unavailable: bool) -> None:
    assert database_unavailable(error) is unavailable
