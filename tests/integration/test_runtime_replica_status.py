"""What runtime replicas on one PostgreSQL database (with Redis) show of
themselves: GetAgent and ListAgents through any replica name the one that
runs the agent, the health service reports each replica's leases and link,
and each replica's status counts its shards and agents (and its store the
fenced writes it refuses)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agentim.runtime.v1 import runtime_pb2 as rpb
from services.runtime.adapters.leases import SqlLeases
from services.runtime.adapters.sql import Database, SqlAgentStore
from services.runtime.bootstrap import LEASES_HEALTH_NAME, REPLICAS_HEALTH_NAME, SERVICE_NAME
from services.runtime.service_layer.leases import Fence, LeaseLost
from tests.conftest import RunningIM, make_world
from tests.faults.harness import RedisProcess
from tests.integration.replicas import SHARDS, TAG, Replicas
from tests.integration.test_runtime_grpc import RunningRuntime, create_agent, start_runtime, stop_runtime
from tests.integration.test_runtime_replicas import hosts, split, until
from tests.integration.test_runtime_store import make_agent, make_run, make_step

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def health(runtime: RunningRuntime) -> dict[str, int]:
    """Every name the replica's health service knows, with its status."""
    listed = await health_pb2_grpc.HealthStub(runtime.channel).List(health_pb2.HealthListRequest(), timeout=5)
    return {name: int(status.status) for name, status in listed.statuses.items()}


async def test_get_agent_through_either_replica_names_the_one_that_runs_it(
    im: RunningIM,
    replicas: Replicas,
) -> None:
    both, worlds, agents = await split(im, replicas, 6)
    assert {hosts(both, a)[0] for a in agents} == {"r1", "r2"}, "the agents are spread (else retry with more)"
    for world, agent in zip(worlds, agents, strict=True):
        (runs_it,) = hosts(both, agent)
        for via in both:
            got = await via.stub.GetAgent(rpb.GetAgentRequest(agent_id=agent.id), metadata=world.md(0))
            assert got.agent.replica == f"{runs_it}-{TAG}"
            listed = await via.stub.ListAgents(rpb.ListAgentsRequest(), metadata=world.md(0))
            assert [a.replica for a in listed.agents] == [f"{runs_it}-{TAG}"]

    statuses = [r.app.monitor.status() for r in both if r.app.monitor is not None]
    assert [s.replica for s in statuses] == [f"r1-{TAG}", f"r2-{TAG}"]
    assert sum(s.shards for s in statuses) == SHARDS
    assert sum(s.agents for s in statuses) == len(agents)
    assert all(s.leases_proven and not s.link_degraded and s.renewals > 0 for s in statuses)
    assert all(s.refused_fenced_writes == 0 for s in statuses), "no shard moved under a runner"
    assert sum(s.shards_taken for s in statuses) >= SHARDS


async def test_the_health_of_a_replica_names_its_leases_and_its_link(
    im: RunningIM,
    replicas: Replicas,
    private_redis: RedisProcess,
) -> None:
    first = await replicas("r1", redis=private_redis.url)
    await until(lambda: first.app.leases is not None and len(first.app.leases.held) == SHARDS)
    assert await health(first) == {
        "": SERVING,
        SERVICE_NAME: SERVING,
        LEASES_HEALTH_NAME: SERVING,
        REPLICAS_HEALTH_NAME: SERVING,
    }

    private_redis.kill()
    link = first.app.link
    await until(lambda: link is not None and link.degraded)
    statuses = await health(first)
    assert statuses[SERVICE_NAME] == SERVING, "the replica still serves (its owner reconciles)"
    assert statuses[REPLICAS_HEALTH_NAME] == NOT_SERVING, "and says what is degraded"
    assert statuses[LEASES_HEALTH_NAME] == SERVING, "its leases live in the database"

    private_redis.start()
    await until(lambda: link is not None and not link.degraded)
    assert (await health(first))[REPLICAS_HEALTH_NAME] == SERVING


async def test_a_lone_runtime_names_no_replica_and_has_no_replica_health(
    im: RunningIM, tmp_path: Path
) -> None:
    lone = await start_runtime(im.address, tmp_path / "runtime.db")
    try:
        world = await make_world(im.stub, people=1)
        agent = await create_agent(lone, world, "ada")
        got = await lone.stub.GetAgent(rpb.GetAgentRequest(agent_id=agent.id), metadata=world.md(0))
        assert got.agent.replica == ""
        assert await health(lone) == {"": SERVING, SERVICE_NAME: SERVING}
        assert lone.app.monitor is None
    finally:
        await stop_runtime(lone)


async def test_the_store_counts_the_fenced_writes_it_refuses(own_runtime_url: str) -> None:
    database = Database(own_runtime_url)
    store = SqlAgentStore(database)
    try:
        leases = SqlLeases(database)
        await leases.prepare(SHARDS)
        agent = make_agent()
        await store.add_agent(agent)
        run = make_run(agent)
        await store.add_run(run)
        fence = Fence(3, (await leases.take("r1", [3], 30))[3], "r1")
        await store.append_step(make_step(run, 1), fence=fence)
        await store.save_watch_cursors({agent.workspace_id: "c1"}, fences=[fence])
        assert store.refused_fenced_writes == 0
        await leases.release("r1", [3])  # another replica's from now on
        with pytest.raises(LeaseLost):
            await store.append_step(make_step(run, 2), fence=fence)
        with pytest.raises(LeaseLost):
            await store.save_watch_cursors({agent.workspace_id: "c2"}, fences=[fence])
        assert store.refused_fenced_writes == 2
    finally:
        await store.aclose()


async def listed_by(via: RunningRuntime, md: object) -> list[rpb.RuntimeReplica]:
    response = await via.stub.ListReplicas(rpb.ListReplicasRequest(), metadata=md)
    return list(response.replicas)


async def test_any_replica_lists_every_replica_with_what_it_runs(im: RunningIM, replicas: Replicas) -> None:
    both, worlds, agents = await split(im, replicas, 4)
    owner = worlds[0].md(0)
    # Each report comes with its replica's next renewal (every 0.2 s here).
    async with asyncio.timeout(15):
        while sum(r.agents for r in await listed_by(both[0], owner)) != len(agents):  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    for via, name in zip(both, ("r1", "r2"), strict=True):
        listed = await listed_by(via, owner)
        assert [r.id for r in listed] == [f"r1-{TAG}", f"r2-{TAG}"]
        assert [r.answering for r in listed] == [r.id == f"{name}-{TAG}" for r in listed]
        assert sum(r.shards for r in listed) == SHARDS
        assert sum(r.agents for r in listed) == len(agents)
        assert all(r.leases_proven and not r.link_degraded and r.renewals > 0 for r in listed)
        assert all(r.start_time.seconds > 0 and r.report_time.seconds >= r.start_time.seconds for r in listed)
    member = await make_world(im.stub, people=2)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await listed_by(both[0], member.md(1))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "owners and admins" in (refused.value.details() or "")


async def test_one_runtime_lists_itself_as_the_only_replica(im: RunningIM, tmp_path: Path) -> None:
    lone = await start_runtime(im.address, tmp_path / "runtime.db")
    try:
        world = await make_world(im.stub, people=1)
        await create_agent(lone, world, "ada")
        (alone,) = await listed_by(lone, world.md(0))
        assert (alone.id, alone.shards, alone.agents, alone.answering) == ("", 0, 1, True)
    finally:
        await stop_runtime(lone)
