"""The runtime as unit tests build it: `bootstrap.build` over the in-memory fakes."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from services.runtime.bootstrap import RuntimeApp, build
from services.runtime.config import Settings
from services.runtime.service_layer.im_port import IMPort
from services.runtime.service_layer.leases import Fences
from services.runtime.service_layer.llm_port import LLM
from services.runtime.service_layer.memory_port import MemoryPort
from services.runtime.service_layer.runners import Runners
from services.runtime.service_layer.store import AgentStore
from tests.unit.runtime_fakes import FakeClock, FakeIM, InMemoryAgentStore, ScriptedLLM

# The defaults, except for what would only make the tests wait: cursors and
# read positions are written at once, a broken-off stream is asked for again
# at once, and a tool's time limit stays short.
UNIT_ENVIRONMENT = {
    "RUNTIME_SERVICE_SECRET": "unit-tests",
    "RUNTIME_CURSOR_SAVE_DELAY_SECONDS": "0",
    "RUNTIME_READ_POSITION_DELAY_SECONDS": "0",
    "LLM_STREAM_CUT_BACKOFF_SECONDS": "0.001",
    "TOOL_TIMEOUT_SECONDS": "5",
}


def unit_settings(**fields: Any) -> Settings:
    """The runtime's settings for unit tests, with `fields` changed."""
    return replace(Settings.from_env(UNIT_ENVIRONMENT), **fields)


def fake_runtime(
    *,
    settings: Settings | None = None,
    store: AgentStore | None = None,
    im: IMPort | None = None,
    llm: LLM | None = None,
    clock: Callable[[], Any] | None = None,
    memory: MemoryPort | None = None,
    runners: Runners | None = None,
    fences: Fences | None = None,
    jitter: Callable[[], float] = random.random,
) -> RuntimeApp:
    """The runtime over fakes (new ones for those not given), without a server."""
    return build(
        settings or unit_settings(),
        store=store if store is not None else InMemoryAgentStore(),
        im=im if im is not None else FakeIM(),
        llm=llm if llm is not None else ScriptedLLM(),
        clock=clock if clock is not None else FakeClock(),
        memory=memory,
        runners=runners,
        fences=fences,
        jitter=jitter,
        serve=False,
    )
