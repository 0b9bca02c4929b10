"""Replica faults among three runtime replicas: `kill -9` mid-stream (1),
SIGSTOP of one past its leases (2), a rolling SIGTERM (4), a fourth replica
joining (5), Redis stopped (6).

Three runtime processes share one PostgreSQL database and one Redis (r0
talks to one IM replica, r1 and r2 to another, as deployed); agents
live in workspaces of their own, so their shards spread over the replicas.
People ask the agents (in their direct chats and as queued tasks, through a
replica that is never killed, so most calls cross to the owner) to send a
token to Bea: a tool call, then an answer. Meanwhile the two other replicas
are killed with SIGKILL at random moments and started again. When all is
done: every token reached Bea exactly once (the ledger of tool effects),
every task ended, every tool call has exactly one result, no run is left
RUNNING and no agent is in ERROR.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import asyncpg
import grpc
import pytest

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from agentim.runtime.v1 import runtime_pb2_grpc
from services.runtime.domain.shards import shard_of
from tests.conftest import RunningIM, World, make_world
from tests.faults.harness import RedisProcess, ServiceProcess, clean_environment, migrate, scaled
from tests.faults.llm import DecidingLLM, instruction
from tests.faults.test_im_kill import FAST_RECONNECT, RETRYABLE
from tests.identities import as_member, learning_channel

REPLICAS = 3
AGENTS = 6
SHARDS = 32
SETTLE_SECONDS = 90.0
TTL_SECONDS = 3.0
TERMINAL = {rpb.TASK_STATUS_SUCCEEDED, rpb.TASK_STATUS_DEAD, rpb.TASK_STATUS_CANCELLED}


@dataclass
class Desk:
    """One agent, its workspace (Ada asks, Bea receives) and what was asked of it."""

    world: World
    agent: rpb.Agent
    chat: im_pb2.Group
    tokens: list[str] = field(default_factory=list)
    # Tokens whose asking the test itself cut short (it stops asking
    # mid-call): asked only if the IM or the runtime has the request.
    unconfirmed: set[str] = field(default_factory=set)

    @property
    def bea(self) -> im_pb2.Member:
        return self.world.members[1]


async def call(method: object, request: object, metadata: object) -> object:
    """A call that changes nothing (or is idempotent), made again while its
    server is away or the agent's shard moves."""
    while True:
        try:
            return await method(request, metadata=metadata, timeout=10, wait_for_ready=True)  # type: ignore[operator]
        except grpc.aio.AioRpcError as error:
            if error.code() not in RETRYABLE:
                raise
            await asyncio.sleep(0.05)


@dataclass
class Cluster:
    """Runtime replica processes, a client of r0 and the agents' desks."""

    processes: list[ServiceProcess]
    runtime: runtime_pb2_grpc.RuntimeServiceStub
    desks: list[Desk]
    env: dict[str, str] = field(default_factory=dict)
    tag: str = ""
    logs: Path = Path()
    # The IM replica the replicas other than r0 talk to (r0's is the client's).
    second_im: str = ""

    def add(self) -> ServiceProcess:
        """Starts one more replica (stopped with the others)."""
        index = len(self.processes)
        process = ServiceProcess(
            "services.runtime",
            {**self.env, **_im_of(index, self.second_im), "RUNTIME_REPLICA_ID": f"r{index}-{self.tag}"},
            self.logs / f"r{index}.log",
        )
        self.processes.append(process)
        return process.start()


def _im_of(index: int, second_im: str) -> dict[str, str]:
    return {"IM_ADDRESS": second_im} if second_im and index > 0 else {}


@contextlib.asynccontextmanager
async def cluster(
    im: RunningIM | tuple[RunningIM, RunningIM],
    database_url: str,
    redis_url: str,
    llm: DecidingLLM,
    tmp_path: Path,
    *,
    only: Mapping[int, Mapping[str, str]] | None = None,
    **settings: str,
) -> AsyncIterator[Cluster]:
    """Three replicas on the test's database, six agents each in a workspace
    of its own, two in the shards of each replica (once the shards have
    settled); `only` adds settings of one replica (by index) to `settings`.

    Given two IM replicas (`ims`), r0 and the client talk to the first and
    the other runtime replicas to the second, as a deployment spreads them."""
    im, second_im = (im[0], im[1].address) if isinstance(im, tuple) else (im, "")
    if database_url.startswith("sqlite"):
        pytest.skip("replicas share a PostgreSQL database")
    tag = uuid.uuid4().hex[:6]
    tunables = {
        "RUNTIME_SHARDS": str(SHARDS),
        "RUNTIME_LEASE_TTL_SECONDS": str(TTL_SECONDS),
        "RUNTIME_LEASE_RENEW_SECONDS": "0.5",
        "RUNTIME_LEASE_MARGIN_SECONDS": "1",
        "RUNTIME_RECONCILE_SECONDS": "1",
        "LLM_MAX_RETRIES": "2",
        "IM_CALL_TIMEOUT_SECONDS": "5",
        # Five processes and the test's own on one PostgreSQL (beside another
        # test session's): each keeps fewer connections than a deployment's.
        "RUNTIME_DB_POOL_SIZE": "6",
    }
    env = clean_environment(
        **{**tunables, **settings},
        RUNTIME_DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        RUNTIME_GRPC_ADDRESS="127.0.0.1:0",
        IM_ADDRESS=im.address,
        OPENAI_BASE_URL=llm.url,
        OPENAI_MODEL="fake",
    )
    migrate("services.runtime", env)
    processes = [
        ServiceProcess(
            "services.runtime",
            {**env, **_im_of(i, second_im), **(only or {}).get(i, {}), "RUNTIME_REPLICA_ID": f"r{i}-{tag}"},
            tmp_path / f"r{i}.log",
        )
        for i in range(REPLICAS)
    ]
    try:
        for process in processes:
            # In a thread: the test's IMs keep serving meanwhile.
            await asyncio.to_thread(process.start)
            process.pin_address("RUNTIME_GRPC_ADDRESS")
        # The client talks to r0, never faulted: most calls cross to the owner.
        channel = learning_channel(processes[0].address, options=FAST_RECONNECT)
        runtime = runtime_pb2_grpc.RuntimeServiceStub(channel)
        # Workspaces spread by hand, since six random ones all land in one
        # replica's shards now and then, and a case then has no victim.
        owners = await settled_owners(database_url, REPLICAS)
        wanted = dict.fromkeys(owners.values(), AGENTS // REPLICAS)
        worlds: list[World] = []
        while len(worlds) < AGENTS:
            world = await make_world(im.stub, people=2)
            owner = owners[shard_of(uuid.UUID(world.workspace.id), SHARDS)]
            if wanted[owner] > 0:
                wanted[owner] -= 1
                worlds.append(world)
        desks = []
        for index, world in enumerate(worlds):
            created = await call(
                runtime.CreateAgent,
                rpb.CreateAgentRequest(
                    name=f"agent-{index}", tools=["send_direct_message"], request_id=f"a{index}"
                ),
                world.md(0),
            )
            agent = created.agent  # type: ignore[attr-defined]
            chat = (
                await im.stub.GetOrCreateDirectGroup(
                    im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=agent.member_id), metadata=world.md(0)
                )
            ).group
            desks.append(Desk(world, agent, chat))
        yield Cluster(processes, runtime, desks, env=env, tag=tag, logs=tmp_path, second_im=second_im)
        await channel.close()
    finally:
        for process in processes:
            process.kill()


@contextlib.asynccontextmanager
async def asking(im: RunningIM, replicas: Cluster) -> AsyncIterator[list[BaseException]]:
    """Ada keeps asking (`ask`) while the block injects its faults; yields
    the calls that failed, known once the block ends."""
    task = asyncio.create_task(ask(replicas.runtime, im, replicas.desks))
    failed: list[BaseException] = []
    try:
        yield failed
    finally:
        task.cancel()
        outcome = await asyncio.gather(task, return_exceptions=True)
        failed += [
            e for e in outcome if isinstance(e, BaseException) and not isinstance(e, asyncio.CancelledError)
        ]


async def settled(im: RunningIM, replicas: Cluster) -> tuple[Counters, float]:
    """The counters once the work is done (or the time is up), and how long that took."""
    started = time.monotonic()
    counters = await settle(replicas.runtime, im, replicas.desks)
    return counters, time.monotonic() - started


def summary(name: str, faults: str, counters: Counters, settled_in: float) -> str:
    return (
        f"{name}: {faults}, {counters.tokens} tokens,"
        f" {counters.delivered} delivered, {len(counters.duplicated)} duplicated, {len(counters.lost)} lost,"
        f" {counters.stuck} tasks stuck RUNNING, {counters.dead} dead,"
        f" {counters.unpaired} unpaired tool calls,"
        f" {counters.runs_running} runs RUNNING, {counters.errored} agents in ERROR,"
        f" {counters.unsent} never sent (the test stopped asking mid-call),"
        f" settled {settled_in:.1f}s after the last fault"
        + (f"; lost: {counters.what_became}" if counters.what_became else "")
    )


def assert_nothing_lost_or_doubled(counters: Counters, said: str) -> None:
    assert counters.duplicated == [], said
    assert counters.lost == [], said
    assert (counters.stuck, counters.dead, counters.unpaired, counters.errored) == (0, 0, 0, 0), said
    assert counters.runs_running == 0, said


# Three processes started, up to 20 kills and restarts, then the settling.
@pytest.mark.timeout(scaled(120, long=400))
async def test_killing_replicas_mid_run_loses_and_repeats_nothing(
    ims: tuple[RunningIM, RunningIM], own_runtime_url: str, redis_url: str, llm: DecidingLLM, tmp_path: Path
) -> None:
    im = ims[0]
    kills = scaled(3, long=20)
    async with cluster(ims, own_runtime_url, redis_url, llm, tmp_path) as replicas:
        rng = random.Random(uuid.uuid4().int)
        async with asking(im, replicas):
            for _ in range(kills):
                await asyncio.sleep(rng.uniform(0.5, 1.5))
                victim = rng.choice(replicas.processes[1:])
                victim.kill()
                await asyncio.sleep(rng.uniform(0.0, 0.5))
                await asyncio.to_thread(victim.start)
        counters, settled_in = await settled(im, replicas)
    said = summary("replica kill", f"{kills} kills of {REPLICAS} replicas", counters, settled_in)
    print(said)
    assert_nothing_lost_or_doubled(counters, said)


async def ask(runtime: runtime_pb2_grpc.RuntimeServiceStub, im: RunningIM, desks: list[Desk]) -> None:
    """Ada asks, at random moments, by chat or by task, through r0."""
    rng = random.Random(uuid.uuid4().int)
    number = 0
    while True:
        await asyncio.sleep(rng.uniform(0.1, 0.3))
        desk = rng.choice(desks)
        number += 1
        token = f"k{number}"
        content = instruction(token, desk.bea.display_name)
        desk.tokens.append(token)
        try:
            if rng.random() < 0.5:
                request = im_pb2.SendMessageRequest(group_id=desk.chat.id, content=content)
                await im.stub.SendMessage(request, metadata=desk.world.md(0))
            else:
                task = rpb.SubmitTaskRequest(agent_id=desk.agent.id, input=content, request_id=token)
                await call(runtime.SubmitTask, task, desk.world.md(0))
        except asyncio.CancelledError:
            desk.unconfirmed.add(token)
            raise


@dataclass
class Counters:
    tokens: int = 0
    delivered: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    stuck: int = 0
    dead: int = 0
    unpaired: int = 0
    errored: int = 0
    runs_running: int = 0
    unfinished: int = 0
    # Tokens whose asking was cut short before the IM or the runtime had it.
    unsent: int = 0
    # Each lost token: "chat", or its task's status.
    what_became: dict[str, str] = field(default_factory=dict)


async def settle(runtime: runtime_pb2_grpc.RuntimeServiceStub, im: RunningIM, desks: list[Desk]) -> Counters:
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        counters = await count(runtime, im, desks)
        done = (
            not counters.lost
            and counters.stuck == 0
            and counters.runs_running == 0
            and not counters.unfinished
        )
        if done or time.monotonic() > deadline:
            return counters
        await asyncio.sleep(0.5)


async def count(runtime: runtime_pb2_grpc.RuntimeServiceStub, im: RunningIM, desks: list[Desk]) -> Counters:
    counters = Counters()
    for desk in desks:
        md, agent = desk.world.md(0), desk.agent
        counters.tokens += len(desk.tokens)
        as_bea = as_member(desk.bea.id)
        direct = await call(
            im.stub.GetOrCreateDirectGroup,
            im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=agent.member_id),
            as_bea,
        )
        page = await call(
            im.stub.ListMessages,
            im_pb2.ListMessagesRequest(group_id=direct.group.id, page_size=1000),  # type: ignore[attr-defined]
            as_bea,
        )
        ledger = Counter(m.content for m in page.messages)  # type: ignore[attr-defined]
        never_asked = await never_asked_of(runtime, im, desk, ledger)
        counters.unsent += len(never_asked)
        counters.delivered += sum(1 for t in desk.tokens if ledger[t])
        counters.lost += [t for t in desk.tokens if not ledger[t] and t not in never_asked]
        counters.duplicated += [c for c, n in ledger.items() if n > 1]
        steps = await all_steps(runtime, desk)
        calls = Counter(c.id for s in steps for c in s.tool_calls)
        results = Counter(s.tool_call_id for s in steps if s.role == rpb.STEP_ROLE_TOOL)
        counters.unpaired += sum((calls - results).values()) + sum((results - calls).values())
        counters.unpaired += sum(n - 1 for n in results.values() if n > 1)
        tasks = await call(runtime.ListTasks, rpb.ListTasksRequest(agent_id=agent.id, page_size=500), md)
        statuses = [t.status for t in tasks.tasks]  # type: ignore[attr-defined]
        by_token = {t.request_id: t for t in tasks.tasks}  # type: ignore[attr-defined]
        for token in desk.tokens:
            if not ledger[token]:
                task = by_token.get(token)
                counters.what_became[token] = (
                    "chat" if task is None else f"task {rpb.TaskStatus.Name(task.status)} {task.result!r}"
                )
        counters.stuck += statuses.count(rpb.TASK_STATUS_RUNNING)
        counters.dead += statuses.count(rpb.TASK_STATUS_DEAD)
        counters.unfinished += sum(s not in TERMINAL for s in statuses)
        got = await call(runtime.GetAgent, rpb.GetAgentRequest(agent_id=agent.id), md)
        counters.errored += got.agent.state == rpb.AGENT_STATE_ERROR  # type: ignore[attr-defined]
        runs = await call(runtime.ListRuns, rpb.ListRunsRequest(agent_id=agent.id, page_size=500), md)
        counters.runs_running += sum(r.status == rpb.RUN_STATUS_RUNNING for r in runs.runs)  # type: ignore[attr-defined]
    return counters


async def all_steps(runtime: runtime_pb2_grpc.RuntimeServiceStub, desk: Desk) -> list[rpb.Step]:
    """Every stored step of the desk's agent, page after page (the server
    caps a page, at 200 today, below what the call asks for)."""
    steps: list[rpb.Step] = []
    while True:
        after = steps[-1].sequence if steps else 0
        listed = await call(
            runtime.ListSteps,
            rpb.ListStepsRequest(agent_id=desk.agent.id, page_size=500, after_sequence=after),
            desk.world.md(0),
        )
        if not listed.steps:  # type: ignore[attr-defined]
            return steps
        steps += listed.steps  # type: ignore[attr-defined]


async def never_asked_of(
    runtime: runtime_pb2_grpc.RuntimeServiceStub, im: RunningIM, desk: Desk, ledger: Counter[str]
) -> set[str]:
    """The undelivered tokens the test stopped asking for mid-call, whose
    request never reached the IM (a chat) or the runtime (a task)."""
    doubtful = {t for t in desk.unconfirmed if not ledger[t]}
    if not doubtful:
        return set()
    md = desk.world.md(0)
    chat = await call(
        im.stub.ListMessages, im_pb2.ListMessagesRequest(group_id=desk.chat.id, page_size=1000), md
    )
    asked = {m.content for m in chat.messages}  # type: ignore[attr-defined]
    tasks = await call(runtime.ListTasks, rpb.ListTasksRequest(agent_id=desk.agent.id, page_size=500), md)
    submitted = {t.request_id for t in tasks.tasks}  # type: ignore[attr-defined]
    return {t for t in doubtful if instruction(t, desk.bea.display_name) not in asked and t not in submitted}


# Replica fault 2: SIGSTOP past the lease, then SIGCONT.

_STOPPED_BY_PROOF = "stops here: shard"  # a runner's write refused before it left the replica
_PROOF_GONE = "can no longer be proven"  # the woken keeper stopping its runners


@pytest.mark.timeout(scaled(150, long=400))
async def test_a_replica_frozen_past_its_lease_is_refused_and_stops(
    ims: tuple[RunningIM, RunningIM], own_runtime_url: str, redis_url: str, tmp_path: Path
) -> None:
    """Frozen mid-run for longer than its leases live, a replica wakes to
    find its shards taken: whatever its runners then try to write is refused,
    they stop, and every token still reaches Bea exactly once."""
    im = ims[0]
    freezes = scaled(2, long=8)
    slow = DecidingLLM(delay=0.15)  # runs long enough to freeze one mid-stream
    await slow.start()
    stopped_after: list[float] = []
    try:
        async with cluster(ims, own_runtime_url, redis_url, slow, tmp_path, LOG_LEVEL="INFO") as replicas:
            async with asking(im, replicas):
                for number in range(freezes):
                    if number:
                        # The last victim back with shards of its own first: else it
                        # could be picked again while its lost leases still name it,
                        # frozen holding nothing, and wake with nothing to notice.
                        await settled_owners(own_runtime_url, REPLICAS)
                    victim, thawed_at = await freeze_mid_run(replicas)
                    stopped_after.append(await noticed(victim, thawed_at))
            counters, settled_in = await settled(im, replicas)
            logs = "".join(p.log() for p in replicas.processes[1:])
    finally:
        await slow.stop()
    refused = logs.count(_STOPPED_BY_PROOF)
    said = summary(
        "replica freeze",
        f"{freezes} freezes of {TTL_SECONDS + 2:.0f} s (leases live {TTL_SECONDS:.0f} s),"
        f" {refused} stale writes refused, 0 accepted (the ledger below),"
        f" runners stopped {max(stopped_after):.2f} s at most after waking",
        counters,
        settled_in,
    )
    print(said)
    assert refused > 0, said
    assert max(stopped_after) < 2.0, said
    assert_nothing_lost_or_doubled(counters, said)


async def freeze_mid_run(replicas: Cluster) -> tuple[ServiceProcess, float]:
    """Asks an agent that r1 or r2 runs, freezes that replica once the agent
    is RUNNING, thaws it after its leases have expired; returns it and when it was thawed."""
    ids = {p.env["RUNTIME_REPLICA_ID"]: p for p in replicas.processes[1:]}
    seen: Counter[tuple[str, str]] = Counter()
    try:
        async with asyncio.timeout(30):
            while True:
                for desk in replicas.desks:
                    got = await call(
                        replicas.runtime.GetAgent,
                        rpb.GetAgentRequest(agent_id=desk.agent.id),
                        desk.world.md(0),
                    )
                    agent = got.agent  # type: ignore[attr-defined]
                    seen[(agent.replica or "(moving)", rpb.AgentState.Name(agent.state))] += 1
                    if agent.replica in ids and agent.state == rpb.AGENT_STATE_RUNNING:
                        victim = ids[agent.replica]
                        victim.freeze()
                        await asyncio.sleep(TTL_SECONDS + 2)
                        victim.thaw()
                        return victim, time.time()
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(
            f"no agent of r1 or r2 was RUNNING within 30 s; (owner, state) seen: {dict(seen)}"
        ) from None


async def noticed(victim: ServiceProcess, thawed_at: float) -> float:
    """Seconds from the thaw to the woken keeper's word that its leases are gone."""
    async with asyncio.timeout(10):
        while True:
            for line in victim.log().splitlines():
                if _PROOF_GONE in line:
                    at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                    if at >= thawed_at - 0.5:
                        return max(0.0, at - thawed_at)
            await asyncio.sleep(0.05)


# Replica fault 6: Redis stopped.


@pytest.mark.timeout(scaled(120, long=400))
async def test_with_redis_stopped_every_task_reaches_its_owner_within_the_reconcile_interval(
    ims: tuple[RunningIM, RunningIM],
    own_runtime_url: str,
    private_redis: RedisProcess,
    llm: DecidingLLM,
    tmp_path: Path,
) -> None:
    """Redis is killed under load: tasks submitted through r0 for agents that
    r1 and r2 run cannot be told to them, and reach them by the owners'
    reads of the database, within the reconcile interval; nothing is lost
    or doubled, and all goes on once Redis is back."""
    im = ims[0]
    outages = scaled(1, long=4)
    reconcile = 1.0
    delays: list[float] = []
    async with cluster(
        ims, own_runtime_url, private_redis.url, llm, tmp_path, RUNTIME_RECONCILE_SECONDS=str(reconcile)
    ) as replicas:
        async with asking(im, replicas):
            for outage in range(outages):
                await asyncio.sleep(1.0)
                private_redis.kill()
                delays += await tasks_while_away(replicas, f"o{outage}")
                private_redis.start()
        counters, settled_in = await settled(im, replicas)
    delays.sort()
    p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))]
    said = summary(
        "redis stopped",
        f"{outages} outages, {len(delays)} tasks submitted meanwhile started after p50"
        f" {delays[len(delays) // 2]:.2f} s, p99 {p99:.2f} s (reconcile interval {reconcile:g} s)",
        counters,
        settled_in,
    )
    print(said)
    # A task waits for the next read of the database (at most the interval),
    # then for the run before it, if its agent is busy (a model's few chunks).
    assert p99 < reconcile + 2.0, said
    assert_nothing_lost_or_doubled(counters, said)


async def tasks_while_away(replicas: Cluster, name: str) -> list[float]:
    """One task for each agent while Redis is away; how long each waited to start."""
    submitted = []
    for desk in replicas.desks:
        token = f"{name}-{desk.agent.id[-6:]}"
        desk.tokens.append(token)
        request = rpb.SubmitTaskRequest(
            agent_id=desk.agent.id, input=instruction(token, desk.bea.display_name), request_id=token
        )
        got = await call(replicas.runtime.SubmitTask, request, desk.world.md(0))
        submitted.append((desk, got.task.id))  # type: ignore[attr-defined]
    delays = []
    async with asyncio.timeout(30):
        for desk, task_id in submitted:
            while True:
                got = await call(
                    replicas.runtime.GetTask, rpb.GetTaskRequest(task_id=task_id), desk.world.md(0)
                )
                task = got.task  # type: ignore[attr-defined]
                if task.HasField("start_time"):
                    delays.append(
                        (task.start_time.ToDatetime() - task.create_time.ToDatetime()).total_seconds()
                    )
                    break
                await asyncio.sleep(0.05)
    return delays


# Replica fault 4: rolling SIGTERM under load.


@pytest.mark.timeout(scaled(150, long=400))
async def test_a_rolling_restart_fails_no_call_and_hands_over_without_waiting_for_leases(
    ims: tuple[RunningIM, RunningIM], own_runtime_url: str, redis_url: str, llm: DecidingLLM, tmp_path: Path
) -> None:
    """Every replica in turn gets SIGTERM (as a rollout does) and comes back:
    clients that retry UNAVAILABLE see no failed call, each stopping replica
    hands its agents over at once (long before its leases would expire), and
    nothing is lost or doubled."""
    im = ims[0]
    rounds = scaled(1, long=3)
    ttl = 10.0
    handoffs: list[float] = []
    codes: list[int] = []
    async with cluster(
        ims,
        own_runtime_url,
        redis_url,
        llm,
        tmp_path,
        RUNTIME_LEASE_TTL_SECONDS=str(ttl),
        RUNTIME_LEASE_MARGIN_SECONDS="2",
    ) as replicas:
        channels = [learning_channel(p.address, options=FAST_RECONNECT) for p in replicas.processes]
        stubs = [runtime_pb2_grpc.RuntimeServiceStub(c) for c in channels]
        async with asking(im, replicas) as failed:
            for _ in range(rounds):
                for index, victim in enumerate(replicas.processes):
                    await asyncio.sleep(1.0)
                    name = victim.env["RUNTIME_REPLICA_ID"]
                    other = stubs[(index + 1) % len(stubs)]
                    ran = [d for d in replicas.desks if await owner(other, d) == name]
                    stopped_at = time.monotonic()
                    codes.append(await asyncio.to_thread(victim.terminate))
                    for desk in ran:
                        # A client asking, as an operator's would.
                        while await owner(other, desk) in ("", name):  # noqa: ASYNC110
                            await asyncio.sleep(0.05)
                    if ran:
                        handoffs.append(time.monotonic() - stopped_at)
                    await asyncio.to_thread(victim.start)
        counters, settled_in = await settled(im, replicas)
        for channel in channels:
            await channel.close()
    said = summary(
        "rolling restart",
        f"{len(codes)} SIGTERMs (exit codes {sorted(set(codes))}), {len(failed)} failed calls,"
        f" agents owned again after max {max(handoffs, default=0):.2f} s (leases live {ttl:g} s)",
        counters,
        settled_in,
    )
    print(said)
    assert failed == [] and set(codes) == {0}, said
    assert max(handoffs, default=0) < ttl / 2, said
    assert_nothing_lost_or_doubled(counters, said)


async def owner(stub: runtime_pb2_grpc.RuntimeServiceStub, desk: Desk) -> str:
    """The replica that runs the desk's agent, as the replica behind `stub` sees it."""
    got = await call(stub.GetAgent, rpb.GetAgentRequest(agent_id=desk.agent.id), desk.world.md(0))
    return str(got.agent.replica)  # type: ignore[attr-defined]


# Replica fault 5: scaling from three replicas to four.


@pytest.mark.timeout(scaled(120, long=400))
async def test_a_fourth_replica_takes_a_quarter_of_the_shards_and_nothing_else_moves(
    ims: tuple[RunningIM, RunningIM], own_runtime_url: str, redis_url: str, llm: DecidingLLM, tmp_path: Path
) -> None:
    """Under load, a fourth replica joins three: it takes a quarter of the
    shards (moves within 10% of that), no other shard changes hands, the
    most loaded replica holds at most 1.25 times the average, and nothing is
    lost or doubled."""
    im = ims[0]
    async with cluster(ims, own_runtime_url, redis_url, llm, tmp_path, LOG_LEVEL="INFO") as replicas:
        async with asking(im, replicas):
            before = await settled_owners(own_runtime_url, 3)
            replicas.add()
            after = await settled_owners(own_runtime_url, 4)
        counters, settled_in = await settled(im, replicas)
    shards = len(after)
    moved = sum(before.get(shard) != owner for shard, owner in after.items())
    load = Counter(after.values())
    most = max(load.values()) / (shards / len(load))
    said = summary(
        "scale 3 to 4",
        f"{moved} of {shards} shards moved (a quarter is {shards / 4:g}), loads {sorted(load.values())},"
        f" the most loaded {most:.2f}x the average",
        counters,
        settled_in,
    )
    print(said)
    assert abs(moved - shards / 4) <= shards / 4 * 0.1, said
    assert most <= 1.25, said
    assert_nothing_lost_or_doubled(counters, said)


async def settled_owners(database_url: str, replicas: int) -> dict[int, str]:
    """Each shard's owner once `replicas` replicas hold every shard and
    nothing has moved for a few renewals."""
    url = database_url.replace("postgresql+asyncpg://", "postgresql://")
    connection = await asyncpg.connect(url)
    try:
        last: dict[int, str] = {}
        steady = 0
        async with asyncio.timeout(60):
            while steady < 4:
                rows = await connection.fetch(
                    "SELECT shard, owner FROM runtime.shard_leases WHERE owner IS NOT NULL"
                    " AND expires_at > extract(epoch FROM clock_timestamp())"
                )
                owners = {int(r["shard"]): str(r["owner"]) for r in rows}
                complete = len(set(owners.values())) == replicas and len(owners) == SHARDS
                steady = steady + 1 if complete and owners == last else 0
                last = owners
                await asyncio.sleep(0.5)
        return last
    finally:
        await connection.close()
