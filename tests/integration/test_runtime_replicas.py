"""Several runtime replicas on one PostgreSQL database (with Redis): each
agent runs in exactly one of them, shards move as replicas join and leave,
and what an agent was asked is answered once, by whichever replica runs it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from agentim.runtime.v1 import runtime_pb2_grpc
from services.runtime import bootstrap
from services.runtime.config import Settings
from tests.auth_support import service_environment
from tests.conftest import RunningIM, World, make_world
from tests.identities import learning_channel
from tests.integration.test_runtime_grpc import RunningRuntime, direct_chat, stop_runtime, wait_for_messages

WAIT = 15.0
SHARDS = 16


@pytest.fixture
async def replicas(
    im: RunningIM, own_runtime_url: str, redis_url: str
) -> AsyncIterator[Callable[[str], Awaitable[RunningRuntime]]]:
    if own_runtime_url.startswith("sqlite"):
        pytest.skip("replicas share a PostgreSQL database; SQLite is one process's")
    started: list[RunningRuntime] = []

    async def start(name: str) -> RunningRuntime:
        environ = {
            "RUNTIME_DATABASE_URL": own_runtime_url,
            "REDIS_URL": redis_url,
            "RUNTIME_GRPC_ADDRESS": "127.0.0.1:0",
            "IM_ADDRESS": im.address,
            "LOG_LEVEL": "WARNING",
            "RUNTIME_REPLICA_ID": name,
            "RUNTIME_SHARDS": str(SHARDS),
            "RUNTIME_LEASE_TTL_SECONDS": "3",
            "RUNTIME_LEASE_RENEW_SECONDS": "0.2",
            "RUNTIME_LEASE_MARGIN_SECONDS": "1",
            **service_environment(),
        }
        app = bootstrap.build(Settings.from_env(environ))
        port, _ = await app.start()
        channel = learning_channel(f"127.0.0.1:{port}")
        running = RunningRuntime(app, channel, runtime_pb2_grpc.RuntimeServiceStub(channel))
        started.append(running)
        return running

    yield start
    for running in reversed(started):
        await stop_runtime(running)


def hosts(replicas: list[RunningRuntime], agent: rpb.Agent) -> list[str]:
    """The replicas running the agent."""
    return [
        r.app.settings.leases.replica
        for r in replicas
        if r.app.settings.leases is not None and r.app.runner(uuid.UUID(agent.id)) is not None
    ]


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT):
        while not condition():  # noqa: ASYNC110 - the leases move on the replicas' own rounds
            await asyncio.sleep(0.05)


async def ask_and_count(im: RunningIM, worlds: list[World], agents: list[rpb.Agent], text: str) -> None:
    """Asks every agent in its direct chat; each answers exactly once."""
    chats = [
        await direct_chat(im, world, agent.member_id) for world, agent in zip(worlds, agents, strict=True)
    ]
    for world, chat in zip(worlds, chats, strict=True):
        await im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=chat.id, content=text), metadata=world.md(0)
        )
    for world, chat in zip(worlds, chats, strict=True):
        messages = await wait_for_messages(im, world.members[0].id, chat.id, 2)
        answers = [m for m in messages if m.sender_id != world.members[0].id]
        assert len(answers) >= 1
    # Settled: no second answer to anything.
    await asyncio.sleep(0.5)
    for world, chat in zip(worlds, chats, strict=True):
        page = await im.stub.ListMessages(
            im_pb2.ListMessagesRequest(group_id=chat.id, page_size=100), metadata=world.md(0)
        )
        asked = [m for m in page.messages if m.sender_id == world.members[0].id]
        answered = [m for m in page.messages if m.sender_id != world.members[0].id]
        assert len(answered) == len(asked), [m.content for m in page.messages]


async def test_two_replicas_split_the_agents_and_each_agent_runs_once(
    im: RunningIM, replicas: Callable[[str], Awaitable[RunningRuntime]]
) -> None:
    first = await replicas("r1")
    worlds = [await make_world(im.stub, people=1) for _ in range(8)]
    agents = [
        (await first.stub.CreateAgent(rpb.CreateAgentRequest(name="ada"), metadata=w.md(0))).agent
        for w in worlds
    ]
    assert all(hosts([first], a) == ["r1"] for a in agents), "alone, it runs every agent"
    second = await replicas("r2")
    both = [first, second]
    # The first gives the second its share (about half the shards) on its next rounds.
    await until(lambda: second.app.supervisor is not None and second.app.supervisor.agent_count > 0)
    await until(lambda: all(len(hosts(both, a)) == 1 for a in agents))
    keepers = [r.app.leases for r in both]
    assert all(k is not None for k in keepers)
    held = [set(k.held) for k in keepers if k is not None]
    assert held[0].isdisjoint(held[1]) and len(held[0] | held[1]) == SHARDS
    await ask_and_count(im, worlds, agents, "hello")


async def test_a_replica_that_stops_hands_its_agents_over_at_once(
    im: RunningIM, replicas: Callable[[str], Awaitable[RunningRuntime]]
) -> None:
    first = await replicas("r1")
    worlds = [await make_world(im.stub, people=1) for _ in range(6)]
    agents = [
        (await first.stub.CreateAgent(rpb.CreateAgentRequest(name="ada"), metadata=w.md(0))).agent
        for w in worlds
    ]
    second = await replicas("r2")
    await until(lambda: second.app.supervisor is not None and second.app.supervisor.agent_count > 0)
    await first.app.stop()  # releases its leases: no waiting for them to expire
    await until(lambda: all(hosts([second], a) == ["r2"] for a in agents))
    await ask_and_count(im, worlds, agents, "still there?")
