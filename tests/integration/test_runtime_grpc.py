"""The runtime end to end over gRPC, with a real IM service and the offline model."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from agentim.runtime.v1 import runtime_pb2_grpc
from services.runtime import bootstrap
from services.runtime.adapters import migrate
from services.runtime.adapters.sql import Database
from services.runtime.config import Settings
from tests.auth_support import service_environment
from tests.conftest import RunningIM, World, make_world
from tests.fake_openai import FakeOpenAI, Reply, text_reply
from tests.holding_proxy import HoldingProxy
from tests.identities import as_member, learning_channel

WAIT = 10.0


@dataclass
class RunningRuntime:
    app: bootstrap.RuntimeApp
    channel: grpc.aio.Channel
    stub: runtime_pb2_grpc.RuntimeServiceStub


async def start_runtime(im_address: str, database_file: Path, **overrides: str) -> RunningRuntime:
    url = f"sqlite:///{database_file}"
    database = Database(url)
    await migrate.upgrade(database)
    await database.aclose()
    environ = {
        "RUNTIME_DATABASE_URL": url,
        "RUNTIME_GRPC_ADDRESS": "127.0.0.1:0",
        "IM_ADDRESS": im_address,
        "LOG_LEVEL": "WARNING",
        **service_environment(),
        **overrides,
    }
    app = bootstrap.build(Settings.from_env(environ))
    port, _ = await app.start()
    channel = learning_channel(f"127.0.0.1:{port}")
    return RunningRuntime(app, channel, runtime_pb2_grpc.RuntimeServiceStub(channel))


async def stop_runtime(running: RunningRuntime) -> None:
    await running.channel.close()
    await running.app.stop()


@pytest.fixture
async def runtime(im: RunningIM, tmp_path: Path) -> AsyncIterator[RunningRuntime]:
    running = await start_runtime(im.address, tmp_path / "runtime.db")
    yield running
    await stop_runtime(running)


async def create_agent(runtime: RunningRuntime, world: World, name: str, **fields: Any) -> rpb.Agent:
    response = await runtime.stub.CreateAgent(
        rpb.CreateAgentRequest(name=name, **fields), metadata=world.md(0)
    )
    return response.agent


async def direct_chat(im: RunningIM, world: World, peer: str) -> im_pb2.Group:
    response = await im.stub.GetOrCreateDirectGroup(
        im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=peer), metadata=world.md(0)
    )
    return response.group


async def wait_for_messages(im: RunningIM, member: str, group: str, count: int) -> list[im_pb2.Message]:
    async def poll() -> list[im_pb2.Message]:
        while True:
            page = await im.stub.ListMessages(
                im_pb2.ListMessagesRequest(group_id=group, page_size=100), metadata=as_member(member)
            )
            if len(page.messages) >= count:
                return list(page.messages)
            await asyncio.sleep(0.02)

    return await asyncio.wait_for(poll(), WAIT)


async def test_a_person_messages_an_agent_and_watches_it_answer(
    im: RunningIM, runtime: RunningRuntime
) -> None:
    world = await make_world(im.stub, people=1)
    ada = await create_agent(runtime, world, "ada", role="helper")
    member = await im.stub.GetMember(im_pb2.GetMemberRequest(member_id=ada.member_id), metadata=world.md(0))
    assert member.member.kind == im_pb2.MEMBER_KIND_AGENT and member.member.display_name == "ada"
    chat = await direct_chat(im, world, ada.member_id)
    watch = runtime.stub.WatchAgent(rpb.WatchAgentRequest(agent_id=ada.id), metadata=world.md(0))
    await asyncio.wait_for(watch.wait_for_connection(), WAIT)
    await im.stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=chat.id, content="hello there"), metadata=world.md(0)
    )
    kinds: list[str] = []
    deltas = ""
    while True:
        response = await asyncio.wait_for(watch.read(), WAIT)
        kind = response.event.WhichOneof("event")
        kinds.append(kind)
        if kind == "step_delta" and response.event.step_delta.WhichOneof("delta") == "content":
            deltas += response.event.step_delta.content
        if kind == "run_ended":
            assert response.event.run_ended.status == rpb.RUN_STATUS_COMPLETED
            break
    watch.cancel()
    assert kinds[0] == "run_started" and "step_started" in kinds and "state_changed" in kinds
    messages = await wait_for_messages(im, world.members[0].id, chat.id, 2)
    assert messages[1].sender_id == ada.member_id
    assert messages[1].content == deltas and "hello there" in deltas
    steps = await runtime.stub.ListSteps(rpb.ListStepsRequest(agent_id=ada.id), metadata=world.md(0))
    assert [s.role for s in steps.steps] == [rpb.STEP_ROLE_USER, rpb.STEP_ROLE_ASSISTANT]
    assert steps.steps[1].reasoning and steps.steps[1].metrics.model == "offline"
    runs = await runtime.stub.ListRuns(rpb.ListRunsRequest(agent_id=ada.id), metadata=world.md(0))
    assert [r.status for r in runs.runs] == [rpb.RUN_STATUS_COMPLETED]


async def _end_of(stream: Any) -> grpc.aio.AioRpcError:
    """Reads a stream to its end, which must be an error; returns it."""
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        while await asyncio.wait_for(stream.read(), WAIT) is not grpc.aio.EOF:
            pass
    return ended.value


async def test_a_stopping_runtime_ends_agent_watches_unavailable_saying_where_to_resume(
    im: RunningIM, tmp_path: Path
) -> None:
    runtime = await start_runtime(im.address, tmp_path / "runtime.db")
    try:
        world = await make_world(im.stub, people=1)
        ada = await create_agent(runtime, world, "ada")
        chat = await direct_chat(im, world, ada.member_id)
        watch = runtime.stub.WatchAgent(rpb.WatchAgentRequest(agent_id=ada.id), metadata=world.md(0))
        everyone = runtime.stub.WatchAgents(rpb.WatchAgentsRequest(), metadata=world.md(0))
        await asyncio.wait_for(watch.wait_for_connection(), WAIT)
        await asyncio.wait_for(everyone.wait_for_connection(), WAIT)
        await im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=chat.id, content="hi"), metadata=world.md(0)
        )
        completed = 0
        while (response := await asyncio.wait_for(watch.read(), WAIT)).event.WhichOneof(
            "event"
        ) != "run_ended":
            if response.event.WhichOneof("event") == "step_completed":
                completed = response.event.step_completed.sequence
        assert completed > 0
        await runtime.app.stop()
        ends = [await _end_of(stream) for stream in (watch, everyone)]
        # UNAVAILABLE, which clients retry, and not a normal end, which says the stream is complete.
        assert [e.code() for e in ends] == [grpc.StatusCode.UNAVAILABLE] * 2
        assert f"after_sequence={completed} " in (ends[0].details() or "")
    finally:
        await stop_runtime(runtime)


def runtime_tasks() -> list[asyncio.Task[Any]]:
    """The runtime's long-lived tasks still running: runners, IM watches, cursor savers."""
    names = ("agent-", "im-watch-", "cursor-saver-")
    return [t for t in asyncio.all_tasks() if t.get_name().startswith(names) and not t.done()]


async def test_an_agent_created_while_the_runtime_stops_is_stopped_with_the_others(
    im: RunningIM, tmp_path: Path
) -> None:
    proxy = HoldingProxy(im.address)
    runtime = await start_runtime(await proxy.start(), tmp_path / "runtime.db")
    try:
        world = await make_world(im.stub, people=1)
        proxy.hold()
        # In flight: the runtime waits for the IM to create the agent's member
        # (the runtime has sent nothing else to the IM: it has no agent yet).
        creating = asyncio.ensure_future(create_agent(runtime, world, "late"))
        await asyncio.wait_for(proxy.held.wait(), WAIT)
        stopping = asyncio.ensure_future(runtime.app.stop())
        await asyncio.sleep(0.1)  # what shutdown does before draining is done by now
        proxy.release()
        late = await asyncio.wait_for(creating, WAIT)
        await asyncio.wait_for(stopping, WAIT)
        assert late.name == "late"
        # Its runner, started by the call the stop let finish, was stopped too.
        assert runtime_tasks() == []
    finally:
        await stop_runtime(runtime)
        await proxy.aclose()


async def test_an_agent_messages_another_agent_which_answers(im: RunningIM, runtime: RunningRuntime) -> None:
    world = await make_world(im.stub, people=1)
    ada = await create_agent(runtime, world, "ada")
    bea = await create_agent(runtime, world, "bea")
    chat = await direct_chat(im, world, ada.member_id)
    await im.stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=chat.id, content="tell @bea the build is green"),
        metadata=world.md(0),
    )
    between = await asyncio.wait_for(_direct_group_of(im, ada.member_id, bea.member_id), WAIT)
    messages = await wait_for_messages(im, ada.member_id, between, 2)
    assert messages[0].sender_id == ada.member_id and messages[0].content == "the build is green"
    assert messages[1].sender_id == bea.member_id and "the build is green" in messages[1].content


async def _direct_group_of(im: RunningIM, one: str, other: str) -> str:
    while True:
        groups = await im.stub.ListGroups(im_pb2.ListGroupsRequest(), metadata=as_member(one))
        for group in groups.groups:
            if group.kind == im_pb2.GROUP_KIND_DIRECT and set(group.member_ids) == {one, other}:
                return str(group.id)
        await asyncio.sleep(0.02)


async def test_of_two_agents_in_a_group_only_the_one_a_person_mentions_answers(
    im: RunningIM, runtime: RunningRuntime
) -> None:
    world = await make_world(im.stub, people=1)
    ada = await create_agent(runtime, world, "ada")
    bea = await create_agent(runtime, world, "bea")
    group = await im.stub.CreateGroup(
        im_pb2.CreateGroupRequest(name="pair", member_ids=[ada.member_id, bea.member_id]),
        metadata=world.md(0),
    )
    for mentioned, text in ((ada, "@ada have a look"), (bea, "@bea and you?")):
        await im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=group.group.id, content=text, mentions=[mentioned.member_id]),
            metadata=world.md(0),
        )
        await wait_for_messages(im, world.members[0].id, group.group.id, 2 if mentioned is ada else 4)
    # Bea answers the message for her; Ada's answer, which she saw first, was not for her.
    messages = await wait_for_messages(im, world.members[0].id, group.group.id, 4)
    assert [m.sender_id for m in messages] == [
        world.members[0].id,
        ada.member_id,
        world.members[0].id,
        bea.member_id,
    ]
    steps = await runtime.stub.ListSteps(rpb.ListStepsRequest(agent_id=bea.id), metadata=world.md(0))
    inputs = [s.content for s in steps.steps if s.role == rpb.STEP_ROLE_USER]
    assert len(inputs) == 1 and "and you?" in inputs[0] and "have a look" not in inputs[0]
    runs = await runtime.stub.ListRuns(rpb.ListRunsRequest(agent_id=ada.id), metadata=world.md(0))
    assert len(runs.runs) == 1


async def test_two_agents_that_name_each_other_stop_at_the_limit(im: RunningIM, tmp_path: Path) -> None:
    runtime = await start_runtime(im.address, tmp_path / "rt.db", RUNTIME_AGENT_CHATTER_LIMIT="5")
    try:
        world = await make_world(im.stub, people=1)
        ada = await create_agent(runtime, world, "ada")
        bea = await create_agent(runtime, world, "bea")
        group = await im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="pair", member_ids=[ada.member_id, bea.member_id]),
            metadata=world.md(0),
        )
        # The offline model repeats what it was told: each answer @names the other agent.
        await im.stub.SendMessage(
            im_pb2.SendMessageRequest(
                group_id=group.group.id, content="@ada @bea discuss", mentions=[ada.member_id, bea.member_id]
            ),
            metadata=world.md(0),
        )
        await wait_for_messages(im, world.members[0].id, group.group.id, 6)
        # They stop: nothing more comes, however long we wait for both to be idle.
        for agent in (ada, bea):
            runner = runtime.app.runner(uuid.UUID(agent.id))
            assert runner is not None
            await asyncio.wait_for(runner.idle.wait(), WAIT)
        page = await im.stub.ListMessages(
            im_pb2.ListMessagesRequest(group_id=group.group.id, page_size=100), metadata=world.md(0)
        )
        assert 6 <= len(page.messages) <= 7
        assert all(len(m.mentions) == 1 for m in page.messages[1:])
    finally:
        await stop_runtime(runtime)


async def test_restarting_the_runtime_resumes_agents_with_their_history(
    im: RunningIM, tmp_path: Path
) -> None:
    database_file = tmp_path / "runtime.db"
    runtime = await start_runtime(im.address, database_file)
    world = await make_world(im.stub, people=1)
    ada = await create_agent(runtime, world, "ada")
    chat = await direct_chat(im, world, ada.member_id)
    await im.stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=chat.id, content="first"), metadata=world.md(0)
    )
    await wait_for_messages(im, world.members[0].id, chat.id, 2)
    await stop_runtime(runtime)

    # Written while the runtime was down: seen when it comes back.
    await im.stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=chat.id, content="second"), metadata=world.md(0)
    )
    runtime = await start_runtime(im.address, database_file)
    try:
        await wait_for_messages(im, world.members[0].id, chat.id, 4)
        steps = await runtime.stub.ListSteps(rpb.ListStepsRequest(agent_id=ada.id), metadata=world.md(0))
        assert [s.sequence for s in steps.steps] == [1, 2, 3, 4]
        assert "first" in steps.steps[0].content and "second" in steps.steps[2].content
    finally:
        await stop_runtime(runtime)


async def test_clear_errors(im: RunningIM, runtime: RunningRuntime) -> None:
    world = await make_world(im.stub, people=1)

    async def code_of(call: Any) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        return caught.value.code()

    stub, md = runtime.stub, world.md(0)
    assert await code_of(stub.GetAgent(rpb.GetAgentRequest(agent_id=str(uuid.uuid4())), metadata=md)) == (
        grpc.StatusCode.NOT_FOUND
    )
    assert await code_of(stub.GetAgent(rpb.GetAgentRequest(agent_id="nope"), metadata=md)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert await code_of(
        stub.CreateAgent(rpb.CreateAgentRequest(name="x", tools=["rm_rf"]), metadata=md)
    ) == (grpc.StatusCode.INVALID_ARGUMENT)
    bad_model = rpb.CreateAgentRequest(name="x", model=rpb.ModelSettings(temperature=9))
    assert await code_of(stub.CreateAgent(bad_model, metadata=md)) == grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(stub.ListAgents(rpb.ListAgentsRequest())) == grpc.StatusCode.UNAUTHENTICATED
    other = await make_world(im.stub, people=1)
    theirs = await create_agent(runtime, other, "theirs")
    assert await code_of(stub.GetAgent(rpb.GetAgentRequest(agent_id=theirs.id), metadata=md)) == (
        grpc.StatusCode.NOT_FOUND
    )


async def test_an_endpoint_that_reports_no_usage_gets_counts_estimated_and_marked(
    im: RunningIM, fake: FakeOpenAI, tmp_path: Path
) -> None:
    answer = "Here is what I found, in a few words."
    fake.responder = lambda _: Reply(chunks=text_reply(answer).chunks[:-1])  # no usage chunk
    runtime = await start_runtime(
        im.address, tmp_path / "rt.db", OPENAI_BASE_URL=fake.url, OPENAI_MODEL="m", LLM_MAX_RETRIES="0"
    )
    try:
        world = await make_world(im.stub, people=1)
        ada = await create_agent(runtime, world, "ada")
        chat = await direct_chat(im, world, ada.member_id)
        await im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=chat.id, content="what did you find?"), metadata=world.md(0)
        )
        messages = await wait_for_messages(im, world.members[0].id, chat.id, 2)
        assert messages[1].content == answer
        assert fake.requests[0].body["stream_options"] == {"include_usage": True}
        steps = await runtime.stub.ListSteps(rpb.ListStepsRequest(agent_id=ada.id), metadata=world.md(0))
        (said,) = [s for s in steps.steps if s.role == rpb.STEP_ROLE_ASSISTANT]
        assert said.metrics.usage_estimated
        assert said.metrics.input_tokens > 0 and said.metrics.output_tokens >= len(answer) // 4
        got = await runtime.stub.GetAgent(rpb.GetAgentRequest(agent_id=ada.id), metadata=world.md(0))
        assert got.agent.tokens_used == said.metrics.input_tokens + said.metrics.output_tokens
    finally:
        await stop_runtime(runtime)


async def test_a_failure_is_told_in_the_chat_and_waking_the_agent_retries_it(
    im: RunningIM, fake: FakeOpenAI, tmp_path: Path
) -> None:
    fake.script(Reply(503, body={"error": {"message": "the model is loading", "type": "server_error"}}))
    fake.script(text_reply("Sorry for the wait: here it is."))
    runtime = await start_runtime(
        im.address, tmp_path / "rt.db", OPENAI_BASE_URL=fake.url, OPENAI_MODEL="m", LLM_MAX_RETRIES="0"
    )
    try:
        world = await make_world(im.stub, people=1)
        ada = await create_agent(runtime, world, "ada")
        chat = await direct_chat(im, world, ada.member_id)
        await im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=chat.id, content="hi"), metadata=world.md(0)
        )
        notice = (await wait_for_messages(im, world.members[0].id, chat.id, 2))[1]
        assert notice.sender_id == ada.member_id and notice.content_type == im_pb2.CONTENT_TYPE_SYSTEM
        assert "my model did not respond" in notice.content and "HTTP 503" in notice.content
        about = notice.metadata.fields["agent_failure"].struct_value.fields
        runs = await runtime.stub.ListRuns(rpb.ListRunsRequest(agent_id=ada.id), metadata=world.md(0))
        assert about["run_id"].string_value == runs.runs[0].id and about["retry"].string_value == "WakeAgent"
        await runtime.stub.WakeAgent(rpb.WakeAgentRequest(agent_id=ada.id), metadata=world.md(0))
        messages = await wait_for_messages(im, world.members[0].id, chat.id, 3)
        assert messages[2].content == "Sorry for the wait: here it is."
    finally:
        await stop_runtime(runtime)


async def test_a_stream_cut_midway_is_kept_as_cut_and_asked_for_again(
    im: RunningIM, fake: FakeOpenAI, tmp_path: Path
) -> None:
    partial = text_reply("I was saying something long when the line went dead")
    fake.script(Reply(chunks=partial.chunks, cut_after=4))
    fake.script(text_reply("Here is the whole answer."))
    runtime = await start_runtime(
        im.address, tmp_path / "rt.db", OPENAI_BASE_URL=fake.url, OPENAI_MODEL="m", LLM_MAX_RETRIES="1"
    )
    try:
        world = await make_world(im.stub, people=1)
        ada = await create_agent(runtime, world, "ada")
        chat = await direct_chat(im, world, ada.member_id)
        await im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=chat.id, content="tell me"), metadata=world.md(0)
        )
        messages = await wait_for_messages(im, world.members[0].id, chat.id, 2)
        assert [m.content for m in messages] == ["tell me", "Here is the whole answer."]
        steps = await runtime.stub.ListSteps(rpb.ListStepsRequest(agent_id=ada.id), metadata=world.md(0))
        kinds = [(s.role, s.kind) for s in steps.steps]
        assert kinds == [
            (rpb.STEP_ROLE_USER, rpb.STEP_KIND_MESSAGE),
            (rpb.STEP_ROLE_ASSISTANT, rpb.STEP_KIND_CUT),
            (rpb.STEP_ROLE_ASSISTANT, rpb.STEP_KIND_MESSAGE),
        ]
        cut = steps.steps[1]
        assert cut.content and "I was saying".startswith(cut.content[:12])
        assert len(fake.requests) == 2 and cut.content not in str(fake.requests[1].body["messages"])
    finally:
        await stop_runtime(runtime)


async def test_input_steps_carry_their_origin_and_the_model_reads_names_not_ids(
    im: RunningIM, fake: FakeOpenAI, tmp_path: Path
) -> None:
    fake.responder = lambda _: text_reply("Noted.")
    runtime = await start_runtime(
        im.address, tmp_path / "rt.db", OPENAI_BASE_URL=fake.url, OPENAI_MODEL="m", LLM_MAX_RETRIES="0"
    )
    try:
        world = await make_world(im.stub, people=1)
        ada = await create_agent(runtime, world, "ada")
        team = await im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="Launch crew", member_ids=[ada.member_id]), metadata=world.md(0)
        )
        sent = await im.stub.SendMessage(
            im_pb2.SendMessageRequest(
                group_id=team.group.id, content="@ada ready?", mentions=[ada.member_id]
            ),
            metadata=world.md(0),
        )
        await wait_for_messages(im, world.members[0].id, team.group.id, 2)
        steps = await runtime.stub.ListSteps(rpb.ListStepsRequest(agent_id=ada.id), metadata=world.md(0))
        said = steps.steps[0]
        assert said.content == "@ada ready?"
        origin = said.origin
        assert (origin.group_id, origin.group_name, origin.direct) == (team.group.id, "Launch crew", False)
        assert origin.sender_id == world.members[0].id and origin.message_id == sent.message.id
        assert origin.sender_name == world.members[0].display_name
        system, user = fake.requests[0].body["messages"][:2]
        assert user["content"] == f"{origin.sender_name}: @ada ready?"
        assert 'group chat "Launch crew"' in system["content"]
        assert world.members[0].id not in str(fake.requests[0].body["messages"])
        # Every state change counted; the answer read last is the newest.
        got = await runtime.stub.GetAgent(rpb.GetAgentRequest(agent_id=ada.id), metadata=world.md(0))
        assert got.agent.state == rpb.AGENT_STATE_IDLE and got.agent.state_version >= 2
    finally:
        await stop_runtime(runtime)


async def test_the_tools_an_agent_may_have_are_listed_for_members(
    runtime: RunningRuntime, im: RunningIM
) -> None:
    world = await make_world(im.stub, people=1)
    listed = await runtime.stub.ListTools(rpb.ListToolsRequest(), metadata=world.md(0))
    names = [t.name for t in listed.tools]
    assert {"send_message", "ask_human", "recall"} <= set(names) and all(t.description for t in listed.tools)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await runtime.stub.ListTools(rpb.ListToolsRequest())
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
