"""Embedding in the background: archived segments get their vectors in
batches, off the request path, as soon as an archive wakes the worker.

A run is searchable lexically at once and by meaning once its segments have
vectors; the worker picks up whatever is still without one when it starts
(segments archived while no worker ran, or by another replica that stopped).
Two replicas may embed the same segment at once: the store keeps the first
vector and ignores the second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from services.memory.service_layer.ports import Embedder, MemoryStore

logger = logging.getLogger(__name__)


class EmbeddingWorker:
    """Embeds pending segments whenever `wake` is called, until none is left.

    Args:
        store: where pending segments are read and vectors written.
        embedder: the model.
        batch_size: segments embedded per call to the model.
        retry_initial_seconds: the wait after a failed batch; it doubles up
            to `retry_max_seconds` while the embedder keeps failing (a wake
            ends the wait early).
    """

    def __init__(
        self,
        store: MemoryStore,
        embedder: Embedder,
        *,
        batch_size: int = 16,
        retry_initial_seconds: float = 1.0,
        retry_max_seconds: float = 60.0,
    ) -> None:
        self._store = store
        self._embedder = embedder
        self._batch_size = batch_size
        self._retry_initial = retry_initial_seconds
        self._retry_max = retry_max_seconds
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        # Whether the last pass found nothing left to embed.
        self._drained = False
        self.embedded = 0

    def wake(self) -> None:
        """Something new may wait for a vector."""
        self._drained = False
        self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="memory-embedding-worker")
            self.wake()

    async def aclose(self) -> None:
        """Stops the worker (a batch in progress is left for next time). Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def drained(self) -> None:
        """Returns once every segment archived before the call has its vector."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._drained and not self._wake.is_set())

    async def _run(self) -> None:
        delay = self._retry_initial
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                while batch := await self._store.pending_embeddings(self._batch_size):
                    vectors = await self._embedder.embed_passages([item.text for item in batch])
                    self.embedded += await self._store.store_embeddings(batch, vectors)
                    await self._notify(drained=False)
            except Exception as error:
                logger.warning(
                    "embedding failed (%s: %s); trying again in %.0f s", type(error).__name__, error, delay
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                delay = min(delay * 2, self._retry_max)
                self._wake.set()
                continue
            delay = self._retry_initial
            await self._notify(drained=True)

    async def _notify(self, *, drained: bool) -> None:
        async with self._changed:
            self._drained = drained
            self._changed.notify_all()
