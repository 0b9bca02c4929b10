"""SQL plumbing every service's storage needs, on SQLite and PostgreSQL alike.

Only what is independent of a context's tables lives here: the UTC datetime
column type, the async driver URL, the SQLite connection settings, the
engine holder, the migration runner, and dedicated SQLite connections for hot paths.

Every way into the database here raises `DependencyUnavailable` (an
`errors.Unavailable`) when the database cannot serve: a lost or refused
connection, a locked or unreadable SQLite file (see `services.common.outages`).
A PostgreSQL connection that broke never goes back to the pool as if alive,
and one found closed is replaced when it is taken from the pool (a local
check, no round trip); once one is found broken, every connection opened
before is replaced as it is taken. An idempotent read whose connection
broke under it goes again once on another (`retry_read`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy import event, exc
from sqlalchemy.engine import Connection, Dialect, ExceptionContext, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection

from services.common.outages import (
    DATABASE,
    DependencyUnavailable,
    as_unavailable,
    describe,
    unavailable_error,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long opening a PostgreSQL connection may take (asyncpg's default is a minute).
_CONNECT_TIMEOUT_S = 5.0


class UtcDateTime(sa.TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def async_url(url: str) -> str:
    """Adds the async driver to a plain `postgresql://` or `sqlite://` URL."""
    parsed = make_url(url)
    driver = {
        "postgresql": "postgresql+asyncpg",
        "postgres": "postgresql+asyncpg",
        "sqlite": "sqlite+aiosqlite",
    }
    if parsed.drivername in driver:
        parsed = parsed.set(drivername=driver[parsed.drivername])
    return parsed.render_as_string(hide_password=False)


def configure_sqlite(engine: AsyncEngine, *, write_option: str, busy_timeout_seconds: float = 10.0) -> None:
    """WAL, durable-enough syncs, a busy timeout and foreign keys on every connection.

    Args:
        engine: an aiosqlite engine.
        write_option: the execution option that marks a connection as a writer;
            its transactions start with BEGIN IMMEDIATE.
        busy_timeout_seconds: how long a statement waits for another
            process's lock before failing with "database is locked".
    """

    @event.listens_for(engine.sync_engine, "connect")
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take BEGIN into our own hands (see on_begin); pysqlite's is too late.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode is durable across a crash of any process.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_seconds * 1000)}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def on_begin(conn: Connection) -> None:
        # A write transaction takes the write lock up front, so it never fails
        # half-way with SQLITE_BUSY when another process writes. Reads run
        # without BEGIN (each query sees committed data), as on PostgreSQL.
        if conn.get_execution_options().get(write_option):
            conn.exec_driver_sql("BEGIN IMMEDIATE")


class SqlDatabase:
    """A service's engine on SQLite or PostgreSQL, with the settings both need.

    Each service keeps its tables in its own PostgreSQL schema; on SQLite,
    which has no schemas, the schema is translated away and the tables live
    in the file itself. SQLite allows one writer at a time, so this process's
    writers queue on `write_lock` instead of spinning on busy_timeout.

    Args:
        url: SQLAlchemy URL; `postgresql://` and `sqlite://` get async drivers.
        schema: the service's schema on PostgreSQL.
        write_option: the execution option that marks a writer's connection.
        pool_size: connections kept open (PostgreSQL).
        application_name: how the connections present themselves to
            PostgreSQL (`pg_stat_activity`); by default `agentim-<schema>`.
        server_settings: more settings of its sessions (PostgreSQL).
        busy_timeout_seconds: how long SQLite waits for another process's
            write lock before a call fails (UNAVAILABLE, "database is locked").
    """

    def __init__(
        self,
        url: str,
        *,
        schema: str,
        write_option: str,
        pool_size: int = 16,
        application_name: str | None = None,
        server_settings: Mapping[str, str] | None = None,
        busy_timeout_seconds: float = 10.0,
    ) -> None:
        self.url = async_url(url)
        self.schema = schema
        self.write_option = write_option
        self.busy_timeout_seconds = busy_timeout_seconds
        parsed = make_url(self.url)
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        self.sqlite_path = (parsed.database or "") if self.is_sqlite else ""
        options: dict[str, Any] = {}
        if self.is_sqlite:
            options["execution_options"] = {"schema_translate_map": {schema: None}}
        else:
            # No pool_pre_ping: its round trip per checkout cost the hot paths
            # about 0.35 ms of server CPU and 0.5 ms of latency per call (a
            # third more; bench.im_bench --mode wake). The local check below
            # costs nothing measurable and catches every connection the server
            # closed (terminated, restarted); one that breaks unnoticed fails
            # its call with UNAVAILABLE, and a read goes again once.
            options.update(
                pool_size=pool_size,
                max_overflow=pool_size,
                pool_pre_ping=False,
                connect_args={
                    "timeout": _CONNECT_TIMEOUT_S,
                    "server_settings": {
                        "application_name": application_name or f"agentim-{schema}",
                        **(server_settings or {}),
                    },
                },
            )
        self.engine: AsyncEngine = create_async_engine(self.url, **options)
        self.write_lock = asyncio.Lock()
        # Pooled connections opened before this moment are suspect: one of
        # their generation was found broken (see `_connection_lost`).
        self._suspect_before = 0.0
        if self.is_sqlite:
            configure_sqlite(
                self.engine, write_option=write_option, busy_timeout_seconds=busy_timeout_seconds
            )
        else:
            event.listen(self.engine.sync_engine, "connect", _note_opening)
            event.listen(self.engine.sync_engine, "checkout", self._refuse_dead_connection)
            event.listen(self.engine.sync_engine, "handle_error", self._lost_connections_are_disconnects)

    @contextlib.asynccontextmanager
    async def driver_connection(self) -> AsyncIterator[Any]:
        """A pooled connection's own driver connection (asyncpg on PostgreSQL),
        for hot paths that send their SQL straight through, without a transaction.

        Raises:
            DependencyUnavailable: the database cannot serve (the connection
                broke in the block, or none could be opened). A connection
                that broke is discarded, not returned to the pool.
        """
        with as_unavailable(DATABASE):
            async with self.engine.connect() as conn:
                driver = (await conn.get_raw_connection()).driver_connection
                assert driver is not None
                try:
                    yield driver
                except Exception as error:
                    # SQLAlchemy never saw this error, so it would pool the
                    # connection again: drop it here if it is gone.
                    closed = getattr(driver, "is_closed", None)
                    outage = unavailable_error(error, dependency=DATABASE)
                    if (closed is not None and closed()) or (outage is not None and outage.connection_lost):
                        self._connection_lost()
                        await conn.invalidate(error)
                    raise

    def _connection_lost(self) -> None:
        # When the server goes away, all the pooled connections of that time
        # usually go with it, and the driver sees each one's end a moment
        # apart: replace them all rather than hand out the next dead one. (It
        # is also what SQLAlchemy does for the disconnects it sees.)
        self._suspect_before = time.monotonic()

    def _refuse_dead_connection(
        self, _dbapi_connection: Any, record: ConnectionPoolEntry, _proxy: PoolProxiedConnection
    ) -> None:
        # A pooled connection whose server went away (terminated, restarted)
        # is closed by the driver as soon as the event loop sees the socket
        # close. Asking the driver costs no round trip, unlike pool_pre_ping;
        # the pool then opens a fresh connection in its place.
        driver = record.driver_connection
        if driver is not None and driver.is_closed():
            self._connection_lost()
            raise exc.DisconnectionError("the pooled connection was closed by the server")
        if record.info.get("opened_at", 0.0) < self._suspect_before:
            raise exc.DisconnectionError("the pooled connection is as old as one that broke")

    def _lost_connections_are_disconnects(self, context: ExceptionContext) -> None:
        # SQLAlchemy's asyncpg dialect sees a disconnect only once the driver
        # has closed the connection; a connection whose protocol broke first
        # (the server's termination notice read before the socket closed)
        # would go back to the pool.
        outage = unavailable_error(context.original_exception, dependency=DATABASE)
        if outage is not None and outage.connection_lost:
            context.is_disconnect = True
        if context.is_disconnect:
            self._connection_lost()

    async def retry_read(self, read: Callable[[], Awaitable[T]]) -> T:
        """Runs an idempotent read, and once more if its connection broke under it.

        `read` must take its own connection (the broken one is gone): after a
        cut, pooled connections may be dead before the pool has noticed, and
        a read is safe to repeat. Writes are never repeated here: whether a
        write whose connection broke was committed is unknown.
        """
        try:
            return await read()
        except DependencyUnavailable as error:
            if not error.connection_lost:
                raise
            logger.info("a database read lost its connection (%s); reading again", describe(error))
        return await read()

    async def ping(self) -> bool:
        with as_unavailable(DATABASE):
            async with self.engine.connect() as conn:
                await conn.execute(sa.text("SELECT 1"))
        return True

    async def aclose(self) -> None:
        """Closes the pooled connections. Idempotent."""
        await self.engine.dispose()


def _note_opening(_dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
    record.info["opened_at"] = time.monotonic()


async def upgrade_schema(database: SqlDatabase, migrations: Path, revision: str = "head") -> None:
    """Runs a service's Alembic migrations (its `env.py` takes the connection
    from `config.attributes["connection"]`), creating its schema first on PostgreSQL."""

    def upgrade(connection: Connection) -> None:
        command.upgrade(_alembic_config(migrations, connection), revision)

    async with database.engine.begin() as conn:
        if not database.is_sqlite:
            await conn.execute(sa.text(f"CREATE SCHEMA IF NOT EXISTS {database.schema}"))
        await conn.run_sync(upgrade)


async def downgrade_schema(database: SqlDatabase, migrations: Path, revision: str) -> None:
    def downgrade(connection: Connection) -> None:
        command.downgrade(_alembic_config(migrations, connection), revision)

    async with database.engine.begin() as conn:
        await conn.run_sync(downgrade)


def _alembic_config(migrations: Path, connection: Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations))
    config.attributes["connection"] = connection
    return config


def database_unavailable(error: Exception) -> bool:
    """Whether a failure is the database's own (unreachable, shutting down, out of
    resources, locked) rather than caused by what a statement tried to store
    (`services.common.outages` decides).

    Batched writers fail a whole batch at once on these, instead of splitting
    it to find an item at fault (see `services.common.batching`).
    """
    return unavailable_error(error, dependency=DATABASE) is not None


def sqlite_time(value: datetime) -> str:
    """A datetime as `UtcDateTime` stores it on SQLite: naive UTC text."""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def sqlite_time_from(text: str) -> datetime:
    """The aware UTC datetime of `sqlite_time` text (what `UtcDateTime` reads back)."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def sqlite_id(text: str) -> uuid.UUID:
    """An id as SQLAlchemy's Uuid stores it on SQLite (32 hex digits)."""
    return uuid.UUID(hex=text)


class SqliteWorker:
    """Dedicated SQLite connections in worker threads: a transaction costs one thread hop.

    Writes run on one connection in one thread, in turn with this process's
    other writers through the database's write lock (other processes wait on
    SQLite's own lock). Reads run on a few read-only connections, one per
    reader thread, each read in one transaction (one snapshot).

    Args:
        database: a SQLite database.
        name: prefix of the threads' names.
        readers: reader threads (and connections).
    """

    def __init__(self, database: SqlDatabase, *, name: str, readers: int = 2) -> None:
        if not database.is_sqlite:
            raise ValueError("SqliteWorker needs a SQLite database")
        self._path = database.sqlite_path
        self._busy_timeout = database.busy_timeout_seconds
        self._write_lock = database.write_lock
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-writer")
        self._readers = ThreadPoolExecutor(max_workers=readers, thread_name_prefix=f"{name}-reader")
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        self._closed = False

    def _connection(self, *, read_only: bool) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(
                self._path, isolation_level=None, check_same_thread=False, timeout=self._busy_timeout
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            if read_only:
                conn.execute("PRAGMA query_only=ON")
            self._local.conn = conn
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    def _forget(self, conn: sqlite3.Connection) -> None:
        """Closes this thread's connection; the next call opens a new one."""
        self._local.conn = None
        with self._connections_lock:
            if conn in self._connections:
                self._connections.remove(conn)
        with contextlib.suppress(sqlite3.Error):
            conn.close()

    def _transaction(self, begin: str, work: Callable[[sqlite3.Connection], T], *, read_only: bool) -> T:
        conn = self._connection(read_only=read_only)
        try:
            conn.execute(begin)
            try:
                result = work(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as error:
            if unavailable_error(error) is not None:
                # After an I/O error or a vanished file the connection may stay
                # broken; a new one sees the database as it is now.
                self._forget(conn)
            raise
        return result

    def _write(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return self._transaction("BEGIN IMMEDIATE", work, read_only=False)

    def _read(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return self._transaction("BEGIN", work, read_only=True)

    async def write(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Runs `work` in one write transaction; it commits unless `work` raises.

        Raises:
            DependencyUnavailable: the database is locked by another process
                for longer than the busy timeout, or cannot be read or written.
        """
        with as_unavailable(DATABASE):
            async with self._write_lock:
                return await asyncio.get_running_loop().run_in_executor(self._writer, self._write, work)

    async def read(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Runs `work` in one read transaction on a read-only connection (raises as `write`)."""
        with as_unavailable(DATABASE):
            return await asyncio.get_running_loop().run_in_executor(self._readers, self._read, work)

    async def aclose(self) -> None:
        """Stops the threads and closes the connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._shutdown)

    def _shutdown(self) -> None:
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        with self._connections_lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()
