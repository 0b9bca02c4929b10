"""Signals across replicas over Redis pub/sub (see `services.common.signals`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.common.signals import InProcessSignal, Receiver, Signal

logger = logging.getLogger(__name__)


def fail_fast_client(url: str) -> redis.Redis:
    """A Redis client that notices a lost connection at once: no retries
    inside redis-py (by default up to ten, over seconds); its users pace
    their own reconnection and fall back to the database meanwhile."""
    return redis.Redis.from_url(
        url,
        socket_timeout=5,
        socket_connect_timeout=2,
        socket_keepalive=True,
        retry=Retry(NoBackoff(), 0),
    )


def channels_of_database(client: redis.Redis, prefix: str) -> str:
    """`prefix` named with the client's database number. Pub/sub channels
    belong to the whole server, whatever database a client selected: two
    deployments on one server (databases 1 and 2) would otherwise hear each
    other's messages."""
    return f"{prefix}db{client.connection_pool.connection_kwargs.get('db', 0)}:"


class RedisSignal(Signal):
    """Publishes signals on Redis and listens for every replica's.

    The local receivers are also called directly, so delivery in this
    process does not wait for a Redis round trip. Publishing happens in one
    background task that sends only the newest sequence per workspace, so a
    burst of messages costs few Redis calls and a slow or absent Redis never
    slows down the calls that commit what they signal.

    While the subscription is lost (Redis down or unreachable) delivery
    degrades instead of stopping: every receiver is told to look at every
    key each `fallback_interval_seconds`, which reads the database (the
    truth) for what other replicas committed. Reconnection tries back off from
    50 ms to `reconnect_max_seconds`. The outage is logged once as a warning
    and its end once at INFO; `degraded` says whether one is going on.

    Args:
        url: Redis URL.
        channel_prefix: prefix of the per-key channels.
        reconnect_max_seconds: cap of the backoff between reconnection tries.
        fallback_interval_seconds: while Redis is unreachable, how often
            every key is read from the database.
        name: names the background tasks and the log lines.
    """

    def __init__(
        self,
        url: str,
        *,
        channel_prefix: str = "agentim:im:events:",
        reconnect_max_seconds: float = 1.0,
        fallback_interval_seconds: float = 0.25,
        name: str = "im",
    ) -> None:
        self._client = fail_fast_client(url)
        self._prefix = channel_prefix
        self._name = name
        self._reconnect_max = reconnect_max_seconds
        self._fallback_interval = fallback_interval_seconds
        self._local = InProcessSignal()
        self._listener: asyncio.Task[None] | None = None
        self._tried = asyncio.Event()
        self._pending: dict[uuid.UUID, int] = {}
        self._has_pending = asyncio.Event()
        self._publisher: asyncio.Task[None] | None = None
        self._subscribed = False
        # When the current outage began (event loop time); None while subscribed.
        self._lost_at: float | None = None
        self._poller: asyncio.Task[None] | None = None
        # When the fallback reads stop; None: not until Redis is back.
        self._poll_until: float | None = None

    @property
    def degraded(self) -> bool:
        """Whether other replicas' signals cannot reach this one (delivery falls back to reading)."""
        return not self._subscribed

    def connect(self, on_signal: Receiver) -> None:
        self._local.connect(on_signal)

    async def publish(self, key: uuid.UUID, sequence: int) -> None:
        await self._local.publish(key, sequence)
        if sequence > self._pending.get(key, 0):
            self._pending[key] = sequence
            self._has_pending.set()

    async def start(self) -> None:
        """Subscribes (or, with Redis unreachable, starts the fallback reads); returns after the first try."""
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen(), name=f"{self._name}-redis-signal")
            self._publisher = asyncio.create_task(self._publish_pending(), name=f"{self._name}-redis-publish")
            await self._tried.wait()

    async def _publish_pending(self) -> None:
        failures = 0
        while True:
            await self._has_pending.wait()
            self._has_pending.clear()
            batch, self._pending = self._pending, {}
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    for key, sequence in batch.items():
                        pipe.publish(f"{self._prefix}{key}", str(sequence))
                    await pipe.execute()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as error:
                # Keep the newest sequence per key and try again later.
                # The listener reports the outage (once); this would repeat it.
                failures += 1
                for key, sequence in batch.items():
                    if sequence > self._pending.get(key, 0):
                        self._pending[key] = sequence
                delay = self._backoff(failures)
                logger.debug("publishing %d signals failed (%s); again in %.2fs", len(batch), error, delay)
                await asyncio.sleep(delay)
                self._has_pending.set()

    def _backoff(self, failures: int) -> float:
        return min(self._reconnect_max, 0.05 * 2 ** min(failures, 16))

    async def _listen(self) -> None:
        failures = 0
        while True:
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.psubscribe(f"{self._prefix}*")
                self._restored()
                failures = 0
                async for message in pubsub.listen():
                    self._receive(message)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                failures += 1
                self._lost(error)
                await asyncio.sleep(self._backoff(failures))
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    def _lost(self, error: Exception) -> None:
        self._subscribed = False
        self._tried.set()  # do not hold up start-up: the database still works
        self._poll_until = None
        if self._lost_at is None:
            self._lost_at = asyncio.get_running_loop().time()
            logger.warning(
                "Redis %s signals lost (%s); reading the database every %.0f ms until Redis is back",
                self._name,
                error or type(error).__name__,
                self._fallback_interval * 1000,
            )
            # Signals on their way when the connection broke are lost.
            self._local.deliver(None, 0)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(
                self._read_while_degraded(), name=f"{self._name}-redis-fallback"
            )

    def _restored(self) -> None:
        self._subscribed = True
        self._tried.set()
        if self._lost_at is None:
            return
        now = asyncio.get_running_loop().time()
        logger.info("Redis %s signals restored after %.1f s", self._name, now - self._lost_at)
        self._lost_at = None
        # Anything published while we were away is in the database.
        self._local.deliver(None, 0)
        # Another replica's publisher may still be in its backoff (at most
        # reconnect_max) with signals this one would then miss: read on until
        # it must have published again.
        self._poll_until = now + self._reconnect_max

    async def _read_while_degraded(self) -> None:
        loop = asyncio.get_running_loop()
        while self._poll_until is None or loop.time() < self._poll_until:
            await asyncio.sleep(self._fallback_interval)
            self._local.deliver(None, 0)

    def _receive(self, message: dict[str, object]) -> None:
        channel = message.get("channel")
        data = message.get("data")
        if not isinstance(channel, bytes) or not isinstance(data, bytes):
            return
        try:
            key = uuid.UUID(channel.decode()[len(self._prefix) :])
            sequence = int(data)
        except ValueError:
            logger.warning("ignoring a malformed %s signal on %r", self._name, channel)
            return
        self._local.deliver(key, sequence)

    async def aclose(self) -> None:
        for task in (self._listener, self._publisher, self._poller):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._listener = self._publisher = self._poller = None
        await self._client.aclose()
