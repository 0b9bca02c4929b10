"""Human control of an agent's history over gRPC (issue 5), with a real IM
service and the offline model: edit, delete, notes, checkpoints, sessions,
retry from a step and fork."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import field_mask_pb2

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from tests.conftest import RunningIM, World, make_world
from tests.integration.test_runtime_grpc import (
    WAIT,
    RunningRuntime,
    create_agent,
    direct_chat,
    start_runtime,
    stop_runtime,
    wait_for_messages,
)


@pytest.fixture
async def rt(im: RunningIM, tmp_path: Path) -> AsyncIterator[RunningRuntime]:
    running = await start_runtime(im.address, tmp_path / "runtime.db")
    yield running
    await stop_runtime(running)


async def settled(rt: RunningRuntime, agent_id: str) -> None:
    """Until the agent's runner has nothing left to do."""
    runner = rt.app.runner(uuid.UUID(agent_id))
    assert runner is not None
    await asyncio.sleep(0.05)
    await asyncio.wait_for(runner.idle.wait(), WAIT)


async def steps(rt: RunningRuntime, world: World, agent_id: str, session_id: str = "") -> list[rpb.Step]:
    response = await rt.stub.ListSteps(
        rpb.ListStepsRequest(agent_id=agent_id, session_id=session_id), metadata=world.md(0)
    )
    return list(response.steps)


async def agent_in_chat(im: RunningIM, rt: RunningRuntime, world: World, text: str) -> tuple[rpb.Agent, str]:
    """An agent that answered `text` in a direct chat."""
    ada = await create_agent(rt, world, "ada", system_prompt="Be kind.")
    chat = await direct_chat(im, world, ada.member_id)
    await im.stub.SendMessage(im_pb2.SendMessageRequest(group_id=chat.id, content=text), metadata=world.md(0))
    await wait_for_messages(im, world.members[0].id, chat.id, 2)
    await settled(rt, ada.id)
    return ada, chat.id


async def refused(call: object, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call  # type: ignore[misc]
    assert raised.value.code() == code, raised.value.details()
    return str(raised.value.details())


async def test_pause_edit_delete_note_then_retry_uses_the_corrected_context(
    im: RunningIM, rt: RunningRuntime
) -> None:
    world = await make_world(im.stub, people=1)
    md = world.md(0)
    ada, chat = await agent_in_chat(im, rt, world, "hello")
    assert ada.main_session_id
    edit = rpb.UpdateStepRequest(agent_id=ada.id, sequence=1, content="x")
    details = await refused(rt.stub.UpdateStep(edit, metadata=md), grpc.StatusCode.FAILED_PRECONDITION)
    assert "PAUSED" in details
    await rt.stub.PauseAgent(rpb.PauseAgentRequest(agent_id=ada.id), metadata=md)

    # A watcher that has seen steps 1 and 2.
    watch = rt.stub.WatchAgent(rpb.WatchAgentRequest(agent_id=ada.id), metadata=md)
    for sequence in (1, 2):
        event = (await asyncio.wait_for(watch.read(), WAIT)).event
        assert event.step_completed.sequence == sequence
    first = (await steps(rt, world, ada.id))[0]
    bonjour = first.content.replace("hello", "bonjour")
    edited = await rt.stub.UpdateStep(
        rpb.UpdateStepRequest(agent_id=ada.id, sequence=1, content=bonjour), metadata=md
    )
    assert edited.step.content == bonjour and edited.step.id == first.id
    note = await rt.stub.AddNote(
        rpb.AddNoteRequest(agent_id=ada.id, role=rpb.STEP_ROLE_SYSTEM, content="Answer briefly."),
        metadata=md,
    )
    assert note.step.sequence == 3 and note.step.role == rpb.STEP_ROLE_SYSTEM
    await rt.stub.DeleteStep(rpb.DeleteStepRequest(agent_id=ada.id, sequence=3), metadata=md)
    bad_role = rpb.AddNoteRequest(agent_id=ada.id, role=rpb.STEP_ROLE_TOOL, content="x")
    await refused(rt.stub.AddNote(bad_role, metadata=md), grpc.StatusCode.INVALID_ARGUMENT)
    missing = rpb.DeleteStepRequest(agent_id=ada.id, sequence=9)
    await refused(rt.stub.DeleteStep(missing, metadata=md), grpc.StatusCode.NOT_FOUND)
    rewritten = []
    for _ in range(3):
        event = (await asyncio.wait_for(watch.read(), WAIT)).event
        assert event.WhichOneof("event") == "steps_rewritten"
        rewritten.append(event.steps_rewritten.after_sequence)
    assert rewritten == [0, 2, 2]

    # Retrying from the answer resumes the paused agent, which answers the edited message.
    retried = await rt.stub.RetryFromStep(rpb.RetryFromStepRequest(agent_id=ada.id, sequence=2), metadata=md)
    assert retried.agent.state != rpb.AGENT_STATE_PAUSED
    messages = await wait_for_messages(im, world.members[0].id, chat, 3)
    assert messages[2].content == "(offline model) You said: bonjour"
    await settled(rt, ada.id)
    now = await steps(rt, world, ada.id)
    assert [(s.sequence, s.role) for s in now] == [(1, rpb.STEP_ROLE_USER), (2, rpb.STEP_ROLE_ASSISTANT)]
    assert now[1].content == messages[2].content and not now[1].interrupted
    # The watcher gets the new step 2 although it had an old one.
    while True:
        event = (await asyncio.wait_for(watch.read(), WAIT)).event
        if event.WhichOneof("event") == "step_completed":
            assert (event.step_completed.sequence, event.step_completed.id) == (2, now[1].id)
            break
    watch.cancel()


async def test_retry_after_tool_calls_runs_them_again(im: RunningIM, rt: RunningRuntime) -> None:
    world = await make_world(im.stub, people=1)
    md = world.md(0)
    ada, chat = await agent_in_chat(im, rt, world, "what groups am I in?")
    before = await steps(rt, world, ada.id)
    roles = [s.role for s in before]
    assert roles == [rpb.STEP_ROLE_USER, rpb.STEP_ROLE_ASSISTANT, rpb.STEP_ROLE_TOOL, rpb.STEP_ROLE_ASSISTANT]
    for bad in (1, 5):
        request = rpb.RetryFromStepRequest(agent_id=ada.id, sequence=bad)
        await refused(rt.stub.RetryFromStep(request, metadata=md), grpc.StatusCode.INVALID_ARGUMENT)
    await rt.stub.RetryFromStep(rpb.RetryFromStepRequest(agent_id=ada.id, sequence=3), metadata=md)
    await wait_for_messages(im, world.members[0].id, chat, 3)
    await settled(rt, ada.id)
    after = await steps(rt, world, ada.id)
    assert [s.role for s in after] == roles
    assert after[2].id != before[2].id and after[2].tool_call_id == before[2].tool_call_id
    assert after[3].content.startswith("Done:")


async def test_checkpoints_restore_settings_and_steps(im: RunningIM, rt: RunningRuntime) -> None:
    world = await make_world(im.stub, people=1)
    md = world.md(0)
    ada, chat = await agent_in_chat(im, rt, world, "one")
    made = await rt.stub.CreateCheckpoint(
        rpb.CreateCheckpointRequest(agent_id=ada.id, name="start"), metadata=md
    )
    checkpoint = made.checkpoint
    assert (checkpoint.name, checkpoint.sequence, checkpoint.session_id) == ("start", 2, ada.main_session_id)
    assert checkpoint.settings.system_prompt == "Be kind."
    await rt.stub.UpdateAgent(
        rpb.UpdateAgentRequest(
            agent=rpb.Agent(id=ada.id, system_prompt="Be terse."),
            update_mask=field_mask_pb2.FieldMask(paths=["system_prompt"]),
        ),
        metadata=md,
    )
    await rt.stub.CreateCheckpoint(rpb.CreateCheckpointRequest(agent_id=ada.id, name="later"), metadata=md)
    await im.stub.SendMessage(im_pb2.SendMessageRequest(group_id=chat, content="two"), metadata=md)
    await wait_for_messages(im, world.members[0].id, chat, 4)
    await settled(rt, ada.id)

    page = await rt.stub.ListCheckpoints(
        rpb.ListCheckpointsRequest(agent_id=ada.id, page_size=1), metadata=md
    )
    assert [c.name for c in page.checkpoints] == ["later"] and page.next_page_token
    rest = await rt.stub.ListCheckpoints(
        rpb.ListCheckpointsRequest(agent_id=ada.id, page_token=page.next_page_token), metadata=md
    )
    assert [c.name for c in rest.checkpoints] == ["start"] and not rest.next_page_token

    restored = await rt.stub.RestoreCheckpoint(
        rpb.RestoreCheckpointRequest(agent_id=ada.id, checkpoint_id=checkpoint.id), metadata=md
    )
    assert restored.agent.system_prompt == "Be kind."
    assert [s.sequence for s in await steps(rt, world, ada.id)] == [1, 2]
    wrong = rpb.RestoreCheckpointRequest(agent_id=ada.id, checkpoint_id=str(uuid.uuid4()))
    await refused(rt.stub.RestoreCheckpoint(wrong, metadata=md), grpc.StatusCode.NOT_FOUND)
    bad = rpb.RestoreCheckpointRequest(agent_id=ada.id, checkpoint_id="nope")
    await refused(rt.stub.RestoreCheckpoint(bad, metadata=md), grpc.StatusCode.INVALID_ARGUMENT)
    unknown = rpb.CreateCheckpointRequest(agent_id=str(uuid.uuid4()), name="x")
    await refused(rt.stub.CreateCheckpoint(unknown, metadata=md), grpc.StatusCode.NOT_FOUND)

    # The agent goes on from the restored state.
    await im.stub.SendMessage(im_pb2.SendMessageRequest(group_id=chat, content="three"), metadata=md)
    await wait_for_messages(im, world.members[0].id, chat, 6)
    await settled(rt, ada.id)
    assert [s.sequence for s in await steps(rt, world, ada.id)] == [1, 2, 3, 4]


async def test_fork_into_a_session_and_into_a_clone_agent(im: RunningIM, rt: RunningRuntime) -> None:
    world = await make_world(im.stub, people=1)
    md = world.md(0)
    ada, _ = await agent_in_chat(im, rt, world, "hello")
    original = await steps(rt, world, ada.id)

    watch = rt.stub.WatchAgent(rpb.WatchAgentRequest(agent_id=ada.id, live_only=True), metadata=md)
    await asyncio.wait_for(watch.wait_for_connection(), WAIT)
    forked = await rt.stub.ForkFromStep(rpb.ForkFromStepRequest(agent_id=ada.id, sequence=1), metadata=md)
    fork = forked.session
    assert fork.main and fork.forked_from_session_id == ada.main_session_id and fork.forked_at_sequence == 1
    assert forked.agent.id == ada.id and forked.agent.main_session_id == fork.id
    event = (await asyncio.wait_for(watch.read(), WAIT)).event
    assert event.WhichOneof("event") == "main_session_changed" and event.main_session_changed.id == fork.id
    watch.cancel()
    await settled(rt, ada.id)
    in_fork = await steps(rt, world, ada.id)
    assert [s.sequence for s in in_fork] == [1, 2] and in_fork[0].id != original[0].id
    assert in_fork[0].content == original[0].content and in_fork[0].session_id == fork.id
    assert await steps(rt, world, ada.id, ada.main_session_id) == original, "the original is untouched"

    sessions = (await rt.stub.ListSessions(rpb.ListSessionsRequest(agent_id=ada.id), metadata=md)).sessions
    assert [(s.id, s.main, s.step_count) for s in sessions] == [
        (ada.main_session_id, False, 2),
        (fork.id, True, 2),
    ]
    back = await rt.stub.SetMainSession(
        rpb.SetMainSessionRequest(agent_id=ada.id, session_id=ada.main_session_id), metadata=md
    )
    assert back.agent.main_session_id == ada.main_session_id
    other = rpb.SetMainSessionRequest(agent_id=ada.id, session_id=str(uuid.uuid4()))
    await refused(rt.stub.SetMainSession(other, metadata=md), grpc.StatusCode.NOT_FOUND)
    stranger = rpb.ListStepsRequest(agent_id=ada.id, session_id=str(uuid.uuid4()))
    await refused(rt.stub.ListSteps(stranger, metadata=md), grpc.StatusCode.NOT_FOUND)

    cloned = await rt.stub.ForkFromStep(
        rpb.ForkFromStepRequest(agent_id=ada.id, sequence=1, new_agent=True), metadata=md
    )
    clone = cloned.agent
    assert clone.id != ada.id and clone.name == "ada (fork)" and clone.system_prompt == "Be kind."
    assert (
        cloned.session.id == clone.main_session_id
        and cloned.session.forked_from_session_id == ada.main_session_id
    )
    member = await im.stub.GetMember(im_pb2.GetMemberRequest(member_id=clone.member_id), metadata=md)
    assert member.member.kind == im_pb2.MEMBER_KIND_AGENT and member.member.display_name == "ada (fork)"
    await settled(rt, clone.id)
    clone_steps = await steps(rt, world, clone.id)
    assert [s.sequence for s in clone_steps] == [1, 2] and all(s.agent_id == clone.id for s in clone_steps)
    assert clone_steps[1].content == original[1].content  # the offline model is deterministic
    assert await steps(rt, world, ada.id) == original
    bad = rpb.ForkFromStepRequest(agent_id=ada.id, sequence=3)
    await refused(rt.stub.ForkFromStep(bad, metadata=md), grpc.StatusCode.INVALID_ARGUMENT)
