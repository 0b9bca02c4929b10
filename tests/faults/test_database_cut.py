"""Fault case 6: the PostgreSQL connections of a real IM and a real runtime cut under load.

An IM process and a runtime process (with agents on the offline model) serve
callers in loops: people sending messages (each retried with its request_id
until acknowledged), reading unread messages, chats and history, messaging
the agents; others reading agents and runs and submitting tasks. Meanwhile
every connection the two services hold to the database is terminated
(`pg_terminate_backend`, by the application names the services set, in this
test's database only), several times. Callers see only OK or UNAVAILABLE,
each succeeds again within a second of every cut, nothing acknowledged is
lost, and the agents end IDLE with no run left RUNNING.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import grpc

from agentim.im.v1 import im_pb2, im_pb2_grpc
from agentim.runtime.v1 import runtime_pb2 as rpb
from agentim.runtime.v1 import runtime_pb2_grpc
from services.common.sql import async_url
from tests.faults.harness import ServiceProcess, clean_environment, migrate, scaled
from tests.identities import as_member, learning_channel

# The bound on recovery, and slack for a loaded 2-core machine.
RECOVERY_S = 1.0
SLACK_S = 0.5
AGENTS = 3
CUT = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
    " WHERE datname = current_database() AND application_name IN ('agentim-im', 'agentim-runtime')"
)


@dataclass
class Call:
    started: float
    ended: float
    code: grpc.StatusCode


@dataclass
class Caller:
    """One client calling one RPC in a loop, each request retried until it succeeds."""

    name: str
    call: Callable[[int], Awaitable[Any]]
    pause: float = 0.01
    calls: list[Call] = field(default_factory=list)
    acknowledged: list[Any] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        index = 0
        while not stop.is_set():
            started = time.monotonic()
            try:
                result = await self.call(index)
            except grpc.aio.AioRpcError as error:
                self.calls.append(Call(started, time.monotonic(), error.code()))
                await asyncio.sleep(0.02)
                continue  # the same request again
            self.calls.append(Call(started, time.monotonic(), grpc.StatusCode.OK))
            self.acknowledged.append(result)
            index += 1
            await asyncio.sleep(self.pause)

    def recovery(self, cut: float) -> float:
        """Seconds from the cut to the end of this caller's first success begun after it."""
        after = [c.ended for c in self.calls if c.started >= cut and c.code is grpc.StatusCode.OK]
        assert after, f"{self.name} never succeeded after the cut at {cut:.3f}"
        return min(after) - cut


async def fresh_runtime_schema(url: str) -> None:
    """The runtime keeps agents across runs of the suite; start from none, as the IM's schema does."""
    conn = await asyncpg.connect(async_url(url).replace("postgresql+asyncpg", "postgresql"))
    try:
        await conn.execute("DROP SCHEMA IF EXISTS runtime CASCADE")
    finally:
        await conn.close()


async def cut_connections(url: str) -> int:
    conn = await asyncpg.connect(async_url(url).replace("postgresql+asyncpg", "postgresql"))
    try:
        return int(await conn.fetchval(CUT))
    finally:
        await conn.close()


@dataclass
class World:
    ada: str
    bob: str
    group_id: str
    agents: list[rpb.Agent]
    chats: list[str]


async def make_world(im: im_pb2_grpc.IMServiceStub, runtime: runtime_pb2_grpc.RuntimeServiceStub) -> World:
    created = await im.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(name="database-cut", creator_display_name="ada"), timeout=10
    )
    ada = created.creator.id
    md = as_member(ada)
    bob = (
        await im.CreateMember(
            im_pb2.CreateMemberRequest(kind=im_pb2.MEMBER_KIND_HUMAN, display_name="bob"),
            metadata=md,
            timeout=10,
        )
    ).member.id
    group = await im.CreateGroup(
        im_pb2.CreateGroupRequest(name="g", member_ids=[bob]), metadata=md, timeout=10
    )
    agents = [
        (await runtime.CreateAgent(rpb.CreateAgentRequest(name=f"agent-{i}"), metadata=md, timeout=10)).agent
        for i in range(AGENTS)
    ]
    chats = [
        (
            await im.GetOrCreateDirectGroup(
                im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=agent.member_id), metadata=md, timeout=10
            )
        ).group.id
        for agent in agents
    ]
    return World(ada, bob, group.group.id, agents, chats)


def callers(
    im: im_pb2_grpc.IMServiceStub, runtime: runtime_pb2_grpc.RuntimeServiceStub, w: World
) -> list[Caller]:
    ada, bob = as_member(w.ada), as_member(w.bob)
    agent = w.agents[0].id

    def sender(name: str, group_id: str, pause: float = 0.01) -> Caller:
        async def send(index: int) -> str:
            content = f"{name}-{index}"
            request = im_pb2.SendMessageRequest(group_id=group_id, content=content, request_id=content)
            await im.SendMessage(request, metadata=ada, timeout=5)
            return content

        return Caller(name, send, pause)

    async def submit(index: int) -> str:
        request = rpb.SubmitTaskRequest(agent_id=agent, input=f"task {index}", request_id=f"task-{index}")
        return (await runtime.SubmitTask(request, metadata=ada, timeout=5)).task.id

    return [
        sender("send-a", w.group_id),
        sender("send-b", w.group_id),
        *[sender(f"ask-{i}", chat, pause=0.3) for i, chat in enumerate(w.chats)],
        Caller("unread", lambda _: im.GetAllUnread(im_pb2.GetAllUnreadRequest(), metadata=bob, timeout=5)),
        Caller("chats", lambda _: im.ListChats(im_pb2.ListChatsRequest(), metadata=bob, timeout=5)),
        Caller(
            "history",
            lambda _: im.ListMessages(
                im_pb2.ListMessagesRequest(group_id=w.group_id, page_size=20), metadata=bob, timeout=5
            ),
        ),
        Caller(
            "agent", lambda _: runtime.GetAgent(rpb.GetAgentRequest(agent_id=agent), metadata=ada, timeout=5)
        ),
        Caller(
            "runs", lambda _: runtime.ListRuns(rpb.ListRunsRequest(agent_id=agent), metadata=ada, timeout=5)
        ),
        Caller("tasks", submit, pause=0.2),
    ]


async def settled(runtime: runtime_pb2_grpc.RuntimeServiceStub, w: World, tasks: list[str]) -> dict[str, Any]:
    """Waits (at most 60 s) until every agent is idle with no run in flight and every task done."""
    md = as_member(w.ada)
    deadline = time.monotonic() + 60
    while True:
        agents = (
            await runtime.ListAgents(rpb.ListAgentsRequest(page_size=100), metadata=md, timeout=10)
        ).agents
        runs = [
            run
            for a in agents
            for run in (
                await runtime.ListRuns(
                    rpb.ListRunsRequest(agent_id=a.id, page_size=1000), metadata=md, timeout=10
                )
            ).runs
        ]
        done = [
            (await runtime.GetTask(rpb.GetTaskRequest(task_id=t), metadata=md, timeout=10)).task
            for t in tasks
        ]
        state = {
            "agents": Counter(rpb.AgentState.Name(a.state) for a in agents),
            "runs": Counter(rpb.RunStatus.Name(r.status) for r in runs),
            "tasks": Counter(rpb.TaskStatus.Name(t.status) for t in done),
        }
        idle = all(a.state == rpb.AGENT_STATE_IDLE for a in agents)
        running = any(r.status == rpb.RUN_STATUS_RUNNING for r in runs)
        finished = all(t.status == rpb.TASK_STATUS_SUCCEEDED for t in done)
        if (idle and not running and finished) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.2)


async def stored_contents(im: im_pb2_grpc.IMServiceStub, group_id: str, member_id: str) -> Counter[str]:
    contents: Counter[str] = Counter()
    token = ""
    while True:
        page = await im.ListMessages(
            im_pb2.ListMessagesRequest(group_id=group_id, page_size=200, page_token=token),
            metadata=as_member(member_id),
            timeout=10,
        )
        contents.update(m.content for m in page.messages)
        token = page.next_page_token
        if not token:
            return contents


async def unread_settled(im: im_pb2_grpc.IMServiceStub, world: World, within: float = 15.0) -> list[int]:
    """Each agent's count of unread messages, once all are read or `within` has passed:
    the agents' read positions move in the IM a while after their runs
    (RUNTIME_READ_POSITION_DELAY_SECONDS), and again after a failed move."""
    deadline = time.monotonic() + within
    while True:
        unread = [
            len(
                (
                    await im.GetAllUnread(
                        im_pb2.GetAllUnreadRequest(), metadata=as_member(a.member_id), timeout=10
                    )
                ).messages
            )
            for a in world.agents
        ]
        if not any(unread) or time.monotonic() > deadline:
            return unread
        await asyncio.sleep(0.2)


async def test_cut_database_connections_give_unavailable_and_everything_recovers(
    postgres_url: str, tmp_path: Path
) -> None:
    count = scaled(3, long=10)
    rng = random.Random(uuid.uuid4().int)
    await fresh_runtime_schema(postgres_url)
    im_env = clean_environment(DATABASE_URL=postgres_url, IM_GRPC_ADDRESS="127.0.0.1:0")
    migrate("services.im", im_env)
    with ServiceProcess("services.im", im_env, tmp_path / "im.log") as im_process:
        im_process.start()
        runtime_env = clean_environment(
            DATABASE_URL=postgres_url, IM_ADDRESS=im_process.address, RUNTIME_GRPC_ADDRESS="127.0.0.1:0"
        )
        migrate("services.runtime", runtime_env)
        with ServiceProcess("services.runtime", runtime_env, tmp_path / "runtime.log") as runtime_process:
            runtime_process.start()
            async with (
                learning_channel(im_process.address) as to_im,
                learning_channel(runtime_process.address) as to_runtime,
            ):
                im = im_pb2_grpc.IMServiceStub(to_im)
                runtime = runtime_pb2_grpc.RuntimeServiceStub(to_runtime)
                world = await make_world(im, runtime)
                load = callers(im, runtime, world)
                stop = asyncio.Event()
                running = [asyncio.create_task(c.run(stop)) for c in load]
                cuts: list[float] = []
                terminated = 0
                try:
                    await asyncio.sleep(1.0)
                    for _ in range(count):
                        terminated += await cut_connections(postgres_url)
                        cuts.append(time.monotonic())
                        await asyncio.sleep(rng.uniform(1.2, 2.0))
                finally:
                    stop.set()
                    await asyncio.gather(*running)
                tasks = next(c for c in load if c.name == "tasks").acknowledged
                final = await settled(runtime, world, tasks)
                stored = Counter[str]()
                for group_id in [world.group_id, *world.chats]:
                    stored += await stored_contents(im, group_id, world.ada)
                unread = await unread_settled(im, world)

    statuses = Counter(call.code.name for c in load for call in c.calls)
    recoveries = [c.recovery(cut) for cut in cuts for c in load]
    failures_after = [
        call.ended - max(cut for cut in cuts if cut <= call.ended)
        for c in load
        for call in c.calls
        if call.code is not grpc.StatusCode.OK and call.ended >= cuts[0]
    ]
    sent = [content for c in load if c.name.startswith(("send", "ask")) for content in c.acknowledged]
    lost = [content for content in sent if stored[content] == 0]
    duplicated = [content for content in sent if stored[content] > 1]
    assert set(statuses) <= {"OK", "UNAVAILABLE"}, f"callers saw {dict(statuses)}"
    assert terminated >= count, "every cut terminated connections"
    assert max(recoveries) <= RECOVERY_S + SLACK_S, f"a caller took {max(recoveries):.3f}s to succeed again"
    assert lost == [] and duplicated == [], f"{len(lost)} acknowledged messages lost, {len(duplicated)} twice"
    assert final["agents"] == {"AGENT_STATE_IDLE": AGENTS}, f"agents ended {dict(final['agents'])}"
    assert "RUN_STATUS_RUNNING" not in final["runs"], f"runs ended {dict(final['runs'])}"
    assert final["tasks"] == {"TASK_STATUS_SUCCEEDED": len(tasks)}, f"tasks ended {dict(final['tasks'])}"
    assert unread == [0] * AGENTS, "every message to an agent was read"
    print(
        f"database cut: {count} cuts ({terminated} connections terminated),"
        f" {sum(statuses.values())} calls by {len(load)} callers: {dict(statuses)};"
        f" each caller's first success after a cut p50 {statistics.median(recoveries) * 1000:.0f} ms"
        f" max {max(recoveries) * 1000:.0f} ms (callers pause up to 300 ms between calls),"
        f" the last UNAVAILABLE {max(failures_after, default=0.0) * 1000:.0f} ms after its cut;"
        f" {len(sent)} messages and {len(tasks)} tasks acknowledged,"
        f" {len(lost)} lost, {len(duplicated)} stored twice;"
        f" agents {dict(final['agents'])}, runs {dict(final['runs'])}, tasks {dict(final['tasks'])}"
    )
