"""Fixtures of the fault suite: the faults come with load from a few members,
far past any member's rate limit (those limits have tests of their own), so
the services started here have none."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.conftest import RunningIM, unavailable
from tests.faults.harness import UNLIMITED, PostgresProcess, PostgresUnavailable
from tests.faults.llm import DecidingLLM


@pytest.fixture
async def im(im_factory: Any) -> RunningIM:
    running: RunningIM = await im_factory(**UNLIMITED)
    return running


@pytest.fixture
async def ims(im_factory: Any, redis_url: str) -> tuple[RunningIM, RunningIM]:
    """Two IM replicas on the test's database, signalling through Redis (as deployed)."""
    first: RunningIM = await im_factory(**UNLIMITED, REDIS_URL=redis_url, IM_DB_POOL_SIZE="8")
    second: RunningIM = await im_factory(**UNLIMITED, REDIS_URL=redis_url, IM_DB_POOL_SIZE="8")
    return first, second


@pytest.fixture
async def llm() -> AsyncIterator[DecidingLLM]:
    """The model that decides from the conversation, streaming with a delay
    between chunks so that faults land mid-stream."""
    server = DecidingLLM(delay=0.03)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def private_postgres() -> Iterator[PostgresProcess]:
    """A PostgreSQL cluster of this test's own, to restart (the machine's
    server, shared with others, is never touched)."""
    with PostgresProcess() as server:
        try:
            server.start()
        except PostgresUnavailable as error:
            unavailable(str(error))
        yield server
