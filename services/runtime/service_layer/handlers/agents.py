"""The agent RPCs that change something: CreateAgent, UpdateAgent, DeleteAgent,
and the owners the runtime tells the IM at start-up.

Restoring a checkpoint changes the settings as UpdateAgent does
(`change_settings`), and a fork into a new agent makes it as CreateAgent
does (`create_clone`): the history handlers call those two.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from datetime import datetime
from functools import partial
from typing import Any

from services.common import audit
from services.common.identity import Caller
from services.runtime.domain.access import Viewer, may_set_endpoint
from services.runtime.domain.commands import CreateAgent, DeleteAgent, TellAgentOwners, UpdateAgent
from services.runtime.domain.errors import InvalidAgentRequest, NotAllowed
from services.runtime.domain.model import Agent, AgentDraft
from services.runtime.service_layer.access import AgentAccess
from services.runtime.service_layer.agent_audit import AgentAudit
from services.runtime.service_layer.agent_factory import MAX_REQUEST_ID_CHARS, AgentFactory, model_facts
from services.runtime.service_layer.endpoint_guard import EndpointGuard
from services.runtime.service_layer.im_port import IMPort
from services.runtime.service_layer.messagebus import Handler
from services.runtime.service_layer.runners import Runners
from services.runtime.service_layer.store import AgentStore

# The settings UpdateAgent's update_mask may name: all of a draft's.
UPDATABLE = frozenset(f.name for f in fields(AgentDraft))


@dataclass(frozen=True)
class Agents:
    """What the agent handlers use.

    Args:
        endpoints: checks the model endpoints callers set (None: any).
    """

    store: AgentStore
    im: IMPort
    factory: AgentFactory
    runners: Runners
    access: AgentAccess
    audit: AgentAudit
    clock: Callable[[], datetime]
    endpoints: EndpointGuard | None = None


async def create_agent(command: CreateAgent, deps: Agents) -> Agent:
    """Makes the agent (or finds the one made for the request_id) and starts its runner."""
    principal = command.caller
    viewer = deps.access.workspace(principal, command.workspace_id)
    if len(command.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidAgentRequest(f"request_id is limited to {MAX_REQUEST_ID_CHARS} characters")
    parent = await deps.access.visible(principal, command.parent_id) if command.parent_id else None
    checked = deps.factory.check(command.draft)
    if checked.model.base_url:
        await _check_endpoint(deps, viewer, checked.model.base_url)
    agent = await deps.factory.create(
        viewer.member_id,
        viewer.workspace_id,
        checked,
        parent=parent,
        request_id=command.request_id,
        owner=viewer.member_id,
        actor=audit.actor_of(principal),
        action="CreateAgent",
    )
    deps.runners.start_agent(agent)
    return agent


async def update_agent(command: UpdateAgent, deps: Agents) -> Agent:
    agent = await deps.access.controlled(command.caller, command.agent_id)
    return await change_settings(deps, command.caller, agent, command.draft, command.fields)


async def delete_agent(command: DeleteAgent, deps: Agents) -> None:
    agent = await deps.access.controlled(command.caller, command.agent_id)
    await deps.runners.stop_agent(agent.id)
    await deps.store.delete_agent(agent.id, audit=deps.audit.record(command.caller, agent, "DeleteAgent"))


async def tell_agent_owners(command: TellAgentOwners, deps: Agents) -> int:
    """Idempotent: the IM changes only the owners it did not know."""
    owners = {a.member_id: a.owner_id for a in await deps.store.all_agents() if a.owner_id is not None}
    return await deps.im.set_agent_owners(owners) if owners else 0


async def change_settings(
    deps: Agents,
    principal: Caller | None,
    agent: Agent,
    draft: AgentDraft,
    names: Sequence[str],
    *,
    action: str = "UpdateAgent",
    details: dict[str, str] | None = None,
) -> Agent:
    """Changes the settings of `agent` (which the caller controls) named in
    `names` to `draft`'s: checked again, the IM name follows, the runner gets
    them. Recorded in the audit log as `action`."""
    unknown = set(names) - UPDATABLE
    if unknown or not names:
        raise InvalidAgentRequest(f"update_mask must name some of {sorted(UPDATABLE)}; got {sorted(names)}")
    merged = deps.factory.check(replace(AgentDraft.of(agent), **{n: getattr(draft, n) for n in names}))
    if merged.model.base_url != agent.model.base_url:
        await _check_endpoint(deps, deps.access.viewer(principal), merged.model.base_url)
    if merged.name != agent.name:
        await deps.im.rename_member(agent.member_id, merged.name)
    updated = replace(
        agent,
        name=merged.name,
        role=merged.role,
        system_prompt=merged.system_prompt,
        model=merged.model,
        tools=merged.tools,
        token_budget=merged.token_budget,
        auto_recall=merged.auto_recall,
        updated_at=deps.clock(),
    )
    changed = _changed_fields(agent, updated)
    record = deps.audit.record(
        principal,
        updated,
        action,
        details={
            "fields": ",".join(sorted(set(names))),
            "changed": ",".join(changed),
            **(model_facts(updated.model) if "model" in changed else {}),
            **(details or {}),
        },
    )
    await deps.store.update_agent(updated, audit=record)
    return deps.runners.update(updated) or updated


async def create_clone(deps: Agents, principal: Caller | None, source: Agent, draft: AgentDraft) -> Agent:
    """A fork of `source` into a new agent, started: its parent and its owner are `source`'s."""
    viewer = deps.access.viewer(principal)
    parent = await deps.store.get_agent(source.parent_id) if source.parent_id else None
    agent = await deps.factory.create(
        viewer.member_id,
        source.workspace_id,
        deps.factory.check(draft),
        parent=parent,
        request_id="",
        owner=source.owner_id,
        actor=audit.actor_of(principal),
        action="ForkFromStep",
        details={"forked_from": str(source.id)},
    )
    deps.runners.start_agent(agent)
    return agent


async def _check_endpoint(deps: Agents, viewer: Viewer, base_url: str) -> None:
    """May the caller point an agent's model requests at `base_url`?"""
    if not may_set_endpoint(viewer):
        raise NotAllowed("only the workspace's admins and owner set an agent's model.base_url")
    if deps.endpoints is not None and base_url:
        await deps.endpoints.check(base_url)


def _changed_fields(before: Agent, after: Agent) -> list[str]:
    """The settings that differ (by name, never by value: a prompt may be long or private)."""
    return [f.name for f in fields(AgentDraft) if getattr(before, f.name) != getattr(after, f.name)]


def handlers(deps: Agents) -> dict[type[Any], Handler]:
    """The agent commands' handlers, bound to `deps`."""
    return {
        CreateAgent: partial(create_agent, deps=deps),
        UpdateAgent: partial(update_agent, deps=deps),
        DeleteAgent: partial(delete_agent, deps=deps),
        TellAgentOwners: partial(tell_agent_owners, deps=deps),
    }
