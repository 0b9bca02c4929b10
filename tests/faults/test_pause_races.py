"""Fault case 8: a pause asked for at random moments of 40 runs.

Each trial asks an agent for a tool round and an answer, pauses it after a
random delay (before its run begins, mid-stream, mid-tool, as it answers, or
after it is done), waits for it to be PAUSED, resumes it, then asks it
something unrelated. Every pause must take effect (at a step boundary or as
the run ends), PauseAgent must answer PAUSED or RUNNING with the pause
pending, and no later run may be paused by a request that was already served.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from tests.conftest import RunningIM, World, make_world
from tests.faults.harness import scaled
from tests.faults.llm import DecidingLLM, instruction
from tests.integration.test_runtime_grpc import RunningRuntime, start_runtime, stop_runtime

WAIT = 10.0


@pytest.fixture
async def llm() -> AsyncIterator[DecidingLLM]:
    server = DecidingLLM(delay=0.01)
    await server.start()
    yield server
    await server.stop()


@dataclass
class Tally:
    trials: int = 0
    answered_paused: int = 0
    answered_pending: int = 0
    lost: int = 0  # never became PAUSED
    left_pending: int = 0  # PAUSED with the pause still pending
    stale: int = 0  # a later, unrelated run paused
    unanswered: int = 0


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_pause_at_any_moment_takes_effect_once_and_never_carries_over(
    im: RunningIM, llm: DecidingLLM, tmp_path: Path
) -> None:
    agents, per_agent = 8, scaled(5, long=25)
    world = await make_world(im.stub, people=2)
    runtime = await start_runtime(
        im.address, tmp_path / "runtime.db", OPENAI_BASE_URL=llm.url, OPENAI_MODEL="fake"
    )
    tally = Tally()
    try:
        created = [
            (
                await runtime.stub.CreateAgent(
                    rpb.CreateAgentRequest(name=f"agent-{i}", tools=["send_direct_message"]),
                    metadata=world.md(0),
                )
            ).agent
            for i in range(agents)
        ]
        started = time.monotonic()
        await asyncio.gather(*(trials(Lab(im, runtime, world, tally), agent, per_agent) for agent in created))
        elapsed = time.monotonic() - started
    finally:
        await stop_runtime(runtime)
    print(
        f"pause races: {tally.trials} trials in {elapsed:.1f}s, PauseAgent answered PAUSED"
        f" {tally.answered_paused} and RUNNING with the pause pending {tally.answered_pending} times,"
        f" {tally.lost} pauses lost, {tally.left_pending} left pending, {tally.stale} later runs paused,"
        f" {tally.unanswered} messages unanswered"
    )
    assert tally.trials == agents * per_agent
    assert tally.answered_paused + tally.answered_pending == tally.trials
    assert (tally.lost, tally.left_pending, tally.stale, tally.unanswered) == (0, 0, 0, 0)


@dataclass
class Lab:
    im: RunningIM
    runtime: RunningRuntime
    world: World
    tally: Tally


async def trials(lab: Lab, agent: rpb.Agent, count: int) -> None:
    im, runtime, world, tally = lab.im, lab.runtime, lab.world, lab.tally
    rng = random.Random(uuid.uuid4().int)
    chat = (
        await im.stub.GetOrCreateDirectGroup(
            im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=agent.member_id), metadata=world.md(0)
        )
    ).group
    bea = world.members[1].display_name
    md = world.md(0)
    for number in range(count):
        tally.trials += 1
        token = f"{agent.name}-p{number}"
        await im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=chat.id, content=instruction(token, bea)), metadata=md
        )
        await asyncio.sleep(rng.uniform(0, 0.25))
        try:
            paused = (
                await runtime.stub.PauseAgent(rpb.PauseAgentRequest(agent_id=agent.id), metadata=md)
            ).agent
        except grpc.aio.AioRpcError as error:
            # Already PAUSED, by nobody's request for this run: a stale one.
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
            tally.stale += 1
            await runtime.stub.ResumeAgent(rpb.ResumeAgentRequest(agent_id=agent.id), metadata=md)
            continue
        if paused.state == rpb.AGENT_STATE_PAUSED:
            tally.answered_paused += 1
        elif paused.state == rpb.AGENT_STATE_RUNNING and paused.pause_pending:
            tally.answered_pending += 1
        now = await state_within(runtime, world, agent, {rpb.AGENT_STATE_PAUSED})
        if now is None:
            tally.lost += 1
            continue
        tally.left_pending += now.pause_pending
        await runtime.stub.ResumeAgent(rpb.ResumeAgentRequest(agent_id=agent.id), metadata=md)
        if not await answered(im, world, chat.id, token):
            tally.unanswered += 1
        # Something unrelated afterwards: answered, and the agent is never paused for it.
        later = f"{agent.name}-q{number}"
        await im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=chat.id, content=instruction(later, bea)), metadata=md
        )
        if not await answered(im, world, chat.id, later):
            tally.unanswered += 1
        settled = await state_within(runtime, world, agent, {rpb.AGENT_STATE_IDLE, rpb.AGENT_STATE_PAUSED})
        if settled is None or settled.state == rpb.AGENT_STATE_PAUSED:
            tally.stale += 1
            await runtime.stub.ResumeAgent(rpb.ResumeAgentRequest(agent_id=agent.id), metadata=md)


async def state_within(
    runtime: RunningRuntime, world: World, agent: rpb.Agent, states: set[int]
) -> rpb.Agent | None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        got = (
            await runtime.stub.GetAgent(rpb.GetAgentRequest(agent_id=agent.id), metadata=world.md(0))
        ).agent
        if got.state in states:
            return got
        await asyncio.sleep(0.02)
    return None


async def answered(im: RunningIM, world: World, group_id: str, token: str) -> bool:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        page = await im.stub.ListMessages(
            im_pb2.ListMessagesRequest(group_id=group_id, page_size=20), metadata=world.md(0)
        )
        if Counter(m.content for m in page.messages)[f"done {token}"]:
            return True
        await asyncio.sleep(0.02)
    return False
