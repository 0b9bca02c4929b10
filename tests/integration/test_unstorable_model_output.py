"""A model's output that no database stores (NUL, lone surrogates) never fails a
run: a real runtime, a scripted OpenAI-compatible endpoint, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from tests.conftest import RunningIM, make_world
from tests.edge_support import start_runtime_on
from tests.fake_openai import FakeOpenAI, Reply, call_fragment, chunk, usage_chunk
from tests.integration.test_runtime_grpc import direct_chat, wait_for_messages

WAIT = 15.0
FFFD = "\ufffd"


@pytest.fixture
async def llm() -> AsyncIterator[FakeOpenAI]:
    server = FakeOpenAI()
    await server.start()
    yield server
    await server.stop()


async def test_nul_and_lone_surrogates_from_the_model_are_stored_as_replacement_characters(
    im: RunningIM, runtime_url: str, llm: FakeOpenAI
) -> None:
    # The fake sends its chunks as JSON with ASCII escapes: "\u0000", "\ud800".
    odd_model = "fake\x00model"
    usage = {**usage_chunk(10, 5), "model": odd_model}
    llm.script(
        Reply(
            chunks=[
                chunk(role="assistant", content=""),
                chunk(reasoning="thinking\x00 hard \udfff"),
                chunk(
                    tool_calls=[call_fragment(0, call_id="call\x00a", name="list_groups", arguments="{}")],
                ),
                chunk(finish="tool_calls"),
                usage_chunk(10, 5),
            ]
        ),
        Reply(
            chunks=[
                chunk(role="assistant", content="", model=odd_model),
                chunk(content="before \x00 nul, ", model=odd_model),
                chunk(content="lone \ud800 high, ", model=odd_model),
                chunk(content="pair 😀 kept", model=odd_model),
                chunk(finish="stop", model=odd_model),
                usage,
            ]
        ),
    )
    # Only this agent talks to the scripted server (its own base_url): agents
    # other tests left in a shared database use the offline model. It is on
    # loopback, which agents may reach only when it is listed.
    runtime = await start_runtime_on(im.address, runtime_url, RUNTIME_LLM_ALLOWED_HOSTS="127.0.0.1")
    try:
        world = await make_world(im.stub, people=1)
        md = world.md(0)
        model = rpb.ModelSettings(model="fake", base_url=llm.url)
        agent = (
            await runtime.stub.CreateAgent(
                rpb.CreateAgentRequest(name="echo", tools=["list_groups"], model=model), metadata=md
            )
        ).agent
        chat = await direct_chat(im, world, agent.member_id)
        watch = runtime.stub.WatchAgent(rpb.WatchAgentRequest(agent_id=agent.id), metadata=md)
        await asyncio.wait_for(watch.wait_for_connection(), WAIT)
        await im.stub.SendMessage(im_pb2.SendMessageRequest(group_id=chat.id, content="go"), metadata=md)
        streamed, completed = "", []
        while True:
            event = (await asyncio.wait_for(watch.read(), WAIT)).event
            if event.HasField("step_delta") and event.step_delta.WhichOneof("delta") == "content":
                streamed += event.step_delta.content
            if event.HasField("step_completed"):
                completed.append(event.step_completed.content)
            if event.HasField("run_ended"):
                run = event.run_ended
                break
        watch.cancel()
        assert run.status == rpb.RUN_STATUS_COMPLETED, run.error
        answer = f"before {FFFD} nul, lone {FFFD} high, pair 😀 kept"
        # The deltas a watcher gets (all of them, or, when it is behind, those
        # sent before the completed step, which carries the rest) are clean too.
        assert answer.startswith(streamed)
        assert completed[-1] == answer
        steps = (await runtime.stub.ListSteps(rpb.ListStepsRequest(agent_id=agent.id), metadata=md)).steps
        thinking, tool_result, final = steps[-3], steps[-2], steps[-1]
        assert thinking.reasoning == f"thinking{FFFD} hard {FFFD}"
        assert thinking.tool_calls[0].id == f"call{FFFD}a"
        assert tool_result.tool_call_id == f"call{FFFD}a"
        assert final.content == answer and final.metrics.model == f"fake{FFFD}model"
        messages = await wait_for_messages(im, world.members[0].id, chat.id, 2)
        assert messages[-1].content == answer
        # The next completion's context is what was stored.
        context = llm.requests[1].body["messages"]
        assert json.dumps(context).count("\\u0000") == 0
    finally:
        await runtime.channel.close()
        await runtime.app.stop()
