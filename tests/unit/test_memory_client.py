"""The runtime's memory client calls as the agent, never as the runtime itself."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest

from services.common.service_auth import AgentTokens, Issued, ServiceToken, TokenRefused
from services.runtime.adapters.memory_client import GrpcMemory
from services.runtime.domain.errors import MemoryRefused, MemoryUnavailable
from services.runtime.service_layer.memory_port import RecallQuery
from tests.unit.test_event_relay import an_agent

NOW = datetime(2026, 11, 29, tzinfo=UTC)
# Nothing listens there: a call that went out would come back UNAVAILABLE.
NOWHERE = "127.0.0.1:1"


async def _service_token(service: str, secret: str) -> Issued:
    return Issued(token=f"service-{service}", expires_at=NOW.timestamp() + 3600)


async def _refuse_agents(service_token: str, members: Sequence[uuid.UUID]) -> list[Issued]:
    raise TokenRefused("not an agent of this runtime")


@pytest.mark.parametrize(
    ("secret", "refused"),
    [("s3cret", MemoryRefused), (None, MemoryUnavailable)],
    ids=["the IM issues no agent token", "no credential yet"],
)
async def test_without_an_agent_token_nothing_is_sent(secret: str | None, refused: type[Exception]) -> None:
    service = ServiceToken(service="runtime", secret=lambda: secret, issue=_service_token)
    memory = GrpcMemory(
        NOWHERE,
        credentials=service,
        agent_tokens=AgentTokens(issue=_refuse_agents, service=service),
        deadline_seconds=2,
    )
    try:
        with pytest.raises(MemoryRefused) as raised:
            await memory.recall(an_agent(), [], RecallQuery(text="the deploy"))
        # MemoryUnavailable is a MemoryRefused: the type tells them apart.
        assert type(raised.value) is refused, raised.value
        if refused is MemoryRefused:
            assert "no agent token" in str(raised.value)
    finally:
        await memory.aclose()
