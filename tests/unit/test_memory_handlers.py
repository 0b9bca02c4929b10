"""The memory's handlers and its embedding worker, on an in-memory store with fake ports."""

# Chinese text is written with its own (full-width) punctuation.
# ruff: noqa: RUF001

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import timedelta

import numpy as np
import numpy.typing as npt
import pytest

from agentim.memory.v1 import memory_pb2 as pb
from services.memory.domain.errors import InvalidRequest, NotAllowed, NotFound, Unauthenticated
from services.memory.domain.model import SegmentType
from services.memory.domain.scope import Filters, ForgetTarget
from services.memory.entrypoints.mappers import run_in
from services.memory.service_layer.embedding import EmbeddingWorker
from services.memory.service_layer.handlers import (
    AgentScopeRequest,
    Caller,
    Memory,
    QueryLimits,
    WorkspaceScopeRequest,
)
from services.memory.service_layer.ports import Vector
from tests.memory_support import START, FakeDirectory, FakeEmbedder, FixedDictionary, RunBuilder
from tests.unit.memory_fakes import InMemoryStore


class HangingEmbedder(FakeEmbedder):
    """Embeds passages, but never answers a query (an overloaded model)."""

    async def embed_query(self, text: str) -> Vector:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class World:
    def __init__(
        self, embedder: FakeEmbedder | None = None, dictionary: FixedDictionary | None = None
    ) -> None:
        self.store = InMemoryStore()
        self.directory = FakeDirectory()
        self.embedder = embedder or FakeEmbedder()
        self.archived = 0
        self.memory = Memory(
            store=self.store,
            embedder=self.embedder,
            directory=self.directory,
            query_limits=QueryLimits(query_embedding_seconds=0.05),
            dictionary=dictionary,
            on_archived=self._count,
        )
        self.worker = EmbeddingWorker(self.store, self.embedder, batch_size=2, retry_initial_seconds=30)
        self.workspace = str(uuid.uuid4())
        self.agent = str(uuid.uuid4())
        self.agent_member = self.directory.add(self.workspace, is_agent=True)

    def _count(self) -> None:
        self.archived += 1
        self.worker.wake()

    def run(self) -> RunBuilder:
        return RunBuilder(self.workspace, self.agent, self.agent_member)

    async def archive(self, run: RunBuilder) -> bool:
        result = await self.memory.archive_run(Caller(self.agent_member), run_in(run.build()))
        return result.changed

    async def embedded(self, run: RunBuilder) -> None:
        """Archives the run and waits until its segments have vectors."""
        await self.archive(run)
        self.worker.start()
        try:
            await asyncio.wait_for(self.worker.drained(), 5)
        finally:
            await self.worker.aclose()
        self.worker = EmbeddingWorker(self.store, self.embedder, batch_size=2, retry_initial_seconds=30)

    async def recall(
        self, query: str, *audience: str, caller: str | None = None, **options: object
    ) -> list[str]:
        found = await self.memory.retrieve(
            Caller(caller or self.agent_member),
            AgentScopeRequest(self.agent, tuple(audience)),
            query=query,
            limit=int(options.pop("limit", 0)),  # type: ignore[call-overload]
            filters=options.pop("filters", Filters()),  # type: ignore[arg-type]
            prefer_recent=bool(options.pop("prefer_recent", False)),
        )
        return [result.segment.text for result in found.results]


async def test_archive_is_idempotent_and_only_a_change_wakes_the_embedder() -> None:
    world = World()
    run = world.run().user("first version")
    assert await world.archive(run) is True
    assert await world.archive(run) is False
    assert (world.archived, world.store.archive_writes) == (1, 1)
    run.steps[0].content = "second version"
    assert await world.archive(run) is True
    assert await world.recall("version") == ["second version"]


async def test_only_the_agent_itself_archives_its_runs() -> None:
    world = World()
    person = world.directory.add(world.workspace)
    run = run_in(world.run().user("x").build())
    with pytest.raises(NotAllowed):
        await world.memory.archive_run(Caller(person), run)
    with pytest.raises(Unauthenticated):
        await world.memory.archive_run(Caller(None), run)
    with pytest.raises(Unauthenticated):
        await world.memory.archive_run(Caller(str(uuid.uuid4())), run)


async def test_a_services_own_token_archives_searches_and_expands_nothing_but_is_no_bad_credential() -> None:
    # It acts for no member: refused as not allowed (not as unauthenticated,
    # which would send its holder to get another token that fares no better).
    world = World()
    run = world.run().user("the launch moves")
    await world.archive(run)
    service = Caller(None, is_service=True)
    scope = AgentScopeRequest(world.agent, ())
    with pytest.raises(NotAllowed):
        await world.memory.archive_run(service, run_in(world.run().user("x").build()))
    with pytest.raises(NotAllowed):
        await world.memory.retrieve(
            service, scope, query="launch", limit=0, filters=Filters(), prefer_recent=False
        )
    with pytest.raises(NotAllowed):
        await world.memory.expand(service, scope, ref=f"{run.run_id}/1/0", before=0, after=0)
    # Forgetting and counting are its to do, as an administrator's calls.
    assert (await world.memory.stats(service, agent_id=world.agent, workspace_id="")).segment_count == 1
    assert await world.memory.forget(service, ForgetTarget(run_id=run.run_id)) == 1


async def test_a_reader_other_than_the_agent_joins_the_audience() -> None:
    world = World()
    alice, bob = world.directory.add(world.workspace), world.directory.add(world.workspace)
    run = world.run()
    run.user("secret plan", group="direct-alice", members=[alice])
    run.user("public plan", group="team", members=[alice, bob])
    run.user("task plan")
    await world.archive(run)
    assert sorted(await world.recall("plan")) == ["public plan", "secret plan", "task plan"]
    assert sorted(await world.recall("plan", alice, bob)) == ["public plan", "task plan"]
    assert sorted(await world.recall("plan", caller=bob)) == ["public plan", "task plan"]
    assert sorted(await world.recall("plan", caller=alice)) == ["public plan", "secret plan", "task plan"]
    # A person's workspace search: conversations they were in, never tasks.
    found = await world.memory.retrieve(
        Caller(bob), WorkspaceScopeRequest(""), query="plan", limit=0, filters=Filters(), prefer_recent=False
    )
    assert [r.segment.text for r in found.results] == ["public plan"]


async def test_the_embedding_worker_makes_meaning_searchable_and_recovers_from_failures() -> None:
    world = World()
    world.embedder.synonyms["automobile"] = "car"
    world.embedder.fail = True
    world.worker.start()
    try:
        await world.archive(world.run().user("the car is blue").user("lunch at noon").user("rain tomorrow"))
        # The embedder is down: lexical search still answers, and says what waits.
        assert await world.recall("the car") == ["the car is blue"]
        assert await world.store.pending_count() == 3
        world.embedder.fail = False
        world.worker.wake()
        await asyncio.wait_for(world.worker.drained(), 5)
        assert await world.store.pending_count() == 0
        assert (await world.recall("automobile"))[0] == "the car is blue"
    finally:
        await world.worker.aclose()


async def test_a_query_whose_vector_is_late_goes_lexical_only() -> None:
    world = World(HangingEmbedder())
    world.worker.start()
    try:
        await world.archive(world.run().user("deploy failed with ERR_QUOTA_42"))
        await asyncio.wait_for(world.worker.drained(), 5)
        assert await world.recall("ERR_QUOTA_42") == ["deploy failed with ERR_QUOTA_42"]
    finally:
        await world.worker.aclose()


async def test_a_question_finds_the_fact_told_in_the_other_language_by_its_words() -> None:
    facts = [
        "The billing deploy on Monday failed because the cache ran out of memory.",
        "search的部署失败了，原因是缓存内存不足。",
        "billing的文档修复已经合并了。",
        "Merged the docs fix for billing.",
        "The search deploy on Friday went fine.",
    ]
    question = "billing的部署为什么失败了？"
    found = []
    for dictionary in (None, FixedDictionary(loaded=False), FixedDictionary()):
        world = World(dictionary=dictionary)
        run = world.run()
        for fact in facts:
            run.user(fact)
        await world.embedded(run)
        found.append(await world.recall(question, limit=2))
    # The fake embedder knows no Chinese: without the dictionary (or while it
    # loads) the English look-alikes win.
    assert facts[0] not in found[0] and found[1] == found[0]
    assert facts[0] in found[2]


async def test_prefer_recent_puts_the_newest_statement_of_a_fact_first_and_nothing_else() -> None:
    world = World()
    for day, text in enumerate(
        [
            "Ada is on call for billing from now on.",
            "Finn is on call for billing from now on.",
            "Merged the docs fix for billing.",
        ]
    ):
        await world.embedded(world.run().user(text, at=START + timedelta(days=30 * day)))
    found = await world.recall("who is on call for billing?", prefer_recent=True, limit=3)
    assert found[:2] == [
        "Finn is on call for billing from now on.",
        "Ada is on call for billing from now on.",
    ]


async def test_retrieve_filters_limits_and_duplicates() -> None:
    world = World()
    run = world.run()
    for index in range(30):
        run.step(pb.STEP_ROLE_TOOL, f"build {index} ok", tool_name="build")
    run.user("please build it")
    await world.archive(run)
    assert await world.recall("build ok") == ["build 0 ok", "please build it"]
    only_results = await world.recall("build", filters=Filters(types=frozenset({SegmentType.USER_MESSAGE})))
    assert only_results == ["please build it"]
    for limit in (-1, 101):
        with pytest.raises(InvalidRequest, match="limit"):
            await world.recall("x", limit=limit)
    with pytest.raises(InvalidRequest, match="query"):
        await world.recall(" ")


async def test_expand_hides_what_the_audience_may_not_see() -> None:
    world = World()
    alice, bob = world.directory.add(world.workspace), world.directory.add(world.workspace)
    run = world.run()
    run.user("for alice only", group="direct-alice", members=[alice])
    run.user("for both", group="team", members=[alice, bob])
    await world.archive(run)
    scope = AgentScopeRequest(world.agent, (bob,))
    expanded = await world.memory.expand(
        Caller(world.agent_member), scope, ref=f"{run.run_id}/2/0", before=0, after=0
    )
    assert expanded.before == [] and expanded.focus.text == "for both"
    with pytest.raises(NotFound):
        await world.memory.expand(
            Caller(world.agent_member), scope, ref=f"{run.run_id}/1/0", before=0, after=0
        )
    with pytest.raises(InvalidRequest):
        await world.memory.expand(
            Caller(world.agent_member), scope, ref=f"{run.run_id}/1/0", before=51, after=0
        )


async def test_forget_and_stats_stay_within_the_callers_workspace() -> None:
    world, other = World(), World()
    run = world.run().user("hello")
    await world.archive(run)
    stranger = other.agent_member
    world.directory.members.update(other.directory.members)
    with pytest.raises(NotAllowed):
        await world.memory.forget(Caller(stranger), ForgetTarget(run_id=run.run_id))
    with pytest.raises(NotAllowed):
        await world.memory.stats(Caller(stranger), agent_id=world.agent, workspace_id="")
    with pytest.raises(InvalidRequest):
        await world.memory.forget(Caller(world.agent_member), ForgetTarget(run_id="a", agent_id="b"))
    assert await world.memory.forget(Caller(world.agent_member), ForgetTarget(run_id="no-such-run")) == 0
    assert await world.memory.forget(Caller(world.agent_member), ForgetTarget(agent_id=world.agent)) == 1
    # A trusted service acting for nobody is an administrator.
    assert (
        await world.memory.forget(Caller(None, is_service=True), ForgetTarget(workspace_id=world.workspace))
        == 0
    )


async def test_an_agents_work_is_its_owners_and_the_admins_to_read_and_forget() -> None:
    """Others see what was said in the chats they share with the agent, and
    forget nothing of it; the owner and the workspace's admins see its
    reasoning and tool calls and forget what it keeps."""
    world = World()
    owner = world.directory.owner_of(world.agent_member)
    colleague = world.directory.add(world.workspace)
    everyone = [owner, colleague]
    run = world.run().user("what is the plan?", group="team", members=everyone)
    run.assistant(
        "the plan is friday",
        group="team",
        members=everyone,
        reasoning="the plan needs a quiet friday",
        tool_calls=[("lookup", '{"q": "plan"}')],
    )
    await world.archive(run)
    people = {
        "owner": Caller(owner),
        "admin": Caller(colleague, roles=("admin",)),
        "colleague": Caller(colleague, roles=("member",)),
    }
    work = frozenset({SegmentType.RESPONSE, SegmentType.REASONING, SegmentType.TOOL_CALL})

    async def kinds(caller: Caller, scope: AgentScopeRequest | WorkspaceScopeRequest) -> set[SegmentType]:
        found = await world.memory.retrieve(
            caller, scope, query="plan", limit=20, filters=Filters(types=work), prefer_recent=False
        )
        return {r.segment.type for r in found.results}

    agent_scope = AgentScopeRequest(world.agent, ())
    assert await kinds(people["owner"], agent_scope) == work
    assert await kinds(people["admin"], agent_scope) == work
    assert await kinds(people["colleague"], agent_scope) == {SegmentType.RESPONSE}
    assert await kinds(people["colleague"], WorkspaceScopeRequest("")) == {SegmentType.RESPONSE}
    assert await kinds(people["admin"], WorkspaceScopeRequest("")) == work
    reasoning = next(
        r.segment
        for r in (
            await world.memory.retrieve(
                people["owner"], agent_scope, query="quiet", limit=5, filters=Filters(), prefer_recent=False
            )
        ).results
        if r.segment.type is SegmentType.REASONING
    )
    ref = f"{reasoning.run_id}/{reasoning.step_sequence}/{reasoning.segment_index}"
    with pytest.raises(NotFound):
        await world.memory.expand(people["colleague"], agent_scope, ref=ref, before=0, after=0)
    assert (
        await world.memory.expand(people["owner"], agent_scope, ref=ref, before=0, after=0)
    ).focus == reasoning

    with pytest.raises(NotAllowed):
        await world.memory.forget(people["colleague"], ForgetTarget(run_id=run.run_id))
    with pytest.raises(NotAllowed):
        await world.memory.forget(Caller(owner), ForgetTarget(workspace_id=world.workspace))
    assert await world.memory.forget(people["owner"], ForgetTarget(run_id=run.run_id)) > 0
    await world.archive(world.run().user("again", group="team", members=everyone))
    assert await world.memory.forget(people["admin"], ForgetTarget(workspace_id=world.workspace)) > 0


class RecordingEmbedder(FakeEmbedder):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    async def embed_passages(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        self.batches.append(len(texts))
        return await super().embed_passages(texts)


async def test_the_worker_embeds_in_batches_and_picks_up_what_waited_before_it_started() -> None:
    embedder = RecordingEmbedder()
    world = World(embedder)
    await world.archive(world.run().user("one").user("two").user("three").user("four").user("five"))
    world.worker.start()
    try:
        await asyncio.wait_for(world.worker.drained(), 5)
    finally:
        await world.worker.aclose()
    assert embedder.batches == [2, 2, 1]
    assert world.worker.embedded == 5
