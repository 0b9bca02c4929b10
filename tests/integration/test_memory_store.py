"""The memory's storage on SQLite and PostgreSQL: schema, lexical tokens, vector caches, retention."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
import warnings
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import numpy as np
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.engine import Connection, make_url

from agentim.memory.v1 import memory_pb2 as pb
from services.memory.adapters import migrate
from services.memory.adapters.pgvector import HNSW_INDEX, UNCENTERED_INDEX
from services.memory.adapters.search import TermFrequencies
from services.memory.adapters.sql import Database
from services.memory.adapters.tables import SCHEMA, language_means, metadata
from services.memory.domain.scope import Filters, Scope
from services.memory.domain.terms import language_of
from services.memory.service_layer.retention import RetentionSweep
from tests.conftest import POSTGRES_URL, unavailable
from tests.identities import as_member
from tests.integration.memory_harness import (
    WITH_PGVECTOR,
    RunningMemory,
    memory,
    memory_url,
    start_memory,
    stop_memory,
)
from tests.memory_support import START, FakeDirectory, FakeEmbedder, RunBuilder

__all__ = ["memory", "memory_url"]

# Lexical indexes live outside the metadata, being backend-specific (see tables.py),
# and so does what pgvector needs, made at start where the database has it (adapters/pgvector.py).
_LEXICAL = {"segment_fts", "tsv", "ix_memory_segments_tsv"}
_PGVECTOR = {"centered", "vector_centering", HNSW_INDEX, UNCENTERED_INDEX}


def _ours(name: str | None, kind: str, _parent: Any) -> bool:
    if name is None:
        return True
    if kind == "schema":
        return name == SCHEMA
    return not name.startswith("segment_fts") and name not in _LEXICAL | _PGVECTOR


def _differences(connection: Connection) -> list[Any]:
    is_postgres = connection.dialect.name == "postgresql"
    context = MigrationContext.configure(
        connection,
        opts={
            "version_table": "memory_alembic_version",
            "version_table_schema": SCHEMA if is_postgres else None,
            "include_schemas": is_postgres,
            "include_name": _ours
            if is_postgres
            else lambda name, kind, parent: _ours(name, kind, parent) or kind == "schema",
            "compare_type": True,
        },
    )
    if is_postgres:
        target = metadata
    else:
        target = sa.MetaData()
        for table in metadata.tables.values():
            table.to_metadata(target, schema=None)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        # pgvector's column, where it exists, is one SQLAlchemy does not know (and is left out above).
        warnings.filterwarnings("ignore", "Did not recognize type 'vector'", sa.exc.SAWarning)
        return list(compare_metadata(context, target))


@pytest.mark.parametrize("memory_url", WITH_PGVECTOR, indirect=True)
async def test_the_migrations_build_exactly_the_tables(memory_url: str) -> None:
    database = Database(memory_url)
    try:
        async with database.engine.connect() as conn:
            assert await conn.run_sync(_differences) == []
    finally:
        await database.aclose()


async def test_identifiers_and_chinese_bigrams_stay_single_tokens(memory: RunningMemory) -> None:
    workspace, agent, agent_member = memory.new_workspace()
    run = RunBuilder(workspace, agent, agent_member)
    run.user("quota error ERR_QUOTA_42 in services/im/bootstrap.py while 部署")
    run.user("err quota 42 services im bootstrap py 部 署")
    await memory.stub.ArchiveRun(pb.ArchiveRunRequest(run=run.build()), metadata=as_member(agent_member))
    database = memory.app.database
    async with database.engine.connect() as conn:
        for token in ("err_quota_42", "services/im/bootstrap.py", "部署"):
            if database.is_sqlite:
                found = await conn.execute(
                    sa.text("SELECT count(*) FROM segment_fts WHERE segment_fts MATCH :q"),
                    {"q": f'"{token}"'},
                )
            else:
                found = await conn.execute(
                    sa.text(
                        "SELECT count(*) FROM memory.segments"
                        " WHERE workspace_id = :w AND tsv @@ CAST(:q AS tsquery)"
                    ),
                    {"w": workspace, "q": f"'{token}'"},
                )
            # Only the first segment holds the whole token; the second has its pieces.
            assert found.scalar_one() == 1, token


@pytest.mark.parametrize("memory_url", WITH_PGVECTOR, indirect=True)
async def test_a_replica_sees_writes_made_through_another(memory_url: str) -> None:
    directory, embedder = FakeDirectory(), FakeEmbedder()
    first = await start_memory(memory_url, directory=directory, embedder=embedder)
    second = await start_memory(memory_url, directory=directory, embedder=embedder)
    try:
        workspace, agent, agent_member = first.new_workspace()

        async def search(replica: RunningMemory, query: str) -> list[str]:
            response = await replica.stub.Retrieve(
                pb.RetrieveRequest(agent=pb.AgentScope(agent_id=agent), query=query),
                metadata=as_member(agent_member),
            )
            return [hit.segment.text for hit in response.results]

        one = RunBuilder(workspace, agent, agent_member).user("orange juice in the fridge")
        await first.stub.ArchiveRun(pb.ArchiveRunRequest(run=one.build()), metadata=as_member(agent_member))
        assert first.app.worker is not None
        await asyncio.wait_for(first.app.worker.drained(), 10)
        embedder.synonyms["citrus"] = "orange"
        assert await search(second, "citrus") == ["orange juice in the fridge"]
        loads = second.app.store.vectors.loads
        assert await search(second, "citrus") == ["orange juice in the fridge"]
        assert second.app.store.vectors.loads == loads, "an unchanged scope is not loaded again"
        person = directory.owner_of(agent_member)
        await first.stub.Forget(pb.ForgetRequest(run_id=one.run_id), metadata=as_member(person))
        assert await search(second, "citrus") == []
    finally:
        await stop_memory(first)
        await stop_memory(second)


async def test_a_scope_matrix_takes_new_rows_in_without_reloading_and_reloads_after_a_deletion(
    memory_url: str,
) -> None:
    directory, embedder = FakeDirectory(), FakeEmbedder()
    replica = await start_memory(memory_url, directory=directory, embedder=embedder)
    try:
        workspace, agent, agent_member = replica.new_workspace()
        vectors = replica.app.store.vectors
        assert replica.app.worker is not None

        async def add(*texts: str) -> str:
            run = RunBuilder(workspace, agent, agent_member)
            for text in texts:
                run.user(text)
            await replica.stub.ArchiveRun(
                pb.ArchiveRunRequest(run=run.build()), metadata=as_member(agent_member)
            )
            assert replica.app.worker is not None
            await asyncio.wait_for(replica.app.worker.drained(), 10)
            return run.run_id

        async def search(query: str) -> list[str]:
            response = await replica.stub.Retrieve(
                pb.RetrieveRequest(agent=pb.AgentScope(agent_id=agent), query=query),
                metadata=as_member(agent_member),
            )
            return [hit.segment.text for hit in response.results]

        await add(*(f"filler line {word}" for word in map(str, range(70))))
        await search("filler")
        loads, appends = vectors.loads, vectors.appends
        added = await add("a kiwi in the bowl")
        embedder.synonyms["fruit"] = "kiwi"
        assert (await search("fruit"))[0] == "a kiwi in the bowl"  # found by meaning: its vector is in
        assert (vectors.loads, vectors.appends) == (loads, appends + 1)
        person = directory.owner_of(agent_member)
        await replica.stub.Forget(pb.ForgetRequest(run_id=added), metadata=as_member(person))
        assert "a kiwi in the bowl" not in await search("fruit")
        assert vectors.loads == loads + 1  # a deletion reloads
    finally:
        await stop_memory(replica)


async def test_a_rare_term_weighs_more_than_a_common_one(memory: RunningMemory) -> None:
    workspace, agent, agent_member = memory.new_workspace()
    run = RunBuilder(workspace, agent, agent_member)
    for number in range(6):
        run.user(f"the build passed {'zanzibar' if number == 0 else 'again'}")
    await memory.stub.ArchiveRun(pb.ArchiveRunRequest(run=run.build()), metadata=as_member(agent_member))
    rarity = await memory.app.store.term_rarity(["the", "zanzibar", "never-seen", "the"])
    assert set(rarity) == {"the", "zanzibar", "never-seen"}
    # A term no segment holds says nothing about which one is meant.
    assert rarity["zanzibar"] > rarity["the"] > rarity["never-seen"] == 0


async def test_retention_forgets_what_is_older_than_the_period(memory: RunningMemory) -> None:
    workspace, agent, agent_member = memory.new_workspace()
    old = RunBuilder(workspace, agent, agent_member, start=START).user("an old fact")
    new = RunBuilder(workspace, agent, agent_member, start=START + timedelta(days=20)).user("a new fact")
    for run in (old, new):
        await memory.stub.ArchiveRun(pb.ArchiveRunRequest(run=run.build()), metadata=as_member(agent_member))
    sweep = RetentionSweep(
        memory.app.store, days=10, interval=timedelta(hours=1), clock=lambda: START + timedelta(days=25)
    )
    assert await sweep.sweep() >= 1
    stats = await memory.stub.GetMemoryStats(
        pb.GetMemoryStatsRequest(agent_id=agent), metadata=as_member(memory.directory.add(workspace))
    )
    assert (stats.run_count, stats.segment_count) == (1, 1)
    assert stats.oldest_time.ToDatetime(tzinfo=UTC) > START + timedelta(days=19)
    with pytest.raises(ValueError, match="days must be positive"):
        RetentionSweep(memory.app.store, days=0, interval=timedelta(hours=1), clock=lambda: datetime.now(UTC))


async def test_forget_before_a_time_keeps_the_newer_part_of_a_session(memory: RunningMemory) -> None:
    workspace, agent, agent_member = memory.new_workspace()
    run = RunBuilder(workspace, agent, agent_member)
    run.user("first", at=START)
    run.user("second", at=START + timedelta(hours=2))
    await memory.stub.ArchiveRun(pb.ArchiveRunRequest(run=run.build()), metadata=as_member(agent_member))
    before = pb.ForgetRequest(session_id=run.session_id)
    before.before.FromDatetime(START + timedelta(hours=1))
    forgotten = await memory.stub.Forget(before, metadata=as_member(memory.directory.owner_of(agent_member)))
    assert forgotten.deleted_segments == 1
    expanded = await memory.stub.Expand(
        pb.ExpandRequest(agent=pb.AgentScope(agent_id=agent), ref=f"{run.run_id}/2/0"),
        metadata=as_member(agent_member),
    )
    assert expanded.focus.text == "second" and list(expanded.before) == []
    assert expanded.run.segment_count == 1


async def test_language_sums_of_another_embedder_are_replaced_not_mixed(memory_url: str) -> None:
    small, large = FakeEmbedder(dimensions=8), FakeEmbedder(dimensions=16)
    for embedder in (small, large):
        running = await start_memory(memory_url, embedder=embedder)
        try:
            workspace, agent, agent_member = running.new_workspace()
            run = RunBuilder(workspace, agent, agent_member).user("a fact in english").user("another fact")
            await running.stub.ArchiveRun(
                pb.ArchiveRunRequest(run=run.build()), metadata=as_member(agent_member)
            )
            assert running.app.worker is not None
            await asyncio.wait_for(running.app.worker.drained(), 10)
        finally:
            await stop_memory(running)
    database = Database(memory_url)
    try:
        async with database.engine.connect() as conn:
            row = (
                await conn.execute(sa.select(language_means).where(language_means.c.language == "en"))
            ).one()
        # Only the 16-dimension vectors count (another test may have added more of them).
        assert len(row.sums) == 16 * 8 and row._mapping["count"] >= 2
    finally:
        await database.aclose()


async def test_downgrade_and_upgrade_again(memory_url: str) -> None:
    database = Database(memory_url)
    if not database.is_sqlite:
        await database.aclose()
        pytest.skip("PostgreSQL tests share one migrated schema")
    try:
        await migrate.downgrade(database, "0001")
        await migrate.downgrade(database, "base")
        async with database.engine.connect() as conn:
            names = await conn.run_sync(lambda c: sa.inspect(c).get_table_names())
        assert set(names) == {"memory_alembic_version"}
        await migrate.upgrade(database)
        async with database.engine.connect() as conn:
            assert await conn.run_sync(_differences) == []
    finally:
        await database.aclose()


async def test_runs_archived_at_once_share_transactions_and_keep_their_own_outcomes(memory_url: str) -> None:
    replica = await start_memory(memory_url)
    try:
        workspace, agent, member = replica.new_workspace()
        other_workspace, other_agent, other_member = replica.new_workspace()

        async def archive(run: RunBuilder, as_who: str) -> Any:
            return await replica.stub.ArchiveRun(
                pb.ArchiveRunRequest(run=run.build()), metadata=as_member(as_who)
            )

        kept = RunBuilder(workspace, agent, member).user("kept as it was")
        first = RunBuilder(workspace, agent, member).user("the first version")
        for run in (kept, first):
            await archive(run, member)
        second = RunBuilder(workspace, agent, member, run_id=first.run_id).user("the second version")
        stolen = RunBuilder(other_workspace, other_agent, other_member, run_id=kept.run_id).user("not yours")
        twice = RunBuilder(workspace, agent, member).user("sent twice at once")
        fresh = [RunBuilder(workspace, agent, member).user(f"fresh run number {n}") for n in range(30)]
        transactions = replica.app.store.archive_transactions

        outcomes = await asyncio.gather(
            archive(kept, member),
            archive(second, member),
            archive(stolen, other_member),
            archive(twice, member),
            archive(twice, member),
            *(archive(run, member) for run in fresh),
            return_exceptions=True,
        )

        calls = len(outcomes)
        assert replica.app.store.archive_transactions - transactions < calls, (
            "runs arriving at once are batched"
        )
        refused = outcomes[2]
        assert isinstance(refused, grpc.aio.AioRpcError)
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        responses = [outcome for index, outcome in enumerate(outcomes) if index != 2]
        assert all(isinstance(response, pb.ArchiveRunResponse) for response in responses)
        unchanged, replaced, twice_a, twice_b, *new = [
            response for response in responses if isinstance(response, pb.ArchiveRunResponse)
        ]
        assert unchanged.changed is False
        assert replaced.changed is True
        assert sorted([twice_a.changed, twice_b.changed]) == [False, True]
        assert all(response.changed and response.segment_count == 1 for response in new)
        stats = await replica.stub.GetMemoryStats(
            pb.GetMemoryStatsRequest(agent_id=agent), metadata=as_member(replica.directory.add(workspace))
        )
        assert (stats.run_count, stats.segment_count) == (2 + 1 + 30, 2 + 1 + 30)

        async def texts(query: str) -> list[str]:
            response = await replica.stub.Retrieve(
                pb.RetrieveRequest(agent=pb.AgentScope(agent_id=agent), query=query),
                metadata=as_member(member),
            )
            return [hit.segment.text for hit in response.results]

        assert replica.app.worker is not None
        await asyncio.wait_for(replica.app.worker.drained(), 10)
        found = await texts("version")
        assert found[0] == "the second version" and "the first version" not in found
        assert "not yours" not in await texts("yours")
    finally:
        await stop_memory(replica)


async def test_lexical_search_leaves_out_terms_found_in_more_segments_than_its_budget(
    memory_url: str,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        if not memory_url.startswith("sqlite"):
            # Common terms come from the planner's statistics of the whole table,
            # which on a shared database depend on the tests before.
            memory_url = await stack.enter_async_context(_fresh_postgres_database())
        await _common_terms_are_left_out(memory_url)


async def _common_terms_are_left_out(memory_url: str) -> None:
    replica = await start_memory(memory_url, MEMORY_LEXICAL_POSTINGS="4")
    try:
        workspace, agent, member = replica.new_workspace()
        run = RunBuilder(workspace, agent, member)
        for number in range(6):
            run.user(f"omnipresent filler {number}")
        run.user("omnipresent zanzibar")
        await replica.stub.ArchiveRun(pb.ArchiveRunRequest(run=run.build()), metadata=as_member(member))
        store = replica.app.store
        scope = Scope(workspace_id=workspace, audience=frozenset({member}), agent_id=agent)

        ranked = await store.lexical_search(scope, Filters(), ["omnipresent", "zanzibar"], 10)
        found = await store.segments([hit.key for hit in ranked])
        assert [found[hit.key].text for hit in ranked] == ["omnipresent zanzibar"]
        # Only terms over the budget: no lexical ranking at all (vectors rank such a query).
        assert await store.lexical_search(scope, Filters(), ["omnipresent"], 10) == []
        # The counts are kept: asking again reads nothing.
        lookups = store.term_frequencies.lookups
        await store.lexical_search(scope, Filters(), ["zanzibar", "omnipresent"], 10)
        assert store.term_frequencies.lookups == lookups
    finally:
        await stop_memory(replica)


async def test_a_term_searched_for_before_any_segment_held_it_is_found_once_one_does(
    memory_url: str,
) -> None:
    writer = await start_memory(memory_url)
    reader = await start_memory(memory_url)
    try:
        workspace, agent, member = writer.new_workspace()
        scope = Scope(workspace_id=workspace, audience=frozenset({member}), agent_id=agent)
        now = [0.0]
        reader.app.store.term_frequencies = TermFrequencies(
            cap=reader.app.store.term_frequencies.cap,
            sqlite=reader.app.database.is_sqlite,
            clock=lambda: now[0],
        )

        async def found(replica: RunningMemory) -> list[str]:
            ranked = await replica.app.store.lexical_search(scope, Filters(), ["quokka"], 10)
            segments = await replica.app.store.segments([hit.key for hit in ranked])
            return [segments[hit.key].text for hit in ranked]

        assert await found(writer) == [] and await found(reader) == []
        run = RunBuilder(workspace, agent, member)
        run.user("the quokka smiled")
        await writer.stub.ArchiveRun(pb.ArchiveRunRequest(run=run.build()), metadata=as_member(member))

        # The replica that archived it knows at once; another one within a second.
        assert await found(writer) == ["the quokka smiled"]
        assert await found(reader) == []
        now[0] += 1.0
        assert await found(reader) == ["the quokka smiled"]
    finally:
        await stop_memory(reader)
        await stop_memory(writer)


@contextlib.asynccontextmanager
async def _fresh_postgres_database(revision: str = "head") -> AsyncIterator[str]:
    """A database of its own, migrated to `revision` and never analyzed (the
    shared one's statistics and schema depend on the tests before)."""
    name = f"agentim_memory_{uuid.uuid4().hex[:12]}"
    try:
        admin = await asyncpg.connect(POSTGRES_URL)
    except OSError as error:
        unavailable(f"PostgreSQL is unreachable at {POSTGRES_URL}: {error}")
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        url = str(make_url(POSTGRES_URL).set(database=name))
        database = Database(url)
        try:
            await migrate.upgrade(database, revision)
        finally:
            await database.aclose()
        yield url
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def test_postgres_takes_common_terms_from_the_statistics_it_has_analyzed_itself() -> None:
    async with _fresh_postgres_database() as url:
        replica = await start_memory(url)
        try:
            workspace, agent, member = replica.new_workspace()
            run = RunBuilder(workspace, agent, member)
            for number in range(400):
                run.user(f"ubiquitous line {number}")
            run.user("ubiquitous zanzibar")
            await replica.stub.ArchiveRun(pb.ArchiveRunRequest(run=run.build()), metadata=as_member(member))
            store = replica.app.store
            frequencies = store.term_frequencies

            # Never analyzed: the first search counts, and starts ANALYZE in the background.
            assert (await store.term_rarity(["ubiquitous"]))["ubiquitous"] > 0
            await asyncio.wait_for(frequencies.analysis_done(), 30)
            assert frequencies.analyses == 1

            rarity = await store.term_rarity(["ubiquitous", "zanzibar"])
            assert rarity["zanzibar"] > rarity["ubiquitous"] > 0
            # A common term is read from the statistics, not counted row by row.
            fresh = TermFrequencies(cap=10_000, sqlite=False)
            async with replica.app.database.transaction(write=False) as conn:
                total, counts = await fresh.counts(conn, ["ubiquitous"])
            assert fresh.lookups == 0
            assert 380 <= counts["ubiquitous"] <= 401
            assert total >= 401
        finally:
            await stop_memory(replica)


async def test_a_large_scope_is_searched_through_its_approximate_index_once_built(memory_url: str) -> None:
    directory, embedder = FakeDirectory(), FakeEmbedder()
    # Every list probed: the approximate search must find exactly what exact search does.
    replica = await start_memory(
        memory_url,
        directory=directory,
        embedder=embedder,
        MEMORY_APPROXIMATE_FROM_ROWS="300",
        MEMORY_APPROXIMATE_PROBE_SHARE="1",
    )
    exact = await start_memory(
        memory_url, directory=directory, embedder=embedder, MEMORY_APPROXIMATE_FROM_ROWS="0"
    )
    try:
        workspace, agent, member = replica.new_workspace()
        vectors = replica.app.store.vectors
        words = ["ledger", "billing", "search", "deploy", "cache", "quota", "schema", "review", "latency"]

        async def add(*texts: str) -> str:
            run = RunBuilder(workspace, agent, member)
            for text in texts:
                run.user(text)
            await replica.stub.ArchiveRun(pb.ArchiveRunRequest(run=run.build()), metadata=as_member(member))
            assert replica.app.worker is not None
            await asyncio.wait_for(replica.app.worker.drained(), 30)
            return run.run_id

        async def search(query: str) -> list[str]:
            response = await replica.stub.Retrieve(
                pb.RetrieveRequest(agent=pb.AgentScope(agent_id=agent), query=query, limit=10),
                metadata=as_member(member),
            )
            return [hit.segment.text for hit in response.results]

        async def nearest(query: str, through: RunningMemory) -> list[int]:
            """The vector ranking alone: the lexical half of Retrieve weighs terms by
            counts each replica caches (on PostgreSQL, from statistics that ANALYZE,
            started by a search, changes meanwhile), so only this half is compared."""
            scope = Scope(workspace_id=workspace, audience=frozenset(), agent_id=agent)
            hits = await through.app.store.vector_search(
                scope, Filters(), embedder.vector(query), language_of(query), 10
            )
            return [hit.key for hit in hits]

        for batch in range(4):
            # Letters, not digits, tell the notes apart: digits alone would make them near-duplicates.
            tags = ["abcd"[batch] + chr(97 + n // 26) + chr(97 + n % 26) for n in range(100)]
            await add(*(f"{words[n % 9]} {words[(n * 7 + batch) % 9]} note {tags[n]}" for n in range(100)))
        queries = ["ledger quota", "deploy review", "cache latency", "schema billing"]
        await search(queries[0])  # the first search of a big scope starts building its index
        await asyncio.wait_for(vectors.settled(), 60)
        assert vectors.builds == 1
        searches = vectors.approximate_searches
        assert [await nearest(query, replica) for query in queries] == [
            await nearest(query, exact) for query in queries
        ]
        assert vectors.approximate_searches == searches + len(queries)
        assert all([await search(query) for query in queries])  # Retrieve goes through it too
        assert vectors.approximate_searches == searches + 2 * len(queries)
        assert exact.app.store.vectors.approximate_searches == 0

        # Rows embedded after the build are searched too (exactly, until the next build).
        added = await add("a kiwi in the bowl")
        embedder.synonyms["fruit"] = "kiwi"
        assert (await search("fruit"))[0] == "a kiwi in the bowl"
        # A deletion reloads the matrix: exact search until the index is built again.
        await replica.stub.Forget(
            pb.ForgetRequest(run_id=added), metadata=as_member(directory.owner_of(member))
        )
        searches = vectors.approximate_searches
        assert "a kiwi in the bowl" not in await search("fruit")
        assert vectors.approximate_searches == searches
        await asyncio.wait_for(vectors.settled(), 60)
        assert vectors.builds == 2
        assert [await nearest(query, replica) for query in queries] == [
            await nearest(query, exact) for query in queries
        ]
    finally:
        await stop_memory(replica)
        await stop_memory(exact)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_moving_vectors_apart_keeps_every_vector_and_the_queue(kind: str, tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        if kind == "sqlite":
            url = f"sqlite:///{tmp_path / 'memory.db'}"
            database = Database(url)
            await migrate.upgrade(database, "0002")
        else:
            url = await stack.enter_async_context(_fresh_postgres_database("0002"))
            database = Database(url)
        stack.push_async_callback(database.aclose)
        prefix = "" if database.is_sqlite else "memory."
        vector = np.arange(4, dtype="<f4").tobytes()
        columns = (
            "run_id, workspace_id, agent_id, session_id, step_sequence, segment_index, type, text, tool_name,"
            " group_id, audience_id, created_at, language, dedup_key, terms, term_count, embedding"
        )
        async with database.engine.begin() as conn:
            for number, embedding in ((1, vector), (2, None)):
                await conn.execute(
                    sa.text(
                        f"INSERT INTO {prefix}segments ({columns}) VALUES ('r', 'w', 'a', 's', {number},"
                        " 0, 1, 'text', '', '', '', :at, 'en', 'k', 'text', 1, :embedding)"
                    ),
                    {"at": START, "embedding": embedding},
                )

        await migrate.upgrade(database)
        async with database.engine.connect() as conn:
            moved = (
                await conn.execute(sa.text(f"SELECT segment_id, embedding FROM {prefix}segment_vectors"))
            ).all()
            queued = (
                await conn.execute(sa.text(f"SELECT segment_id, agent_id FROM {prefix}unembedded"))
            ).all()
            ids: dict[int, int] = {
                int(row.step_sequence): int(row.id)
                for row in (
                    await conn.execute(sa.text(f"SELECT step_sequence, id FROM {prefix}segments"))
                ).all()
            }
        assert [(row.segment_id, bytes(row.embedding)) for row in moved] == [(ids[1], vector)]
        assert [(row.segment_id, row.agent_id) for row in queued] == [(ids[2], "a")]

        await migrate.downgrade(database, "0002")
        async with database.engine.connect() as conn:
            back = (
                await conn.execute(sa.text(f"SELECT step_sequence, embedding FROM {prefix}segments"))
            ).all()
        assert {row.step_sequence: row.embedding and bytes(row.embedding) for row in back} == {
            1: vector,
            2: None,
        }
