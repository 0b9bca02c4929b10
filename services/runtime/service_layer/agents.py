"""The runtime's use cases: agents, their runs and steps, and their live events."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from urllib.parse import urlsplit

from uuid_utils.compat import uuid7

from services.common import audit
from services.common.identity import Caller
from services.common.tokens import PrincipalKind
from services.runtime.domain.access import Action, Verdict, Viewer, decide, may_set_endpoint
from services.runtime.domain.errors import (
    AgentNotFound,
    DuplicateAgentRequest,
    HubClosed,
    InvalidAgentRequest,
    NotAllowed,
    NotAuthenticated,
    RequestReused,
    SessionNotFound,
)
from services.runtime.domain.llm import ModelSettings, ToolSpec
from services.runtime.domain.model import (
    Agent,
    Emitted,
    MainSessionChanged,
    Run,
    Session,
    StateChanged,
    Step,
    StepCompleted,
    StepDelta,
    StepsRewritten,
    StepStarted,
    merge_deltas,
)
from services.runtime.service_layer.endpoint_guard import EndpointGuard
from services.runtime.service_layer.hub import AgentHub, InFlight, Watcher
from services.runtime.service_layer.im_port import IMPort
from services.runtime.service_layer.runners import Runners
from services.runtime.service_layer.store import AgentStore
from services.runtime.service_layer.tools import ToolRegistry

logger = logging.getLogger(__name__)

MAX_NAME_CHARS = 200
MAX_PROMPT_CHARS = 100_000
MAX_REQUEST_ID_CHARS = 128  # the width of agent_requests.request_id, and of the IM's request ids
UPDATABLE = {"name", "role", "system_prompt", "model", "tools", "token_budget", "auto_recall"}
MAX_AUTO_RECALL = 20
# A window smaller than this cannot hold a system prompt, a message and an answer.
MIN_CONTEXT_TOKENS = 1024
MAX_CONTEXT_TOKENS = 10_000_000


@dataclass(frozen=True, slots=True)
class AgentDraft:
    """What a caller asks an agent to be."""

    name: str
    role: str = ""
    system_prompt: str = ""
    model: ModelSettings = field(default_factory=ModelSettings)
    tools: tuple[str, ...] = ()
    token_budget: int = 0
    auto_recall: int | None = None


class AgentFactory:
    """Makes agents: checks a draft, creates the agent's IM member, and stores
    the agent with its main session (the same agent again for a repeated
    request_id). Starting its runner is the caller's (`Runners.start_agent`).

    The runners use it for the create_sub_agent tool, and the use cases for
    CreateAgent and ForkFromStep; it needs neither of them.
    """

    def __init__(
        self, *, store: AgentStore, im: IMPort, tools: ToolRegistry, clock: Callable[[], datetime]
    ) -> None:
        self._store = store
        self._im = im
        self._tools = tools
        self._clock = clock

    def check(self, draft: AgentDraft) -> AgentDraft:
        """The draft with its name trimmed; InvalidAgentRequest says what is wrong with it."""
        name = draft.name.strip()
        if not name:
            raise InvalidAgentRequest("name is required")
        if len(name) > MAX_NAME_CHARS or len(draft.role) > MAX_NAME_CHARS:
            raise InvalidAgentRequest(f"name and role are limited to {MAX_NAME_CHARS} characters")
        if len(draft.system_prompt) > MAX_PROMPT_CHARS:
            raise InvalidAgentRequest(
                f"system_prompt is {len(draft.system_prompt)} characters; the limit is {MAX_PROMPT_CHARS}"
            )
        unknown = self._tools.unknown(draft.tools)
        if unknown:
            raise InvalidAgentRequest(f"unknown tools: {unknown}; known: {self._tools.names}")
        model = draft.model
        if model.temperature is not None and not 0 <= model.temperature <= 2:
            raise InvalidAgentRequest(f"model.temperature must be between 0 and 2, got {model.temperature}")
        if model.max_tokens is not None and model.max_tokens <= 0:
            raise InvalidAgentRequest(f"model.max_tokens must be positive, got {model.max_tokens}")
        if (
            model.context_tokens is not None
            and not MIN_CONTEXT_TOKENS <= model.context_tokens <= MAX_CONTEXT_TOKENS
        ):
            raise InvalidAgentRequest(
                f"model.context_tokens must be from {MIN_CONTEXT_TOKENS} to {MAX_CONTEXT_TOKENS},"
                f" got {model.context_tokens}"
            )
        if model.context_tokens and model.max_tokens and model.max_tokens > model.context_tokens // 2:
            raise InvalidAgentRequest(
                f"model.max_tokens ({model.max_tokens}) must leave room for the context: at most half"
                f" of model.context_tokens ({model.context_tokens})"
            )
        if model.base_url and not model.base_url.startswith(("http://", "https://")):
            raise InvalidAgentRequest(f"model.base_url must be an http(s) URL, got {model.base_url[:100]!r}")
        if draft.token_budget < 0:
            raise InvalidAgentRequest("token_budget must not be negative")
        if draft.auto_recall is not None and not 0 <= draft.auto_recall <= MAX_AUTO_RECALL:
            raise InvalidAgentRequest(
                f"auto_recall must be from 0 to {MAX_AUTO_RECALL}, got {draft.auto_recall}"
            )
        return replace(draft, name=name)

    async def create_child(
        self, parent: Agent, name: str, role: str, system_prompt: str, request_id: str = ""
    ) -> Agent:
        """The create_sub_agent tool: a child with its parent's model and tools
        (the same child again for a repeated request_id)."""
        draft = self.check(
            AgentDraft(
                name=name, role=role, system_prompt=system_prompt, model=parent.model, tools=parent.tools
            )
        )
        return await self.create(
            parent.member_id,
            parent.workspace_id,
            draft,
            parent=parent,
            request_id=request_id,
            owner=parent.owner_id,
            # The parent agent's create_sub_agent tool.
            actor=audit.Actor(audit.ActorKind.AGENT, member_id=parent.member_id),
            action="CreateAgent",
        )

    async def create(
        self,
        caller: uuid.UUID,
        workspace: uuid.UUID,
        draft: AgentDraft,
        *,
        parent: Agent | None,
        request_id: str,
        owner: uuid.UUID | None,
        actor: audit.Actor,
        action: str,
        details: dict[str, str] | None = None,
    ) -> Agent:
        """Creates the agent's IM member and stores the agent, with its main
        session; the agent already made for a repeated `request_id`."""
        fingerprint = hashlib.sha256(
            json.dumps([str(workspace), repr(draft), str(parent.id if parent else "")]).encode()
        ).hexdigest()
        if request_id:
            found = await self._store.find_request(caller, request_id)
            if found is not None:
                return await self._replayed(found, fingerprint, request_id)
        member = await self._im.create_agent_member(
            workspace, draft.name, request_id=_member_request_id(request_id), owner_id=owner
        )
        now = self._clock()
        agent = Agent(
            id=uuid7(),
            workspace_id=workspace,
            member_id=member.id,
            name=draft.name,
            role=draft.role,
            system_prompt=draft.system_prompt,
            model=draft.model,
            tools=draft.tools,
            parent_id=parent.id if parent else None,
            created_at=now,
            updated_at=now,
            token_budget=draft.token_budget,
            auto_recall=draft.auto_recall,
            session_id=uuid7(),
            owner_id=owner,
        )
        record = audit.succeeded(
            None,
            actor=actor,
            workspace_id=workspace,
            action=action,
            target=audit.Target("agent", str(agent.id)),
            at=now,
            request_id=request_id,
            details={
                "name": agent.name,
                **({"parent_id": str(parent.id)} if parent else {}),
                **(details or {}),
                **_model_facts(agent.model),
            },
        )
        try:
            await self._store.add_agent(
                agent, request=(caller, request_id, fingerprint) if request_id else None, audit=record
            )
        except DuplicateAgentRequest:
            found = await self._store.find_request(caller, request_id)
            assert found is not None
            return await self._replayed(found, fingerprint, request_id)
        # Its main session; stored after the agent, which a replay returns without this.
        await self._store.add_session(Session(id=agent.session_id, agent_id=agent.id, created_at=now))
        return agent

    async def _replayed(self, found: tuple[str, uuid.UUID], fingerprint: str, request_id: str) -> Agent:
        used, agent_id = found
        if used != fingerprint:
            raise RequestReused(f"request_id {request_id!r} was already used for a different agent")
        agent = await self._store.get_agent(agent_id)
        if agent is None:
            raise AgentNotFound(f"agent {agent_id} not found")
        return agent


class AgentService:
    """Agents' lifecycle and views. Callers act as IM members of a workspace."""

    def __init__(
        self,
        *,
        store: AgentStore,
        im: IMPort,
        factory: AgentFactory,
        runners: Runners,
        hub: AgentHub,
        tools: ToolRegistry,
        clock: Callable[[], datetime],
        endpoints: EndpointGuard | None = None,
        max_page_size: int = 200,
        audit_log: audit.AuditLog | None = None,
    ) -> None:
        self._audit_log = audit_log
        self._store = store
        self._endpoints = endpoints
        self._im = im
        self._factory = factory
        self._runners = runners
        self._hub = hub
        self._tools = tools
        self._clock = clock
        self._max_page = max_page_size

    # -- identity -----------------------------------------------------------

    async def _viewer(self, caller: Caller | None) -> Viewer:
        """The calling member, its workspace and (from its token) its roles."""
        if caller is None:
            raise NotAuthenticated("this call needs the acting member: authorization: Bearer <access token>")
        claims = caller.claims
        if claims.kind is PrincipalKind.SERVICE or claims.member_id is None or claims.workspace_id is None:
            raise NotAllowed("a service acts on no agent of its own: call as a member")
        return Viewer(claims.member_id, claims.workspace_id, frozenset(claims.roles))

    async def _visible(self, caller: Caller | None, agent_id: str, action: Action = Action.VIEW) -> Agent:
        """The agent as its runner has it, if the caller may do `action` to it."""
        viewer = await self._viewer(caller)
        wanted = _parse_id(agent_id, "agent_id")
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
        return await self._visible(caller, agent_id, Action.CONTROL)

    async def _check_endpoint(self, viewer: Viewer, base_url: str) -> None:
        """May the caller point an agent's model requests at `base_url`?"""
        if not may_set_endpoint(viewer):
            raise NotAllowed("only the workspace's admins and owner set an agent's model.base_url")
        if self._endpoints is not None and base_url:
            await self._endpoints.check(base_url)

    # -- agents -------------------------------------------------------------

    async def create_agent(
        self,
        principal: Caller | None,
        draft: AgentDraft,
        *,
        workspace_id: str = "",
        parent_id: str = "",
        request_id: str = "",
    ) -> Agent:
        viewer = await self._viewer(principal)
        workspace = viewer.workspace_id
        if workspace_id and _parse_id(workspace_id, "workspace_id") != workspace:
            raise AgentNotFound(f"workspace {workspace_id} not found")
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidAgentRequest(f"request_id is limited to {MAX_REQUEST_ID_CHARS} characters")
        parent: Agent | None = await self._visible(principal, parent_id) if parent_id else None
        checked = self._factory.check(draft)
        if checked.model.base_url:
            await self._check_endpoint(viewer, checked.model.base_url)
        agent = await self._factory.create(
            viewer.member_id,
            workspace,
            checked,
            parent=parent,
            request_id=request_id,
            owner=viewer.member_id,
            actor=audit.actor_of(principal),
            action="CreateAgent",
        )
        self._runners.start_agent(agent)
        return agent

    async def create_clone(self, caller: Caller | None, source: Agent, draft: AgentDraft) -> Agent:
        """A fork of `source` into a new agent: its parent and its owner are `source`'s."""
        viewer = await self._viewer(caller)
        parent = await self._store.get_agent(source.parent_id) if source.parent_id else None
        agent = await self._factory.create(
            viewer.member_id,
            source.workspace_id,
            self._factory.check(draft),
            parent=parent,
            request_id="",
            owner=source.owner_id,
            actor=audit.actor_of(caller),
            action="ForkFromStep",
            details={"forked_from": str(source.id)},
        )
        self._runners.start_agent(agent)
        return agent

    async def get_agent(self, principal: Caller | None, agent_id: str) -> Agent:
        return await self._visible(principal, agent_id)

    async def list_tools(self, principal: Caller | None) -> list[ToolSpec]:
        """Every tool an agent may be given, for a member choosing them."""
        await self._viewer(principal)
        return self._tools.specs(())

    async def list_agents(
        self, principal: Caller | None, *, page_size: int, page_token: str, parent_id: str
    ) -> tuple[list[Agent], str]:
        workspace = (await self._viewer(principal)).workspace_id
        limit = self._limit(page_size)
        after = _parse_id(page_token, "page_token") if page_token else None
        parent = _parse_id(parent_id, "parent_id") if parent_id else None
        agents = await self._store.list_agents(workspace, parent_id=parent, after=after, limit=limit + 1)
        live = [self._live(a) for a in agents[:limit]]
        return live, str(agents[limit - 1].id) if len(agents) > limit else ""

    def _live(self, agent: Agent) -> Agent:
        return self._runners.live(agent.id) or agent

    async def update_agent(
        self,
        principal: Caller | None,
        agent_id: str,
        draft: AgentDraft,
        fields: Sequence[str],
        *,
        action: str = "UpdateAgent",
        details: dict[str, str] | None = None,
    ) -> Agent:
        """Changes the agent's settings named in `fields`; recorded in the audit
        log as `action` (RestoreCheckpoint brings settings back through here)."""
        agent = await self.controlled(principal, agent_id)
        unknown = set(fields) - UPDATABLE
        if unknown or not fields:
            raise InvalidAgentRequest(
                f"update_mask must name some of {sorted(UPDATABLE)}; got {sorted(fields)}"
            )
        merged = AgentDraft(
            name=draft.name if "name" in fields else agent.name,
            role=draft.role if "role" in fields else agent.role,
            system_prompt=draft.system_prompt if "system_prompt" in fields else agent.system_prompt,
            model=draft.model if "model" in fields else agent.model,
            tools=draft.tools if "tools" in fields else agent.tools,
            token_budget=draft.token_budget if "token_budget" in fields else agent.token_budget,
            auto_recall=draft.auto_recall if "auto_recall" in fields else agent.auto_recall,
        )
        merged = self._factory.check(merged)
        if merged.model.base_url != agent.model.base_url:
            await self._check_endpoint(await self._viewer(principal), merged.model.base_url)
        if merged.name != agent.name:
            await self._im.rename_member(agent.member_id, merged.name)
        updated = replace(
            agent,
            name=merged.name,
            role=merged.role,
            system_prompt=merged.system_prompt,
            model=merged.model,
            tools=merged.tools,
            token_budget=merged.token_budget,
            auto_recall=merged.auto_recall,
            updated_at=self._clock(),
        )
        changed = _changed_fields(agent, updated)
        record = self.audit_record(
            principal,
            updated,
            action,
            details={
                "fields": ",".join(sorted(set(fields))),
                "changed": ",".join(changed),
                **(_model_facts(updated.model) if "model" in changed else {}),
                **(details or {}),
            },
        )
        await self._store.update_agent(updated, audit=record)
        return self._runners.update(updated) or updated

    async def delete_agent(self, principal: Caller | None, agent_id: str) -> None:
        agent = await self.controlled(principal, agent_id)
        await self._runners.stop_agent(agent.id)
        await self._store.delete_agent(agent.id, audit=self.audit_record(principal, agent, "DeleteAgent"))

    async def tell_owners(self) -> int:
        """Tells the IM who owns each agent this runtime hosts (for agents made
        before the IM knew owners); idempotent. Returns how many the IM changed."""
        owners = {a.member_id: a.owner_id for a in await self._store.all_agents() if a.owner_id is not None}
        return await self._im.set_agent_owners(owners) if owners else 0

    # -- the audit log ----------------------------------------------------------

    async def recorded(
        self,
        principal: Caller | None,
        agent: Agent,
        action: str,
        *,
        target: audit.Target | None = None,
        details: dict[str, str] | None = None,
    ) -> None:
        """Records an action applied outside the store's transactions (by the
        agent's runner): right after it took effect."""
        await self._store.record_audit(
            self.audit_record(principal, agent, action, target=target, details=details)
        )

    def audit_record(
        self,
        principal: Caller | None,
        agent: Agent,
        action: str,
        *,
        target: audit.Target | None = None,
        request_id: str = "",
        details: dict[str, str] | None = None,
    ) -> audit.AuditRecord:
        """The record of an action on `agent`, for a store change that takes it."""
        return audit.succeeded(
            principal,
            workspace_id=agent.workspace_id,
            action=action,
            target=target or audit.Target("agent", str(agent.id)),
            at=self._clock(),
            request_id=request_id,
            details=details,
        )

    async def list_audit_events(
        self, principal: Caller | None, query: audit.AuditQuery, *, page_size: int, page_token: str
    ) -> tuple[list[audit.AuditRecord], str]:
        """The runtime's audit records of the caller's workspace, newest first
        (its owner and admins only)."""
        viewer = await self._viewer(principal)
        if viewer.roles is None or not audit.ADMIN_ROLES & viewer.roles:
            raise NotAllowed("only the workspace's owner and admins read its audit log")
        if self._audit_log is None:
            return [], ""
        return await audit.list_page(
            self._audit_log, viewer.workspace_id, query, page_token=page_token, size=page_size
        )

    # -- runs and steps -------------------------------------------------------

    async def list_runs(
        self, principal: Caller | None, agent_id: str, *, page_size: int, page_token: str
    ) -> tuple[list[Run], str]:
        agent = await self.controlled(principal, agent_id)
        limit = self._limit(page_size)
        before = _parse_id(page_token, "page_token") if page_token else None
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
        agent = await self.controlled(principal, agent_id)
        if after_sequence < 0:
            raise InvalidAgentRequest("after_sequence must not be negative")
        limit = self._limit(page_size)
        run = _parse_id(run_id, "run_id") if run_id else None
        session = agent.session_id
        if session_id:
            session = _parse_id(session_id, "session_id")
            found = await self._store.get_session(session)
            if session != agent.session_id and (found is None or found.agent_id != agent.id):
                raise SessionNotFound(f"session {session} of agent {agent.id} not found")
        steps = await self._store.list_steps(
            session, after_sequence=after_sequence, limit=limit + 1, run_id=run
        )
        return steps[:limit], len(steps) > limit

    async def watch_agent(
        self, principal: Caller | None, agent_id: str, *, after_sequence: int, live_only: bool
    ) -> AsyncGenerator[Emitted, None]:
        """Snapshots of the steps after `after_sequence`, the step in flight so far, then live events."""
        agent = await self.controlled(principal, agent_id)
        if after_sequence < 0:
            raise InvalidAgentRequest("after_sequence must not be negative")
        watcher, flights = self._hub.watch([agent.id])
        return self._replay_then_live(agent, watcher, flights, after_sequence, live_only)

    async def _replay_then_live(
        self, agent: Agent, watcher: Watcher, flights: list[InFlight], after_sequence: int, live_only: bool
    ) -> AsyncGenerator[Emitted, None]:
        sent = after_sequence
        # The last step this watch delivered whole: where its client resumes.
        whole = after_sequence
        events = watcher.events()
        try:
            if not live_only:
                while True:
                    page = await self._store.list_steps(agent.session_id, after_sequence=sent, limit=500)
                    for step in page:
                        yield Emitted(agent.id, step.created_at, StepCompleted(step))
                        sent = whole = step.sequence
                    if len(page) < 500:
                        break
            for flight in flights:
                started = flight.started.event
                assert isinstance(started, StepStarted)
                if started.sequence > sent:
                    yield flight.started
                    for delta in merge_deltas(flight.deltas):
                        yield delta
            async for emitted in events:
                event = emitted.event
                # Steps rewritten (retry, restore) or another main session:
                # the steps to come are numbered from there, not after `sent`.
                if isinstance(event, StepsRewritten):
                    sent = min(sent, event.after_sequence)
                    whole = min(whole, event.after_sequence)
                elif isinstance(event, MainSessionChanged):
                    sent = whole = event.session.forked_at_sequence
                if isinstance(event, StepCompleted) and event.step.sequence <= sent:
                    continue
                if isinstance(event, StepDelta | StepStarted) and event.sequence <= sent:
                    continue
                yield emitted
                if isinstance(event, StepCompleted):
                    whole = event.step.sequence
        except HubClosed:
            raise HubClosed(
                f"the runtime is shutting down; watch again with after_sequence={whole} to resume"
                " with nothing missed"
            ) from None
        finally:
            await events.aclose()

    async def watch_agents(
        self, principal: Caller | None, *, agent_ids: Sequence[str], workspace_id: str
    ) -> AsyncGenerator[Emitted, None]:
        """Live events of some agents, or of the workspace's: all of them for
        the agents the caller controls, the changes of state for the others."""
        viewer = await self._viewer(principal)
        workspace = viewer.workspace_id
        if workspace_id and _parse_id(workspace_id, "workspace_id") != workspace:
            raise AgentNotFound(f"workspace {workspace_id} not found")
        if agent_ids:
            ids = [(await self._visible(principal, a)).id for a in agent_ids]
            watcher, _ = self._hub.watch(ids)
        else:
            watcher, _ = self._hub.watch(None)
        return self._filtered(watcher.events(), viewer)

    async def _filtered(
        self, events: AsyncIterator[Emitted], viewer: Viewer
    ) -> AsyncGenerator[Emitted, None]:
        try:
            async for emitted in events:
                agent = self._runners.live(emitted.agent_id)
                if agent is None:
                    continue
                verdict = decide(
                    viewer, Action.CONTROL, workspace_id=agent.workspace_id, owner_id=agent.owner_id
                )
                if verdict is Verdict.ALLOWED or (
                    verdict is Verdict.DENIED and isinstance(emitted.event, StateChanged)
                ):
                    yield emitted
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    def _limit(self, page_size: int) -> int:
        if page_size < 0:
            raise InvalidAgentRequest("page_size must not be negative")
        return min(page_size or 50, self._max_page)


def _parse_id(value: str, field: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidAgentRequest(f"{field} is not a valid id: {value[:64]!r}") from None


def _model_facts(model: ModelSettings) -> dict[str, str]:
    """What the audit log keeps of a model's settings: its name and endpoint's
    host (never the rest of the URL, which may carry credentials)."""
    facts = {"model": model.model} if model.model else {}
    if model.base_url:
        facts["base_url_host"] = urlsplit(model.base_url).hostname or ""
    return facts


def _changed_fields(before: Agent, after: Agent) -> list[str]:
    """The settings that differ (by name, never by value: a prompt may be long or private)."""
    names = ("name", "role", "system_prompt", "model", "tools", "token_budget", "auto_recall")
    return [n for n in names if getattr(before, n) != getattr(after, n)]


def _member_request_id(request_id: str) -> str:
    """The request_id of the agent's IM member: the agent's, marked, within the IM's width."""
    if not request_id:
        return ""
    marked = f"agent:{request_id}"
    if len(marked) <= MAX_REQUEST_ID_CHARS:
        return marked
    # Too long once marked: its digest, as unique and as stable.
    return f"agent#{hashlib.sha256(request_id.encode()).hexdigest()}"
