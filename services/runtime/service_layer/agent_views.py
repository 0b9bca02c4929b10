"""The reads of agents: GetAgent, ListAgents, ListTools, ListRuns, ListSteps
and ListAuditEvents. They change nothing, so they are no commands: the
servicer calls them directly (the changes are `handlers.agents`')."""

from __future__ import annotations

from services.common import audit
from services.common.identity import Caller
from services.runtime.domain.errors import InvalidAgentRequest, NotAllowed, SessionNotFound
from services.runtime.domain.llm import ToolSpec
from services.runtime.domain.model import Agent, Run, Step
from services.runtime.service_layer.access import AgentAccess, parse_id
from services.runtime.service_layer.runners import Runners
from services.runtime.service_layer.store import AgentStore
from services.runtime.service_layer.tools import ToolRegistry


class AgentViews:
    """Agents, their runs and steps, as a caller may see them.

    Args:
        max_page_size: the largest page of a list.
        audit_log: the runtime's audit log (None: ListAuditEvents finds nothing).
    """

    def __init__(
        self,
        *,
        store: AgentStore,
        runners: Runners,
        access: AgentAccess,
        tools: ToolRegistry,
        max_page_size: int = 200,
        audit_log: audit.AuditLog | None = None,
    ) -> None:
        self._store = store
        self._runners = runners
        self._access = access
        self._tools = tools
        self._max_page = max_page_size
        self._audit_log = audit_log

    async def get_agent(self, principal: Caller | None, agent_id: str) -> Agent:
        return await self._access.visible(principal, agent_id)

    def replica_of(self, agent: Agent) -> str:
        """The runtime replica that runs the agent now, as this one last saw
        the leases; empty where one runtime runs every agent, or while the
        agent's shard is moving."""
        return self._runners.replica_of(agent)

    async def list_tools(self, principal: Caller | None) -> list[ToolSpec]:
        """Every tool an agent may be given, for a member choosing them."""
        self._access.viewer(principal)
        return self._tools.specs(())

    async def list_agents(
        self, principal: Caller | None, *, page_size: int, page_token: str, parent_id: str
    ) -> tuple[list[Agent], str]:
        workspace = self._access.viewer(principal).workspace_id
        limit = self._limit(page_size)
        after = parse_id(page_token, "page_token") if page_token else None
        parent = parse_id(parent_id, "parent_id") if parent_id else None
        agents = await self._store.list_agents(workspace, parent_id=parent, after=after, limit=limit + 1)
        live = [self._runners.live(a.id) or a for a in agents[:limit]]
        return live, str(agents[limit - 1].id) if len(agents) > limit else ""

    async def list_audit_events(
        self, principal: Caller | None, query: audit.AuditQuery, *, page_size: int, page_token: str
    ) -> tuple[list[audit.AuditRecord], str]:
        """The runtime's audit records of the caller's workspace, newest first
        (its owner and admins only)."""
        viewer = self._access.viewer(principal)
        if viewer.roles is None or not audit.ADMIN_ROLES & viewer.roles:
            raise NotAllowed("only the workspace's owner and admins read its audit log")
        if self._audit_log is None:
            return [], ""
        return await audit.list_page(
            self._audit_log, viewer.workspace_id, query, page_token=page_token, size=page_size
        )

    async def list_runs(
        self, principal: Caller | None, agent_id: str, *, page_size: int, page_token: str
    ) -> tuple[list[Run], str]:
        agent = await self._access.controlled(principal, agent_id)
        limit = self._limit(page_size)
        before = parse_id(page_token, "page_token") if page_token else None
        runs = await self._store.list_runs(agent.id, before=before, limit=limit + 1)
        return runs[:limit], str(runs[limit - 1].id) if len(runs) > limit else ""

    async def list_steps(
        self,
        principal: Caller | None,
        agent_id: str,
        *,
        after_sequence: int,
        page_size: int,
        run_id: str,
        session_id: str = "",
    ) -> tuple[list[Step], bool]:
        """Steps of the agent's main session, or of `session_id` (one of its sessions)."""
        agent = await self._access.controlled(principal, agent_id)
        if after_sequence < 0:
            raise InvalidAgentRequest("after_sequence must not be negative")
        limit = self._limit(page_size)
        run = parse_id(run_id, "run_id") if run_id else None
        session = agent.session_id
        if session_id:
            session = parse_id(session_id, "session_id")
            found = await self._store.get_session(session)
            if session != agent.session_id and (found is None or found.agent_id != agent.id):
                raise SessionNotFound(f"session {session} of agent {agent.id} not found")
        steps = await self._store.list_steps(
            session, after_sequence=after_sequence, limit=limit + 1, run_id=run
        )
        return steps[:limit], len(steps) > limit

    def _limit(self, page_size: int) -> int:
        if page_size < 0:
            raise InvalidAgentRequest("page_size must not be negative")
        return min(page_size or 50, self._max_page)
