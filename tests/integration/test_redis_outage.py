"""A Redis outage degrades event delivery instead of stopping it.

Redis here is a private redis-server (`private_redis`), killed and started
again on its port; the shared one is never touched.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agentim.im.v1 import im_pb2
from services.common.redis_signals import RedisSignal
from services.im.bootstrap import SIGNALS_HEALTH_NAME
from tests.conftest import ImFactory, RunningIM, make_world, next_event
from tests.faults.harness import RedisProcess

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SIGNALS_LOGGER = "services.common.redis_signals"


async def health_of(im: RunningIM, service: str = "") -> int:
    response = await health_pb2_grpc.HealthStub(im.channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=5
    )
    return int(response.status)


async def until(condition: Callable[[], bool], within: float = 10.0) -> None:
    """Waits for a state that no event announces (the test's own observation)."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.02)


class Looks:
    """A receiver counting "look at every workspace" signals."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = asyncio.Event()

    def __call__(self, workspace_id: uuid.UUID | None, sequence: int) -> None:
        if workspace_id is None:
            self.count += 1
            self.changed.set()

    async def at_least(self, count: int, within: float = 5.0) -> None:
        async def wait() -> None:
            while self.count < count:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(wait(), within)


async def test_without_redis_every_workspace_is_read_at_the_fallback_interval() -> None:
    signal = RedisSignal("redis://127.0.0.1:1/0", fallback_interval_seconds=0.05)
    looks = Looks()
    signal.connect(looks)
    try:
        await asyncio.wait_for(signal.start(), 10)
        assert signal.degraded
        # One look at once (signals may have been lost), then one per interval.
        await looks.at_least(4)
    finally:
        await signal.aclose()


async def test_an_outage_is_logged_once_when_it_begins_and_once_when_it_ends(
    private_redis: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    signal = RedisSignal(private_redis.url, reconnect_max_seconds=0.1, fallback_interval_seconds=0.05)
    looks = Looks()
    signal.connect(looks)
    caplog.set_level(logging.INFO, logger=SIGNALS_LOGGER)
    try:
        await asyncio.wait_for(signal.start(), 10)
        assert not signal.degraded
        private_redis.kill()
        await until(lambda: signal.degraded)
        seen = looks.count
        await looks.at_least(seen + 10)  # ten fallback reads: several reconnection tries failed meanwhile
        private_redis.start()
        await until(lambda: not signal.degraded)
    finally:
        await signal.aclose()
    records = [r for r in caplog.records if r.name == SIGNALS_LOGGER]
    assert [r.levelno for r in records] == [logging.WARNING, logging.INFO], [r.getMessage() for r in records]
    assert "lost" in records[0].getMessage() and "restored" in records[1].getMessage()


async def test_during_an_outage_events_of_other_replicas_still_arrive(
    database_url: str, im_factory: ImFactory, private_redis: RedisProcess
) -> None:
    settings = {"REDIS_URL": private_redis.url, "IM_REDIS_FALLBACK_POLL_SECONDS": "0.05"}
    sender: RunningIM = await im_factory(**settings)
    watched: RunningIM = await im_factory(**settings)
    world = await make_world(sender.stub, people=2)
    group = (
        await sender.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="g", member_ids=[world.members[1].id]), metadata=world.md(0)
        )
    ).group
    stream = watched.stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=world.md(1))
    await asyncio.wait_for(stream.wait_for_connection(), 5)
    assert await health_of(watched, SIGNALS_HEALTH_NAME) == SERVING

    private_redis.kill()
    await until(lambda: watched.app.signal.degraded and sender.app.signal.degraded)
    sent = await sender.stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=group.id, content="during the outage"), metadata=world.md(0)
    )
    event = await next_event(stream, within=5)  # Redis is still down
    assert event.message_created.message.id == sent.message.id
    assert await health_of(watched) == SERVING, "the replica still serves"
    assert await health_of(watched, "agentim.im.v1.IMService") == SERVING
    assert await health_of(watched, SIGNALS_HEALTH_NAME) == NOT_SERVING, "and says what is degraded"

    private_redis.start()
    await until(lambda: not watched.app.signal.degraded)
    assert await health_of(watched, SIGNALS_HEALTH_NAME) == SERVING
    after = await sender.stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=group.id, content="after the outage"), metadata=world.md(0)
    )
    assert (await next_event(stream, within=5)).message_created.message.id == after.message.id
    stream.cancel()


async def test_in_process_signals_are_never_degraded(im: RunningIM) -> None:
    assert await health_of(im, SIGNALS_HEALTH_NAME) == SERVING


async def test_shutting_down_reports_every_part_not_serving(
    database_url: str, im_factory: ImFactory, private_redis: RedisProcess
) -> None:
    running: RunningIM = await im_factory(REDIS_URL=private_redis.url)
    assert await health_of(running, SIGNALS_HEALTH_NAME) == SERVING
    await running.app.server.health.enter_graceful_shutdown()
    assert await health_of(running, SIGNALS_HEALTH_NAME) == NOT_SERVING
