"""Messages between runtime replicas over Redis pub/sub (see `service_layer.replicas`).

Each replica listens on a channel of its own. A message is JSON; one that
asks carries an id and the asker's replica, and its answer comes back on the
asker's channel. Pub/sub keeps nothing: a message sent while the receiver is
not subscribed is lost, which is why everything a message says is in the
database first, and why the receiver is told (`missed`) to read the database
again whenever its subscription was down, every `reconcile_seconds` during
the outage and once as it ends. A message that cannot be sent is kept (the
newest per replica, operation and agent) and sent when Redis is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as redis

from services.common import errors
from services.common.redis_signals import channels_of_database, fail_fast_client
from services.runtime.service_layer.replicas import Inbox, Message, ReplicaLink

logger = logging.getLogger(__name__)

_LINK_ERRORS = (redis.RedisError, OSError)


class RedisReplicaLink(ReplicaLink):
    """`ReplicaLink` over Redis pub/sub.

    Args:
        url: Redis URL.
        replica: this replica's id (its channel is `channel_prefix`, the database's number and the id).
        reconcile_seconds: how often `missed` is called while the link is down.
        reconnect_max_seconds: the longest wait between reconnection tries.
    """

    def __init__(
        self,
        url: str,
        *,
        replica: str,
        channel_prefix: str = "agentim:runtime:replica:",
        reconcile_seconds: float = 5.0,
        reconnect_max_seconds: float = 2.0,
    ) -> None:
        self._client = fail_fast_client(url)
        self._replica = replica
        # Replicas of two deployments on one Redis server may share ids (runtime-0).
        self._prefix = channels_of_database(self._client, channel_prefix)
        self._reconcile = reconcile_seconds
        self._reconnect_max = reconnect_max_seconds
        self._inbox: Inbox | None = None
        self._missed: Callable[[], None] = lambda: None
        self._answers: dict[str, asyncio.Future[Message]] = {}
        self._unsent: dict[tuple[str, str, str], Message] = {}
        self._listener: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._serving: set[asyncio.Task[None]] = set()

    def serve(self, inbox: Inbox, *, missed: Callable[[], None]) -> None:
        self._inbox, self._missed = inbox, missed

    async def start(self) -> None:
        self._listener = asyncio.create_task(self._listen(), name=f"replica-link-{self._replica}")
        # Subscribed before the replica takes shards, if Redis is there at all.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._subscribed.wait(), 2.0)

    @property
    def degraded(self) -> bool:
        """Whether messages to this replica may be lost now."""
        return not self._subscribed.is_set()

    async def tell(self, replica: str, message: Message) -> None:
        try:
            await self._publish(replica, message)
        except _LINK_ERRORS as error:
            self._unsent[(replica, str(message.get("op")), str(message.get("agent")))] = message
            logger.warning(
                "replica %s: kept a message for %s until Redis is back: %s", self._replica, replica, error
            )

    async def ask(self, replica: str, message: Message) -> Message:
        asking = uuid.uuid4().hex
        answer: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._answers[asking] = answer
        try:
            try:
                heard = await self._publish(replica, {**message, "id": asking, "reply_to": self._replica})
            except _LINK_ERRORS as error:
                raise errors.Unavailable(f"replica {replica} cannot be reached: {error}") from error
            if not heard:
                raise errors.Unavailable(f"replica {replica} is not listening")
            return await answer
        finally:
            self._answers.pop(asking, None)

    async def _publish(self, replica: str, message: Message) -> int:
        return int(await self._client.publish(self._prefix + replica, json.dumps(message)))

    async def _listen(self) -> None:
        wait, reconciled = 0.05, 0.0
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with self._client.pubsub() as pubsub:
                    await pubsub.subscribe(self._prefix + self._replica)
                    if self._subscribed.is_set() is False and reconciled:
                        logger.info("replica %s: Redis is back", self._replica)
                        self._missed()  # what was sent meanwhile is lost: read the database
                    self._subscribed.set()
                    wait = 0.05
                    await self._flush()
                    async for item in pubsub.listen():
                        if item.get("type") == "message":
                            self._received(item["data"])
            except asyncio.CancelledError:
                raise
            except _LINK_ERRORS as error:
                if self._subscribed.is_set() or not reconciled:
                    logger.warning(
                        "replica %s: Redis is unreachable (%s); reading the database instead",
                        self._replica,
                        error,
                    )
                self._subscribed.clear()
                if loop.time() - reconciled >= self._reconcile:
                    reconciled = loop.time()
                    self._missed()
                await asyncio.sleep(wait)
                wait = min(wait * 2, self._reconnect_max)

    async def _flush(self) -> None:
        unsent, self._unsent = self._unsent, {}
        for (replica, _, _), message in unsent.items():
            await self.tell(replica, message)

    def _received(self, data: Any) -> None:
        try:
            message = json.loads(data)
        except (TypeError, ValueError):
            logger.warning("replica %s: a message that is not JSON was dropped", self._replica)
            return
        if not isinstance(message, dict):
            return
        answered = message.get("answer_to")
        if answered is not None:
            waiting = self._answers.get(str(answered))
            if waiting is not None and not waiting.done():
                waiting.set_result(message)
            return
        task = asyncio.create_task(self._serve(message), name="replica-link-serve")
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    async def _serve(self, message: dict[str, Any]) -> None:
        if self._inbox is None:
            return
        try:
            answer = await self._inbox(message)
        except Exception:
            logger.exception("replica %s: a message from another replica failed", self._replica)
            answer = {"refused": "Unavailable", "message": "the replica failed to handle the request"}
        asking, reply_to = message.get("id"), message.get("reply_to")
        if asking is None or reply_to is None:
            return
        try:
            await self._publish(str(reply_to), {**(answer or {}), "answer_to": asking})
        except _LINK_ERRORS as error:
            logger.warning("replica %s: an answer to %s was lost: %s", self._replica, reply_to, error)

    async def aclose(self) -> None:
        tasks = [t for t in (self._listener, *self._serving) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._listener = None
        await self._client.aclose()
