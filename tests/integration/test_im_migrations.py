"""The IM's migrations: they build exactly the tables the code defines, and
0002 gives existing workspaces an owner and existing agents their host."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.engine import Connection

from services.im.adapters import migrate
from services.im.adapters.sql import Database
from services.im.adapters.tables import SCHEMA, accounts, members, metadata, workspaces
from services.im.domain.model import Role


def _differences(connection: Connection) -> list[Any]:
    is_postgres = connection.dialect.name == "postgresql"
    context = MigrationContext.configure(
        connection,
        opts={
            "version_table": "im_alembic_version",
            "version_table_schema": SCHEMA if is_postgres else None,
            "include_schemas": is_postgres,
            # Only the IM's schema (the runtime's and memory's share the database).
            "include_name": lambda name, kind, _parent: kind != "schema" or name == SCHEMA or not is_postgres,
            "compare_type": True,
        },
    )
    if is_postgres:
        target = metadata
    else:
        target = sa.MetaData()
        for table in metadata.tables.values():
            # None takes the target's schema (none), as documented; the annotation omits it.
            table.to_metadata(target, schema=None)  # type: ignore[arg-type]
    return list(compare_metadata(context, target))


async def test_the_migrations_build_exactly_the_tables(database_url: str) -> None:
    database = Database(database_url)
    try:
        async with database.engine.connect() as conn:
            assert await conn.run_sync(_differences) == []
    finally:
        await database.aclose()


async def test_existing_members_get_roles_and_agents_their_host_and_it_all_goes_back(tmp_path: Path) -> None:
    database = Database(f"sqlite:///{tmp_path / 'im.db'}")
    try:
        await migrate.upgrade(database, "0001")
        start = datetime(2026, 1, 1, tzinfo=UTC)
        first_ws, second_ws = uuid.uuid4(), uuid.uuid4()
        rows = [
            # (workspace, kind, minutes after start)
            (first_ws, "agent", 0),  # older than the people: never an owner
            (first_ws, "human", 1),  # the earliest person: the owner
            (first_ws, "human", 2),
            (second_ws, "human", 5),
        ]
        ids = [uuid.uuid4() for _ in rows]
        async with database.engine.begin() as conn:
            for workspace in (first_ws, second_ws):
                await conn.execute(workspaces.insert().values(id=workspace, name="w", created_at=start))
            for member_id, (workspace, kind, minutes) in zip(ids, rows, strict=True):
                await conn.execute(
                    sa.text(
                        "INSERT INTO members (id, workspace_id, kind, display_name, avatar, created_at)"
                        " VALUES (:id, :ws, :kind, 'x', '', :at)"
                    ),
                    {
                        "id": member_id.hex,
                        "ws": workspace.hex,
                        "kind": kind,
                        "at": (start + timedelta(minutes=minutes)).replace(tzinfo=None),
                    },
                )
        await migrate.upgrade(database)
        async with database.engine.connect() as conn:
            found = {r.id: (r.role, r.host) for r in (await conn.execute(sa.select(members))).all()}
        assert [found[i] for i in ids] == [
            (Role.MEMBER.value, "runtime"),
            (Role.OWNER.value, None),
            (Role.MEMBER.value, None),
            (Role.OWNER.value, None),
        ]
        await migrate.downgrade(database, "0001")
        async with database.engine.connect() as conn:
            names = await conn.run_sync(lambda c: sa.inspect(c).get_table_names())
            columns = await conn.run_sync(
                lambda c: [col["name"] for col in sa.inspect(c).get_columns("members")]
            )
        assert "accounts" not in names and "role" not in columns and "host" not in columns
        await migrate.upgrade(database)
        async with database.engine.connect() as conn:
            assert await conn.run_sync(_differences) == []
    finally:
        await database.aclose()


async def test_downgrade_to_nothing_and_up_again(tmp_path: Path) -> None:
    database = Database(f"sqlite:///{tmp_path / 'im.db'}")
    try:
        await migrate.upgrade(database)
        await migrate.downgrade(database, "base")
        async with database.engine.connect() as conn:
            names = await conn.run_sync(lambda c: sa.inspect(c).get_table_names())
        assert set(names) == {"im_alembic_version"}
        await migrate.upgrade(database)
    finally:
        await database.aclose()


async def test_0004_keeps_accounts_and_lets_new_ones_go_without_a_password(tmp_path: Path) -> None:
    # On SQLite, 0004 copies the accounts table (nullability changes so): nothing may be lost.
    database = Database(f"sqlite:///{tmp_path / 'im.db'}")
    try:
        await migrate.upgrade(database, "0003")
        member, workspace, at = uuid.uuid4(), uuid.uuid4(), datetime(2026, 1, 1, tzinfo=UTC)
        async with database.engine.begin() as conn:
            await conn.execute(
                sa.text(
                    "INSERT INTO accounts (member_id, workspace_id, login, password_hash, created_at,"
                    " password_changed_at) VALUES (:m, :w, 'ada', '$argon2id$hash', :at, :at)"
                ),
                {"m": member.hex, "w": workspace.hex, "at": at.replace(tzinfo=None)},
            )
        await migrate.upgrade(database)
        async with database.engine.begin() as conn:
            rows = (await conn.execute(sa.select(accounts))).all()
            assert [(r.member_id, r.login, r.password_hash, r.email) for r in rows] == [
                (member, "ada", "$argon2id$hash", None)
            ]
            # The login stays unique in its workspace; an email-only account needs none.
            with pytest.raises(sa.exc.IntegrityError):
                async with conn.begin_nested():
                    await conn.execute(
                        accounts.insert().values(
                            member_id=uuid.uuid4(),
                            workspace_id=workspace,
                            login="ada",
                            password_hash="x",
                            created_at=at,
                            password_changed_at=at,
                        )
                    )
            for _ in range(2):
                await conn.execute(
                    accounts.insert().values(
                        member_id=uuid.uuid4(),
                        workspace_id=workspace,
                        login=None,
                        password_hash=None,
                        created_at=at,
                        password_changed_at=at,
                        email=f"{uuid.uuid4().hex[:6]}@x.test",
                    )
                )
            with pytest.raises(sa.exc.IntegrityError):
                async with conn.begin_nested():
                    await conn.execute(
                        accounts.insert().values(
                            member_id=uuid.uuid4(),
                            workspace_id=workspace,
                            login=None,
                            password_hash=None,
                            created_at=at,
                            password_changed_at=at,
                            email="ada@x.test",
                        )
                    )
                    await conn.execute(
                        accounts.insert().values(
                            member_id=uuid.uuid4(),
                            workspace_id=workspace,
                            login=None,
                            password_hash=None,
                            created_at=at,
                            password_changed_at=at,
                            email="ada@x.test",
                        )
                    )
        await migrate.downgrade(database, "0003")
        async with database.engine.connect() as conn:
            logins = (await conn.execute(sa.text("SELECT login FROM accounts"))).scalars().all()
        assert logins == ["ada"]  # the accounts without a password are gone with 0004
    finally:
        await database.aclose()
