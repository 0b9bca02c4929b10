"""Shared fixtures: real databases (SQLite and PostgreSQL), Redis, IM servers.

PostgreSQL and Redis tests use AGENTIM_TEST_DATABASE_URL and
AGENTIM_TEST_REDIS_URL (defaults: the local servers). When one is
unreachable they skip with the reason, except under CI=true, where they fail.

Under pytest-xdist (`make test` runs two workers) each worker has a database
of its own (`<name>_gw0`, `<name>_gw1`, created on first use) and a Redis
database number of its own, so that no test sees another worker's rows, and
tests that cut every connection to their database cut only their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
import redis.asyncio as redis
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from agentim.im.v1 import im_pb2, im_pb2_grpc
from services.common.sql import async_url
from services.im import bootstrap
from services.im.adapters import migrate
from services.im.adapters.sql import Database
from services.im.config import Settings
from services.runtime.adapters import migrate as runtime_migrate
from services.runtime.adapters.sql import Database as RuntimeDatabase
from services.runtime.adapters.sql import SqlAgentStore
from services.runtime.adapters.tables import SCHEMA as RUNTIME_SCHEMA
from tests.auth_support import auth_environment
from tests.fake_openai import FakeOpenAI
from tests.faults.harness import RedisProcess
from tests.identities import as_member, learn_member, learning_channel

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_BASE_POSTGRES_URL = os.environ.get("AGENTIM_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
_BASE_REDIS_URL = os.environ.get("AGENTIM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _worker_urls() -> tuple[str, str]:
    """This worker's PostgreSQL and Redis URLs (the configured ones without xdist)."""
    if not _WORKER.startswith("gw"):
        return _BASE_POSTGRES_URL, _BASE_REDIS_URL
    number = int(_WORKER.removeprefix("gw"))
    postgres = make_url(_BASE_POSTGRES_URL)
    server, _, db = _BASE_REDIS_URL.partition("://")[2].partition("/")
    redis_db = int(db or 0) + 1 + number
    return (
        postgres.set(database=f"{postgres.database}_{_WORKER}").render_as_string(hide_password=False),
        f"redis://{server}/{redis_db}",
    )


POSTGRES_URL, REDIS_URL = _worker_urls()
IN_CI = os.environ.get("CI", "").lower() == "true"


def unavailable(reason: str) -> None:
    """Skips outside CI; fails under CI, where every server must be there."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: servers must be available)")
    pytest.skip(reason)


# Whether PostgreSQL answered, once per session (None: not asked yet).
_postgres: dict[str, bool] = {}


async def _create_worker_database() -> None:
    """Creates this xdist worker's database if it is missing (nothing to do without xdist)."""
    if POSTGRES_URL == _BASE_POSTGRES_URL:
        return
    name = make_url(POSTGRES_URL).database
    admin = await asyncpg.connect(_BASE_POSTGRES_URL)
    try:
        if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()


def pytest_configure(config: pytest.Config) -> None:
    # Before any test (and any fixture's event loop) so every PostgreSQL user finds it;
    # an unreachable server is reported by the tests that need it.
    with contextlib.suppress(OSError, asyncpg.PostgresError):
        asyncio.run(_create_worker_database())


async def _prepare_postgres() -> None:
    if "ready" not in _postgres:
        engine = create_async_engine(async_url(POSTGRES_URL))
        try:
            async with engine.begin() as conn:
                await conn.execute(sa.text("DROP SCHEMA IF EXISTS im CASCADE"))
            _postgres["ready"] = True
        except (OSError, sa.exc.SQLAlchemyError):
            _postgres["ready"] = False
        finally:
            await engine.dispose()
        if _postgres["ready"]:
            database = Database(POSTGRES_URL)
            await migrate.upgrade(database)
            await database.aclose()
    if not _postgres["ready"]:
        unavailable(f"PostgreSQL is unreachable at {POSTGRES_URL}")


@pytest.fixture(params=["sqlite", "postgresql"])
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated database of each kind; PostgreSQL tests share one schema and use fresh ids."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'im.db'}"
        database = Database(url)
        await migrate.upgrade(database)
        await database.aclose()
        return url
    await _prepare_postgres()
    return POSTGRES_URL


# PostgreSQL URLs whose runtime schema this session has re-created.
_runtime_prepared: set[str] = set()


async def _runtime_migrated(url: str) -> None:
    database = RuntimeDatabase(url)
    try:
        await runtime_migrate.upgrade(database)
    finally:
        await database.aclose()


@pytest.fixture
async def runtime_url(database_url: str, tmp_path: Path) -> str:
    """A migrated runtime database of each kind that `database_url` offers.

    PostgreSQL tests share the `runtime` schema (dropped, re-created and
    migrated once per session, as the IM's is) and use fresh ids.
    """
    if database_url.startswith("sqlite"):
        url = f"sqlite:///{tmp_path / 'runtime.db'}"
        await _runtime_migrated(url)
        return url
    if database_url not in _runtime_prepared:
        database = RuntimeDatabase(database_url)
        try:
            async with database.engine.begin() as conn:
                await conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {RUNTIME_SCHEMA} CASCADE"))
        finally:
            await database.aclose()
        await _runtime_migrated(database_url)
        _runtime_prepared.add(database_url)
    return database_url


@pytest.fixture
async def own_runtime_url(database_url: str, tmp_path: Path) -> AsyncIterator[str]:
    """A migrated runtime database that holds nothing of other tests, for a
    runtime process that loads (and watches the IM for) every agent it finds:
    the shared PostgreSQL schema holds agents that store tests made with no IM
    behind them. PostgreSQL: a database of the test's own, dropped after it."""
    if database_url.startswith("sqlite"):
        url = f"sqlite:///{tmp_path / 'runtime.db'}"
        await _runtime_migrated(url)
        yield url
        return
    name = f"agentim_runtime_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(POSTGRES_URL)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        url = make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
        await _runtime_migrated(url)
        yield url
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


@pytest.fixture
async def postgres_url() -> str:
    """The migrated PostgreSQL test database, for tests of PostgreSQL alone."""
    await _prepare_postgres()
    return POSTGRES_URL


@pytest.fixture
async def redis_url() -> str:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        await client.ping()
    except (OSError, redis.RedisError):
        unavailable(f"Redis is unreachable at {REDIS_URL}")
    finally:
        await client.aclose()
    return REDIS_URL


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A redis-server of this test's own, on a free port, to kill and restart
    (the shared one is never touched)."""
    if shutil.which("redis-server") is None:
        unavailable("redis-server is not installed")
    with RedisProcess(tmp_path) as server:
        yield server.start()


def settings_for(database_url: str, **overrides: str) -> Settings:
    environ: dict[str, str] = {
        "DATABASE_URL": database_url,
        "IM_GRPC_ADDRESS": "127.0.0.1:0",
        "LOG_LEVEL": "WARNING",
        **auth_environment(),
    }
    environ.update(overrides)
    return Settings.from_env(environ)


@dataclass
class RunningIM:
    """An IM server on a free loopback port, with a client stub."""

    app: bootstrap.IMApp
    port: int
    channel: grpc.aio.Channel
    stub: im_pb2_grpc.IMServiceStub

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def start_im(database_url: str, **overrides: str) -> RunningIM:
    app = bootstrap.build(settings_for(database_url, **overrides))
    port = await app.start()
    channel = learning_channel(f"127.0.0.1:{port}")
    return RunningIM(app=app, port=port, channel=channel, stub=im_pb2_grpc.IMServiceStub(channel))


async def stop_im(running: RunningIM) -> None:
    await running.channel.close()
    await running.app.stop()


ImFactory = Callable[..., Any]


@pytest.fixture
async def im_factory(database_url: str) -> AsyncIterator[Callable[..., Any]]:
    """Starts IM servers on the test's database with extra settings; stops them after."""
    started: list[RunningIM] = []

    async def make(**overrides: str) -> RunningIM:
        running = await start_im(database_url, **overrides)
        started.append(running)
        return running

    yield make
    for running in reversed(started):
        await stop_im(running)


@pytest.fixture
async def im(im_factory: Callable[..., Any]) -> RunningIM:
    running: RunningIM = await im_factory()
    return running


@dataclass
class World:
    """A workspace with members, for tests that need some people."""

    workspace: im_pb2.Workspace
    members: list[im_pb2.Member]

    def md(self, index: int) -> tuple[tuple[str, str], ...]:
        return as_member(self.members[index].id)


async def make_world(
    stub: im_pb2_grpc.IMServiceStub,
    *,
    people: int = 3,
    kinds: Mapping[int, im_pb2.MemberKind.ValueType] | None = None,
) -> World:
    created = await stub.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(name=f"ws-{uuid.uuid4().hex[:6]}", creator_display_name="member-0")
    )
    learn_member(created.creator)
    members = [created.creator]
    for index in range(1, people):
        kind = (kinds or {}).get(index, im_pb2.MEMBER_KIND_HUMAN)
        response = await stub.CreateMember(
            im_pb2.CreateMemberRequest(kind=kind, display_name=f"member-{index}"),
            metadata=as_member(created.creator.id),
        )
        learn_member(response.member)
        members.append(response.member)
    return World(workspace=created.workspace, members=members)


async def next_event(stream: Any, within: float = 5.0) -> im_pb2.WatchEventsResponse:
    event: im_pb2.WatchEventsResponse = await asyncio.wait_for(stream.read(), within)
    return event


# The runtime's store


@pytest.fixture
async def store(runtime_url: str) -> AsyncIterator[SqlAgentStore]:
    store = SqlAgentStore(RuntimeDatabase(runtime_url))
    yield store
    await store.aclose()


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    """A scriptable fake OpenAI-compatible server on a free port."""
    server = FakeOpenAI()
    await server.start()
    yield server
    await server.stop()
