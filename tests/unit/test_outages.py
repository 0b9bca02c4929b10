"""Which failures are a dependency's outage (UNAVAILABLE) and which are bugs (INTERNAL)."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio as redis
import sqlalchemy as sa
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from sqlalchemy.ext.asyncio import create_async_engine

from services.common import errors
from services.common.outages import (
    DATABASE,
    DependencyUnavailable,
    as_unavailable,
    describe,
    unavailable_error,
)


def locked(path: Path) -> sqlite3.OperationalError:
    """SQLite's own "database is locked": a writer gives up at once on a held write lock."""
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE IF NOT EXISTS t (x)")
    holder.execute("BEGIN IMMEDIATE")
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        other.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as error:
        return error
    finally:
        other.close()
        holder.close()
    raise AssertionError("the second writer was not refused")


def test_sqlite_that_cannot_serve_is_unavailable_and_a_sql_bug_is_not(tmp_path: Path) -> None:
    busy = unavailable_error(locked(tmp_path / "db.sqlite"))
    assert busy is not None and busy.message == "the database is unavailable (database is locked); try again"
    with pytest.raises(sqlite3.OperationalError) as cannot_open:
        sqlite3.connect(tmp_path / "missing" / "db.sqlite")
    assert unavailable_error(cannot_open.value) is not None
    with pytest.raises(sqlite3.OperationalError) as bug:
        sqlite3.connect(":memory:").execute("SELECT * FROM no_such_table")
    assert unavailable_error(bug.value) is None


async def test_a_refused_database_is_unavailable_through_sqlalchemy() -> None:
    engine = create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    try:
        with pytest.raises(Exception) as refused:
            async with engine.connect() as conn:
                await conn.execute(sa.text("SELECT 1"))
    finally:
        await engine.dispose()
    found = unavailable_error(refused.value, dependency=DATABASE)
    assert found is not None
    assert found.message.startswith("the database is unavailable (")
    assert "Error" not in found.message, "no exception class names for the caller"


async def test_a_refused_redis_is_unavailable() -> None:
    client = redis.Redis(port=1, retry=Retry(NoBackoff(), 0))
    try:
        with pytest.raises(redis.ConnectionError) as refused:
            await client.ping()
    finally:
        await client.aclose()
    found = unavailable_error(refused.value)
    assert found is not None and found.dependency == "Redis"


def test_postgres_errors_are_told_apart_by_sqlstate() -> None:
    lost = unavailable_error(asyncpg.exceptions.ConnectionDoesNotExistError("closed in the middle"))
    assert lost is not None and lost.connection_lost
    terminated = unavailable_error(asyncpg.exceptions.AdminShutdownError("terminating connection"))
    assert terminated is not None and terminated.connection_lost
    too_many = unavailable_error(asyncpg.exceptions.TooManyConnectionsError("too many clients"))
    assert too_many is not None and not too_many.connection_lost
    broken = unavailable_error(
        asyncpg.exceptions.InternalClientError(
            "cannot switch to state 11; another operation (2) is in progress"
        )
    )
    assert broken is not None and broken.connection_lost, "the termination notice came before the close"
    assert unavailable_error(asyncpg.exceptions.UndefinedTableError("no such table")) is None
    assert unavailable_error(asyncpg.exceptions.UniqueViolationError("duplicate key")) is None


def test_socket_failures_are_outages_and_other_os_errors_are_not() -> None:
    assert unavailable_error(ConnectionRefusedError(111, "refused"), dependency=DATABASE) is not None
    assert unavailable_error(ConnectionResetError(104, "reset")) is not None
    assert unavailable_error(socket.gaierror(-2, "Name or service not known")) is not None
    everything_failed = OSError("Multiple exceptions: [Errno 111] Connect call failed ('::1', 1)")
    assert unavailable_error(everything_failed) is not None
    assert unavailable_error(FileNotFoundError(2, "No such file")) is None
    assert unavailable_error(ValueError("bad")) is None
    assert unavailable_error(KeyError("x")) is None


def test_service_errors_keep_their_own_status() -> None:
    refused = errors.NotFound("no such group")
    refused.__cause__ = ConnectionResetError()
    assert unavailable_error(refused) is None


def test_the_cause_decides_but_an_error_raised_while_handling_another_does_not() -> None:
    try:
        try:
            raise ConnectionResetError(104, "reset")
        except ConnectionResetError as lost:
            raise RuntimeError("wrapped") from lost
    except RuntimeError as wrapped:
        assert unavailable_error(wrapped) is not None
    try:
        try:
            raise ConnectionResetError(104, "reset")
        except ConnectionResetError:
            raise KeyError("a bug in the handler") from None
    except KeyError as bug:
        assert unavailable_error(bug) is None


def test_as_unavailable_raises_the_typed_error_from_the_original() -> None:
    with pytest.raises(DependencyUnavailable) as caught, as_unavailable(DATABASE):
        raise ConnectionRefusedError(111, "refused")
    assert isinstance(caught.value, errors.Unavailable)
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)
    assert caught.value.message == "the database is unavailable (connection refused); try again"
    with pytest.raises(ValueError), as_unavailable(DATABASE):
        raise ValueError("a bug stays a bug")


async def test_a_cancelled_call_is_not_an_outage() -> None:
    task = asyncio.ensure_future(asyncio.sleep(10))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError) as caught:
        await task
    assert unavailable_error(caught.value) is None


async def test_the_log_gets_the_drivers_words_without_the_statement_or_its_parameters(tmp_path: Path) -> None:
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")
    try:
        with pytest.raises(sa.exc.OperationalError) as caught:
            async with engine.connect() as conn:
                await conn.execute(
                    sa.text("INSERT INTO missing VALUES (:secret)"), {"secret": "what ada wrote"}
                )
    finally:
        await engine.dispose()
    assert "what ada wrote" in str(caught.value), "SQLAlchemy's own text holds the parameters"
    assert describe(caught.value) == "no such table: missing"
