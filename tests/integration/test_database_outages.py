"""Database outages: callers get UNAVAILABLE with a readable message (never
INTERNAL), on every path a call may take, and the pool recovers by itself.

PostgreSQL connections are cut with `pg_terminate_backend`: every backend
of this test's own database (the services under test are its only users),
never another database's.
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
import sqlalchemy as sa

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from agentim.runtime.v1 import runtime_pb2_grpc
from services.common.outages import DependencyUnavailable
from services.common.server import GrpcServer
from services.im.adapters import migrate
from services.im.adapters.message_log import open_message_log
from services.im.adapters.read_path import open_read_path
from services.im.adapters.sql import Database
from services.im.domain.model import ContentType, Message, Workspace
from services.runtime import bootstrap as runtime_bootstrap
from services.runtime.adapters import migrate as runtime_migrate
from services.runtime.adapters.sql import Database as RuntimeDatabase
from services.runtime.config import Settings as RuntimeSettings
from tests.auth_support import service_environment
from tests.conftest import POSTGRES_URL, RunningIM, make_world, start_im, stop_im
from tests.identities import as_unknown, learning_channel

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


async def terminate() -> int:
    """Cuts every other connection to the test database."""
    admin = await asyncpg.connect(POSTGRES_URL)
    try:
        count = await admin.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    finally:
        await admin.close()
    # The server closes the sockets; give this process's event loop a moment to see it.
    await asyncio.sleep(0.05)
    return int(count)


async def terminate_pid(pid: int) -> None:
    admin = await asyncpg.connect(POSTGRES_URL)
    try:
        await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await admin.close()


@pytest.fixture
async def pg_im(postgres_url: str) -> AsyncIterator[RunningIM]:
    running = await start_im(postgres_url)
    yield running
    await stop_im(running)


async def test_an_im_whose_connections_were_cut_serves_every_path_at_once(pg_im: RunningIM) -> None:
    stub = pg_im.stub
    world = await make_world(stub, people=2)
    group = (
        await stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="g", member_ids=[world.members[1].id]), metadata=world.md(0)
        )
    ).group
    sent = await stub.SendMessage(
        im_pb2.SendMessageRequest(group_id=group.id, content="x"), metadata=world.md(0)
    )
    await stub.GetAllUnread(im_pb2.GetAllUnreadRequest(), metadata=world.md(1))
    await stub.ListChats(im_pb2.ListChatsRequest(), metadata=world.md(1))
    assert await terminate() > 0

    # Each path once: SQLAlchemy reads and writes, the raw asyncpg reads and
    # writes of the hot paths, the event log behind a new watch.
    await stub.ListChats(im_pb2.ListChatsRequest(), metadata=world.md(1))
    await stub.GetAllUnread(im_pb2.GetAllUnreadRequest(), metadata=world.md(1))
    await stub.MarkRead(
        im_pb2.MarkReadRequest(group_id=group.id, up_to_message_id=sent.message.id), metadata=world.md(1)
    )
    await stub.SendMessage(im_pb2.SendMessageRequest(group_id=group.id, content="y"), metadata=world.md(0))
    await stub.CreateGroup(im_pb2.CreateGroupRequest(name="h"), metadata=world.md(0))
    watch = stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=world.md(1))
    await asyncio.wait_for(watch.wait_for_connection(), 5)
    watch.cancel()


async def test_a_driver_connection_cut_in_use_is_unavailable_and_a_read_goes_again(postgres_url: str) -> None:
    database = Database(postgres_url, pool_size=2)
    try:
        with pytest.raises(DependencyUnavailable) as caught:
            async with database.driver_connection() as conn:
                await terminate_pid(await conn.fetchval("SELECT pg_backend_pid()"))
                await conn.fetchval("SELECT 1")
        assert caught.value.connection_lost
        assert caught.value.message == "the database is unavailable (connection lost); try again"

        tries = 0

        async def read() -> int:
            nonlocal tries
            tries += 1
            async with database.driver_connection() as conn:
                if tries == 1:
                    await terminate_pid(await conn.fetchval("SELECT pg_backend_pid()"))
                return int(await conn.fetchval("SELECT 1"))

        assert await database.retry_read(read) == 1
        assert tries == 2
    finally:
        await database.aclose()


async def test_a_read_transaction_goes_again_and_a_write_is_unavailable(postgres_url: str) -> None:
    database = Database(postgres_url, pool_size=2)
    workspace = Workspace(id=uuid.uuid4(), name="cut", created_at=datetime.now(UTC))
    try:
        async with database.transaction() as tx:
            await tx.add_workspace(workspace)
            await tx.commit()
        async with database.transaction(write=False) as tx:
            await terminate_pid(await tx.conn.scalar(sa.text("SELECT pg_backend_pid()")))
            assert await tx.get_workspace(workspace.id) == workspace
        with pytest.raises(DependencyUnavailable):
            async with database.transaction() as tx:
                await terminate_pid(await tx.conn.scalar(sa.text("SELECT pg_backend_pid()")))
                await tx.rename_group(uuid.uuid4(), "never")
    finally:
        await database.aclose()


async def test_a_refused_database_is_unavailable_with_a_readable_message() -> None:
    im = await start_im("postgresql://nobody@127.0.0.1:1/none")
    # A genuine token: the call gets past authentication to the database.
    member = as_unknown()
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: im.stub.CreateWorkspace(im_pb2.CreateWorkspaceRequest(name="w", creator_display_name="a")),
        lambda: im.stub.GetAllUnread(im_pb2.GetAllUnreadRequest(), metadata=member),
    ]
    try:
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call()
            assert caught.value.code() == UNAVAILABLE
            assert caught.value.details() == "the database is unavailable (connection refused); try again"
    finally:
        await stop_im(im)


async def test_a_runtime_whose_database_refuses_answers_unavailable(tmp_path: Path) -> None:
    im_url = f"sqlite:///{tmp_path / 'im.db'}"
    im_database = Database(im_url)
    await migrate.upgrade(im_database)
    await im_database.aclose()
    im = await start_im(im_url)
    settings = RuntimeSettings.from_env(
        {
            "RUNTIME_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
            "RUNTIME_GRPC_ADDRESS": "127.0.0.1:0",
            "IM_ADDRESS": im.address,
            "LOG_LEVEL": "WARNING",
            **service_environment(),
        }
    )
    app = runtime_bootstrap.build(settings)
    port = await app.server.start()  # the runners need the database; the API answers without it
    try:
        world = await make_world(im.stub, people=1)
        async with learning_channel(f"127.0.0.1:{port}") as channel:
            stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ListAgents(rpb.ListAgentsRequest(), metadata=world.md(0), timeout=10)
        assert caught.value.code() == UNAVAILABLE
        assert caught.value.details().startswith("the database is unavailable")
    finally:
        await app.stop()
        await stop_im(im)


async def test_a_runtime_whose_connections_were_cut_serves_the_next_calls(
    postgres_url: str, pg_im: RunningIM
) -> None:
    im = pg_im
    database = RuntimeDatabase(postgres_url)
    await runtime_migrate.upgrade(database)
    await database.aclose()
    settings = RuntimeSettings.from_env(
        {
            "RUNTIME_DATABASE_URL": postgres_url,
            "RUNTIME_GRPC_ADDRESS": "127.0.0.1:0",
            "IM_ADDRESS": im.address,
            "LOG_LEVEL": "WARNING",
            **service_environment(),
        }
    )
    app = runtime_bootstrap.build(settings)
    port, _ = await app.start()
    world = await make_world(im.stub, people=1)
    try:
        async with learning_channel(f"127.0.0.1:{port}") as channel:
            stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
            agent = (
                await stub.CreateAgent(rpb.CreateAgentRequest(name="ada"), metadata=world.md(0), timeout=10)
            ).agent
            await stub.ListRuns(rpb.ListRunsRequest(agent_id=agent.id), metadata=world.md(0), timeout=10)
            assert await terminate() > 0
            got = await stub.GetAgent(
                rpb.GetAgentRequest(agent_id=agent.id), metadata=world.md(0), timeout=10
            )
            assert got.agent.id == agent.id
            await stub.ListRuns(rpb.ListRunsRequest(agent_id=agent.id), metadata=world.md(0), timeout=10)
            await stub.SubmitTask(
                rpb.SubmitTaskRequest(agent_id=agent.id, input="after the cut"),
                metadata=world.md(0),
                timeout=10,
            )
    finally:
        await app.stop()


# -- SQLite -----------------------------------------------------------------------------


def hold_write_lock(path: Path) -> sqlite3.Connection:
    """Another process's writer, as SQLite sees it: a connection in BEGIN IMMEDIATE."""
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    return holder


async def test_a_locked_sqlite_database_is_unavailable_on_every_write_path(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'im.db'}"
    setup = Database(url)
    await migrate.upgrade(setup)
    await setup.aclose()
    database = Database(url, busy_timeout_seconds=0.05)
    log = open_message_log(database)
    holder = hold_write_lock(tmp_path / "im.db")
    now = datetime.now(UTC)
    message = Message(
        id=uuid.uuid4(),
        workspace_id=uuid.uuid4(),
        group_id=uuid.uuid4(),
        sender_id=uuid.uuid4(),
        content_type=ContentType.TEXT,
        content="x",
        mentions=(),
        reply_to=None,
        metadata={},
        sent_at=now,
        edited_at=None,
        request_id=None,
        request_hash=None,
    )
    try:
        with pytest.raises(DependencyUnavailable) as batched:
            await log.append(message, now)  # the hot path's dedicated writer
        assert batched.value.message == "the database is unavailable (database is locked); try again"
        with pytest.raises(DependencyUnavailable):
            async with database.transaction() as tx:  # SQLAlchemy's writers
                await tx.add_workspace(Workspace(id=uuid.uuid4(), name="w", created_at=now))
        holder.rollback()
        async with database.transaction() as tx:
            await tx.add_workspace(Workspace(id=uuid.uuid4(), name="w", created_at=now))
            await tx.commit()
    finally:
        holder.close()
        await log.aclose()
        await database.aclose()


async def test_a_sqlite_file_that_cannot_be_opened_is_unavailable(tmp_path: Path) -> None:
    database = Database(f"sqlite:///{tmp_path / 'gone' / 'im.db'}")
    read_path = open_read_path(database)
    try:
        with pytest.raises(DependencyUnavailable) as caught:
            await read_path.unread(uuid.uuid4(), limit=10)
        assert "unable to open database file" in caught.value.message
    finally:
        await read_path.aclose()
        await database.aclose()


# -- the interceptor ------------------------------------------------------------------


def _raising_registrar(failures: dict[str, Callable[[], BaseException]]) -> Callable[[grpc.aio.Server], None]:
    def handler_for(make: Callable[[], BaseException]) -> grpc.RpcMethodHandler:
        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            raise make()

        async def stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            yield b"first"
            raise make()

        if make is failures.get("Stream"):
            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(unary)

    handler = grpc.method_handlers_generic_handler(
        "test.Failing", {name: handler_for(make) for name, make in failures.items()}
    )
    return lambda server: server.add_generic_rpc_handlers((handler,))


def _sqlite_error(sql: str, path: Path | None = None) -> sqlite3.Error:
    try:
        if path is None:
            sqlite3.connect(":memory:").execute(sql)
        else:
            holder = hold_write_lock(path)
            try:
                sqlite3.connect(path, isolation_level=None, timeout=0).execute(sql)
            finally:
                holder.close()
    except sqlite3.Error as error:
        return error
    raise AssertionError(f"{sql} did not fail")


async def test_the_interceptor_maps_outages_to_unavailable_and_bugs_to_internal(tmp_path: Path) -> None:
    locked = _sqlite_error("BEGIN IMMEDIATE", tmp_path / "locked.db")
    bug = _sqlite_error("SELECT * FROM no_such_table")
    failures: dict[str, Callable[[], BaseException]] = {
        "Locked": lambda: locked,
        "Refused": lambda: OSError("Multiple exceptions: [Errno 111] Connect call failed ('127.0.0.1', 1)"),
        "Bug": lambda: bug,
        "Stream": lambda: asyncpg.exceptions.ConnectionDoesNotExistError("closed in the middle of operation"),
    }

    async def ready() -> bool:
        return True

    server = GrpcServer(
        address="127.0.0.1:0", registrars=[_raising_registrar(failures)], service_names=[], readiness=ready
    )
    port = await server.start()
    try:
        async with learning_channel(f"127.0.0.1:{port}") as channel:

            async def status_of(name: str) -> tuple[grpc.StatusCode, str]:
                try:
                    if name == "Stream":
                        async for _ in channel.unary_stream(f"/test.Failing/{name}")(b"", timeout=5):
                            pass
                    else:
                        await channel.unary_unary(f"/test.Failing/{name}")(b"", timeout=5)
                except grpc.aio.AioRpcError as error:
                    return error.code(), error.details() or ""
                raise AssertionError(f"{name} did not fail")

            assert await status_of("Locked") == (
                UNAVAILABLE,
                "the database is unavailable (database is locked); try again",
            )
            code, details = await status_of("Refused")
            assert code == UNAVAILABLE and "127.0.0.1" not in details
            assert await status_of("Bug") == (grpc.StatusCode.INTERNAL, "internal error")
            assert await status_of("Stream") == (
                UNAVAILABLE,
                "the database is unavailable (connection lost); try again",
            )
    finally:
        await server.stop()
