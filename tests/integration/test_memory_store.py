"""The memory's storage on SQLite and PostgreSQL: schema, lexical tokens, vector caches, retention."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.engine import Connection

from agentim.memory.v1 import memory_pb2 as pb
from services.memory.adapters import migrate
from services.memory.adapters.sql import Database
from services.memory.adapters.tables import SCHEMA, language_means, metadata
from services.memory.service_layer.retention import RetentionSweep
from tests.integration.memory_harness import (
    RunningMemory,
    as_member,
    memory,
    memory_url,
    start_memory,
    stop_memory,
)
from tests.memory_support import START, FakeDirectory, FakeEmbedder, RunBuilder

__all__ = ["memory", "memory_url"]

# Lexical indexes live outside the metadata, being backend-specific (see tables.py).
_LEXICAL = {"segment_fts", "tsv", "ix_memory_segments_tsv"}


def _ours(name: str | None, kind: str, _parent: Any) -> bool:
    if name is None:
        return True
    if kind == "schema":
        return name == SCHEMA
    return not name.startswith("segment_fts") and name not in _LEXICAL


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
    return list(compare_metadata(context, target))


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
        await first.stub.Forget(pb.ForgetRequest(run_id=one.run_id), metadata=as_member(agent_member))
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
        await replica.stub.Forget(pb.ForgetRequest(run_id=added), metadata=as_member(agent_member))
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
    assert rarity["never-seen"] >= rarity["zanzibar"] > rarity["the"] >= 0


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
        pb.GetMemoryStatsRequest(agent_id=agent), metadata=as_member(agent_member)
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
    forgotten = await memory.stub.Forget(before, metadata=as_member(agent_member))
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
