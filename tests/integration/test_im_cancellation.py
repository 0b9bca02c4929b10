"""Calls cancelled at any moment (a client that went away, a deadline, a
shutdown; sometimes twice over) leave the IM's database usable: no write
lock or connection is kept by a transaction that was given up."""

from __future__ import annotations

import asyncio
import random
import uuid
from datetime import UTC, datetime
from pathlib import Path

from services.im.adapters import migrate
from services.im.adapters.sql import Database
from services.im.domain.model import Workspace


async def _write(database: Database, inside: asyncio.Event | None = None) -> None:
    async with database.transaction() as tx:
        if inside is not None:
            inside.set()
        await tx.add_workspace(Workspace(id=uuid.uuid4(), name="w", created_at=datetime.now(UTC)))
        await tx.commit()


async def test_write_transactions_cancelled_twice_at_random_moments_leave_the_database_writable(
    tmp_path: Path,
) -> None:
    database = Database(f"sqlite:///{tmp_path / 'im.db'}")
    await migrate.upgrade(database)
    rng = random.Random(7)
    try:
        for _ in range(300):
            inside = asyncio.Event()
            writer = asyncio.ensure_future(_write(database, inside))
            await asyncio.wait_for(inside.wait(), 10)
            # The second cancellation tends to land while the first one's
            # rollback is returning the connection to the pool.
            for _ in range(2):
                await asyncio.sleep(rng.uniform(0, 0.001))
                writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
        await asyncio.wait_for(_write(database), 10)
        assert not database.write_lock.locked()
    finally:
        await database.aclose()
