"""Agent lifecycle over gRPC (issue 5): the controls, their refusals, the
events on the agent's stream, and states that survive a restart."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import grpc
import pytest

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from tests.conftest import RunningIM, make_world
from tests.integration.test_runtime_grpc import (
    WAIT,
    RunningRuntime,
    create_agent,
    direct_chat,
    start_runtime,
    stop_runtime,
    wait_for_messages,
)


async def states_seen(
    runtime: RunningRuntime, agent_id: str, metadata: object, until: int
) -> asyncio.Task[list[int]]:
    """Watches the agent's stream (subscribed when this returns) and collects
    its state changes, until (and with) `until`."""
    call = runtime.stub.WatchAgent(
        rpb.WatchAgentRequest(agent_id=agent_id, live_only=True),
        metadata=metadata,
    )
    # The runtime answers with its headers once the watch is subscribed.
    await asyncio.wait_for(call.wait_for_connection(), WAIT)

    async def collect() -> list[int]:
        states: list[int] = []
        try:
            while not states or states[-1] != until:
                response = await asyncio.wait_for(call.read(), WAIT)
                if response.event.WhichOneof("event") == "state_changed":
                    states.append(response.event.state_changed.state)
        finally:
            call.cancel()
        return states

    return asyncio.create_task(collect())


async def test_pause_resume_terminate_start_over_grpc(im: RunningIM, tmp_path: Path) -> None:
    runtime = await start_runtime(im.address, tmp_path / "runtime.db")
    try:
        world = await make_world(im.stub, people=1)
        ada = await create_agent(runtime, world, "ada")
        md = world.md(0)
        watching = await states_seen(runtime, ada.id, md, rpb.AGENT_STATE_TERMINATED)

        paused = await runtime.stub.PauseAgent(rpb.PauseAgentRequest(agent_id=ada.id), metadata=md)
        assert paused.agent.state == rpb.AGENT_STATE_PAUSED
        chat = await direct_chat(im, world, ada.member_id)
        await im.stub.SendMessage(im_pb2.SendMessageRequest(group_id=chat.id, content="hello"), metadata=md)
        await asyncio.sleep(0.2)
        page = await im.stub.ListMessages(im_pb2.ListMessagesRequest(group_id=chat.id), metadata=md)
        assert len(page.messages) == 1, "a paused agent does not answer"

        resumed = await runtime.stub.ResumeAgent(rpb.ResumeAgentRequest(agent_id=ada.id), metadata=md)
        assert resumed.agent.state in (rpb.AGENT_STATE_IDLE, rpb.AGENT_STATE_RUNNING)
        messages = await wait_for_messages(im, world.members[0].id, chat.id, 2)
        assert messages[1].sender_id == ada.member_id

        terminated = await runtime.stub.TerminateAgent(
            rpb.TerminateAgentRequest(agent_id=ada.id, queue_policy=rpb.QUEUE_POLICY_KEEP), metadata=md
        )
        assert terminated.agent.state == rpb.AGENT_STATE_TERMINATED
        states = await asyncio.wait_for(watching, WAIT)
        assert states[0] == rpb.AGENT_STATE_PAUSED and rpb.AGENT_STATE_IDLE in states
    finally:
        await stop_runtime(runtime)

    # The state is kept across a restart: still terminated, then started.
    runtime = await start_runtime(im.address, tmp_path / "runtime.db")
    try:
        got = await runtime.stub.GetAgent(rpb.GetAgentRequest(agent_id=ada.id), metadata=md)
        assert got.agent.state == rpb.AGENT_STATE_TERMINATED
        await im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=chat.id, content="while terminated"), metadata=md
        )
        started = await runtime.stub.StartAgent(rpb.StartAgentRequest(agent_id=ada.id), metadata=md)
        assert started.agent.state in (rpb.AGENT_STATE_IDLE, rpb.AGENT_STATE_RUNNING)
        messages = await wait_for_messages(im, world.members[0].id, chat.id, 4)
        assert messages[3].sender_id == ada.member_id and "while terminated" in messages[3].content
    finally:
        await stop_runtime(runtime)


async def test_controls_refused_with_clear_statuses(im: RunningIM, tmp_path: Path) -> None:
    runtime = await start_runtime(im.address, tmp_path / "runtime.db")
    try:
        world = await make_world(im.stub, people=1)
        ada = await create_agent(runtime, world, "ada")
        md = world.md(0)
        refusals = [
            (runtime.stub.ResumeAgent(rpb.ResumeAgentRequest(agent_id=ada.id), metadata=md), "resume"),
            (runtime.stub.StartAgent(rpb.StartAgentRequest(agent_id=ada.id), metadata=md), "start"),
            (
                runtime.stub.InterruptAgent(rpb.InterruptAgentRequest(agent_id=ada.id), metadata=md),
                "interrupt",
            ),
        ]
        for call, verb in refusals:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"cannot {verb} an agent that is IDLE" in (caught.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await runtime.stub.PauseAgent(rpb.PauseAgentRequest(agent_id=str(uuid.uuid4())), metadata=md)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as malformed:
            await runtime.stub.PauseAgent(rpb.PauseAgentRequest(agent_id="nope"), metadata=md)
        assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await stop_runtime(runtime)
