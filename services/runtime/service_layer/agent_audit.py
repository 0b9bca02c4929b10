"""The audit records of what callers do to agents."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from services.common import audit
from services.common.identity import Caller
from services.runtime.domain.model import Agent
from services.runtime.service_layer.store import AgentStore


class AgentAudit:
    """Makes the audit record of an action on an agent, and writes those that
    no store change carries."""

    def __init__(self, *, store: AgentStore, clock: Callable[[], datetime]) -> None:
        self._store = store
        self._clock = clock

    def record(
        self,
        caller: Caller | None,
        agent: Agent,
        action: str,
        *,
        target: audit.Target | None = None,
        request_id: str = "",
        details: dict[str, str] | None = None,
    ) -> audit.AuditRecord:
        """The record of an action on `agent`, for a store change that takes it."""
        return audit.succeeded(
            caller,
            workspace_id=agent.workspace_id,
            action=action,
            target=target or audit.Target("agent", str(agent.id)),
            at=self._clock(),
            request_id=request_id,
            details=details,
        )

    async def write(
        self,
        caller: Caller | None,
        agent: Agent,
        action: str,
        *,
        target: audit.Target | None = None,
        details: dict[str, str] | None = None,
    ) -> None:
        """Records an action applied outside the store's transactions (by the
        agent's runner): right after it took effect."""
        await self._store.record_audit(self.record(caller, agent, action, target=target, details=details))
