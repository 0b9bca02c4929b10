"""Replica fault 8: work and control through a replica that does not run
the agents, and WatchAgent across handoffs.

Three runtime replicas; the client talks only to r0, which is never faulted,
so most of what it does (tasks, chats' answers, pauses and resumes, watches)
concerns agents another replica runs. Meanwhile r1 and r2 are stopped in
turn, by SIGTERM (a handoff) or SIGKILL (a crash), and started again, so the
agents move between replicas several times. Each agent is watched on r0 from
before the first question to the end. When all is done: every step stored is
seen by its watch exactly once and in order (0 gaps, 0 duplicates), every
step started again without completing was said aborted first, every control
through r0 left the state it should, and nothing asked is lost or doubled.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from agentim.runtime.v1 import runtime_pb2 as rpb
from agentim.runtime.v1 import runtime_pb2_grpc
from tests.conftest import RunningIM
from tests.faults.harness import scaled
from tests.faults.llm import DecidingLLM
from tests.faults.test_im_kill import RETRYABLE
from tests.faults.test_replica_kill import (
    Desk,
    all_steps,
    asking,
    assert_nothing_lost_or_doubled,
    call,
    cluster,
    settled,
    summary,
)


@dataclass
class Watched:
    """What WatchAgent on r0 showed of one agent, resumed after any break
    from the last step it gave whole (as a client does)."""

    desk: Desk
    completed: list[int] = field(default_factory=list)
    # Steps started again before completing, and how many of those were said aborted first.
    restarted: int = 0
    announced: int = 0
    resumed: int = 0

    async def follow(self, runtime: runtime_pb2_grpc.RuntimeServiceStub) -> None:
        streaming: int | None = None
        aborted: set[int] = set()
        while True:
            after = self.completed[-1] if self.completed else 0
            stream = runtime.WatchAgent(
                rpb.WatchAgentRequest(agent_id=self.desk.agent.id, after_sequence=after),
                metadata=self.desk.world.md(0),
            )
            try:
                async for response in stream:
                    event = response.event
                    kind = event.WhichOneof("event")
                    if kind == "step_completed":
                        self.completed.append(event.step_completed.sequence)
                        streaming = None
                    elif kind == "step_started":
                        sequence = event.step_started.sequence
                        if streaming == sequence:
                            self.restarted += 1
                            self.announced += sequence in aborted
                        streaming = sequence
                        aborted.discard(sequence)
                    elif kind == "step_aborted":
                        aborted.add(event.step_aborted.sequence)
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRYABLE:
                    raise
            self.resumed += 1
            await asyncio.sleep(0.05)


@dataclass
class Controlled:
    """Pauses and resumes of an idle agent, through r0, as its shard moves."""

    desk: Desk
    done: int = 0
    wrong: list[str] = field(default_factory=list)

    async def toggle(self, runtime: runtime_pb2_grpc.RuntimeServiceStub) -> None:
        agent_id = self.desk.agent.id
        while True:
            await asyncio.sleep(0.2)
            await self._control(
                runtime, runtime.PauseAgent, rpb.PauseAgentRequest(agent_id=agent_id), rpb.AGENT_STATE_PAUSED
            )
            await self._control(
                runtime, runtime.ResumeAgent, rpb.ResumeAgentRequest(agent_id=agent_id), rpb.AGENT_STATE_IDLE
            )
            self.done += 1

    async def _control(
        self, runtime: runtime_pb2_grpc.RuntimeServiceStub, method: object, request: object, wanted: int
    ) -> None:
        md = self.desk.world.md(0)
        try:
            state = (await call(method, request, md)).agent.state  # type: ignore[attr-defined]
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            # A retry of a control whose first try landed (its answer was
            # lost with the replica): the state it left is what counts.
            got = await call(runtime.GetAgent, rpb.GetAgentRequest(agent_id=self.desk.agent.id), md)
            state = got.agent.state  # type: ignore[attr-defined]
        if state != wanted:
            self.wrong.append(f"{type(request).__name__} left {rpb.AgentState.Name(state)}")


async def stored_steps(runtime: runtime_pb2_grpc.RuntimeServiceStub, desk: Desk) -> list[int]:
    return [step.sequence for step in await all_steps(runtime, desk)]


@pytest.mark.timeout(scaled(150, long=400))
async def test_watches_and_controls_through_a_non_owner_across_handoffs_miss_and_repeat_nothing(
    ims: tuple[RunningIM, RunningIM], own_runtime_url: str, redis_url: str, llm: DecidingLLM, tmp_path: Path
) -> None:
    im = ims[0]
    faults = scaled(3, long=16)
    async with cluster(ims, own_runtime_url, redis_url, llm, tmp_path) as replicas:
        runtime = replicas.runtime
        # The last agent is only paused and resumed; the others work.
        working, controlled = replicas.desks[:-1], Controlled(replicas.desks[-1])
        replicas.desks = working
        watches = [Watched(desk) for desk in working]
        background = [asyncio.create_task(w.follow(runtime)) for w in watches]
        background.append(asyncio.create_task(controlled.toggle(runtime)))
        await asyncio.sleep(0.5)  # the watches are following before anything is asked
        rng = random.Random(uuid.uuid4().int)
        signals: Counter[str] = Counter()
        async with asking(im, replicas) as failed:
            for number in range(faults):
                await asyncio.sleep(rng.uniform(1.0, 2.0))
                victim = replicas.processes[1 + number % 2]
                if rng.random() < 0.5:
                    signals["SIGTERM"] += 1
                    await asyncio.to_thread(victim.terminate)
                else:
                    signals["SIGKILL"] += 1
                    victim.kill()
                    await asyncio.sleep(rng.uniform(0.0, 0.5))
                await asyncio.to_thread(victim.start)
        counters, settled_in = await settled(im, replicas)
        stored = {w.desk.agent.id: await stored_steps(runtime, w.desk) for w in watches}
        # The last steps' events reach the watches a moment after they are stored.
        try:
            async with asyncio.timeout(10):
                while any(w.completed[-1:] != stored[w.desk.agent.id][-1:] for w in watches):  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
        except TimeoutError:
            behind = {
                w.desk.agent.id: (
                    w.completed[-3:],
                    stored[w.desk.agent.id][-3:],
                    (await stored_steps(runtime, w.desk))[-3:],
                    w.resumed,
                    # A watch that stopped following: how.
                    repr(task.exception()) if task.done() else "following",
                )
                for w, task in zip(watches, background, strict=False)
                if w.completed[-1:] != stored[w.desk.agent.id][-1:]
            }
            raise AssertionError(
                "watches behind the store 10 s after settling (agent: last shown, last stored then,"
                f" stored now, watches resumed, the watch): {behind}"
            ) from None
        for task in background:
            task.cancel()
        outcome = await asyncio.gather(*background, return_exceptions=True)
    broke = [e for e in outcome if isinstance(e, BaseException) and not isinstance(e, asyncio.CancelledError)]
    gaps = sum(len(set(stored[w.desk.agent.id]) - set(w.completed)) for w in watches)
    duplicates = sum(len(w.completed) - len(set(w.completed)) for w in watches)
    disordered = sum(w.completed != sorted(w.completed) for w in watches)
    unseen_extra = sum(len(set(w.completed) - set(stored[w.desk.agent.id])) for w in watches)
    restarted = sum(w.restarted for w in watches)
    announced = sum(w.announced for w in watches)
    said = summary(
        "watch across handoffs",
        f"{dict(signals)} of r1/r2, {sum(len(s) for s in stored.values())} steps watched on r0:"
        f" {gaps} gaps, {duplicates} duplicates, {disordered} out of order, {unseen_extra} not stored;"
        f" {restarted} steps started again ({announced} said aborted first);"
        f" {sum(w.resumed for w in watches)} watches resumed; {controlled.done} pause/resume pairs"
        f" through r0 ({len(controlled.wrong)} wrong); {len(failed)} failed calls",
        counters,
        settled_in,
    )
    print(said)
    assert broke == [] and failed == [], said
    assert (gaps, duplicates, disordered, unseen_extra) == (0, 0, 0, 0), said
    assert announced == restarted, said
    assert controlled.done > 0 and controlled.wrong == [], said
    assert_nothing_lost_or_doubled(counters, said)
