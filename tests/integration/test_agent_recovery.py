"""Crash recovery (issue 5): a real runtime process killed with SIGKILL in the
middle of a run comes back with its agent where it was: the run goes on from
its last completed step, nothing stored is lost, and a tool call whose result
was recorded does not run again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from agentim.runtime.v1 import runtime_pb2_grpc
from tests.auth_support import service_environment
from tests.conftest import RunningIM, make_world
from tests.fake_openai import FakeOpenAI, Reply, call_fragment, chunk, text_reply, usage_chunk
from tests.identities import as_member, learning_channel
from tests.integration.test_runtime_grpc import direct_chat, wait_for_messages

WAIT = 15.0


class RuntimeProcess:
    """`python -m services.runtime serve` as a child process."""

    def __init__(self, environ: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.runtime", "serve"],
            env=environ,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"the runtime did not start (exit code {self.process.wait()})")
        self.address = line.split()[4]
        self.channel = learning_channel(self.address)
        self.stub = runtime_pb2_grpc.RuntimeServiceStub(self.channel)

    async def kill(self) -> None:
        await self.channel.close()
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    async def stop(self) -> None:
        await self.channel.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(20)


@pytest.fixture
async def llm() -> AsyncIterator[FakeOpenAI]:
    server = FakeOpenAI()
    await server.start()
    yield server
    await server.stop()


def tool_call_reply(name: str, arguments: dict[str, str]) -> Reply:
    text = json.dumps(arguments)
    return Reply(
        chunks=[
            chunk(role="assistant", content=""),
            chunk(tool_calls=[call_fragment(0, call_id="call_dm", name=name)]),
            chunk(tool_calls=[call_fragment(0, arguments=text[:10])]),
            chunk(tool_calls=[call_fragment(0, arguments=text[10:])]),
            chunk(finish="tool_calls"),
            usage_chunk(10, 5),
        ]
    )


async def test_a_runtime_killed_mid_run_goes_on_from_the_last_step_without_repeating_a_tool_call(
    im: RunningIM, llm: FakeOpenAI, tmp_path: Path
) -> None:
    if not im.address:
        pytest.skip("no IM")
    world = await make_world(im.stub, people=2)
    environ = {
        **os.environ,
        "RUNTIME_DATABASE_URL": f"sqlite:///{tmp_path / 'runtime.db'}",
        "RUNTIME_GRPC_ADDRESS": "127.0.0.1:0",
        "IM_ADDRESS": im.address,
        "OPENAI_BASE_URL": llm.url,
        "OPENAI_MODEL": "fake",
        "LOG_LEVEL": "WARNING",
        **service_environment(),
    }
    migrate = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.runtime", "migrate", env=environ
    )
    assert await migrate.wait() == 0
    listed = await im.stub.GetMember(
        im_pb2.GetMemberRequest(member_id=world.members[1].id), metadata=world.md(0)
    )
    bob_name = listed.member.display_name
    llm.script(
        tool_call_reply("send_direct_message", {"to": bob_name, "content": "the build is green"}),
        # The second completion streams a little and then hangs: the process dies in it.
        Reply(chunks=[chunk(role="assistant", content=""), chunk(content="Tell")], hold=True),
    )
    first = RuntimeProcess(environ)
    try:
        created = await first.stub.CreateAgent(
            rpb.CreateAgentRequest(name="ada", tools=["send_direct_message"]), metadata=world.md(0)
        )
        agent = created.agent
        chat = await direct_chat(im, world, agent.member_id)
        await im.stub.SendMessage(
            im_pb2.SendMessageRequest(group_id=chat.id, content="tell bob the build is green"),
            metadata=world.md(0),
        )

        async def second_completion_started() -> None:
            # The fake server records requests and offers no event for them.
            while len(llm.requests) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.01)

        await asyncio.wait_for(second_completion_started(), WAIT)
        await asyncio.sleep(0.2)  # the first chunks reached the runtime
    finally:
        await first.kill()

    llm.script(text_reply("Told Bob."))
    second = RuntimeProcess(environ)
    try:
        messages = await wait_for_messages(im, world.members[0].id, chat.id, 2)
        assert messages[1].sender_id == agent.member_id and messages[1].content == "Told Bob."
        dm = await im.stub.GetOrCreateDirectGroup(
            im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=agent.member_id), metadata=world.md(1)
        )
        sent = await im.stub.ListMessages(
            im_pb2.ListMessagesRequest(group_id=dm.group.id, page_size=10),
            metadata=as_member(world.members[1].id),
        )
        assert [m.content for m in sent.messages] == ["the build is green"], "the tool call ran once"
        steps = await second.stub.ListSteps(rpb.ListStepsRequest(agent_id=agent.id), metadata=world.md(0))
        assert [s.role for s in steps.steps] == [
            rpb.STEP_ROLE_USER,
            rpb.STEP_ROLE_ASSISTANT,
            rpb.STEP_ROLE_TOOL,
            rpb.STEP_ROLE_ASSISTANT,
        ]
        assert steps.steps[-1].content == "Told Bob."
        runs = await second.stub.ListRuns(rpb.ListRunsRequest(agent_id=agent.id), metadata=world.md(0))
        statuses = [r.status for r in reversed(runs.runs)]
        assert statuses == [rpb.RUN_STATUS_COMPLETED], "the run the process died in went on"
        got = await second.stub.GetAgent(rpb.GetAgentRequest(agent_id=agent.id), metadata=world.md(0))
        assert got.agent.state == rpb.AGENT_STATE_IDLE
        # The resumed completion was sent the whole stored history, the tool result included.
        resumed = llm.requests[-1].body["messages"]
        assert [m["role"] for m in resumed] == ["system", "user", "assistant", "tool"]
    finally:
        await second.stop()
