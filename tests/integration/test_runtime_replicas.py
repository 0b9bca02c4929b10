"""Several runtime replicas on one PostgreSQL database (with Redis): each
agent runs in exactly one of them, shards move as replicas join and leave,
and what an agent was asked is answered once, by whichever replica runs it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

import grpc
import pytest
from uuid_utils.compat import uuid7

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from services.runtime import bootstrap
from services.runtime.adapters.sql import Database, SqlAgentStore
from services.runtime.config import Settings
from services.runtime.domain.model import Task, TaskStatus
from services.runtime.domain.shards import shard_of
from tests.auth_support import service_environment
from tests.conftest import RunningIM, World, make_world
from tests.faults.harness import RedisProcess
from tests.faults.llm import DecidingLLM, instruction
from tests.identities import as_member
from tests.integration.replicas import SHARDS, TAG, WAIT, Replicas
from tests.integration.test_runtime_grpc import RunningRuntime, direct_chat, wait_for_messages


def hosts(replicas: list[RunningRuntime], agent: rpb.Agent) -> list[str]:
    """The replicas running the agent."""
    return [
        r.app.settings.leases.replica.removesuffix(f"-{TAG}")
        for r in replicas
        if r.app.settings.leases is not None and r.app.runner(uuid.UUID(agent.id)) is not None
    ]


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT):
        while not condition():  # noqa: ASYNC110 - the leases move on the replicas' own rounds
            await asyncio.sleep(0.05)


async def pair(replicas: Replicas, **options: str) -> list[RunningRuntime]:
    """Two replicas, r1 and r2, once each holds half the shards."""
    both = [await replicas("r1", **options), await replicas("r2", **options)]
    await until(lambda: all(r.app.leases is not None and len(r.app.leases.held) == SHARDS // 2 for r in both))
    return both


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
    im: RunningIM, replicas: Replicas
) -> None:
    first = await replicas("r1")
    # Shards from its second lease round (the first only says it is there).
    await until(lambda: first.app.leases is not None and len(first.app.leases.held) == SHARDS)
    worlds = [await make_world(im.stub, people=1) for _ in range(8)]
    agents = [
        (await first.stub.CreateAgent(rpb.CreateAgentRequest(name="ada"), metadata=w.md(0))).agent
        for w in worlds
    ]
    assert all(hosts([first], a) == ["r1"] for a in agents), "alone, it runs every agent"
    second = await replicas("r2")
    both = [first, second]
    # The first gives the second its share (half the shards) on its next rounds.
    # (Which agents move depends on where their random workspaces hash, so the
    # check is that each runs where its shard is held, not how many moved.)
    await until(lambda: all(r.app.leases is not None and len(r.app.leases.held) == SHARDS // 2 for r in both))
    await until(lambda: all(len(hosts(both, a)) == 1 for a in agents))
    keepers = [r.app.leases for r in both]
    assert all(k is not None for k in keepers)
    held = [set(k.held) for k in keepers if k is not None]
    assert held[0].isdisjoint(held[1]) and len(held[0] | held[1]) == SHARDS
    for agent, world in zip(agents, worlds, strict=True):
        shard = shard_of(uuid.UUID(world.workspace.id), SHARDS)
        assert hosts(both, agent) == ["r1" if shard in held[0] else "r2"]
    await ask_and_count(im, worlds, agents, "hello")


async def test_a_replica_that_stops_hands_its_agents_over_at_once(im: RunningIM, replicas: Replicas) -> None:
    (first, second), worlds, agents = await split(im, replicas, 6)
    assert sorted(h for a in agents for h in hosts([first, second], a)) == ["r1"] * 3 + ["r2"] * 3
    await first.app.stop()  # releases its leases: no waiting for them to expire
    await until(lambda: all(hosts([second], a) == ["r2"] for a in agents))
    await ask_and_count(im, worlds, agents, "still there?")


async def test_released_shards_are_taken_at_once_not_at_the_next_renewal(
    im: RunningIM, replicas: Replicas
) -> None:
    """The leaving replica tells the others, who take its shards in a round
    of their own rather than at their next renewal, here far later than the
    test waits."""
    # The newcomer said so: the first gave it its share at once.
    first, second = await pair(replicas, RUNTIME_LEASE_TTL_SECONDS="120", RUNTIME_LEASE_RENEW_SECONDS="60")
    keeper = second.app.leases
    assert keeper is not None
    renewals = keeper.counters.renewals
    await first.app.stop()
    await until(lambda: len(keeper.held) == SHARDS)
    assert keeper.counters.renewals <= renewals + 2, "taken in a round or two of its own"


async def split(
    im: RunningIM, replicas: Replicas, count: int, **options: str
) -> tuple[list[RunningRuntime], list[World], list[rpb.Agent]]:
    """Two replicas with `count` agents (one per workspace), half in the shards of each."""
    first, _ = both = await pair(replicas, **options)
    keeper = first.app.leases
    assert keeper is not None
    wanted = {f"r1-{TAG}": count // 2, f"r2-{TAG}": count - count // 2}
    worlds = []
    while any(wanted.values()):
        world = await make_world(im.stub, people=1)
        owner = keeper.owner_of(uuid.UUID(world.workspace.id)) or ""
        if wanted.get(owner, 0) > 0:
            wanted[owner] -= 1
            worlds.append(world)
    agents = [
        (await first.stub.CreateAgent(rpb.CreateAgentRequest(name="ada"), metadata=w.md(0))).agent
        for w in worlds
    ]
    await until(lambda: all(len(hosts(both, a)) == 1 for a in agents))
    return both, worlds, agents


async def agent_on_the_first(
    im: RunningIM, replicas: Replicas, **options: str
) -> tuple[tuple[RunningRuntime, RunningRuntime], World, rpb.Agent]:
    """Two replicas, each with half the shards, and an agent (of two people's
    workspace) that the first runs."""
    first, second = both = await pair(replicas, **options)
    assert first.app.leases is not None
    world = await make_world(im.stub, people=2)
    while first.app.leases.owner_of(uuid.UUID(world.workspace.id)) != f"r1-{TAG}":
        world = await make_world(im.stub, people=2)
    agent = (await first.stub.CreateAgent(rpb.CreateAgentRequest(name="ada"), metadata=world.md(0))).agent
    await until(lambda: hosts(both, agent) == ["r1"])
    return (first, second), world, agent


def elsewhere(replicas: list[RunningRuntime], agent: rpb.Agent) -> RunningRuntime:
    """A replica that does not run the agent."""
    (other,) = [r for r in replicas if r.app.runner(uuid.UUID(agent.id)) is None]
    return other


async def task_done(runtime: RunningRuntime, world: World, task_id: str) -> rpb.Task:
    async with asyncio.timeout(WAIT):
        while True:
            got = await runtime.stub.GetTask(rpb.GetTaskRequest(task_id=task_id), metadata=world.md(0))
            if got.task.status == rpb.TASK_STATUS_SUCCEEDED:
                return got.task
            await asyncio.sleep(0.05)


async def test_any_replica_answers_for_any_agent(im: RunningIM, replicas: Replicas) -> None:
    both, worlds, agents = await split(im, replicas, 6)
    assert {hosts(both, a)[0] for a in agents} == {"r1", "r2"}, "the agents are spread (else retry with more)"
    for world, agent in zip(worlds, agents, strict=True):
        other, md = elsewhere(both, agent), world.md(0)
        paused = await other.stub.PauseAgent(rpb.PauseAgentRequest(agent_id=agent.id), metadata=md)
        assert paused.agent.state == rpb.AGENT_STATE_PAUSED
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await other.stub.InterruptAgent(rpb.InterruptAgentRequest(agent_id=agent.id), metadata=md)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, "checked by the owner"
        resumed = await other.stub.ResumeAgent(rpb.ResumeAgentRequest(agent_id=agent.id), metadata=md)
        assert resumed.agent.state == rpb.AGENT_STATE_IDLE
        submitted = await other.stub.SubmitTask(
            rpb.SubmitTaskRequest(agent_id=agent.id, input="say hello", request_id="t1"), metadata=md
        )
        done = await task_done(other, world, submitted.task.id)
        assert done.result
    # An agent created through a replica that does not hold its shard runs on the one that does.
    late = await make_world(im.stub, people=1)
    owner_of_late = both[0].app.leases.owner_of(uuid.UUID(late.workspace.id)).removesuffix(f"-{TAG}")  # type: ignore[union-attr]
    via = next(
        r
        for r in both
        if r.app.settings.leases is not None and not r.app.settings.leases.replica.startswith(owner_of_late)
    )
    created = (await via.stub.CreateAgent(rpb.CreateAgentRequest(name="bea"), metadata=late.md(0))).agent
    await until(lambda: hosts(both, created) == [owner_of_late])
    await ask_and_count(im, [late], [created], "hello bea")


async def test_with_redis_away_work_reaches_its_owner_within_the_reconcile_interval(
    im: RunningIM, replicas: Replicas, private_redis: RedisProcess
) -> None:
    both, worlds, agents = await split(im, replicas, 4, redis=private_redis.url)
    private_redis.kill()
    for world, agent in zip(worlds, agents, strict=True):
        other = elsewhere(both, agent)
        submitted = await other.stub.SubmitTask(
            rpb.SubmitTaskRequest(agent_id=agent.id, input="say hello", request_id="t1"), metadata=world.md(0)
        )
        await task_done(other, world, submitted.task.id)


async def test_a_replica_stopping_lets_the_run_in_flight_end_before_it_hands_over(
    im: RunningIM, replicas: Replicas
) -> None:
    llm = DecidingLLM(delay=0.1)
    await llm.start()
    try:
        model = {"OPENAI_BASE_URL": llm.url, "OPENAI_MODEL": "fake", "SHUTDOWN_GRACE_SECONDS": "10"}
        (first, second), world, agent = await agent_on_the_first(im, replicas, **model)
        chat = await direct_chat(im, world, agent.member_id)
        bea = world.members[1]
        request = im_pb2.SendMessageRequest(group_id=chat.id, content=instruction("tok", bea.display_name))
        await im.stub.SendMessage(request, metadata=world.md(0))
        await until(lambda: first.app.runner(uuid.UUID(agent.id)) is not None)
        runner = first.app.runner(uuid.UUID(agent.id))
        assert runner is not None
        await until(lambda: not runner.idle.is_set())
        await first.app.stop()  # drains: the run ends here, then the shards go
        runs = await second.stub.ListRuns(rpb.ListRunsRequest(agent_id=agent.id), metadata=world.md(0))
        assert [r.status for r in runs.runs] == [rpb.RUN_STATUS_COMPLETED], "not cut by the handover"
        to_bea = await im.stub.GetOrCreateDirectGroup(
            im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=agent.member_id), metadata=as_member(bea.id)
        )
        page = await im.stub.ListMessages(
            im_pb2.ListMessagesRequest(group_id=to_bea.group.id, page_size=10), metadata=as_member(bea.id)
        )
        assert [m.content for m in page.messages] == ["tok"]
        await until(lambda: hosts([second], agent) == ["r2"])
    finally:
        await llm.stop()


async def test_a_runtime_without_redis_refuses_to_start_beside_replicas(
    im: RunningIM, own_runtime_url: str, replicas: Replicas
) -> None:
    await replicas("r1")
    environ = {
        "RUNTIME_DATABASE_URL": own_runtime_url,
        "RUNTIME_GRPC_ADDRESS": "127.0.0.1:0",
        "IM_ADDRESS": im.address,
        **service_environment(),
    }
    lone = bootstrap.build(Settings.from_env(environ))
    try:
        with pytest.raises(bootstrap.BesideReplicas, match=f"r1-{TAG}"):
            await lone.start()
    finally:
        await lone.stop()


@pytest.mark.parametrize("left", ["queued", "running without its run"])
async def test_a_task_left_while_its_shard_had_no_owner_runs_once_the_next_owner_takes_it(
    im: RunningIM, replicas: Replicas, own_runtime_url: str, left: str
) -> None:
    """Queued with nobody told, or marked RUNNING by an owner killed before
    it stored the run (the agent idle, the task orphaned): the next owner
    runs it when it takes the shard, not at a reconcile."""
    # Reconciling far later than the test waits: only taking the shard may start the task.
    slow_reconcile = {"RUNTIME_RECONCILE_SECONDS": "120"}
    first = await replicas("r1", **slow_reconcile)
    world = await make_world(im.stub, people=1)
    agent = (await first.stub.CreateAgent(rpb.CreateAgentRequest(name="ada"), metadata=world.md(0))).agent
    # A chat answered: the workspace's IM cursor is saved, so the next owner
    # starts the idle agent waiting for the IM's replay, not looking around.
    await ask_and_count(im, [world], [agent], "hello")
    await asyncio.sleep(1.5)
    await first.app.stop()
    # Queued straight into the database while no replica runs the agent, with
    # nobody told (the word went to an owner that was leaving, or nowhere).
    database = Database(own_runtime_url)
    try:
        store = SqlAgentStore(database)
        stored = await store.get_agent(uuid.UUID(agent.id))
        assert stored is not None
        task = Task(
            id=uuid7(),
            agent_id=stored.id,
            session_id=stored.session_id,
            input="say hello",
            status=TaskStatus.QUEUED if left == "queued" else TaskStatus.RUNNING,
            created_at=datetime.now(UTC),
            request_id="while-moving",
            run_id=None if left == "queued" else uuid7(),
        )
        await store.add_task(task)
    finally:
        await database.aclose()
    second = await replicas("r2", **slow_reconcile)
    done = await task_done(second, world, str(task.id))
    assert done.result
