"""Members: people and agents joining a workspace, their names and avatars,
and the owners of agents (named by the service that hosts them)."""

from __future__ import annotations

import uuid
from dataclasses import replace

from uuid_utils.compat import uuid7

from services.common import audit
from services.common.identity import Caller
from services.im.domain import rules
from services.im.domain.commands import CreateMember, SetAgentOwners, UpdateMember
from services.im.domain.errors import InvalidRequest, NotAllowed, NotFound
from services.im.domain.model import Member, MemberKind
from services.im.service_layer.handlers.deps import Deps, Page, page_of, page_start
from services.im.service_layer.ports import DuplicateRequest, Transaction

# Agents per SetAgentOwners call.
MAX_AGENT_OWNERS = 100


async def create_member(deps: Deps, command: CreateMember) -> Member:
    caller, kind = command.caller, command.kind
    if kind is None:
        raise InvalidRequest("kind is required (HUMAN or AGENT)")
    owner = rules.parse_optional_id(command.owner_id, "owner_id")
    if owner is not None and (kind is not MemberKind.AGENT or caller is None or not caller.is_service):
        raise NotAllowed("only the service that hosts an agent names its owner")
    display_name = rules.check_name(command.display_name, "display_name", required=True)
    avatar = rules.check_avatar(command.avatar)
    rid = rules.check_request_id(command.request_id)
    for attempt in range(2):
        async with deps.uow() as tx:
            resolved = await deps.caller_workspace(tx, caller, command.workspace_id)
            scope = _request_scope(caller, resolved)
            fingerprint = rules.request_fingerprint(
                op="create_member", ws=str(resolved), kind=kind.value, name=display_name, avatar=avatar
            )
            existing = await deps.replay(tx, scope, rid, fingerprint)
            if existing is not None:
                member = await tx.get_member(existing)
                if member is None:
                    raise NotFound(f"member {existing} not found")
                return member
            await check_member_quota(deps, tx, resolved, kind)
            if owner is not None:
                await _check_owner(tx, resolved, owner)
            member = Member(
                id=uuid7(),
                workspace_id=resolved,
                kind=kind,
                display_name=display_name,
                avatar=avatar,
                created_at=deps.clock(),
                host=_host_of_new(kind, caller),
                owner_id=owner,
            )
            await tx.add_member(member)
            await tx.add_audit(
                audit.succeeded(
                    caller,
                    workspace_id=resolved,
                    action="CreateMember",
                    target=audit.Target("member", str(member.id)),
                    at=member.created_at,
                    request_id=rid,
                    details={"kind": kind.value, "display_name": display_name}
                    | ({"owner_id": str(owner)} if owner is not None else {}),
                )
            )
            if rid is not None:
                try:
                    await tx.remember_request(scope, rid, fingerprint, member.id)
                except DuplicateRequest:
                    if attempt == 0:
                        continue
                    raise
            await tx.commit()
            return member
    raise AssertionError("unreachable")


async def check_member_quota(deps: Deps, tx: Transaction, workspace_id: uuid.UUID, kind: MemberKind) -> None:
    """Refuses one more member of `kind` over the workspace's quota; holds
    the workspace until the transaction ends (no concurrent create overshoots)."""
    quota = deps.quotas.agents if kind is MemberKind.AGENT else deps.quotas.members
    if not quota:
        return
    if not await tx.lock_workspace(workspace_id):
        raise NotFound(f"workspace {workspace_id} not found")
    what = "agents" if kind is MemberKind.AGENT else "people"
    rules.check_quota(what, quota, await tx.count_members(workspace_id, kind))


async def _check_owner(tx: Transaction, workspace_id: uuid.UUID, owner_id: uuid.UUID) -> None:
    owner = await tx.get_member(owner_id)
    if owner is None or owner.workspace_id != workspace_id or owner.kind is not MemberKind.HUMAN:
        raise InvalidRequest(f"owner_id {owner_id} is not a person of the workspace")


async def set_agent_owners(deps: Deps, command: SetAgentOwners) -> int:
    """Sets the owners of agents the calling service hosts; returns how many changed."""
    caller, owners = command.caller, command.owners
    if caller is None or caller.service is None:
        raise NotAllowed("only the service that hosts agents names their owners")
    host = caller.service
    if not owners:
        raise InvalidRequest("agent_owners is empty")
    if len(owners) > MAX_AGENT_OWNERS:
        raise InvalidRequest(f"at most {MAX_AGENT_OWNERS} agent_owners per call, got {len(owners)}")
    pairs = [
        (
            rules.parse_id(agent, "agent_owners.agent_member_id"),
            rules.parse_id(owner, "agent_owners.owner_id"),
        )
        for agent, owner in owners
    ]
    changed = 0
    async with deps.uow() as tx:
        found = await tx.get_members([m for pair in pairs for m in pair])
        for agent_id, owner_id in pairs:
            agent = found.get(agent_id)
            if agent is None or agent.kind is not MemberKind.AGENT or agent.host != host:
                raise NotAllowed(f"member {agent_id} is not an agent hosted by {host}")
            owner = found.get(owner_id)
            if (
                owner is None
                or owner.workspace_id != agent.workspace_id
                or owner.kind is not MemberKind.HUMAN
            ):
                raise InvalidRequest(f"owner_id {owner_id} is not a person of agent {agent_id}'s workspace")
            if agent.owner_id != owner_id and await tx.set_owner(agent_id, owner_id):
                changed += 1
                await tx.add_audit(
                    audit.succeeded(
                        caller,
                        workspace_id=agent.workspace_id,
                        action="SetAgentOwners",
                        target=audit.Target("member", str(agent_id)),
                        at=deps.clock(),
                        details={"owner_id": str(owner_id)},
                    )
                )
        await tx.commit()
    return changed


async def get_member(deps: Deps, caller: Caller | None, member_id: str) -> Member:
    wanted = rules.parse_id(member_id, "member_id")
    async with deps.uow(write=False) as tx:
        member = await tx.get_member(wanted)
        if member is None:
            raise NotFound(f"member {wanted} not found")
        await deps.caller_workspace(tx, caller, str(member.workspace_id))
        return member


async def list_members(
    deps: Deps, caller: Caller | None, *, workspace_id: str, page_size: int, page_token: str
) -> Page[Member]:
    limit = rules.page_size(page_size, deps.limits)
    after = page_start(page_token)
    async with deps.uow(write=False) as tx:
        resolved = await deps.caller_workspace(tx, caller, workspace_id)
        items = await tx.list_members(resolved, after=after, limit=limit + 1)
    return page_of(items, limit, lambda m: m.id)


async def update_member(deps: Deps, command: UpdateMember) -> Member:
    caller, fields = command.caller, command.fields
    wanted = rules.parse_id(command.member_id, "member.id")
    unknown = set(fields) - {"display_name", "avatar"}
    if unknown:
        raise InvalidRequest(f"update_mask names fields that cannot be updated: {sorted(unknown)}")
    if not fields:
        raise InvalidRequest("update_mask is empty: name display_name and/or avatar")
    async with deps.uow() as tx:
        member = await tx.get_member(wanted)
        if member is None:
            raise NotFound(f"member {wanted} not found")
        await deps.caller_workspace(tx, caller, str(member.workspace_id))
        is_self = caller is not None and caller.member_id == member.id
        if not is_self and not _manages(caller, member):
            raise NotAllowed("a member may only update itself; a service, only the agents it hosts")
        if "display_name" in fields:
            member = replace(
                member, display_name=rules.check_name(command.display_name, "display_name", required=True)
            )
        if "avatar" in fields:
            member = replace(member, avatar=rules.check_avatar(command.avatar))
        await tx.update_member(member)
        await tx.add_audit(
            audit.succeeded(
                caller,
                workspace_id=member.workspace_id,
                action="UpdateMember",
                target=audit.Target("member", str(member.id)),
                at=deps.clock(),
                details={"fields": ",".join(sorted(set(fields)))},
            )
        )
        await tx.commit()
        return member


def _request_scope(caller: Caller | None, workspace_id: uuid.UUID) -> uuid.UUID:
    if caller is not None and caller.member_id is not None:
        return caller.member_id
    return workspace_id


def _host_of_new(kind: MemberKind, caller: Caller | None) -> str | None:
    """The host of a member about to be created: the service that creates an agent."""
    if caller is None or caller.service is None:
        return None
    if kind is not MemberKind.AGENT:
        raise NotAllowed("a service creates only agent members")
    return caller.service


def _manages(caller: Caller | None, member: Member) -> bool:
    """Whether a service may change `member`: only an agent it hosts."""
    if caller is None or caller.service is None:
        return False
    return member.kind is MemberKind.AGENT and member.host == caller.service
