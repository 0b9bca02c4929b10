"""Applies the memory's Alembic migrations to a database."""

from __future__ import annotations

from pathlib import Path

from services.common.sql import SqlDatabase, downgrade_schema, upgrade_schema

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


async def upgrade(database: SqlDatabase, revision: str = "head") -> None:
    """Brings the schema to `revision` (the newest by default)."""
    await upgrade_schema(database, MIGRATIONS, revision)


async def downgrade(database: SqlDatabase, revision: str) -> None:
    await downgrade_schema(database, MIGRATIONS, revision)
