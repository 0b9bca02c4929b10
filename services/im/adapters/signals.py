"""Event signals: in-process by default, Redis pub/sub across replicas.

A signal says only "workspace W has events up to N"; receivers read the
events from the database. Losing a signal delays delivery, never loses an
event: after Redis comes back, every hub is told to look at every workspace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable

import redis.asyncio as redis

from services.im.service_layer.ports import EventSignal

logger = logging.getLogger(__name__)

Receiver = Callable[[uuid.UUID | None, int], None]


class InProcessSignal(EventSignal):
    """Delivers signals to receivers in this process, synchronously."""

    def __init__(self) -> None:
        self._receivers: list[Receiver] = []

    def connect(self, on_signal: Receiver) -> None:
        self._receivers.append(on_signal)

    async def publish(self, workspace_id: uuid.UUID, sequence: int) -> None:
        self.deliver(workspace_id, sequence)

    def deliver(self, workspace_id: uuid.UUID | None, sequence: int) -> None:
        for receiver in self._receivers:
            receiver(workspace_id, sequence)

    async def publish_all(self) -> None:
        """Asks every receiver to look at every workspace."""
        self.deliver(None, 0)


class RedisSignal(EventSignal):
    """Publishes signals on Redis and listens for every replica's.

    The local receivers are also called directly, so delivery in this
    process does not wait for a Redis round trip. Publishing happens in one
    background task that sends only the newest sequence per workspace, so a
    burst of messages costs few Redis calls and a slow or absent Redis never
    slows down the calls that commit events.

    Args:
        url: Redis URL.
        channel_prefix: prefix of the per-workspace channels.
        reconnect_max_seconds: cap of the backoff between reconnection tries.
    """

    def __init__(
        self, url: str, *, channel_prefix: str = "agentim:im:events:", reconnect_max_seconds: float = 5.0
    ) -> None:
        self._client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self._prefix = channel_prefix
        self._reconnect_max = reconnect_max_seconds
        self._local = InProcessSignal()
        self._listener: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._pending: dict[uuid.UUID, int] = {}
        self._has_pending = asyncio.Event()
        self._publisher: asyncio.Task[None] | None = None

    def connect(self, on_signal: Receiver) -> None:
        self._local.connect(on_signal)

    async def publish(self, workspace_id: uuid.UUID, sequence: int) -> None:
        await self._local.publish(workspace_id, sequence)
        if sequence > self._pending.get(workspace_id, 0):
            self._pending[workspace_id] = sequence
            self._has_pending.set()

    async def start(self) -> None:
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen(), name="im-redis-signal")
            self._publisher = asyncio.create_task(self._publish_pending(), name="im-redis-publish")
            await self._subscribed.wait()

    async def _publish_pending(self) -> None:
        failures = 0
        while True:
            await self._has_pending.wait()
            self._has_pending.clear()
            batch, self._pending = self._pending, {}
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    for workspace_id, sequence in batch.items():
                        pipe.publish(f"{self._prefix}{workspace_id}", str(sequence))
                    await pipe.execute()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as error:
                # Keep the newest sequence per workspace and try again later.
                failures += 1
                for workspace_id, sequence in batch.items():
                    if sequence > self._pending.get(workspace_id, 0):
                        self._pending[workspace_id] = sequence
                delay = min(self._reconnect_max, 0.05 * 2**failures)
                logger.warning(
                    "could not publish %d event signals to Redis (%s); again in %.2fs",
                    len(batch),
                    error,
                    delay,
                )
                await asyncio.sleep(delay)
                self._has_pending.set()

    async def _listen(self) -> None:
        failures = 0
        while True:
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.psubscribe(f"{self._prefix}*")
                self._subscribed.set()
                if failures:
                    logger.info("event signals from Redis restored")
                    # Anything published while we were away is in the database.
                    await self._local.publish_all()
                failures = 0
                async for message in pubsub.listen():
                    self._receive(message)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                failures += 1
                self._subscribed.set()  # do not hold up start-up: the database still works
                delay = min(self._reconnect_max, 0.05 * 2**failures)
                logger.warning("Redis event signals lost (%s); retrying in %.2fs", error, delay)
                await asyncio.sleep(delay)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    def _receive(self, message: dict[str, object]) -> None:
        channel = message.get("channel")
        data = message.get("data")
        if not isinstance(channel, bytes) or not isinstance(data, bytes):
            return
        try:
            workspace_id = uuid.UUID(channel.decode()[len(self._prefix) :])
            sequence = int(data)
        except ValueError:
            logger.warning("ignoring a malformed event signal on %r", channel)
            return
        self._local.deliver(workspace_id, sequence)

    async def ping(self) -> bool:
        return bool(await self._client.ping())

    async def aclose(self) -> None:
        for task in (self._listener, self._publisher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._listener = self._publisher = None
        await self._client.aclose()
