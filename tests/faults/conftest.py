"""Fixtures of the fault suite: the faults come with load from a few members,
far past any member's rate limit (those limits have tests of their own), so
the services started here have none."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import RunningIM
from tests.faults.harness import UNLIMITED
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
