"""The shared gRPC server plumbing: health, reflection, shutdown, ports, limits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sqlalchemy.engine import make_url

from agentim.im.v1 import im_pb2, im_pb2_grpc
from services.common.clients import open_channel
from services.common.server import GrpcServer
from services.common.settings import ConfigError
from services.im.config import Settings
from tests.auth_support import auth_environment
from tests.conftest import RunningIM, make_world, start_im, stop_im
from tests.holding_proxy import HoldingProxy
from tests.identities import learning_channel

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def health_of(address: str, service: str = "") -> int:
    async with learning_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return int(response.status)


async def test_health_reports_serving_for_the_im_service(im: RunningIM) -> None:
    assert await health_of(im.address) == SERVING
    assert await health_of(im.address, "agentim.im.v1.IMService") == SERVING


async def test_health_lists_every_service_and_component(im: RunningIM) -> None:
    """Reflection advertises List; it answers (it was INTERNAL, with a traceback logged)."""
    async with learning_channel(im.address) as channel:
        listed = await health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=5)
    statuses = {name: response.status for name, response in listed.statuses.items()}
    assert statuses[""] == SERVING and statuses["agentim.im.v1.IMService"] == SERVING


async def test_health_can_be_watched(im: RunningIM) -> None:
    async with learning_channel(im.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        first = await asyncio.wait_for(watch.read(), 5)
        watch.cancel()
    assert first.status == SERVING


async def test_health_follows_database_readiness(postgres_url: str) -> None:
    """The database's connections are held up for real (a proxy stops
    forwarding): the IM reports NOT_SERVING, then SERVING once they flow again."""
    url = make_url(postgres_url)
    proxy = HoldingProxy(f"{url.host or '127.0.0.1'}:{url.port or 5432}")
    address = await proxy.start()
    host, _, port = address.rpartition(":")
    running = await start_im(url.set(host=host, port=int(port)).render_as_string(hide_password=False))
    try:
        assert await health_of(running.address) == SERVING
        proxy.hold()
        assert await health_of(running.address) == NOT_SERVING
        proxy.release()
        assert await health_of(running.address) == SERVING
    finally:
        await stop_im(running)
        await proxy.aclose()


async def test_unreachable_database_is_not_serving() -> None:
    running = await start_im("postgresql://nobody@127.0.0.1:1/none")
    try:
        assert await health_of(running.address) == NOT_SERVING
    finally:
        await stop_im(running)


async def test_reflection_lists_services_and_can_be_switched_off(im_factory: Any) -> None:
    async def listed(address: str) -> list[str]:
        async with learning_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            async for response in call:
                return [s.name for s in response.list_services_response.service]
        return []

    on: RunningIM = await im_factory()
    assert "agentim.im.v1.IMService" in await listed(on.address)
    assert "grpc.health.v1.Health" in await listed(on.address)
    off: RunningIM = await im_factory(GRPC_REFLECTION="false")
    async with learning_channel(off.address) as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
        # The server may end the call before the request is even sent (grpc
        # then fails the write, as INTERNAL on the client): its status tells.
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        assert await call.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_taken_port_is_refused(im: RunningIM, tmp_path: Path) -> None:
    with pytest.raises(OSError, match="cannot listen"):
        await start_im(f"sqlite:///{tmp_path / 'other.db'}", IM_GRPC_ADDRESS=im.address)


def _slow_registrar(started: asyncio.Event) -> Any:
    async def sleep(request: bytes, context: Any) -> bytes:
        started.set()
        await asyncio.sleep(0.5)
        return b"done"

    handler = grpc.method_handlers_generic_handler(
        "test.Slow", {"Sleep": grpc.unary_unary_rpc_method_handler(sleep)}
    )
    return lambda server: server.add_generic_rpc_handlers((handler,))


async def test_shutdown_reports_not_serving_and_drains_in_flight_calls() -> None:
    started = asyncio.Event()
    closed: list[str] = []

    async def ready() -> bool:
        return True

    async def closer() -> None:
        closed.append("closer")

    async def cleanup() -> None:
        closed.append("cleanup")

    server = GrpcServer(
        address="127.0.0.1:0",
        registrars=[_slow_registrar(started)],
        service_names=["test.Slow"],
        readiness=ready,
        grace_seconds=5,
        closers=[closer],
        cleanups=[cleanup],
    )
    port = await server.start()
    channel = learning_channel(f"127.0.0.1:{port}")
    slow = asyncio.ensure_future(channel.unary_unary("/test.Slow/Sleep")(b"", timeout=5))
    await asyncio.wait_for(started.wait(), 5)
    health = health_pb2_grpc.HealthStub(channel)
    stopping = asyncio.ensure_future(server.stop())
    await asyncio.sleep(0.05)
    assert server.health._server_status[""] == NOT_SERVING
    assert await slow == b"done", "the in-flight call was cut off"
    await stopping
    assert closed == ["closer", "cleanup"]
    with pytest.raises(grpc.aio.AioRpcError):
        await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
    await channel.close()
    await server.stop()  # idempotent


def _recording_registrar(handled: list[bytes], started: asyncio.Event) -> Any:
    """`test.Slow/Sleep`: records each request; b"slow" takes half a second."""

    async def sleep(request: bytes, context: Any) -> bytes:
        handled.append(request)
        started.set()
        if request == b"slow":
            await asyncio.sleep(0.5)
        return b"done"

    handler = grpc.method_handlers_generic_handler(
        "test.Slow", {"Sleep": grpc.unary_unary_rpc_method_handler(sleep)}
    )
    return lambda server: server.add_generic_rpc_handlers((handler,))


async def _always_ready() -> bool:
    return True


async def _timed(call: Any) -> tuple[float, Any]:
    """Awaits a call; returns when it ended and its result (or its error)."""
    try:
        result = await call
    except grpc.aio.AioRpcError as error:
        result = error
    return time.monotonic(), result


async def test_a_call_arriving_while_stopping_is_refused_unavailable_after_the_drain_and_never_run() -> None:
    handled: list[bytes] = []
    started = asyncio.Event()
    server = GrpcServer(
        address="127.0.0.1:0",
        registrars=[_recording_registrar(handled, started)],
        service_names=["test.Slow"],
        readiness=_always_ready,
        grace_seconds=5,
    )
    port = await server.start()
    async with learning_channel(f"127.0.0.1:{port}") as channel:
        sleep = channel.unary_unary("/test.Slow/Sleep")
        slow = asyncio.ensure_future(_timed(sleep(b"slow", timeout=5)))
        await asyncio.wait_for(started.wait(), 5)
        stopping = asyncio.ensure_future(server.stop())
        # Health answers while the server drains, and it says why.
        check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert check.status == NOT_SERVING
        late = asyncio.ensure_future(_timed(sleep(b"late", timeout=5)))
        # A deadline shorter than the drain: refused in time, not DEADLINE_EXCEEDED.
        hurried = asyncio.ensure_future(_timed(sleep(b"hurried", timeout=0.3)))
        (slow_ended, slow_result), (late_ended, refused), (_, hurried_refused) = await asyncio.gather(
            slow, late, hurried
        )
        await asyncio.wait_for(stopping, 5)
    assert slow_result == b"done", "the call in flight was cut off"
    for error in (refused, hurried_refused):
        assert isinstance(error, grpc.aio.AioRpcError)
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "shutting down" in (error.details() or ""), error
    # Held back while the call in flight drained (then grpc's shutdown sent
    # GOAWAY, so that its client's next call goes elsewhere), and never run.
    assert late_ended >= slow_ended
    assert handled == [b"slow"]


async def test_health_watch_hears_not_serving_then_ends_unavailable_at_shutdown() -> None:
    server = GrpcServer(
        address="127.0.0.1:0",
        registrars=[],
        service_names=["test.Slow"],
        readiness=_always_ready,
        grace_seconds=5,
    )
    port = await server.start()
    async with learning_channel(f"127.0.0.1:{port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="test.Slow"))
        first = await asyncio.wait_for(watch.read(), 5)
        assert first.status == SERVING
        began = time.monotonic()
        stopping = asyncio.ensure_future(server.stop())
        assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(watch.read(), 5)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        await asyncio.wait_for(stopping, 5)
    # The watch did not hold the server for its whole grace period.
    assert time.monotonic() - began < 2


async def test_client_channels_give_unary_calls_a_deadline() -> None:
    started = asyncio.Event()

    async def ready() -> bool:
        return True

    server = GrpcServer(
        address="127.0.0.1:0", registrars=[_slow_registrar(started)], service_names=[], readiness=ready
    )
    port = await server.start()
    channel = open_channel(f"127.0.0.1:{port}", default_timeout_seconds=0.1)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary("/test.Slow/Sleep")(b"")
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await channel.close()
    await server.stop()


async def test_a_stuck_shutdown_step_is_left_behind_and_the_later_ones_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[str] = []
    never = asyncio.Event()

    async def ready() -> bool:
        return True

    async def stuck_pool() -> None:
        ran.append("stuck")
        await never.wait()

    async def close_channels() -> None:
        ran.append("after")

    server = GrpcServer(
        address="127.0.0.1:0",
        registrars=[],
        service_names=[],
        readiness=ready,
        cleanups=[stuck_pool, close_channels],
        step_timeout_seconds=0.2,
    )
    await server.start()
    await asyncio.wait_for(server.stop(), 5)
    assert ran == ["stuck", "after"]
    assert any("stuck_pool" in record.getMessage() for record in caplog.records)


def test_settings_report_every_problem_and_hide_secrets() -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_env(
            {
                "DATABASE_URL": "mysql://x",
                "IM_GRPC_ADDRESS": "nowhere",
                "LOG_LEVEL": "LOUD",
                "IM_MAX_GROUP_MEMBERS": "many",
                "GRPC_REFLECTION": "perhaps",
                "AGENTIM_SERVICE_TOKEN": "hunter2",
            }
        )
    problems = "\n".join(caught.value.problems)
    for name in ("DATABASE_URL", "IM_GRPC_ADDRESS", "LOG_LEVEL", "IM_MAX_GROUP_MEMBERS", "GRPC_REFLECTION"):
        assert name in problems
    assert len(caught.value.problems) == 5
    # The retired shared service token is read by nothing: neither kept nor shown.
    settings = Settings.from_env({"AGENTIM_SERVICE_TOKEN": "hunter2", "AGENTIM_DATA_DIR": "/tmp/x"})
    assert "hunter2" not in repr(settings)
    assert settings.database_url == "sqlite:////tmp/x/im.db" and settings.redis_url is None
    # Nor are the passwords the database and Redis URLs may hold.
    with_passwords = Settings.from_env(
        {
            "DATABASE_URL": "postgresql://im:s3cret-db@db/agentim",
            "REDIS_URL": "redis://:s3cret-redis@redis:6379/0",
            "AUTH_SIGNING_KEYS_DIR": "/tmp/x/keys",
        }
    )
    assert "s3cret" not in repr(with_passwords)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_service_process_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    env = {**os.environ, "AGENTIM_DATA_DIR": str(tmp_path), "IM_GRPC_ADDRESS": f"127.0.0.1:{_free_port()}"}
    subprocess.run([sys.executable, "-m", "services.im", "migrate"], env=env, check=True, capture_output=True)
    process = subprocess.Popen(
        [sys.executable, "-m", "services.im", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("IM service listening on 127.0.0.1:"), line
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _serve(env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "services.im", "serve"], env=env, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("IM service listening on "), line
    return process, line.split()[4]


async def test_an_acknowledged_message_survives_a_crash(database_url: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "IM_GRPC_ADDRESS": "127.0.0.1:0",
        "LOG_LEVEL": "WARNING",
        "AGENTIM_DATA_DIR": str(tmp_path),
        **auth_environment(),
    }
    process, address = _serve(env)
    try:
        async with learning_channel(address) as channel:
            stub = im_pb2_grpc.IMServiceStub(channel)
            world = await make_world(stub, people=2)
            group = await stub.CreateGroup(
                im_pb2.CreateGroupRequest(name="g", member_ids=[world.members[1].id]), metadata=world.md(0)
            )
            sent = await stub.SendMessage(
                im_pb2.SendMessageRequest(group_id=group.group.id, content="do not lose me"),
                metadata=world.md(0),
            )
    finally:
        process.kill()  # SIGKILL: no clean-up of any kind
        process.wait()
    process, address = _serve(env)
    try:
        async with learning_channel(address) as channel:
            stub = im_pb2_grpc.IMServiceStub(channel)
            unread = await stub.GetAllUnread(im_pb2.GetAllUnreadRequest(), metadata=world.md(1))
            assert [m.id for m in unread.messages] == [sent.message.id]
            assert unread.messages[0].content == "do not lose me"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
