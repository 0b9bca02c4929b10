"""Fault case 7: Redis killed and restarted under two IM replicas.

Two IM processes on PostgreSQL share a private redis-server. A client sends
numbered messages through replica A and watches (WatchEvents) through
replica B; meanwhile Redis is killed and started again on its port, several
times. At the watcher every acknowledged message arrives exactly once, and
during an outage each reaches B within the fallback interval (B reads the
database at that interval while Redis is away) plus slack. B stays SERVING
throughout, reporting `agentim.im.v1.IMService/signals` NOT_SERVING while
Redis is away.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from agentim.im.v1 import im_pb2, im_pb2_grpc
from tests.faults.harness import RedisProcess, ServiceProcess, clean_environment, migrate, scaled
from tests.identities import as_member, learning_channel

FALLBACK_S = 0.25
# Beyond the fallback interval: a database read, a loaded 2-core machine.
SLACK_S = 0.5
SIGNALS = "agentim.im.v1.IMService/signals"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Delivery:
    """When each message was acknowledged to the sender and seen by the watcher."""

    acknowledged: dict[str, float] = field(default_factory=dict)
    received: dict[str, float] = field(default_factory=dict)
    sequences: Counter[int] = field(default_factory=Counter)
    contents: Counter[str] = field(default_factory=Counter)
    all_in: asyncio.Event = field(default_factory=asyncio.Event)
    expected: int = -1

    def receive(self, event: im_pb2.WatchEventsResponse) -> None:
        self.sequences[event.sequence] += 1
        if event.WhichOneof("event") != "message_created":
            return
        content = event.message_created.message.content
        self.contents[content] += 1
        self.received.setdefault(content, time.monotonic())
        if len(self.received) == self.expected:
            self.all_in.set()


async def watch(
    stub: im_pb2_grpc.IMServiceStub, member_id: str, delivery: Delivery, subscribed: asyncio.Event
) -> None:
    stream = stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=as_member(member_id))
    try:
        await stream.wait_for_connection()  # the headers come once the subscription is in place
        subscribed.set()
        async for event in stream:
            delivery.receive(event)
    except asyncio.CancelledError:
        stream.cancel()
        raise


async def send(
    stub: im_pb2_grpc.IMServiceStub, group_id: str, member_id: str, delivery: Delivery, stop: asyncio.Event
) -> None:
    index = 0
    while not stop.is_set():
        content = f"m{index}"
        request = im_pb2.SendMessageRequest(group_id=group_id, content=content, request_id=content)
        await stub.SendMessage(request, metadata=as_member(member_id), timeout=10)
        delivery.acknowledged[content] = time.monotonic()
        index += 1
        await asyncio.sleep(0.02)


async def signals_status(stub: health_pb2_grpc.HealthStub, service: str = SIGNALS) -> int:
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(response.status)


async def until_status(stub: health_pb2_grpc.HealthStub, wanted: int, within: float = 10.0) -> float:
    """Waits until B reports its signals `wanted`; returns when (health has no push for this)."""
    deadline = time.monotonic() + within
    while (status := await signals_status(stub)) != wanted:
        assert time.monotonic() < deadline, f"signals stayed {status} for {within}s"
        await asyncio.sleep(0.02)
    return time.monotonic()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def people_and_group(stub: im_pb2_grpc.IMServiceStub) -> tuple[str, str, str]:
    """(sender, watcher, their group)."""
    created = await stub.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(name="redis-outage", creator_display_name="ada"), timeout=10
    )
    ada = created.creator.id
    bob = (
        await stub.CreateMember(
            im_pb2.CreateMemberRequest(kind=im_pb2.MEMBER_KIND_HUMAN, display_name="bob"),
            metadata=as_member(ada),
            timeout=10,
        )
    ).member.id
    group = await stub.CreateGroup(
        im_pb2.CreateGroupRequest(name="g", member_ids=[bob]), metadata=as_member(ada), timeout=10
    )
    return ada, bob, group.group.id


@dataclass
class Outages:
    windows: list[tuple[float, float]] = field(default_factory=list)  # (Redis killed, B subscribed again)
    lengths: list[float] = field(default_factory=list)  # Redis down
    reconnects: list[float] = field(default_factory=list)  # Redis up again -> B subscribed
    degraded_but_serving: int = 0


async def kill_and_restart(
    redis_server: RedisProcess, health_b: health_pb2_grpc.HealthStub, count: int, rng: random.Random
) -> Outages:
    outages = Outages()
    for _ in range(count):
        await asyncio.sleep(rng.uniform(0.5, 1.0))
        redis_server.kill()
        killed = time.monotonic()
        await until_status(health_b, NOT_SERVING)
        if await signals_status(health_b, "") == SERVING:
            outages.degraded_but_serving += 1
        await asyncio.sleep(max(0.0, rng.uniform(1.0, 2.0) - (time.monotonic() - killed)))
        redis_server.start()
        restarted = time.monotonic()
        back = await until_status(health_b, SERVING)
        outages.windows.append((killed, back))
        outages.lengths.append(restarted - killed)
        outages.reconnects.append(back - restarted)
    return outages


def latencies(delivery: Delivery, windows: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Acknowledgement to arrival at the watcher: (sent during an outage, sent outside)."""
    inside: list[float] = []
    outside: list[float] = []
    for content, acknowledged_at in delivery.acknowledged.items():
        if content in delivery.received:
            latency = max(0.0, delivery.received[content] - acknowledged_at)
            during = any(start <= acknowledged_at <= end for start, end in windows)
            (inside if during else outside).append(latency)
    return inside, outside


async def test_delivery_degrades_but_never_stops_or_loses_events_while_redis_is_away(
    postgres_url: str, tmp_path: Path
) -> None:
    count = scaled(3, long=10)
    redis_server = RedisProcess(tmp_path)
    env = clean_environment(
        DATABASE_URL=postgres_url,
        REDIS_URL=redis_server.url,
        IM_GRPC_ADDRESS="127.0.0.1:0",
        IM_REDIS_FALLBACK_POLL_SECONDS=str(FALLBACK_S),
    )
    migrate("services.im", env)
    with (
        redis_server,
        ServiceProcess("services.im", dict(env), tmp_path / "a.log") as a,
        ServiceProcess("services.im", dict(env), tmp_path / "b.log") as b,
    ):
        redis_server.start()
        a.start()
        b.start()
        async with learning_channel(a.address) as to_a, learning_channel(b.address) as to_b:
            stub_a, stub_b = im_pb2_grpc.IMServiceStub(to_a), im_pb2_grpc.IMServiceStub(to_b)
            ada, bob, group_id = await people_and_group(stub_a)
            delivery = Delivery()
            subscribed = asyncio.Event()
            watching = asyncio.create_task(watch(stub_b, bob, delivery, subscribed))
            await asyncio.wait_for(subscribed.wait(), 10)
            stop = asyncio.Event()
            sending = asyncio.create_task(send(stub_a, group_id, ada, delivery, stop))
            try:
                outages = await kill_and_restart(
                    redis_server, health_pb2_grpc.HealthStub(to_b), count, random.Random(uuid.uuid4().int)
                )
                await asyncio.sleep(1.0)
            finally:
                stop.set()
                await sending
            delivery.expected = len(delivery.acknowledged)
            if len(delivery.received) < delivery.expected:
                await asyncio.wait_for(delivery.all_in.wait(), 10)
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)

    lost = [content for content in delivery.acknowledged if content not in delivery.received]
    duplicated = [content for content, n in delivery.contents.items() if n > 1]
    repeated_sequences = [sequence for sequence, n in delivery.sequences.items() if n > 1]
    inside, outside = latencies(delivery, outages.windows)
    assert lost == [], f"{len(lost)} acknowledged messages never reached the watcher"
    assert duplicated == [] and repeated_sequences == [], "an event reached the watcher twice"
    assert len(inside) >= count, f"too little traffic during the outages: {len(inside)}"
    assert outages.degraded_but_serving == count, "B must stay SERVING while its signals are NOT_SERVING"
    assert max(inside) <= FALLBACK_S + SLACK_S, f"delivery during an outage took {max(inside):.3f}s"
    assert max(outside) <= FALLBACK_S + SLACK_S, f"delivery outside the outages took {max(outside):.3f}s"
    print(
        f"redis outage: {count} outages ({min(outages.lengths):.1f}-{max(outages.lengths):.1f} s),"
        f" {len(delivery.acknowledged)} messages, {len(lost)} lost, {len(duplicated)} duplicated;"
        f" delivery during outages p50 {statistics.median(inside) * 1000:.0f} ms"
        f" max {max(inside) * 1000:.0f} ms ({len(inside)} messages),"
        f" outside p50 {statistics.median(outside) * 1000:.1f} ms max {max(outside) * 1000:.0f} ms;"
        f" B subscribed again {percentile(outages.reconnects, 0.5):.2f}-{max(outages.reconnects):.2f} s"
        f" after Redis restarted; B SERVING with signals NOT_SERVING in"
        f" {outages.degraded_but_serving}/{count} outages"
    )
