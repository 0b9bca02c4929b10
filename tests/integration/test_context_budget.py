"""The context budget against an endpoint with a small window: a long
conversation never fails a call, nothing stored is lost, and a "too long"
from the endpoint is shrunk and retried without putting the agent in ERROR."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from tests.conftest import RunningIM, make_world
from tests.fake_openai import FakeOpenAI, Received, Reply
from tests.integration.test_runtime_grpc import (
    RunningRuntime,
    create_agent,
    direct_chat,
    start_runtime,
    stop_runtime,
)
from tests.windowed_llm import SUMMARY_MARK, WindowedModel

MESSAGES = 500
WAIT = 20.0


async def windowed_runtime(
    im: RunningIM, fake: FakeOpenAI, tmp_path: Path, *, window: int = 4096
) -> RunningRuntime:
    # A model name the runtime does not know: its window comes from OPENAI_CONTEXT_TOKENS.
    return await start_runtime(
        im.address,
        tmp_path / "runtime.db",
        OPENAI_BASE_URL=fake.url,
        OPENAI_MODEL="small-local-model",
        OPENAI_CONTEXT_TOKENS=str(window),
        LLM_MAX_RETRIES="0",
        # 500 requests of up to 4,096 tokens: more than the default budget.
        RUNTIME_TOKEN_BUDGET="100000000",
    )


class Conversation:
    """A person talking to an agent in a direct chat, one message per run."""

    def __init__(self, im: RunningIM, runtime: RunningRuntime, md: Any, agent: rpb.Agent, chat: str) -> None:
        self.im, self.runtime, self.md, self.agent, self.chat = im, runtime, md, agent, chat
        self.watch = runtime.stub.WatchAgent(rpb.WatchAgentRequest(agent_id=agent.id), metadata=md)
        self.ended: list[rpb.Run] = []

    async def say(self, text: str) -> rpb.Run:
        request = im_pb2.SendMessageRequest(group_id=self.chat, content=text)
        while True:
            try:
                await self.im.stub.SendMessage(request, metadata=self.md)
                break
            except grpc.aio.AioRpcError as error:
                # Faster than a person types, the test meets the IM's limit of
                # sends per second once its burst is spent: it waits, as a client should.
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                await asyncio.sleep(0.1)
        return await asyncio.wait_for(self._next_end(), WAIT)

    async def _next_end(self) -> rpb.Run:
        async for response in self.watch:
            if response.event.HasField("run_ended"):
                self.ended.append(response.event.run_ended)
                return response.event.run_ended
        raise AssertionError("the watch ended")


# 500 runs beside the other test worker; the default 120 s is too close.
@pytest.mark.timeout(300)
async def test_an_agent_talks_through_500_messages_in_a_4096_token_window(
    im: RunningIM, fake: FakeOpenAI, tmp_path: Path
) -> None:
    model = WindowedModel(window=4096)
    fake.responder = model
    runtime = await windowed_runtime(im, fake, tmp_path)
    try:
        world = await make_world(im.stub, people=1)
        md = world.md(0)
        ada = await create_agent(runtime, world, "ada")
        chat = await direct_chat(im, world, ada.member_id)
        talk = Conversation(im, runtime, md, ada, chat.id)
        await asyncio.wait_for(talk.watch.wait_for_connection(), WAIT)
        for number in range(1, MESSAGES + 1):
            text = (
                "Remember this: my locker number is 4711."
                if number == 3
                else f"Note {number}: the nightly build {number * 7} passed; nothing else to report."
            )
            run = await talk.say(text)
            assert run.status == rpb.RUN_STATUS_COMPLETED, (number, run.error)

        # Not one call refused or failed, and every request fit the window with room to answer.
        assert model.refusals == 0
        assert max(model.prompt_sizes) + model.answer_tokens <= model.window
        assert len(talk.ended) == MESSAGES
        agent = (await runtime.stub.GetAgent(rpb.GetAgentRequest(agent_id=ada.id), metadata=md)).agent
        assert agent.state == rpb.AGENT_STATE_IDLE
        # Nothing stored was dropped: every input and answer is still a step,
        # and what left the context was summarized.
        steps = await all_steps(runtime, ada.id, md)
        kinds = [s.kind for s in steps]
        assert kinds.count(rpb.STEP_KIND_MESSAGE) >= 2 * MESSAGES
        summaries = [s for s in steps if s.kind == rpb.STEP_KIND_SUMMARY]
        assert summaries and model.summaries == len(summaries)
        assert all(s.role == rpb.STEP_ROLE_SYSTEM and s.summary_through > 0 for s in summaries)
        # The last request carried the latest summary and the newest messages, not the first.
        last = model.seen[-1]
        assert summaries[-1].content in str(last[0]["content"])
        assert "Note 500" in str(last[-1]["content"]) and "locker number is 4711" not in str(last)
    finally:
        await talk_closed(locals().get("talk"))
        await stop_runtime(runtime)


async def test_a_context_too_long_answer_is_shrunk_and_retried_and_never_an_error_state(
    im: RunningIM, fake: FakeOpenAI, tmp_path: Path
) -> None:
    # The runtime is told the window is twice what the endpoint has: the
    # endpoint's first refusal teaches it (OpenAI's message names the window).
    model = WindowedModel(window=4096)
    forced = [0]

    def responder(request: Received) -> Reply:
        messages = list(dict(request.body).get("messages", []))
        summarizing = bool(messages) and SUMMARY_MARK in str(messages[0].get("content", ""))
        # Only the run's own requests are refused (a summary written on the way may pass).
        if forced[0] and not summarizing:
            forced[0] -= 1
            model.refusals += 1
            return too_long_reply(model.count(dict(request.body)))
        return model(request)

    fake.responder = responder
    runtime = await windowed_runtime(im, fake, tmp_path, window=8192)
    talk: Conversation | None = None
    try:
        world = await make_world(im.stub, people=1)
        md = world.md(0)
        ada = await create_agent(runtime, world, "ada")
        chat = await direct_chat(im, world, ada.member_id)
        talk = Conversation(im, runtime, md, ada, chat.id)
        await asyncio.wait_for(talk.watch.wait_for_connection(), WAIT)
        for number in range(60):
            run = await talk.say(f"message {number}: " + "some words " * 20)
            assert run.status == rpb.RUN_STATUS_COMPLETED, (number, run.error)
        assert model.refusals == 1  # once, then it knew
        sizes = model.prompt_sizes
        shrunk_at = next(i for i in range(1, len(sizes)) if sizes[i] < sizes[i - 1])
        assert shrunk_at > 10 and max(sizes) + model.answer_tokens <= model.window

        forced[0] = 2  # refused again after shrinking: the run fails, the agent does not
        run = await talk.say("after two refusals")
        assert run.status == rpb.RUN_STATUS_FAILED and "maximum context length" in run.error
        agent = (await runtime.stub.GetAgent(rpb.GetAgentRequest(agent_id=ada.id), metadata=md)).agent
        assert agent.state == rpb.AGENT_STATE_IDLE and agent.last_error == ""
        run = await talk.say("and it goes on")
        assert run.status == rpb.RUN_STATUS_COMPLETED
    finally:
        await talk_closed(talk)
        await stop_runtime(runtime)


def too_long_reply(tokens: int) -> Reply:
    return Reply(
        400,
        body={
            "error": {
                "message": "This model's maximum context length is 4096 tokens. However, your"
                f" messages resulted in {tokens} tokens.",
                "type": "invalid_request_error",
                "code": "context_length_exceeded",
            }
        },
    )


async def all_steps(runtime: RunningRuntime, agent_id: str, md: Any) -> list[rpb.Step]:
    steps: list[rpb.Step] = []
    while True:
        after = steps[-1].sequence if steps else 0
        page = await runtime.stub.ListSteps(
            rpb.ListStepsRequest(agent_id=agent_id, after_sequence=after, page_size=500), metadata=md
        )
        if not page.steps:
            return steps
        steps += page.steps


async def talk_closed(talk: Conversation | None) -> None:
    if talk is not None:
        talk.watch.cancel()
