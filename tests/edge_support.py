"""Servers for the edge tests: an IM and a runtime on one database of each kind,
and raw calls that send bytes no generated client would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from agentim.runtime.v1 import runtime_pb2_grpc
from services.runtime import bootstrap as runtime_bootstrap
from services.runtime.config import Settings as RuntimeSettings
from tests.auth_support import service_environment
from tests.conftest import RunningIM
from tests.identities import learning_channel
from tests.integration.test_runtime_grpc import RunningRuntime

__all__ = ["RawReply", "call_raw", "runtime_on", "start_runtime_on"]


async def start_runtime_on(im_address: str, url: str, **overrides: str) -> RunningRuntime:
    """A runtime on a migrated database (SQLite or PostgreSQL), on a free port."""
    environ = {
        "RUNTIME_DATABASE_URL": url,
        "RUNTIME_GRPC_ADDRESS": "127.0.0.1:0",
        "IM_ADDRESS": im_address,
        "LOG_LEVEL": "WARNING",
        **service_environment(),
        **overrides,
    }
    app = runtime_bootstrap.build(RuntimeSettings.from_env(environ))
    port, _ = await app.start()
    channel = learning_channel(f"127.0.0.1:{port}")
    return RunningRuntime(app, channel, runtime_pb2_grpc.RuntimeServiceStub(channel))


@pytest.fixture
async def runtime_on(im: RunningIM, runtime_url: str, tmp_path: Path) -> AsyncIterator[RunningRuntime]:
    """A runtime on the test's kind of database, with the test's IM."""
    running = await start_runtime_on(im.address, runtime_url)
    yield running
    await running.channel.close()
    await running.app.stop()


@dataclass(frozen=True)
class RawReply:
    code: grpc.StatusCode
    details: str


async def call_raw(
    channel: grpc.aio.Channel,
    method: str,
    payload: bytes,
    metadata: tuple[tuple[str, str], ...] = (),
    *,
    streaming: bool = False,
    deadline_seconds: float = 10.0,
) -> RawReply:
    """Sends `payload` as the request bytes of `method` (`/pkg.Service/Rpc`); its status.

    A unary call's response is dropped: the status is what the tests look
    at. A stream that opens (its headers arrive and it goes on) is OK and is
    cancelled at once.
    """
    if streaming:
        stream = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        call = stream(payload, metadata=metadata, timeout=deadline_seconds)
        await call.initial_metadata()
        # A refusal ends the call with its headers; give its status a moment to land.
        await asyncio.sleep(0.01)
        if call.done():
            return RawReply(await call.code(), await call.details() or "")
        call.cancel()
        return RawReply(grpc.StatusCode.OK, "")
    unary = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        await unary(payload, metadata=metadata, timeout=deadline_seconds)
    except grpc.aio.AioRpcError as error:
        return RawReply(error.code(), error.details() or "")
    return RawReply(grpc.StatusCode.OK, "")
