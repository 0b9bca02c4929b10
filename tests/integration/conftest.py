"""Fixtures of the integration tests: a migrated runtime database of each kind and its store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from services.runtime.adapters import migrate
from services.runtime.adapters.sql import Database, SqlAgentStore
from services.runtime.adapters.tables import SCHEMA

# PostgreSQL URLs whose runtime schema this session has re-created.
_prepared: set[str] = set()


async def _migrated(url: str) -> None:
    database = Database(url)
    try:
        await migrate.upgrade(database)
    finally:
        await database.aclose()


@pytest.fixture
async def runtime_url(database_url: str, tmp_path: Path) -> str:
    """A migrated runtime database of each kind that `database_url` offers."""
    if database_url.startswith("sqlite"):
        url = f"sqlite:///{tmp_path / 'runtime.db'}"
        await _migrated(url)
        return url
    if database_url not in _prepared:
        database = Database(database_url)
        try:
            async with database.engine.begin() as conn:
                await conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        finally:
            await database.aclose()
        await _migrated(database_url)
        _prepared.add(database_url)
    return database_url


@pytest.fixture
async def store(runtime_url: str) -> AsyncIterator[SqlAgentStore]:
    store = SqlAgentStore(Database(runtime_url))
    yield store
    await store.aclose()
