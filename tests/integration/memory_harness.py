"""A memory server on a free port, on SQLite or PostgreSQL, with a fake embedder and directory.

Backends: SQLite, the shared PostgreSQL (Debian's, without pgvector: vectors
are searched in numpy) and `pgvector`, an embedded PostgreSQL 18 with
pgvector (`tests/pgvector_server.py`, one server per session) where vectors
are searched through its HNSW index. The `memory_url` fixture gives the
first two; a test that should also run on the third asks for it with
`@pytest.mark.parametrize("memory_url", WITH_PGVECTOR, indirect=True)`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa

from agentim.memory.v1 import memory_pb2_grpc
from services.common.tokens import KeyRing, keyring_source
from services.memory import bootstrap
from services.memory.adapters import migrate
from services.memory.adapters.sql import Database
from services.memory.adapters.tables import SCHEMA
from services.memory.config import Settings
from services.memory.service_layer.ports import Dictionary, Embedder, MemberDirectory
from tests.auth_support import auth_dir, service_environment
from tests.conftest import POSTGRES_URL, unavailable
from tests.identities import learning_channel
from tests.memory_support import FakeDirectory, FakeEmbedder
from tests.pgvector_server import ServerUnavailable, pgvector_url

BACKENDS = ["sqlite", "postgresql"]
WITH_PGVECTOR = [*BACKENDS, "pgvector"]

_prepared: set[str] = set()


async def migrated_url(kind: str, tmp_path: Path) -> str:
    """A migrated memory database: a fresh SQLite file, or a PostgreSQL test
    database (the shared one, or the embedded one with pgvector) whose
    `memory` schema is re-created once per session."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'memory.db'}"
        database = Database(url)
        try:
            await migrate.upgrade(database)
        finally:
            await database.aclose()
        return url
    if kind == "pgvector":
        try:
            url = await pgvector_url()
        except ServerUnavailable as error:
            unavailable(f"no PostgreSQL with pgvector: {error}")
    else:
        url = POSTGRES_URL
    if url not in _prepared:
        database = Database(url)
        try:
            async with database.engine.begin() as conn:
                await conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
            await migrate.upgrade(database)
        except (OSError, sa.exc.SQLAlchemyError) as error:
            unavailable(f"PostgreSQL is unreachable at {url}: {error}")
        finally:
            await database.aclose()
        _prepared.add(url)
    return url


@dataclass
class RunningMemory:
    app: bootstrap.MemoryApp
    channel: grpc.aio.Channel
    stub: memory_pb2_grpc.MemoryServiceStub
    directory: FakeDirectory
    embedder: FakeEmbedder

    def new_workspace(self) -> tuple[str, str, str]:
        """A workspace id with an agent (id, member id) in it."""
        workspace = str(uuid.uuid4())
        return workspace, str(uuid.uuid4()), self.directory.add(workspace, is_agent=True)


def settings_for(url: str, **overrides: str) -> Settings:
    environ = {
        "MEMORY_DATABASE_URL": url,
        "MEMORY_GRPC_ADDRESS": "127.0.0.1:0",
        "MEMORY_EMBEDDER": "none",
        # CC-CEDICT takes seconds to load: tests that want a dictionary pass a small one.
        "MEMORY_DICTIONARY": "none",
        "LOG_LEVEL": "WARNING",
        **service_environment(),
        **overrides,
    }
    return Settings.from_env(environ)


async def start_memory(
    url: str,
    *,
    embedder: Embedder | None = None,
    directory: MemberDirectory | None = None,
    dictionary: Dictionary | None = None,
    **overrides: str,
) -> RunningMemory:
    fake_directory = directory if isinstance(directory, FakeDirectory) else FakeDirectory()
    fake_embedder = embedder if isinstance(embedder, FakeEmbedder) else FakeEmbedder()
    app = bootstrap.build(
        settings_for(url, **overrides),
        embedder=embedder or fake_embedder,
        directory=directory or fake_directory,
        dictionary=dictionary,
        # No IM runs beside it: the tokens are verified with the test key ring's public keys.
        signing_keys=keyring_source(KeyRing.load(auth_dir() / "keys")),
    )
    port = await app.start()
    channel = learning_channel(f"127.0.0.1:{port}")
    return RunningMemory(
        app, channel, memory_pb2_grpc.MemoryServiceStub(channel), fake_directory, fake_embedder
    )


async def stop_memory(running: RunningMemory) -> None:
    await running.channel.close()
    await running.app.stop()


@pytest.fixture(params=BACKENDS)
async def memory_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return await migrated_url(request.param, tmp_path)


@pytest.fixture
async def memory(memory_url: str) -> AsyncIterator[RunningMemory]:
    running = await start_memory(memory_url)
    yield running
    await stop_memory(running)
