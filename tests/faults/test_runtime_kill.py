"""Fault case 3: `kill -9` of the runtime during tool-calling runs and queued tasks.

Agents work through queued tasks and chat messages, each of which asks them
to send a token to Bea (a tool call, then an answer); people keep writing to
them; meanwhile the runtime process is killed with SIGKILL at random moments
and started again. When all is done: every token reached Bea exactly once,
every chat message became exactly one input step, no task is left RUNNING or
died, every tool call has exactly one result, and no agent is in ERROR.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from agentim.runtime.v1 import runtime_pb2_grpc
from tests.conftest import RunningIM, World, make_world
from tests.faults.harness import ServiceProcess, clean_environment, migrate, scaled
from tests.faults.llm import DecidingLLM, instruction
from tests.faults.test_im_kill import FAST_RECONNECT, RETRYABLE
from tests.identities import as_member, learning_channel

AGENTS = 4
SETTLE_SECONDS = 90.0
TERMINAL = {rpb.TASK_STATUS_SUCCEEDED, rpb.TASK_STATUS_DEAD, rpb.TASK_STATUS_CANCELLED}


T = TypeVar("T")


@dataclass
class Work:
    """Agents, who asks them for what, and how to reach them."""

    im: RunningIM
    world: World
    runtime: runtime_pb2_grpc.RuntimeServiceStub
    agents: list[rpb.Agent] = field(default_factory=list)
    task_tokens: list[str] = field(default_factory=list)
    chat_tokens: list[str] = field(default_factory=list)

    @property
    def bea(self) -> im_pb2.Member:
        return self.world.members[1]

    async def call(self, method: Callable[..., Awaitable[T]], request: object) -> T:
        """A call to the runtime as Ada, made again while the runtime is away (being restarted)."""
        while True:
            try:
                return await method(request, metadata=self.world.md(0), timeout=5, wait_for_ready=True)
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRYABLE:
                    raise
                await asyncio.sleep(0.05)

    async def create_agents(self, count: int) -> None:
        for index in range(count):
            request = rpb.CreateAgentRequest(
                name=f"agent-{index}", tools=["send_direct_message"], request_id=f"a{index}"
            )
            created = await self.call(self.runtime.CreateAgent, request)
            self.agents.append(created.agent)

    async def submit_tasks(self, per_agent: int) -> None:
        for index, agent in enumerate(self.agents):
            for number in range(per_agent):
                token = f"t{index}-{number}"
                self.task_tokens.append(token)
                request = rpb.SubmitTaskRequest(
                    agent_id=agent.id, input=instruction(token, self.bea.display_name), request_id=token
                )
                await self.call(self.runtime.SubmitTask, request)

    async def chatter(self) -> None:
        """Ada asks the agents, at random moments, to send a token to Bea."""
        chats = [await self.direct_chat(agent.member_id) for agent in self.agents]
        rng = random.Random(uuid.uuid4().int)
        while True:
            await asyncio.sleep(rng.uniform(0.1, 0.4))
            index = rng.randrange(len(chats))
            token = f"c{index}-{len(self.chat_tokens)}"
            await self.im.stub.SendMessage(
                im_pb2.SendMessageRequest(
                    group_id=chats[index].id, content=instruction(token, self.bea.display_name)
                ),
                metadata=self.world.md(0),
            )
            self.chat_tokens.append(token)

    async def direct_chat(self, peer: str, *, as_member_id: str = "") -> im_pb2.Group:
        request = im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=peer)
        metadata = as_member(as_member_id or self.world.members[0].id)
        while True:
            try:
                response = await self.im.stub.GetOrCreateDirectGroup(request, metadata=metadata, timeout=5)
                return response.group
            except grpc.aio.AioRpcError as error:
                # The IM's SQLite file is busy with the runtime's writes ("try again").
                if error.code() not in RETRYABLE:
                    raise
                await asyncio.sleep(0.05)

    async def tasks(self, agent: rpb.Agent) -> list[rpb.Task]:
        request = rpb.ListTasksRequest(agent_id=agent.id, page_size=200)
        return list((await self.call(self.runtime.ListTasks, request)).tasks)

    async def steps(self, agent: rpb.Agent) -> list[rpb.Step]:
        found: list[rpb.Step] = []
        while True:
            after = found[-1].sequence if found else 0
            request = rpb.ListStepsRequest(agent_id=agent.id, page_size=200, after_sequence=after)
            page = await self.call(self.runtime.ListSteps, request)
            found += page.steps
            if len(page.steps) < 200:
                return found


@dataclass
class Counters:
    tokens: int = 0
    delivered: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    input_twice: list[str] = field(default_factory=list)
    input_missed: list[str] = field(default_factory=list)
    stuck: int = 0
    dead: int = 0
    unpaired: int = 0
    errored: int = 0
    runs_running: int = 0
    # For each token asked for and never delivered: the results of the calls that tried to send it.
    tried: dict[str, list[str]] = field(default_factory=dict)


async def test_killing_the_runtime_mid_run_repeats_and_loses_nothing(
    im: RunningIM, database_url: str, llm: DecidingLLM, tmp_path: Path
) -> None:
    kills = scaled(5, long=20)
    tasks_per_agent = scaled(4, long=10)
    world = await make_world(im.stub, people=2)
    runtime_db = database_url if database_url.startswith("postgresql") else f"sqlite:///{tmp_path / 'rt.db'}"
    env = clean_environment(
        RUNTIME_DATABASE_URL=runtime_db,
        RUNTIME_GRPC_ADDRESS="127.0.0.1:0",
        IM_ADDRESS=im.address,
        OPENAI_BASE_URL=llm.url,
        OPENAI_MODEL="fake",
        LLM_MAX_RETRIES="2",
        IM_CALL_TIMEOUT_SECONDS="5",
    )
    migrate("services.runtime", env)
    with ServiceProcess("services.runtime", env, tmp_path / "runtime.log") as process:
        process.start()
        process.pin_address("RUNTIME_GRPC_ADDRESS")
        channel = learning_channel(process.address, options=FAST_RECONNECT)
        work = Work(im, world, runtime_pb2_grpc.RuntimeServiceStub(channel))
        await work.create_agents(AGENTS)
        await work.submit_tasks(tasks_per_agent)
        chatting = asyncio.create_task(work.chatter())
        rng = random.Random(uuid.uuid4().int)
        try:
            for _ in range(kills):
                await asyncio.sleep(rng.uniform(0.3, 1.2))
                process.kill()
                await asyncio.sleep(rng.uniform(0.0, 0.3))
                process.start()
        finally:
            chatting.cancel()
            await asyncio.gather(chatting, return_exceptions=True)
        started = time.monotonic()
        counters = await settle(work)
        settled_in = time.monotonic() - started
        # Gone from the (maybe shared) database, so that no later runtime starts them.
        for agent in work.agents:
            await work.call(work.runtime.DeleteAgent, rpb.DeleteAgentRequest(agent_id=agent.id))
        await channel.close()

    summary = (
        f"runtime kill: {kills} kills, {len(work.task_tokens)} tasks,"
        f" {len(work.chat_tokens)} chat messages,"
        f" {counters.delivered}/{counters.tokens} tokens delivered, {len(counters.duplicated)} duplicated,"
        f" {len(counters.lost)} lost, {len(counters.input_twice)} inputs twice,"
        f" {len(counters.input_missed)} missed, {counters.stuck} tasks stuck RUNNING, {counters.dead} dead,"
        f" {counters.unpaired} unpaired tool calls, {counters.errored} agents in ERROR,"
        f" settled {settled_in:.1f}s after the last restart"
    )
    if counters.lost:
        summary += "; the lost ones' sends: " + repr({t: counters.tried.get(t, []) for t in counters.lost})
    print(summary)
    assert process.starts == kills + 1
    assert counters.duplicated == [], summary
    assert counters.lost == [], summary
    assert counters.input_twice == [] and counters.input_missed == [], summary
    assert (counters.stuck, counters.dead, counters.unpaired, counters.errored) == (0, 0, 0, 0), summary
    assert counters.runs_running == 0, summary


async def settle(work: Work) -> Counters:
    """Waits until the work is done (or the time is up), then counts."""
    expected = set(work.task_tokens) | set(work.chat_tokens)
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        counters = await count(work, expected)
        ended = [t.status in TERMINAL for agent in work.agents for t in await work.tasks(agent)]
        done = (
            not counters.lost
            and counters.stuck == 0
            and counters.runs_running == 0
            and not counters.input_missed
            and all(ended)
        )
        if done or time.monotonic() > deadline:
            return counters
        await asyncio.sleep(0.25)


async def count(work: Work, expected: set[str]) -> Counters:
    counters = Counters(tokens=len(expected))
    delivered: Counter[str] = Counter()
    inputs: Counter[str] = Counter()
    for agent in work.agents:
        dm = await work.direct_chat(agent.member_id, as_member_id=work.bea.id)
        for message in await all_messages(work.im, dm.id, work.bea.id):
            delivered[message.content] += 1
        steps = await work.steps(agent)
        calls = Counter(call.id for step in steps for call in step.tool_calls)
        results = Counter(step.tool_call_id for step in steps if step.role == rpb.STEP_ROLE_TOOL)
        result_of = {step.tool_call_id: step.content for step in steps if step.role == rpb.STEP_ROLE_TOOL}
        for step in steps:
            for call in step.tool_calls:
                for token in expected:
                    if f'"{token}"' in call.arguments:
                        counters.tried.setdefault(token, []).append(result_of.get(call.id, "(no result)"))
        counters.unpaired += sum((calls - results).values()) + sum((results - calls).values())
        counters.unpaired += sum(n - 1 for n in results.values() if n > 1)
        for step in steps:
            if step.role == rpb.STEP_ROLE_USER:
                inputs.update(token for token in expected if f"send {token} to" in step.content)
        statuses = [task.status for task in await work.tasks(agent)]
        counters.stuck += statuses.count(rpb.TASK_STATUS_RUNNING)
        counters.dead += statuses.count(rpb.TASK_STATUS_DEAD)
        got = await work.call(work.runtime.GetAgent, rpb.GetAgentRequest(agent_id=agent.id))
        counters.errored += got.agent.state == rpb.AGENT_STATE_ERROR
        runs = await work.call(work.runtime.ListRuns, rpb.ListRunsRequest(agent_id=agent.id, page_size=200))
        counters.runs_running += sum(r.status == rpb.RUN_STATUS_RUNNING for r in runs.runs)
    counters.delivered = sum(1 for token in expected if delivered[token])
    counters.lost = sorted(token for token in expected if not delivered[token])
    counters.duplicated = sorted(content for content, n in delivered.items() if n > 1)
    counters.input_twice = sorted(token for token, n in inputs.items() if n > 1)
    counters.input_missed = sorted(token for token in expected if not inputs[token])
    return counters


async def all_messages(im: RunningIM, group_id: str, member_id: str) -> list[im_pb2.Message]:
    found: list[im_pb2.Message] = []
    token = ""
    while True:
        page = await im.stub.ListMessages(
            im_pb2.ListMessagesRequest(group_id=group_id, page_size=200, page_token=token),
            metadata=as_member(member_id),
        )
        found += page.messages
        token = page.next_page_token
        if not token:
            return found
