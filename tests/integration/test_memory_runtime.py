"""The runtime with the real memory service and IM: an agent that talked for
longer than its window recalls, with its anchor, what it was told long ago;
runs ended while the memory service was down reach it once it is up."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path

import pytest

from agentim.memory.v1 import memory_pb2 as mpb
from agentim.memory.v1 import memory_pb2_grpc
from agentim.runtime.v1 import runtime_pb2 as rpb
from services.memory import bootstrap as memory_bootstrap
from tests.conftest import RunningIM, make_world
from tests.fake_openai import FakeOpenAI
from tests.identities import learning_channel
from tests.integration.memory_harness import migrated_url, settings_for
from tests.integration.test_context_budget import MESSAGES, Conversation
from tests.integration.test_runtime_grpc import create_agent, direct_chat, start_runtime, stop_runtime
from tests.memory_support import FakeEmbedder
from tests.windowed_llm import WindowedModel

WAIT = 20.0


REF = re.compile(r"ref=([0-9a-f-]{36})/(\d+)/(\d+)")


async def start_memory_service(
    im: RunningIM, tmp_path: Path, address: str = "127.0.0.1:0"
) -> tuple[memory_bootstrap.MemoryApp, str]:
    """The memory service on SQLite, asking the real IM who callers are."""
    url = await migrated_url("sqlite", tmp_path)
    settings = settings_for(url, IM_ADDRESS=im.address, MEMORY_GRPC_ADDRESS=address)
    app = memory_bootstrap.build(settings, embedder=FakeEmbedder())
    port = await app.start()
    return app, f"127.0.0.1:{port}"


# The IM's database does not matter here; one long conversation is enough.
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
# 500 runs take 50-90 s beside the other test worker; the default 120 s is too close.
@pytest.mark.timeout(300)
async def test_after_500_messages_the_agent_recalls_what_it_was_told_at_message_3_with_its_anchor(
    im: RunningIM, fake: FakeOpenAI, tmp_path: Path
) -> None:
    model = WindowedModel(window=4096)
    fake.responder = model
    memory, memory_address = await start_memory_service(im, tmp_path)
    runtime = await start_runtime(
        im.address,
        tmp_path / "runtime.db",
        OPENAI_BASE_URL=fake.url,
        OPENAI_MODEL="small-local-model",
        OPENAI_CONTEXT_TOKENS="4096",
        LLM_MAX_RETRIES="0",
        RUNTIME_TOKEN_BUDGET="100000000",
        MEMORY_ADDRESS=memory_address,
        # A loaded CI machine may take longer than the default 3 s: a skipped
        # recall is right for a user, but would make this test fail.
        RUNTIME_RECALL_TIMEOUT_SECONDS="30",
    )
    talk: Conversation | None = None
    try:
        world = await make_world(im.stub, people=1)
        md = world.md(0)
        ada = await create_agent(runtime, world, "ada")
        chat = await direct_chat(im, world, ada.member_id)
        talk = Conversation(im, runtime, md, ada, chat.id)
        await asyncio.wait_for(talk.watch.wait_for_connection(), WAIT)
        told = None
        for number in range(1, MESSAGES):
            text = (
                "Remember this: my locker number is 4711."
                if number == 3
                else f"Note {number}: the nightly build {number * 7} passed; nothing else to report."
            )
            run = await talk.say(text)
            assert run.status == rpb.RUN_STATUS_COMPLETED, (number, run.error)
            if number == 3:
                told = run
        assert told is not None
        # Long gone from the context by now (the window holds a few dozen runs).
        assert "4711" not in str(model.seen[-1])

        run = await talk.say("What was my locker number again?")

        assert run.status == rpb.RUN_STATUS_COMPLETED
        assert model.refusals == 0
        request = str(model.seen[-1])
        assert "my locker number is 4711" in request
        anchors = {match[0] for match in REF.findall(request)}
        assert told.id in anchors  # recalled with the anchor of the run it was told in
        steps = await runtime.stub.ListSteps(
            rpb.ListStepsRequest(agent_id=ada.id, run_id=run.id), metadata=md
        )
        (recalled,) = [s for s in steps.steps if s.kind == rpb.STEP_KIND_RECALL]
        assert f"ref={told.id}/" in recalled.content and recalled.role == rpb.STEP_ROLE_USER
        # The memory holds every run, each once.
        async with learning_channel(memory_address) as channel:
            stats = await memory_pb2_grpc.MemoryServiceStub(channel).GetMemoryStats(
                mpb.GetMemoryStatsRequest(agent_id=ada.id), metadata=md
            )
        assert MESSAGES - 1 <= stats.run_count <= MESSAGES
    finally:
        if talk is not None:
            talk.watch.cancel()
        await stop_runtime(runtime)
        await memory.stop()


async def test_runs_ended_while_the_memory_service_was_down_reach_it_once_it_is_up(
    im: RunningIM, fake: FakeOpenAI, tmp_path: Path
) -> None:
    fake.responder = WindowedModel(window=100_000)
    address = f"127.0.0.1:{free_port()}"
    runtime = await start_runtime(
        im.address,
        tmp_path / "runtime.db",
        OPENAI_BASE_URL=fake.url,
        OPENAI_MODEL="small-local-model",
        LLM_MAX_RETRIES="0",
        MEMORY_ADDRESS=address,
        MEMORY_CALL_TIMEOUT_SECONDS="1",
    )
    memory = None
    talk: Conversation | None = None
    try:
        world = await make_world(im.stub, people=1)
        md = world.md(0)
        ada = await create_agent(runtime, world, "ada")
        chat = await direct_chat(im, world, ada.member_id)
        talk = Conversation(im, runtime, md, ada, chat.id)
        await asyncio.wait_for(talk.watch.wait_for_connection(), WAIT)
        # Different words: texts differing only in numbers collapse into one result.
        for animal in ("cat", "dog", "parrot"):
            run = await talk.say(f"while memory is down: we talked about the {animal}")
            assert run.status == rpb.RUN_STATUS_COMPLETED  # the agent never waits for memory

        memory, _ = await start_memory_service(im, tmp_path, address)
        channel = learning_channel(address)
        stub = memory_pb2_grpc.MemoryServiceStub(channel)

        async def archived() -> int:
            while True:
                stats = await stub.GetMemoryStats(mpb.GetMemoryStatsRequest(agent_id=ada.id), metadata=md)
                if stats.run_count >= 3:
                    return stats.run_count
                await asyncio.sleep(0.2)

        assert await asyncio.wait_for(archived(), 30) == 3  # each once
        found = await stub.Retrieve(
            mpb.RetrieveRequest(agent=mpb.AgentScope(agent_id=ada.id), query="the parrot"),
            metadata=md,
        )
        assert any("parrot" in r.segment.text for r in found.results), found
        await channel.close()
    finally:
        if talk is not None:
            talk.watch.cancel()
        await stop_runtime(runtime)
        if memory is not None:
            await memory.stop()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
