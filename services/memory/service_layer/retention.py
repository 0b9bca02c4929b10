"""Forgetting what is older than the retention period, on a timer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from services.memory.domain.scope import ForgetTarget
from services.memory.service_layer.ports import MemoryStore

logger = logging.getLogger(__name__)


class RetentionSweep:
    """Deletes segments older than `days`, at start and then every `interval`.

    Args:
        store: the memory.
        days: how long segments are kept.
        interval: time between sweeps.
        clock: the current time.
    """

    def __init__(
        self, store: MemoryStore, *, days: int, interval: timedelta, clock: Callable[[], datetime]
    ) -> None:
        if days <= 0:
            raise ValueError("days must be positive (0 keeps memory forever: run no sweep)")
        self._store = store
        self._keep = timedelta(days=days)
        self._interval = interval
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    async def sweep(self) -> int:
        """Deletes what is past the retention period now; returns how many segments."""
        deleted = await self._store.forget(ForgetTarget(before=self._clock() - self._keep))
        if deleted:
            logger.info("retention: forgot %d segments older than %s", deleted, self._keep)
        return deleted

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="memory-retention")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:
                logger.warning("retention sweep failed; next one in %s", self._interval, exc_info=True)
            # A timer, not a poll: nothing is due before the next interval.
            await asyncio.sleep(self._interval.total_seconds())
