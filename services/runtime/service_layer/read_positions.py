"""Agents' read positions in the IM, moved in batches, off the agents' way.

What an agent has taken as input is kept with its steps (the runtime's own
read marks): the IM's read positions of an agent only show people what it
has read, and spare it old messages when it catches up. So they may lag:
each move waits `delay_seconds`, and the moves of one chat made meanwhile
go to the IM as one `MarkRead`. Under a busy conversation that is one call
per chat per delay instead of one per message answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable

from services.runtime.service_layer.im_port import IMPort

logger = logging.getLogger(__name__)

# A move the IM refused or could not take waits this long, doubling up to the cap.
_RETRY_SECONDS = 0.5
_RETRY_CAP_SECONDS = 30.0
_NOTHING = uuid.UUID(int=0)


class ReadPositions:
    """Gathers read position moves per (agent member, chat) and sends them.

    Args:
        im: where the positions are kept.
        delay_seconds: how long a move waits for others of its chat.
        concurrency: calls in flight at once.
    """

    def __init__(self, im: IMPort, *, delay_seconds: float = 1.0, concurrency: int = 16) -> None:
        self._im = im
        self._delay = delay_seconds
        self._limit = asyncio.Semaphore(concurrency)
        self._pending: dict[tuple[uuid.UUID, uuid.UUID], uuid.UUID] = {}
        self._moved = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        self._closed = False
        # Calls made, for tests and figures.
        self.calls = 0

    def move(self, member_id: uuid.UUID, positions: Iterable[tuple[uuid.UUID, uuid.UUID]]) -> None:
        """Moves `member_id`'s position in each (chat, up to message) soon; never backwards."""
        for group_id, up_to in positions:
            key = (member_id, group_id)
            if up_to > self._pending.get(key, _NOTHING):
                self._pending[key] = up_to
        if self._pending and not self._closed:
            if self._task is None:
                self._task = asyncio.create_task(self._run(), name="runtime-read-positions")
            self._moved.set()

    async def flush(self, member_id: uuid.UUID | None = None) -> None:
        """Sends now what waits (of one member, or of all); what fails waits for the next round."""
        keys = [key for key in self._pending if member_id is None or key[0] == member_id]
        await self._send({key: self._pending.pop(key) for key in keys})

    async def _run(self) -> None:
        while True:
            await self._moved.wait()
            self._moved.clear()
            await asyncio.sleep(self._delay)
            batch, self._pending = self._pending, {}
            failed = await self._send(batch)
            if failed:
                self._failures += 1
                await asyncio.sleep(min(_RETRY_CAP_SECONDS, _RETRY_SECONDS * 2 ** (self._failures - 1)))
                self._moved.set()
            else:
                self._failures = 0

    async def _send(self, batch: dict[tuple[uuid.UUID, uuid.UUID], uuid.UUID]) -> int:
        """Sends each move; puts back the ones that failed (unless a newer one came); returns how many."""
        if not batch:
            return 0
        outcomes = await asyncio.gather(
            *[self._mark(member, group, up_to) for (member, group), up_to in batch.items()],
            return_exceptions=True,
        )
        failed = 0
        for (key, up_to), outcome in zip(batch.items(), outcomes, strict=True):
            if isinstance(outcome, Exception):
                failed += 1
                logger.warning("agent member %s: marking chat %s read failed: %s", key[0], key[1], outcome)
                if up_to > self._pending.get(key, _NOTHING):
                    self._pending[key] = up_to
                self._moved.set()
            elif isinstance(outcome, BaseException):
                raise outcome
        return failed

    async def _mark(self, member_id: uuid.UUID, group_id: uuid.UUID, up_to: uuid.UUID) -> None:
        async with self._limit:
            self.calls += 1
            await self._im.mark_read(member_id, group_id, up_to)

    async def aclose(self, *, timeout_seconds: float = 2.0) -> None:
        """Stops; what waits is sent first, for at most `timeout_seconds`. Idempotent."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_seconds):
                await self.flush()
