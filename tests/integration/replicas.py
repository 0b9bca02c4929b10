"""Runtime replicas started in this process for a test: on the test's own
PostgreSQL database and a Redis, with short leases so that tests see shards
move within seconds."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from agentim.runtime.v1 import runtime_pb2_grpc
from services.runtime import bootstrap
from services.runtime.config import Settings
from tests.auth_support import service_environment
from tests.conftest import RunningIM
from tests.identities import learning_channel
from tests.integration.test_runtime_grpc import RunningRuntime, stop_runtime

WAIT = 15.0
SHARDS = 16
TAG = uuid.uuid4().hex[:8]


Replicas = Callable[..., Awaitable[RunningRuntime]]


@pytest.fixture
async def replicas(im: RunningIM, own_runtime_url: str, redis_url: str) -> AsyncIterator[Replicas]:
    if own_runtime_url.startswith("sqlite"):
        pytest.skip("replicas share a PostgreSQL database; SQLite is one process's")
    started: list[RunningRuntime] = []

    async def start(name: str, *, redis: str = redis_url, **settings: str) -> RunningRuntime:
        environ = {
            "RUNTIME_DATABASE_URL": own_runtime_url,
            "REDIS_URL": redis,
            "RUNTIME_RECONCILE_SECONDS": "0.5",
            "RUNTIME_GRPC_ADDRESS": "127.0.0.1:0",
            "IM_ADDRESS": im.address,
            "LOG_LEVEL": "WARNING",
            # Unique on the shared Redis (other tests' replicas listen there too).
            "RUNTIME_REPLICA_ID": f"{name}-{TAG}",
            "RUNTIME_SHARDS": str(SHARDS),
            # Renewed often, so that shards move within a second; long-lived
            # (as by default), so that a busy test process (every replica
            # shares its event loop) does not lose them to a late renewal.
            "RUNTIME_LEASE_TTL_SECONDS": "10",
            "RUNTIME_LEASE_RENEW_SECONDS": "0.2",
            "RUNTIME_LEASE_MARGIN_SECONDS": "2",
            **settings,  # a test's own settings over the defaults above
            **service_environment(),
        }
        app = bootstrap.build(Settings.from_env(environ))
        port, _ = await app.start()
        channel = learning_channel(f"127.0.0.1:{port}")
        running = RunningRuntime(app, channel, runtime_pb2_grpc.RuntimeServiceStub(channel))
        started.append(running)
        return running

    yield start
    for running in reversed(started):
        await stop_runtime(running)
