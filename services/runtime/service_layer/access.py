"""Who may act on an agent: the caller as a member of a workspace, and the
agents it may see or control (the rules are `domain.access`'s)."""

from __future__ import annotations

import uuid

from services.common.errors import InvalidArgument
from services.common.identity import Caller
from services.common.tokens import PrincipalKind
from services.runtime.domain.access import Action, Verdict, Viewer, decide
from services.runtime.domain.errors import (
    AgentNotFound,
    InvalidAgentRequest,
    NotAllowed,
    NotAuthenticated,
)
from services.runtime.domain.model import Agent
from services.runtime.service_layer.runners import Runners
from services.runtime.service_layer.store import AgentStore


class AgentAccess:
    """Finds the agents a caller may act on. Callers act as IM members of a workspace."""

    def __init__(self, *, store: AgentStore, runners: Runners) -> None:
        self._store = store
        self._runners = runners

    def viewer(self, caller: Caller | None) -> Viewer:
        """The calling member, its workspace and (from its token) its roles."""
        if caller is None:
            raise NotAuthenticated("this call needs the acting member: authorization: Bearer <access token>")
        claims = caller.claims
        if claims.kind is PrincipalKind.SERVICE or claims.member_id is None or claims.workspace_id is None:
            raise NotAllowed("a service acts on no agent of its own: call as a member")
        return Viewer(claims.member_id, claims.workspace_id, frozenset(claims.roles))

    async def visible(self, caller: Caller | None, agent_id: str, action: Action = Action.VIEW) -> Agent:
        """The agent as its runner has it, if the caller may do `action` to it."""
        viewer = self.viewer(caller)
        wanted = parse_id(agent_id, "agent_id")
        # A running agent is its runner's (deleting an agent removes its runner
        # first; its workspace and owner never change): no read for it.
        agent = self._runners.live(wanted) or await self._store.get_agent(wanted)
        verdict = (
            Verdict.HIDDEN
            if agent is None
            else decide(viewer, action, workspace_id=agent.workspace_id, owner_id=agent.owner_id)
        )
        if agent is None or verdict is Verdict.HIDDEN:
            raise AgentNotFound(f"agent {wanted} not found")
        if verdict is Verdict.DENIED:
            raise NotAllowed(
                f"only the agent's owner and the workspace's admins may {action.value} agent {wanted}"
            )
        return agent

    async def controlled(self, caller: Caller | None, agent_id: str) -> Agent:
        """The agent, if the caller may control it, reconfigure it and read its work
        (its owner, the workspace's admins and owner)."""
        return await self.visible(caller, agent_id, Action.CONTROL)

    def workspace(self, caller: Caller | None, workspace_id: str) -> Viewer:
        """The caller, if `workspace_id` (when given) is its workspace."""
        viewer = self.viewer(caller)
        if workspace_id and parse_id(workspace_id, "workspace_id") != viewer.workspace_id:
            raise AgentNotFound(f"workspace {workspace_id} not found")
        return viewer


def parse_id(value: str, field: str, invalid: type[InvalidArgument] = InvalidAgentRequest) -> uuid.UUID:
    """An id the caller sent in `field`; `invalid` if it is none."""
    try:
        return uuid.UUID(value)
    except ValueError:
        raise invalid(f"{field} is not a valid id: {value[:64]!r}") from None
