"""SQL plumbing every service's storage needs, on SQLite and PostgreSQL alike.

Only what is independent of a context's tables lives here: the UTC datetime
column type, the async driver URL, the SQLite connection settings, the
engine holder, the migration runner, and dedicated SQLite connections for hot paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import Connection, Dialect, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

T = TypeVar("T")


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


def configure_sqlite(engine: AsyncEngine, *, write_option: str) -> None:
    """WAL, durable-enough syncs, a busy timeout and foreign keys on every connection.

    Args:
        engine: an aiosqlite engine.
        write_option: the execution option that marks a connection as a writer;
            its transactions start with BEGIN IMMEDIATE.
    """

    @event.listens_for(engine.sync_engine, "connect")
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take BEGIN into our own hands (see on_begin); pysqlite's is too late.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode is durable across a crash of any process.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=10000")
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
    """

    def __init__(self, url: str, *, schema: str, write_option: str, pool_size: int = 16) -> None:
        self.url = async_url(url)
        self.schema = schema
        self.write_option = write_option
        parsed = make_url(self.url)
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        self.sqlite_path = (parsed.database or "") if self.is_sqlite else ""
        options: dict[str, Any] = {}
        if self.is_sqlite:
            options["execution_options"] = {"schema_translate_map": {schema: None}}
        else:
            options.update(pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=False)
        self.engine: AsyncEngine = create_async_engine(self.url, **options)
        self.write_lock = asyncio.Lock()
        if self.is_sqlite:
            configure_sqlite(self.engine, write_option=write_option)

    @contextlib.asynccontextmanager
    async def driver_connection(self) -> AsyncIterator[Any]:
        """A pooled connection's own driver connection (asyncpg on PostgreSQL),
        for hot paths that send their SQL straight through, without a transaction."""
        async with self.engine.connect() as conn:
            driver = (await conn.get_raw_connection()).driver_connection
            assert driver is not None
            yield driver

    async def ping(self) -> bool:
        async with self.engine.connect() as conn:
            await conn.execute(sa.text("SELECT 1"))
        return True

    async def aclose(self) -> None:
        """Closes the pooled connections. Idempotent."""
        await self.engine.dispose()


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


_DATABASE_UNAVAILABLE = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,  # the connection is closed or in a bad state
    asyncpg.PostgresConnectionError,  # class 08
    asyncpg.exceptions.OperatorInterventionError,  # class 57: shutting down, cancelled
    asyncpg.exceptions.InsufficientResourcesError,  # class 53: disk full, too many connections
    sqlite3.OperationalError,  # locked, disk I/O, cannot open
    sa.exc.OperationalError,
    sa.exc.InterfaceError,
    sa.exc.TimeoutError,  # no pooled connection came in time
)


def database_unavailable(error: Exception) -> bool:
    """Whether a failure is the database's own (unreachable, shutting down, out of
    resources, locked) rather than caused by what a statement tried to store.

    Batched writers fail a whole batch at once on these, instead of splitting
    it to find an item at fault (see `services.common.batching`).
    """
    return isinstance(error, _DATABASE_UNAVAILABLE)


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
            conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False, timeout=10)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            if read_only:
                conn.execute("PRAGMA query_only=ON")
            self._local.conn = conn
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    @staticmethod
    def _transaction(conn: sqlite3.Connection, begin: str, work: Callable[[sqlite3.Connection], T]) -> T:
        conn.execute(begin)
        try:
            result = work(conn)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return result

    def _write(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return self._transaction(self._connection(read_only=False), "BEGIN IMMEDIATE", work)

    def _read(self, work: Callable[[sqlite3.Connection], T]) -> T:
        return self._transaction(self._connection(read_only=True), "BEGIN", work)

    async def write(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Runs `work` in one write transaction; it commits unless `work` raises."""
        async with self._write_lock:
            return await asyncio.get_running_loop().run_in_executor(self._writer, self._write, work)

    async def read(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Runs `work` in one read transaction on a read-only connection."""
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
