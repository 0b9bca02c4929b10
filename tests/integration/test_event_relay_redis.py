"""The runtime's Redis event relay against a real Redis server."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import redis.asyncio as redis
from sqlalchemy.engine import make_url

from services.common.redis_signals import channels_of_database
from services.runtime.adapters.event_relay import RedisEventRelay
from services.runtime.domain.model import Emitted, OwnerChanged
from services.runtime.service_layer.relay import Relayed

SHARD = 3


def other_database(url: str) -> str:
    """The same Redis server, another database."""
    parsed = make_url(url)
    return parsed.set(database=str((int(parsed.database or 0) + 8) % 16)).render_as_string()


def relayed(origin: str, epoch: int) -> Relayed:
    return Relayed(origin, SHARD, epoch, Emitted(uuid.uuid4(), datetime.now(UTC), OwnerChanged()))


async def sent(relay: RedisEventRelay, count: int) -> None:
    async with asyncio.timeout(10):
        while relay.sent < count:  # noqa: ASYNC110 - the relay sends in the background
            await asyncio.sleep(0.01)


async def test_deployments_on_other_databases_of_one_server_never_hear_each_other(redis_url: str) -> None:
    """Pub/sub channels belong to the whole server: a runtime on database 2
    used to hear the events of one on database 1, and drop its own as stale
    when the other deployment's lease epochs ran higher."""
    heard: list[Relayed] = []
    receiver = RedisEventRelay(redis_url, replica="receiver")
    neighbour = RedisEventRelay(redis_url, replica="neighbour")
    stranger = RedisEventRelay(other_database(redis_url), replica="stranger")
    receiver.serve(heard.append)
    relays = (receiver, neighbour, stranger)
    try:
        for relay in relays:
            await relay.start()
        await receiver.follow(SHARD)
        # The other deployment's event is published first: were it heard, it would come first.
        stranger.send(relayed("stranger", epoch=99))
        await sent(stranger, 1)
        neighbour.send(relayed("neighbour", epoch=1))
        await sent(neighbour, 1)
        async with asyncio.timeout(10):
            while not heard:  # noqa: ASYNC110 - delivered by the relay's listener
                await asyncio.sleep(0.01)
        assert [r.origin for r in heard] == ["neighbour"]
    finally:
        for relay in relays:
            await relay.aclose()


def test_channels_are_named_with_the_database_number() -> None:
    first = redis.Redis.from_url("redis://127.0.0.1:6379/1")
    second = redis.Redis.from_url("redis://127.0.0.1:6379/2")
    default = redis.Redis.from_url("redis://127.0.0.1:6379")
    names = [channels_of_database(c, "events:") for c in (first, second, default)]
    assert names == ["events:db1:", "events:db2:", "events:db0:"]
