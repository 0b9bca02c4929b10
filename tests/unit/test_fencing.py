"""A runner whose replica lost its agent's shard: its writes are refused
(fenced), it stops without answering or blaming the agent, and the next
owner goes on from what is stored and answers once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.runtime.bootstrap import RuntimeApp
from services.runtime.domain.commands import CreateAgent
from services.runtime.domain.llm import Role
from services.runtime.domain.model import Agent, AgentDraft, AgentState, RunStatus
from services.runtime.domain.shards import shard_of
from services.runtime.service_layer.leases import Fence, Fences
from tests.identities import caller_of
from tests.unit.runtime_fakes import FakeClock, FakeIM, InMemoryAgentStore, Script, ScriptedLLM
from tests.unit.runtime_support import fake_runtime

WAIT = 3.0


class Holding(Fences):
    """A replica's view of its leases: it holds every shard at `epoch` (until
    a keeper would notice otherwise, which these tests never let it)."""

    def __init__(self, replica: str, epoch: int) -> None:
        self.replica, self.epoch = replica, epoch

    def fence_for(self, workspace_id: uuid.UUID) -> Fence:
        return Fence(shard_of(workspace_id), self.epoch, self.replica)


@dataclass
class World:
    im: FakeIM
    store: InMemoryAgentStore
    llm: ScriptedLLM
    human: uuid.UUID

    def runtime(self, fences: Fences) -> RuntimeApp:
        return fake_runtime(store=self.store, im=self.im, llm=self.llm, clock=FakeClock(), fences=fences)

    def shard(self) -> int:
        return shard_of(self.im.workspace)

    async def agent(self, app: RuntimeApp) -> Agent:
        owner = caller_of(self.human, self.im.workspace, roles=("owner",))
        return await app.bus.handle(CreateAgent(caller=owner, draft=AgentDraft(name="ada")))


async def idle(app: RuntimeApp, agent: Agent) -> None:
    assert app.supervisor is not None
    runner = app.supervisor.runner(agent.id)
    assert runner is not None
    await asyncio.sleep(0)
    await asyncio.wait_for(runner.idle.wait(), WAIT)


async def world(*scripts: Script) -> AsyncIterator[World]:
    im = FakeIM()
    yield World(im, InMemoryAgentStore(), ScriptedLLM(*scripts), im.human("alice").id)


async def test_writes_under_the_shards_lease_are_stored() -> None:
    async for w in world(Script(content="Hello Alice!")):
        w.store.leases[w.shard()] = ("r1", 1)
        app = w.runtime(Holding("r1", 1))
        await app.start()
        try:
            ada = await w.agent(app)
            chat = w.im.group("", w.human, ada.member_id, direct=True)
            w.im.post(w.human, chat.id, "hi ada")
            await idle(app, ada)
        finally:
            await app.stop()
        assert [m.content for m in w.im.in_group(chat.id)] == ["hi ada", "Hello Alice!"]
        assert w.store.refused_fenced_writes == 0


async def test_a_stale_owner_stops_without_answering_and_the_new_owner_answers_once() -> None:
    taken = asyncio.Event()

    async def another_replica_takes_the_shard() -> None:
        # While the model answers, the shard moves (this replica was frozen
        # past its lease, say): epoch 2, owner r2.
        w.store.leases[w.shard()] = ("r2", 2)
        taken.set()

    async for w in world(Script(content="Hello Alice!", before=another_replica_takes_the_shard)):
        w.store.leases[w.shard()] = ("r1", 1)
        stale = w.runtime(Holding("r1", 1))
        await stale.start()
        try:
            ada = await w.agent(stale)
            chat = w.im.group("", w.human, ada.member_id, direct=True)
            w.im.post(w.human, chat.id, "hi ada")
            await asyncio.wait_for(taken.wait(), WAIT)
            await idle(stale, ada)
        finally:
            await stale.stop()
        # Its answer was refused: not stored, so not posted; the agent is not blamed.
        assert w.store.refused_fenced_writes >= 1
        assert [m.content for m in w.im.in_group(chat.id)] == ["hi ada"]
        assert [s.role for s in w.store.steps[ada.session_id]] == [Role.USER]
        assert w.store.agents[ada.id].state is AgentState.RUNNING, "left for the next owner to go on with"
        (run,) = w.store.runs.values()
        assert run.status is RunStatus.RUNNING

        owner = w.runtime(Holding("r2", 2))
        await owner.start()
        try:
            await idle(owner, ada)
        finally:
            await owner.stop()
        assert [m.content for m in w.im.in_group(chat.id)] == ["hi ada", "Hello Alice!"]
        assert [s.role for s in w.store.steps[ada.session_id]] == [Role.USER, Role.ASSISTANT]
        assert [r.status for r in w.store.runs.values()] == [RunStatus.COMPLETED]
        assert w.store.agents[ada.id].state is AgentState.IDLE
