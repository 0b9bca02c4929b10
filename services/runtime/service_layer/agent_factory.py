"""Making agents: a draft checked, the agent's IM member created, the agent
stored with its main session (the same agent again for a repeated request_id).

The limits of what a draft may ask for are here, in one place.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from urllib.parse import urlsplit

from uuid_utils.compat import uuid7

from services.common import audit
from services.runtime.domain.errors import (
    AgentNotFound,
    DuplicateAgentRequest,
    InvalidAgentRequest,
    RequestReused,
)
from services.runtime.domain.llm import ModelSettings
from services.runtime.domain.model import Agent, AgentDraft, Session
from services.runtime.service_layer.im_port import IMPort
from services.runtime.service_layer.store import AgentStore
from services.runtime.service_layer.tools import ToolRegistry

MAX_NAME_CHARS = 200
MAX_PROMPT_CHARS = 100_000
MAX_REQUEST_ID_CHARS = 128  # the width of agent_requests.request_id, and of the IM's request ids
MAX_AUTO_RECALL = 20
# A window smaller than this cannot hold a system prompt, a message and an answer.
MIN_CONTEXT_TOKENS = 1024
MAX_CONTEXT_TOKENS = 10_000_000


class AgentFactory:
    """Makes agents: checks a draft, creates the agent's IM member, and stores
    the agent with its main session (the same agent again for a repeated
    request_id). Starting its runner is the caller's (`Runners.start_agent`).

    The runners use it for the create_sub_agent tool, and the handlers for
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
                **model_facts(agent.model),
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


def model_facts(model: ModelSettings) -> dict[str, str]:
    """What the audit log keeps of a model's settings: its name and endpoint's
    host (never the rest of the URL, which may carry credentials)."""
    facts = {"model": model.model} if model.model else {}
    if model.base_url:
        facts["base_url_host"] = urlsplit(model.base_url).hostname or ""
    return facts


def _member_request_id(request_id: str) -> str:
    """The request_id of the agent's IM member: the agent's, marked, within the IM's width."""
    if not request_id:
        return ""
    marked = f"agent:{request_id}"
    if len(marked) <= MAX_REQUEST_ID_CHARS:
        return marked
    # Too long once marked: its digest, as unique and as stable.
    return f"agent#{hashlib.sha256(request_id.encode()).hexdigest()}"
