"""NaturalBatcher: lone callers go at once, concurrent callers share a flush."""

from __future__ import annotations

import asyncio

import pytest

from services.common.batching import BatcherClosed, NaturalBatcher


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
