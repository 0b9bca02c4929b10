"""The reads of an agent's history: ListCheckpoints and ListSessions (the
changes are `handlers.history`')."""

from __future__ import annotations

from services.common.identity import Caller
from services.runtime.domain.errors import InvalidHistoryRequest
from services.runtime.domain.model import Agent, Checkpoint, Session
from services.runtime.service_layer.access import AgentAccess, parse_id
from services.runtime.service_layer.store import AgentStore


class HistoryViews:
    """An agent's checkpoints and sessions, as a caller who controls it sees them.

    Args:
        max_page_size: the largest page of ListCheckpoints.
    """

    def __init__(self, *, store: AgentStore, access: AgentAccess, max_page_size: int = 200) -> None:
        self._store = store
        self._access = access
        self._max_page = max_page_size

    async def list_checkpoints(
        self, principal: Caller | None, agent_id: str, *, page_size: int, page_token: str
    ) -> tuple[list[Checkpoint], str]:
        """Newest first; the token is the last checkpoint's id."""
        agent = await self._access.controlled(principal, agent_id)
        if page_size < 0:
            raise InvalidHistoryRequest("page_size must not be negative")
        limit = min(page_size or 50, self._max_page)
        before = parse_id(page_token, "page_token", InvalidHistoryRequest) if page_token else None
        found = await self._store.list_checkpoints(agent.id, before=before, limit=limit + 1)
        return found[:limit], str(found[limit - 1].id) if len(found) > limit else ""

    async def list_sessions(
        self, principal: Caller | None, agent_id: str
    ) -> tuple[Agent, list[tuple[Session, int]]]:
        """The agent and its sessions, oldest first, with their step counts."""
        agent = await self._access.controlled(principal, agent_id)
        found = await self._store.list_sessions(agent.id)
        if all(s.id != agent.session_id for s, _ in found):
            # An agent stored without its session row (not made by CreateAgent).
            await self._store.add_session(
                Session(id=agent.session_id, agent_id=agent.id, created_at=agent.created_at)
            )
            found = await self._store.list_sessions(agent.id)
        return agent, found
