"""Shard leases against real SQLite and PostgreSQL: exclusive takes, expiry by
the database's clock, epochs that fence stale writes, one-statement renewal."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
import sqlalchemy as sa

from services.common.outages import DependencyUnavailable
from services.runtime.adapters.journal import Journal, Write, open_journal
from services.runtime.adapters.leases import SqlLeases, check_fence
from services.runtime.adapters.sql import IDLE_IN_TRANSACTION_MS, Database, SqlAgentStore
from services.runtime.domain.model import AgentState, Run, RunStatus
from services.runtime.service_layer.leases import Fence, LeaseLost
from tests.cutting_proxy import CuttingProxy, target_of, through
from tests.integration.test_runtime_store import make_agent, make_run, make_step, now

SHARDS = 64


@pytest.fixture
async def database(own_runtime_url: str) -> AsyncIterator[Database]:
    database = Database(own_runtime_url)
    try:
        yield database
    finally:
        await database.aclose()


@pytest.fixture
async def leases(database: Database) -> SqlLeases:
    leases = SqlLeases(database)
    await leases.prepare(SHARDS)
    return leases


async def test_prepare_makes_the_shards_once_and_refuses_another_count(
    database: Database, leases: SqlLeases
) -> None:
    await leases.prepare(SHARDS)
    view = await leases.view()
    assert view.owners == {} and view.replicas == ()
    async with database.transaction(write=False) as conn:
        rows = (await conn.execute(sa.text("SELECT count(*) FROM " + _table(database)))).scalar_one()
    assert rows == SHARDS
    with pytest.raises(ValueError, match="RUNTIME_SHARDS"):
        await leases.prepare(SHARDS // 2)


def _table(database: Database) -> str:
    return "shard_leases" if database.is_sqlite else "runtime.shard_leases"


async def test_two_replicas_taking_the_same_shards_at_once_split_them(leases: SqlLeases) -> None:
    everything = range(SHARDS)
    a, b = await asyncio.gather(leases.take("a", everything, 30), leases.take("b", everything, 30))
    assert set(a).isdisjoint(b) and set(a) | set(b) == set(everything)
    assert set(a.values()) | set(b.values()) == {1}
    # Nothing is free now.
    assert await leases.take("c", everything, 30) == {}
    view = await leases.view()
    assert view.owners == {**dict.fromkeys(a, "a"), **dict.fromkeys(b, "b")}


async def test_renewal_marks_the_replica_live_and_returns_what_it_holds(leases: SqlLeases) -> None:
    taken = await leases.take("a", [1, 2, 3], 30)
    assert await leases.renew("a", "10.0.0.1:50052", 30) == taken
    assert await leases.renew("b", "10.0.0.2:50052", 30) == {}
    assert (await leases.view()).replicas == ("a", "b")


async def test_a_lease_expires_by_the_database_clock_and_its_next_owner_has_a_new_epoch(
    leases: SqlLeases,
) -> None:
    assert await leases.take("a", [5], 0.2) == {5: 1}
    assert await leases.take("b", [5], 30) == {}
    await wait_until_expired(leases, 5)
    assert await leases.take("b", [5], 30) == {5: 2}
    # The old owner's renewal no longer finds it.
    assert await leases.renew("a", "", 30) == {}
    assert await leases.renew("b", "", 30) == {5: 2}


async def wait_until_expired(leases: SqlLeases, shard: int) -> None:
    async with asyncio.timeout(10):
        while shard in (await leases.view()).owners:  # noqa: ASYNC110 - the database's clock has no event
            await asyncio.sleep(0.05)


async def test_release_and_leave_bump_the_epoch_and_free_the_shards(leases: SqlLeases) -> None:
    assert await leases.take("a", [1, 2], 30) == {1: 1, 2: 1}
    await leases.renew("a", "", 30)
    await leases.release("a", [1])
    assert await leases.take("b", [1, 2], 30) == {1: 3}
    await leases.leave("a")
    view = await leases.view()
    assert view.owners == {1: "b"} and "a" not in view.replicas
    assert await leases.take("b", [2], 30) == {2: 3}


async def test_a_fenced_write_is_refused_once_the_shard_has_moved(
    database: Database, leases: SqlLeases
) -> None:
    taken = await leases.take("a", [7], 30)
    fence = Fence(7, taken[7], "a")
    async with database.transaction() as conn:
        await check_fence(conn, fence)
    await leases.release("a", [7])
    await leases.take("b", [7], 30)
    with pytest.raises(LeaseLost):
        async with database.transaction() as conn:
            await check_fence(conn, fence)
    async with database.transaction() as conn:
        await check_fence(conn, Fence(7, 3, "b"))


async def test_a_take_waits_for_a_fenced_write_in_flight(database: Database, leases: SqlLeases) -> None:
    """The fence cannot race a take: the take's update waits for the writer's
    share lock, so the write commits under the old epoch and every later one
    sees the new epoch."""
    if database.is_sqlite:
        pytest.skip("SQLite has one writer at a time: a take cannot run beside a write at all")
    await leases.take("a", [9], 0.2)
    fence = Fence(9, 1, "a")
    await wait_until_expired(leases, 9)
    async with database.transaction() as conn:
        await check_fence(conn, fence)  # expired but not taken: still the shard's epoch
        take = asyncio.create_task(leases.take("b", [9], 30))
        await wait_for_lock_wait(database)
        assert not take.done()
    assert await take == {9: 2}
    with pytest.raises(LeaseLost):
        async with database.transaction() as conn:
            await check_fence(conn, fence)


async def test_a_writer_cut_off_mid_transaction_holds_up_a_take_only_briefly(
    database: Database, leases: SqlLeases, own_runtime_url: str
) -> None:
    """A replica cut off from the database in the middle of a fenced write
    (its lease row locked FOR SHARE, the rest of its transaction never
    arriving) holds up the next owner's take only until the server ends the
    silent session (`idle_in_transaction_session_timeout`), not for as long
    as TCP would keep the connection (hours)."""
    if database.is_sqlite:
        pytest.skip("no network between SQLite and its writer")
    await leases.take("a", [9], 0.2)
    await wait_until_expired(leases, 9)
    with CuttingProxy(target_of(own_runtime_url)) as proxy:
        cut_off = Database(through(own_runtime_url, proxy))
        try:
            with pytest.raises(DependencyUnavailable):
                async with cut_off.transaction() as conn:
                    await check_fence(conn, Fence(9, 1, "a"))
                    proxy.cut()
                    started = time.monotonic()
                    try:
                        # Far longer than the session's timeout; a take that
                        # waited for the heal would fail here.
                        async with asyncio.timeout(IDLE_IN_TRANSACTION_MS / 1000 * 4):
                            taken = await leases.take("b", [9], 30)
                        waited = time.monotonic() - started
                    finally:
                        proxy.heal()
        finally:
            await cut_off.aclose()
    assert taken == {9: 2}
    assert waited >= IDLE_IN_TRANSACTION_MS / 1000 * 0.5, "the take waited for the fenced write at first"


async def wait_for_lock_wait(database: Database) -> None:
    query = sa.text(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    async with asyncio.timeout(10):
        while True:
            async with database.transaction(write=False) as conn:
                if (await conn.execute(query)).scalar_one():
                    return
            await asyncio.sleep(0.02)


async def test_renewal_is_one_statement_whatever_the_shards_held(
    database: Database, leases: SqlLeases
) -> None:
    await leases.take("a", range(SHARDS), 30)
    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if "shard_leases" in statement or "replicas" in statement:
            statements.append(statement)

    sa.event.listen(database.engine.sync_engine, "before_cursor_execute", count)
    try:
        held = await leases.renew("a", "", 30)
    finally:
        sa.event.remove(database.engine.sync_engine, "before_cursor_execute", count)
    assert len(held) == SHARDS
    # PostgreSQL: the heartbeat rides in the renewal's CTE. SQLite (one process
    # by design) sends the two in one transaction.
    assert len(statements) == (2 if database.is_sqlite else 1)


# The runners' journal: every part of a fenced write stands or falls with its fence.


@pytest.fixture
async def store(own_runtime_url: str) -> AsyncIterator[SqlAgentStore]:
    store = SqlAgentStore(Database(own_runtime_url))
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture
async def journal(database: Database) -> AsyncIterator[Journal]:
    journal = open_journal(database)
    try:
        yield journal
    finally:
        await journal.aclose()


async def _stored_steps(store: SqlAgentStore, run: Run) -> list[int]:
    return [s.sequence for s in await store.list_steps(run.session_id, after_sequence=0, limit=100)]


async def test_a_journal_write_fenced_by_a_moved_shard_is_refused_whole(
    leases: SqlLeases, store: SqlAgentStore, journal: Journal
) -> None:
    stale_agent, live_agent = make_agent(), make_agent()
    for agent in (stale_agent, live_agent):
        await store.add_agent(agent)
    taken = await leases.take("a", [3], 30)
    stale = Fence(3, taken[3], "a")
    stale_run, live_run = make_run(stale_agent), make_run(live_agent)
    await journal.write(Write(new_run=stale_run, steps=[make_step(stale_run, 1)], fence=stale))
    await leases.release("a", [3])
    live = Fence(3, (await leases.take("b", [3], 30))[3], "b")
    # One batch: the stale owner's write and the new owner's.
    refused, stored = await asyncio.gather(
        journal.write(
            Write(
                ended_run=replace(stale_run, status=RunStatus.COMPLETED, ended_at=now()),
                steps=[make_step(stale_run, 2)],
                progress=stale_agent.with_state(AgentState.RUNNING, ""),
                fence=stale,
            )
        ),
        journal.write(Write(new_run=live_run, steps=[make_step(live_run, 1)], fence=live)),
        return_exceptions=True,
    )
    assert isinstance(refused, LeaseLost) and stored is None
    assert await _stored_steps(store, stale_run) == [1]
    assert [r.status for r in await store.list_runs(stale_agent.id, before=None, limit=5)] == [
        RunStatus.RUNNING
    ]
    kept = await store.get_agent(stale_agent.id)
    assert kept is not None and kept.state is AgentState.IDLE
    assert await _stored_steps(store, live_run) == [1]


async def test_a_journal_write_waits_for_a_take_in_flight_and_is_refused_after_it(
    database: Database, leases: SqlLeases, store: SqlAgentStore, journal: Journal
) -> None:
    """The race the fence closes: a take that has locked the lease row but not
    committed. The write waits for it and then sees the new epoch."""
    if database.is_sqlite:
        pytest.skip("SQLite has one writer at a time: a take cannot run beside a write at all")
    agent = make_agent()
    await store.add_agent(agent)
    fence = Fence(4, (await leases.take("a", [4], 30))[4], "a")
    run = make_run(agent)
    async with database.transaction() as conn:
        await conn.execute(
            sa.text(
                "UPDATE runtime.shard_leases SET owner = 'b', epoch = epoch + 1"
                " WHERE shard = 4 AND owner = 'a'"
            )
        )
        write = asyncio.create_task(journal.write(Write(new_run=run, steps=[make_step(run, 1)], fence=fence)))
        await wait_for_lock_wait(database)
        assert not write.done()
    with pytest.raises(LeaseLost):
        await write
    assert await _stored_steps(store, run) == []
