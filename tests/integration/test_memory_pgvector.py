"""Vector search in PostgreSQL with pgvector, on a real PostgreSQL 18 with
pgvector 0.8 (the embedded server of `tests/pgvector_server.py`): found at
start or refused, ranking exactly as the numpy path does on the same data,
the audience rule and filters alike, vectors stored before pgvector
centered afterwards. Each test has a database of its own, so that the
languages' means (global to a database) are its own.
"""

# Chinese text is written with its own (full-width) punctuation.

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from agentim.memory.v1 import memory_pb2 as pb
from services.memory.adapters import migrate
from services.memory.adapters.pgvector import HNSW_INDEX, PgVectorUnavailable
from services.memory.adapters.sql import Database, SqlMemoryStore
from services.memory.domain.model import SegmentType
from services.memory.domain.ranking import Hit
from services.memory.domain.scope import Filters, Scope
from services.memory.domain.terms import language_of
from services.memory.service_layer.ports import Vector
from tests.auth_support import service_environment
from tests.conftest import unavailable
from tests.identities import as_member
from tests.integration.memory_harness import (
    RunningMemory,
    migrated_url,
    start_memory,
    stop_memory,
)
from tests.memory_support import START, FakeDirectory, FakeEmbedder, RunBuilder
from tests.pgvector_server import ServerUnavailable, admin_connection, drop_database, pgvector_url

WORDS = ["ledger", "billing", "deploy", "cache", "quota", "schema", "review", "latency", "rollback", "index"]
HANZI = ["部署", "预算", "账单", "缓存", "配额", "评审", "延迟", "回滚", "索引", "迁移"]


@contextlib.asynccontextmanager
async def fresh_database(*, owner: str = "", index_only: bool = False) -> AsyncIterator[str]:
    """A migrated database of its own on the embedded server (owned by
    `owner`, connecting as that role, if given), dropped afterwards.

    With `index_only`, its sessions plan no sorts where they can help it:
    vector search then walks the HNSW index at any size, as it does at scale
    (at a few hundred rows the planner rightly prefers to sort them).
    """
    name = f"agentim_pgv_{uuid.uuid4().hex[:10]}"
    try:
        url = await pgvector_url("postgres")
    except ServerUnavailable as error:
        unavailable(f"no PostgreSQL with pgvector: {error}")
    admin = await admin_connection()
    try:
        await admin.execute(f'CREATE DATABASE "{name}"' + (f' OWNER "{owner}"' if owner else ""))
        if index_only:
            await admin.execute(f'ALTER DATABASE "{name}" SET enable_sort = off')
    finally:
        await admin.close()
    target = make_url(url).set(database=name)
    if owner:
        target = target.set(username=owner)
    url = target.render_as_string(hide_password=False)
    try:
        database = Database(url)
        try:
            await migrate.upgrade(database)
        finally:
            await database.aclose()
        yield url
    finally:
        await drop_database(name)


@dataclass
class World:
    """Two agents of one workspace and two people, conversations of various
    audiences, and another workspace beside it."""

    workspace: str
    agent: str
    agent_member: str
    other_agent: str
    other_member: str
    alice: str
    bob: str
    stranger_workspace: str = ""
    runs: list[str] = field(default_factory=list)


def sentence(rng: random.Random) -> str:
    if rng.random() < 0.35:
        return "".join(rng.sample(HANZI, rng.randint(2, 4)))
    return " ".join(rng.sample(WORDS, rng.randint(2, 5)))


_notes = itertools.count()


def note(rng: random.Random) -> str:
    """A sentence made unique by a word of its own: no two segments have the
    same vector, whose scores would tie, and float32 rounding (which differs
    with a row's place in a matrix) would then order them either way."""
    return f"{sentence(rng)} n{next(_notes)}"


async def populate(memory: RunningMemory, world: World, rng: random.Random, *, runs: int) -> None:
    """Archives `runs` runs of four steps each (a user's message, a reply with
    reasoning, a tool result) in conversations of every audience, over days."""
    groups = [
        ("g-alice", [world.alice]),
        ("g-bob", [world.bob]),
        ("g-both", [world.alice, world.bob]),
        ("", []),
    ]
    for number in range(runs):
        agent, member = rng.choice(
            [(world.agent, world.agent_member), (world.other_agent, world.other_member)]
        )
        group, people = rng.choice(groups)
        run = RunBuilder(world.workspace, agent, member, start=START + timedelta(hours=7 * number))
        run.user(note(rng), group=group, members=people)
        run.assistant(note(rng), reasoning=note(rng), group=group, members=people)
        run.step(pb.STEP_ROLE_TOOL, note(rng), tool_name="lookup", group=group, members=people)
        await memory.stub.ArchiveRun(pb.ArchiveRunRequest(run=run.build()), metadata=as_member(member))
        world.runs.append(run.run_id)
    # The other workspace: the same words, never to be found from this one.
    stranger = RunBuilder(
        world.stranger_workspace,
        str(uuid.uuid4()),
        memory.directory.add(world.stranger_workspace, is_agent=True),
    )
    for _ in range(10):
        stranger.user(note(rng))
    await memory.stub.ArchiveRun(
        pb.ArchiveRunRequest(run=stranger.build()), metadata=as_member(stranger.agent_member_id)
    )
    assert memory.app.worker is not None
    await asyncio.wait_for(memory.app.worker.drained(), 60)


def new_world(memory: RunningMemory) -> World:
    workspace, agent, agent_member = memory.new_workspace()
    stranger_workspace = str(uuid.uuid4())
    other_member = memory.directory.add(workspace, is_agent=True)
    # Alice owns both agents: what they keep is hers to forget.
    alice = memory.directory.owner_of(agent_member)
    memory.directory.owner_of(other_member, owner=alice)
    return World(
        workspace=workspace,
        agent=agent,
        agent_member=agent_member,
        other_agent=str(uuid.uuid4()),
        other_member=other_member,
        alice=alice,
        bob=memory.directory.add(workspace),
        stranger_workspace=stranger_workspace,
    )


def searches(world: World) -> list[tuple[str, Scope, Filters]]:
    """Scopes, audiences and filters of every kind, named."""
    mine = Scope(world.workspace, frozenset(), world.agent)
    return [
        ("the agent's own memory", mine, Filters()),
        ("the agent, for alice", Scope(world.workspace, frozenset({world.alice}), world.agent), Filters()),
        (
            "the agent, for alice and bob",
            Scope(world.workspace, frozenset({world.alice, world.bob}), world.agent),
            Filters(),
        ),
        ("the workspace, for alice", Scope(world.workspace, frozenset({world.alice})), Filters()),
        ("the workspace, for bob", Scope(world.workspace, frozenset({world.bob})), Filters()),
        ("replies only", mine, Filters(types=frozenset({SegmentType.RESPONSE}))),
        (
            "tool results and reasoning",
            mine,
            Filters(types=frozenset({SegmentType.TOOL_RESULT, SegmentType.REASONING})),
        ),
        ("a week", mine, Filters(since=START + timedelta(days=2), until=START + timedelta(days=9))),
        (
            "one group, for alice",
            Scope(world.workspace, frozenset({world.alice})),
            Filters(group_id="g-both"),
        ),
        (
            "the other agent, for bob",
            Scope(world.workspace, frozenset({world.bob})),
            Filters(agent_id=world.other_agent),
        ),
        ("runs left out", mine, Filters(exclude_run_ids=frozenset(world.runs[::2]))),
    ]


async def assert_same_ranking(
    pgvector: SqlMemoryStore,
    url: str,
    world: World,
    embedder: FakeEmbedder,
    queries: Sequence[str],
    *,
    limit: int = 10,
) -> int:
    """Every search of `searches` for every query finds the same segments in
    the same order with the same scores on both paths; returns how many hits.

    The numpy path is a store of its own, loaded now: a cached matrix keeps
    the languages' means it was loaded with while it takes new rows in (up
    to twice as many), where the database path always centers with the
    current ones, as numpy does at a load.
    """
    numpy = SqlMemoryStore(Database(url), dimensions=embedder.dimensions)
    try:
        return await _same_ranking(pgvector, numpy, world, embedder, queries, limit=limit)
    finally:
        await numpy.aclose()


async def _same_ranking(
    pgvector: SqlMemoryStore,
    numpy: SqlMemoryStore,
    world: World,
    embedder: FakeEmbedder,
    queries: Sequence[str],
    *,
    limit: int,
) -> int:
    found = 0
    for name, scope, filters in searches(world):
        for query in queries:
            vector, language = embedder.vector(query), language_of(query)
            database = await pgvector.vector_search(scope, filters, vector, language, limit)
            exact = await numpy.vector_search(scope, filters, vector, language, limit)
            assert [hit.key for hit in database] == [hit.key for hit in exact], (name, query)
            np.testing.assert_allclose(
                [hit.score for hit in database], [hit.score for hit in exact], atol=1e-6, err_msg=name
            )
            await assert_visible(numpy, world, scope, filters, database)
            found += len(database)
    return found


async def assert_visible(
    store: SqlMemoryStore, world: World, scope: Scope, filters: Filters, hits: Sequence[Hit]
) -> None:
    """The audience rule and the filters, checked hit by hit."""
    segments = await store.segments([hit.key for hit in hits])
    may_see = {"g-alice": {world.alice}, "g-bob": {world.bob}, "g-both": {world.alice, world.bob}}
    for hit in hits:
        segment = segments[hit.key]
        assert segment.workspace_id == world.workspace
        if scope.agent_id is not None:
            assert segment.agent_id == scope.agent_id
        if not segment.group_id:
            # A task's segment: in its agent's scope only.
            assert scope.agent_id is not None
        elif scope.audience:
            assert scope.audience <= may_see[segment.group_id], segment.group_id
        assert not filters.types or segment.type in filters.types
        assert not filters.group_id or segment.group_id == filters.group_id
        assert not filters.agent_id or segment.agent_id == filters.agent_id
        assert segment.run_id not in filters.exclude_run_ids
        assert filters.since is None or segment.created_at >= filters.since
        assert filters.until is None or segment.created_at < filters.until


def queries(rng: random.Random, count: int) -> list[str]:
    return [sentence(rng) for _ in range(count)]


async def test_the_database_ranks_exactly_as_numpy_does_on_the_same_data() -> None:
    async with fresh_database(index_only=True) as url:
        embedder = FakeEmbedder()
        # ef_search above the rows: at this size the index's walk reaches every
        # row, so a difference could only be the centering's or the filters'
        # (recall at the default, 100, is measured in bench.memory_pgvector_bench).
        memory = await start_memory(
            url, embedder=embedder, MEMORY_PGVECTOR="on", MEMORY_PGVECTOR_EF_SEARCH="1000"
        )
        try:
            store = memory.app.store
            assert store.pgvector is not None and store.pgvector.extension.iterative_scan
            world = new_world(memory)
            rng = random.Random(5)
            hits = 0
            # Rounds: the languages' means move as vectors come in, new
            # epochs start, and the job centers rows again meanwhile.
            for _ in range(2):
                await populate(memory, world, rng, runs=25)
                hits += await assert_same_ranking(store, url, world, embedder, queries(rng, 2))
            assert store.pgvector.centering.epochs_started >= 2
            await store.pgvector.centering.settled()
            hits += await assert_same_ranking(store, url, world, embedder, queries(rng, 2), limit=50)
            assert hits > 400
            assert store.pgvector.searches > 0 and store.pgvector.exact_searches < store.pgvector.searches

            # Settled, every row is centered with its language's epoch mean.
            async with memory.app.database.transaction(write=False) as conn:
                rows = (
                    await conn.execute(
                        sa.text(
                            "SELECT v.embedding, CAST(v.centered AS real[]) AS centered, c.mean"
                            " FROM memory.segment_vectors v JOIN memory.segments s ON s.id = v.segment_id"
                            " JOIN memory.vector_centering c ON c.language = s.language"
                        )
                    )
                ).all()
            assert len(rows) == 2 * (25 * 4 + 10)
            for row in rows:
                shifted = np.frombuffer(row.embedding, "<f4") - np.frombuffer(row.mean, "<f4")
                np.testing.assert_allclose(row.centered, shifted / np.linalg.norm(shifted), atol=1e-6)

            # The searches walked the HNSW index.
            scope = Scope(world.workspace, frozenset({world.alice}), world.agent)
            plan = await explain(memory, scope, Filters(), embedder.vector("ledger"))
            assert HNSW_INDEX in plan, plan
        finally:
            await stop_memory(memory)


async def explain(memory: RunningMemory, scope: Scope, filters: Filters, query: Vector) -> str:
    """PostgreSQL's plan for the search's statement (with the search's settings)."""
    store = memory.app.store
    assert store.pgvector is not None
    statement = store.pgvector._nearest(scope, filters, query, 20)
    async with memory.app.database.transaction(write=False, set_local=True) as conn:
        await conn.execute(sa.text("SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true)"))
        sql = str(statement.compile(conn.sync_connection, compile_kwargs={"literal_binds": True}))
        rows = (await conn.exec_driver_sql("EXPLAIN " + sql)).all()
    return "\n".join(row[0] for row in rows)


async def test_retrieve_answers_alike_with_and_without_pgvector() -> None:
    async with fresh_database() as url:
        directory, embedder = FakeDirectory(), FakeEmbedder()
        with_pgvector = await start_memory(url, directory=directory, embedder=embedder, MEMORY_PGVECTOR="on")
        try:
            world = new_world(with_pgvector)
            rng = random.Random(8)
            await populate(with_pgvector, world, rng, runs=30)
            await with_pgvector.app.store.pgvector.centering.settled()  # type: ignore[union-attr]
            async with with_pgvector.app.database.transaction() as conn:
                await conn.execute(sa.text("ANALYZE memory.segments"))
                uncentered = await conn.scalar(
                    sa.text("SELECT count(*) FROM memory.segment_vectors WHERE centered IS NULL")
                )
            assert uncentered == 0 and await with_pgvector.app.store.pending_count() == 0
            # Everything is embedded: this replica stores no vector.
            without = await start_memory(url, directory=directory, embedder=embedder, MEMORY_PGVECTOR="off")
            try:
                assert without.app.store.pgvector is None
                # The lexical half weighs terms by counts that each replica reads
                # from PostgreSQL's statistics, whose live-row count moves as
                # backends flush theirs (two replicas a moment apart read 130
                # and 190 rows): one set of counts for both, so that only the
                # vector search differs.
                without.app.store.term_frequencies = with_pgvector.app.store.term_frequencies
                for query in queries(rng, 6):
                    for member, scope in (
                        (world.agent_member, {"agent": pb.AgentScope(agent_id=world.agent)}),
                        (world.alice, {"agent": pb.AgentScope(agent_id=world.agent)}),
                        (world.bob, {"workspace": pb.WorkspaceScope()}),
                    ):
                        request = pb.RetrieveRequest(query=query, limit=20, **scope)
                        answers = [
                            await replica.stub.Retrieve(request, metadata=as_member(member))
                            for replica in (with_pgvector, without)
                        ]
                        database, exact = (answer.results for answer in answers)
                        assert [hit.segment.ref for hit in database] == [hit.segment.ref for hit in exact], (
                            query
                        )
                        # The vector scores of the two agree to float32 rounding.
                        assert [hit.score for hit in database] == pytest.approx(
                            [hit.score for hit in exact], abs=1e-5
                        )
                assert with_pgvector.app.store.pgvector.searches >= 18  # type: ignore[union-attr]
            finally:
                await stop_memory(without)
        finally:
            await stop_memory(with_pgvector)


async def test_a_narrow_filter_gets_its_hits_through_the_index() -> None:
    async with fresh_database(index_only=True) as url:
        embedder = FakeEmbedder()
        # A short candidate list: only iterative scans get past it.
        memory = await start_memory(
            url, embedder=embedder, MEMORY_PGVECTOR="on", MEMORY_PGVECTOR_EF_SEARCH="1"
        )
        numpy = SqlMemoryStore(Database(url), dimensions=embedder.dimensions)
        try:
            workspace, agent, member = memory.new_workspace()
            rng = random.Random(3)
            for batch in range(4):
                run = RunBuilder(workspace, agent, member, start=START + timedelta(days=batch))
                for _ in range(60):
                    run.user(note(rng))
                for _ in range(3):
                    run.step(pb.STEP_ROLE_TOOL, note(rng), tool_name="probe")
                await memory.stub.ArchiveRun(
                    pb.ArchiveRunRequest(run=run.build()), metadata=as_member(member)
                )
            assert memory.app.worker is not None
            await asyncio.wait_for(memory.app.worker.drained(), 60)
            store = memory.app.store
            assert store.pgvector is not None
            await store.pgvector.centering.settled()
            scope = Scope(workspace, frozenset(), agent)
            narrow = Filters(types=frozenset({SegmentType.TOOL_RESULT}))  # 12 of 252 rows
            plan = await explain(memory, scope, narrow, embedder.vector("ledger"))
            assert HNSW_INDEX in plan, plan
            exact_before = store.pgvector.exact_searches
            for query in queries(rng, 6):
                vector, language = embedder.vector(query), language_of(query)
                hits = await store.vector_search(scope, narrow, vector, language, 5)
                assert len(hits) == 5
                assert hits == await numpy.vector_search(scope, narrow, vector, language, 5)
            # 10 candidates each time, found by walking the index past its single candidate.
            assert store.pgvector.exact_searches == exact_before
            # Fewer visible rows than asked for: all of them, exactly.
            everything = await store.vector_search(scope, narrow, embedder.vector("cache"), "en", 40)
            assert len(everything) == 12 and store.pgvector.exact_searches == exact_before + 1
        finally:
            await numpy.aclose()
            await stop_memory(memory)


async def test_vectors_stored_before_pgvector_are_centered_then_searched_in_the_database() -> None:
    async with fresh_database() as url:
        directory, embedder = FakeDirectory(), FakeEmbedder()
        before = await start_memory(url, directory=directory, embedder=embedder, MEMORY_PGVECTOR="off")
        try:
            world = new_world(before)
            await populate(before, world, random.Random(11), runs=30)
        finally:
            await stop_memory(before)
        after = await start_memory(url, directory=directory, embedder=embedder, MEMORY_PGVECTOR="on")
        try:
            store = after.app.store
            assert store.pgvector is not None
            await store.pgvector.centering.settled()
            assert store.pgvector.ready and store.pgvector.centering.rows_centered >= 30 * 4 + 10
            async with after.app.database.transaction(write=False) as conn:
                uncentered = await conn.scalar(
                    sa.text("SELECT count(*) FROM memory.segment_vectors WHERE centered IS NULL")
                )
            assert uncentered == 0
            hits = await assert_same_ranking(store, url, world, embedder, ["ledger cache", "部署预算"])
            assert hits > 0 and store.pgvector.searches == 2 * len(searches(world))

            # Forget (a person's call) takes the vectors out of the index with their segments.
            forgotten = world.runs[:10]
            for run_id in forgotten:
                await after.stub.Forget(pb.ForgetRequest(run_id=run_id), metadata=as_member(world.alice))
            scope = Scope(world.workspace, frozenset({world.alice}), None)
            left = await store.vector_search(scope, Filters(), embedder.vector("ledger"), "en", 200)
            kept = await store.segments([hit.key for hit in left])
            assert left and not {segment.run_id for segment in kept.values()} & set(forgotten)
        finally:
            await stop_memory(after)

        # Another embedder (another vector size): the column is made again for it.
        small = FakeEmbedder(dimensions=16)
        resized = await start_memory(url, directory=directory, embedder=small, MEMORY_PGVECTOR="on")
        try:
            async with resized.app.database.transaction(write=False) as conn:
                size = await conn.scalar(
                    sa.text(
                        "SELECT atttypmod FROM pg_attribute"
                        " WHERE attrelid = 'memory.segment_vectors'::regclass AND attname = 'centered'"
                    )
                )
            assert size == 16
            run = RunBuilder(world.workspace, world.agent, world.agent_member).user("a fresh note on quota")
            await resized.stub.ArchiveRun(
                pb.ArchiveRunRequest(run=run.build()), metadata=as_member(world.agent_member)
            )
            assert resized.app.worker is not None
            await asyncio.wait_for(resized.app.worker.drained(), 30)
            scope = Scope(world.workspace, frozenset(), world.agent)
            found = await resized.app.store.vector_search(scope, Filters(), small.vector("quota"), "en", 10)
            # Only vectors of the embedder's size are searched.
            assert len(found) == 1
        finally:
            await stop_memory(resized)


async def test_a_role_that_may_not_create_the_extension_searches_in_numpy_unless_told_on() -> None:
    role = "agentim_pgvector_plain"
    try:
        await pgvector_url("postgres")
    except ServerUnavailable as error:
        unavailable(f"no PostgreSQL with pgvector: {error}")
    admin = await admin_connection()
    try:
        if not await admin.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
            await admin.execute(f'CREATE ROLE "{role}" LOGIN')
    finally:
        await admin.close()
    async with fresh_database(owner=role) as url:
        automatic = await start_memory(url)
        try:
            assert automatic.app.store.pgvector is None
        finally:
            await stop_memory(automatic)
        with pytest.raises(PgVectorUnavailable, match="this role cannot create it"):
            await start_memory(url, MEMORY_PGVECTOR="on")

        # Once a superuser has created it, the role uses it.
        admin = await admin_connection()
        try:
            name = make_url(url).database
            await admin.execute(f'GRANT CREATE ON DATABASE "{name}" TO "{role}"')
        finally:
            await admin.close()
        superuser = make_url(url).set(username="postgres")
        database = Database(superuser.render_as_string(hide_password=False))
        try:
            async with database.transaction() as conn:
                await conn.execute(sa.text("CREATE EXTENSION vector"))
        finally:
            await database.aclose()
        granted = await start_memory(url, MEMORY_PGVECTOR="on")
        try:
            assert granted.app.store.pgvector is not None
        finally:
            await stop_memory(granted)


async def test_pgvector_on_refuses_to_start_where_the_database_has_none(tmp_path: Path) -> None:
    """Debian's PostgreSQL (the shared test server) has no pgvector."""
    url = await migrated_url("postgresql", tmp_path)
    automatic = await start_memory(url)
    try:
        assert automatic.app.store.pgvector is None
    finally:
        await stop_memory(automatic)
    with pytest.raises(
        PgVectorUnavailable, match="MEMORY_PGVECTOR=on, but the database server has no pgvector"
    ):
        await start_memory(url, MEMORY_PGVECTOR="on")
    environ = {
        **os.environ,
        **service_environment(),
        "MEMORY_DATABASE_URL": url,
        "MEMORY_GRPC_ADDRESS": "127.0.0.1:0",
        "MEMORY_EMBEDDER": "none",
        "MEMORY_DICTIONARY": "none",
        "MEMORY_PGVECTOR": "on",
    }
    process = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "services.memory", "serve"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert process.returncode == 1
    assert "memory service cannot start: MEMORY_PGVECTOR=on, but the database server has no pgvector" in (
        process.stderr
    )


async def test_an_index_build_that_failed_is_built_again_and_tables_must_be_there_first() -> None:
    async with fresh_database() as url:
        first = await start_memory(url, MEMORY_PGVECTOR="on")
        try:
            assert first.app.store.pgvector is not None
            await first.app.store.pgvector.centering.settled()
            assert first.app.store.pgvector.ready
        finally:
            await stop_memory(first)
        # What a CREATE INDEX CONCURRENTLY that failed half-way leaves behind.
        admin = await admin_connection(str(make_url(url).database))
        try:
            failed = await admin.fetchval("SELECT CAST(CAST($1 AS regclass) AS oid)", f"memory.{HNSW_INDEX}")
            await admin.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = $1", failed)
        finally:
            await admin.close()
        second = await start_memory(url, MEMORY_PGVECTOR="on")
        try:
            store = second.app.store
            assert store.pgvector is not None
            await store.pgvector.centering.settled()
            async with second.app.database.transaction(write=False) as conn:
                rebuilt = (
                    await conn.execute(
                        sa.text(
                            "SELECT indexrelid, indisvalid FROM pg_index"
                            " WHERE indexrelid = CAST(:name AS regclass)"
                        ),
                        {"name": f"memory.{HNSW_INDEX}"},
                    )
                ).one()
            # Dropped and made again.
            assert store.pgvector.ready and rebuilt.indisvalid and rebuilt.indexrelid != failed
        finally:
            await stop_memory(second)
    # A database the memory's migrations have not been run on.
    name = f"agentim_pgv_{uuid.uuid4().hex[:10]}"
    url = await pgvector_url(name)
    try:
        with pytest.raises(PgVectorUnavailable, match="the memory's tables are missing"):
            await start_memory(url, MEMORY_PGVECTOR="on")
    finally:
        await drop_database(name)
