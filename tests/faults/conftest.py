"""Fixtures of the fault suite: the faults come with load from a few members,
far past any member's rate limit (those limits have tests of their own), so
the services started here have none."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import RunningIM
from tests.faults.harness import UNLIMITED


@pytest.fixture
async def im(im_factory: Any) -> RunningIM:
    running: RunningIM = await im_factory(**UNLIMITED)
    return running
