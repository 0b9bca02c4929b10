"""`EventRelay` over Redis pub/sub: a channel per shard (see `service_layer.relay`).

A message is JSON: the sending replica, the shard, the lease epoch and the
event (`event_codec`). One task sends, in order, what queued up since its
last round as one pipeline; one task listens on one connection, subscribed
to the shards this replica's watchers follow (and to a channel of its own,
so that the connection stays subscribed when they follow nothing). Pub/sub
keeps nothing: what is sent while Redis is away is dropped, and watchers
read the steps they missed from the store.

Pub/sub channels belong to the whole Redis server, whatever database a
client selected: the channels are named with the URL's database number, so
that runtimes of two deployments on one server (databases 1 and 2) never
hear each other's events. (They did: a replica that heard another
deployment's newer lease epoch for a shard dropped its own deployment's
events of that shard as stale, and its watchers saw nothing more.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter, deque
from typing import Any

import redis.asyncio as redis

from services.common.redis_signals import channels_of_database, fail_fast_client
from services.runtime.adapters import event_codec
from services.runtime.service_layer.relay import Deliver, EventRelay, Relayed

logger = logging.getLogger(__name__)

_LINK_ERRORS = (redis.RedisError, OSError)


class RedisEventRelay(EventRelay):
    """Args:
    url: Redis URL.
    replica: this replica's id.
    max_queued: events waiting to be sent beyond which the oldest are dropped.
    """

    def __init__(
        self,
        url: str,
        *,
        replica: str,
        channel_prefix: str = "agentim:runtime:events:",
        max_queued: int = 10_000,
        follow_timeout_seconds: float = 2.0,
    ) -> None:
        self._client = fail_fast_client(url)
        self._replica = replica
        self._prefix = channels_of_database(self._client, channel_prefix)
        self._own = f"{self._prefix}replica:{replica}"
        self._deliver: Deliver = lambda _: None
        self._queue: deque[Relayed] = deque()
        self._max_queued = max_queued
        self._queued = asyncio.Event()
        self._emptied = asyncio.Event()
        self._emptied.set()
        self._follow_timeout = follow_timeout_seconds
        self._counts: Counter[str] = Counter()
        self._confirmed: dict[str, asyncio.Future[None]] = {}
        self._pubsub: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self.sent = 0
        self.dropped = 0

    def serve(self, deliver: Deliver) -> None:
        self._deliver = deliver

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._listen(), name=f"event-relay-listen-{self._replica}"),
            asyncio.create_task(self._send(), name=f"event-relay-send-{self._replica}"),
        ]

    # -- sending -------------------------------------------------------------------------

    def send(self, relayed: Relayed) -> None:
        if len(self._queue) >= self._max_queued:
            self._queue.popleft()
            self.dropped += 1
        self._queue.append(relayed)
        self._queued.set()
        self._emptied.clear()

    async def _send(self) -> None:
        wait = 0.05
        while True:
            await self._queued.wait()
            self._queued.clear()
            batch = list(self._queue)
            self._queue.clear()
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    for relayed in batch:
                        pipe.publish(self._prefix + str(relayed.shard), _encoded(relayed))
                    await pipe.execute()
                self.sent += len(batch)
                wait = 0.05
                if not self._queue:
                    self._emptied.set()
            except _LINK_ERRORS as error:
                self.dropped += len(batch)
                logger.warning("replica %s: %d live events not relayed: %s", self._replica, len(batch), error)
                await asyncio.sleep(wait)
                wait = min(wait * 2, 2.0)

    # -- receiving -----------------------------------------------------------------------

    async def follow(self, shard: int) -> None:
        channel = self._prefix + str(shard)
        self._counts[channel] += 1
        confirmed = self._confirmed.get(channel)
        if confirmed is None:
            confirmed = self._confirmed[channel] = asyncio.get_running_loop().create_future()
            pubsub = self._pubsub
            if pubsub is None:
                return  # Redis is away: the listener subscribes it once back
            try:
                await pubsub.subscribe(channel)
            except _LINK_ERRORS as error:
                logger.warning("replica %s: cannot follow shard %d now: %s", self._replica, shard, error)
                return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(confirmed), self._follow_timeout)

    def unfollow(self, shard: int) -> None:
        channel = self._prefix + str(shard)
        self._counts[channel] -= 1
        if self._counts[channel] > 0:
            return
        del self._counts[channel]
        confirmed = self._confirmed.pop(channel, None)
        if confirmed is not None and not confirmed.done():
            confirmed.cancel()
        pubsub = self._pubsub
        if pubsub is not None:
            self._spawn(self._unsubscribe(pubsub, channel))

    async def _unsubscribe(self, pubsub: Any, channel: str) -> None:
        if channel in self._counts:
            return  # followed again meanwhile
        with contextlib.suppress(*_LINK_ERRORS):
            await pubsub.unsubscribe(channel)

    async def _listen(self) -> None:
        wait = 0.05
        while True:
            try:
                async with self._client.pubsub() as pubsub:
                    # Set first: a shard followed while this subscribes is
                    # subscribed by `follow` itself.
                    self._pubsub = pubsub
                    await pubsub.subscribe(self._own, *list(self._counts))
                    wait = 0.05
                    async for item in pubsub.listen():
                        self._heard(item)
            except asyncio.CancelledError:
                raise
            except _LINK_ERRORS as error:
                if self._pubsub is not None:
                    logger.warning("replica %s: event relay lost Redis: %s", self._replica, error)
                self._pubsub = None
                # Not confirmed until subscribed again.
                for channel in list(self._confirmed):
                    if self._confirmed[channel].done():
                        self._confirmed[channel] = asyncio.get_running_loop().create_future()
                await asyncio.sleep(wait)
                wait = min(wait * 2, 2.0)

    def _heard(self, item: dict[str, Any]) -> None:
        kind = item.get("type")
        channel = item.get("channel")
        if isinstance(channel, bytes):
            channel = channel.decode()
        if kind == "subscribe":
            confirmed = self._confirmed.get(str(channel))
            if confirmed is not None and not confirmed.done():
                confirmed.set_result(None)
            return
        if kind != "message":
            return
        try:
            relayed = _decoded(item["data"])
        except (event_codec.UnreadableEvent, KeyError, TypeError, ValueError) as error:
            logger.warning("replica %s: an unreadable relayed event was dropped: %s", self._replica, error)
            return
        self._deliver(relayed)

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work, name="event-relay-unfollow")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        if self._tasks:
            # What runners said as they stopped (steps aborted) goes out first, if it can.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._emptied.wait(), 1.0)
        tasks = [*self._tasks, *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        for confirmed in self._confirmed.values():
            if not confirmed.done():
                confirmed.cancel()
        await self._client.aclose()


def _encoded(relayed: Relayed) -> str:
    return json.dumps(
        {
            "origin": relayed.origin,
            "shard": relayed.shard,
            "epoch": relayed.epoch,
            "event": event_codec.encode(relayed.emitted),
        },
        separators=(",", ":"),
    )


def _decoded(data: str | bytes) -> Relayed:
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("not an object")
    return Relayed(
        origin=str(message["origin"]),
        shard=int(message["shard"]),
        epoch=int(message["epoch"]),
        emitted=event_codec.decode(message["event"]),
    )
