"""WatchAgent and WatchAgents on any runtime replica (PostgreSQL and Redis
for real): an agent's live events reach watchers on a replica that does not
run it, and a watch that spans a handoff shows every step once, in order,
with the step cut by the handoff said aborted before it starts again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from tests.conftest import RunningIM, World
from tests.faults.llm import DecidingLLM, instruction
from tests.integration.replicas import WAIT, Replicas
from tests.integration.test_runtime_grpc import RunningRuntime, direct_chat
from tests.integration.test_runtime_replicas import agent_on_the_first, elsewhere, hosts, split, until


class Watch:
    """The events of one watch stream, gathered as they come."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self.events: list[rpb.AgentEvent] = []
        self._call = call
        self._task = asyncio.create_task(self._gather())

    async def _gather(self) -> None:
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            async for response in self._call:
                self.events.append(response.event)

    def kinds(self) -> list[str]:
        return [str(e.WhichOneof("event")) for e in self.events]

    def completed(self) -> list[int]:
        return [e.step_completed.sequence for e in self.events if e.WhichOneof("event") == "step_completed"]

    async def until_completed(self, sequences: list[int]) -> None:
        await until(lambda: self.completed()[-len(sequences) :] == sequences if sequences else True)

    async def aclose(self) -> None:
        self._call.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


@contextlib.asynccontextmanager
async def watching(runtime: RunningRuntime, world: World, agent: rpb.Agent) -> AsyncIterator[Watch]:
    call = runtime.stub.WatchAgent(rpb.WatchAgentRequest(agent_id=agent.id), metadata=world.md(0))
    watch = Watch(call)
    try:
        yield watch
    finally:
        await watch.aclose()


async def stored(runtime: RunningRuntime, world: World, agent: rpb.Agent) -> list[int]:
    page = await runtime.stub.ListSteps(
        rpb.ListStepsRequest(agent_id=agent.id, page_size=500), metadata=world.md(0)
    )
    return [s.sequence for s in page.steps]


async def ask(im: RunningIM, world: World, agent: rpb.Agent, text: str) -> None:
    chat = await direct_chat(im, world, agent.member_id)
    await im.stub.SendMessage(im_pb2.SendMessageRequest(group_id=chat.id, content=text), metadata=world.md(0))


async def idle(runtime: RunningRuntime, world: World, agent: rpb.Agent, runs: int) -> None:
    """Until the agent ended `runs` runs and is IDLE again."""

    async def done() -> bool:
        got = await runtime.stub.ListRuns(rpb.ListRunsRequest(agent_id=agent.id), metadata=world.md(0))
        state = await runtime.stub.GetAgent(rpb.GetAgentRequest(agent_id=agent.id), metadata=world.md(0))
        ended = [r for r in got.runs if r.status != rpb.RUN_STATUS_RUNNING]
        return len(ended) >= runs and state.agent.state == rpb.AGENT_STATE_IDLE

    async with asyncio.timeout(WAIT):
        while not await done():  # noqa: ASYNC110 - the state is another process's
            await asyncio.sleep(0.1)


async def test_a_watch_on_a_replica_that_does_not_run_the_agent_sees_its_steps_stream(
    im: RunningIM, replicas: Replicas
) -> None:
    both, worlds, agents = await split(im, replicas, 2)
    for world, agent in zip(worlds, agents, strict=True):
        other = elsewhere(both, agent)
        workspace = other.stub.WatchAgents(rpb.WatchAgentsRequest(), metadata=world.md(0))
        everyone = Watch(workspace)
        async with watching(other, world, agent) as watch:
            await asyncio.sleep(0.3)  # subscribed (WatchAgents has no first event to wait for)
            await ask(im, world, agent, "hello")
            await idle(other, world, agent, runs=1)
            steps = await stored(other, world, agent)
            await watch.until_completed(steps)
        await until(lambda everyone=everyone: "run_ended" in everyone.kinds())  # type: ignore[misc]
        await everyone.aclose()
        assert watch.completed() == steps, "every step once, in order"
        kinds = watch.kinds()
        assert "step_started" in kinds and "step_delta" in kinds, "streamed live, not only stored"
        assert "state_changed" in everyone.kinds() and "run_started" in everyone.kinds()


async def test_a_watch_across_a_handoff_shows_every_step_once_and_the_cut_step_aborted(
    im: RunningIM, replicas: Replicas
) -> None:
    llm = DecidingLLM(delay=0.4)  # each step streams for a couple of seconds
    await llm.start()
    try:
        model = {"OPENAI_BASE_URL": llm.url, "OPENAI_MODEL": "fake", "SHUTDOWN_GRACE_SECONDS": "0"}
        (first, second), world, agent = await agent_on_the_first(im, replicas, **model)
        async with watching(second, world, agent) as watch:
            await asyncio.sleep(0.3)
            await ask(im, world, agent, instruction("tok", world.members[1].display_name))
            await until(lambda: "step_delta" in watch.kinds())
            await first.app.stop()  # no grace: the step streaming now is cut, r2 takes the agent
            await until(lambda: hosts([second], agent) == ["r2"])
            await idle(second, world, agent, runs=1)
            steps = await stored(second, world, agent)
            await watch.until_completed(steps)
        assert watch.completed() == steps, "no gap, no repeat across the handoff"
        said = [e for e in watch.events if e.WhichOneof("event") in ("step_started", "step_aborted")]
        started = [e.step_started.sequence for e in said if e.WhichOneof("event") == "step_started"]
        again = {s for s in started if started.count(s) > 1}
        assert again, f"the cut step starts again on r2: {watch.kinds()}"
        for sequence in again:
            order = [
                e.WhichOneof("event")
                for e in said
                if (
                    e.step_started.sequence
                    if e.WhichOneof("event") == "step_started"
                    else e.step_aborted.sequence
                )
                == sequence
            ]
            assert order[:3] == ["step_started", "step_aborted", "step_started"], order
    finally:
        await llm.stop()
