"""Groups and direct chats, and who is in them."""

from __future__ import annotations

from dataclasses import replace

from uuid_utils.compat import uuid7

from services.common.identity import Caller
from services.im.domain import rules
from services.im.domain.commands import (
    AddGroupMembers,
    CreateGroup,
    GetOrCreateDirectGroup,
    RemoveGroupMembers,
    RenameGroup,
)
from services.im.domain.errors import InvalidRequest, NotAllowed, WrongState
from services.im.domain.model import Group, GroupChanged, GroupKind
from services.im.service_layer.handlers.deps import Deps, Page, page_of, page_start
from services.im.service_layer.ports import DuplicateRequest


async def create_group(deps: Deps, command: CreateGroup) -> Group:
    caller = command.caller
    name = rules.check_name(command.name, "name", required=True)
    others = rules.parse_ids(command.member_ids, "member_ids")
    rid = rules.check_request_id(command.request_id)
    for attempt in range(2):
        async with deps.uow() as tx:
            actor = await deps.acting_member(tx, caller)
            # Sorted as storage returns them: members who joined together, by id.
            everyone = tuple(sorted({actor.id, *others}))
            rules.check_group_size(len(everyone), deps.limits)
            fingerprint = rules.request_fingerprint(
                op="create_group", name=name, members=sorted(str(m) for m in everyone)
            )
            existing = await deps.replay(tx, actor.id, rid, fingerprint)
            if existing is not None:
                return await deps.visible_group(tx, actor, existing)
            if deps.quotas.groups:
                await tx.lock_workspace(actor.workspace_id)
                count = await tx.count_groups(actor.workspace_id, GroupKind.GROUP)
                rules.check_quota("groups", deps.quotas.groups, count)
            await deps.check_workspace_members(tx, actor.workspace_id, everyone)
            group = Group(
                id=uuid7(),
                workspace_id=actor.workspace_id,
                name=name,
                kind=GroupKind.GROUP,
                creator_id=actor.id,
                created_at=deps.clock(),
                member_ids=everyone,
            )
            await tx.add_group(group)
            if rid is not None:
                try:
                    await tx.remember_request(actor.id, rid, fingerprint, group.id)
                except DuplicateRequest:
                    if attempt == 0:
                        continue
                    raise
            await deps.commit(tx, group.workspace_id, [GroupChanged(group=group, added_member_ids=everyone)])
            return group
    raise AssertionError("unreachable")


async def get_or_create_direct_group(deps: Deps, command: GetOrCreateDirectGroup) -> tuple[Group, bool]:
    caller = command.caller
    peer_id = rules.parse_id(command.peer_member_id, "peer_member_id")
    for attempt in range(2):
        async with deps.uow() as tx:
            actor = await deps.acting_member(tx, caller)
            if peer_id == actor.id:
                raise InvalidRequest("a direct chat needs another member")
            await deps.check_workspace_members(tx, actor.workspace_id, (peer_id,))
            key = rules.direct_key(actor.id, peer_id)
            existing = await tx.find_direct_group(actor.workspace_id, key)
            if existing is not None:
                return existing, False
            group = Group(
                id=uuid7(),
                workspace_id=actor.workspace_id,
                name="",
                kind=GroupKind.DIRECT,
                creator_id=actor.id,
                created_at=deps.clock(),
                member_ids=(actor.id, peer_id),
                direct_key=key,
            )
            try:
                await tx.add_group(group)
            except DuplicateRequest:
                # The other side created it at the same moment: take theirs.
                if attempt == 0:
                    continue
                raise
            await deps.commit(
                tx, group.workspace_id, [GroupChanged(group=group, added_member_ids=group.member_ids)]
            )
            return group, True
    raise AssertionError("unreachable")


async def get_group(deps: Deps, caller: Caller | None, group_id: str) -> Group:
    wanted = rules.parse_id(group_id, "group_id")
    async with deps.uow(write=False) as tx:
        actor = await deps.acting_member(tx, caller)
        return await deps.visible_group(tx, actor, wanted)


async def list_groups(
    deps: Deps, caller: Caller | None, *, member_id: str, page_size: int, page_token: str
) -> Page[Group]:
    limit = rules.page_size(page_size, deps.limits)
    after = page_start(page_token)
    whose = rules.parse_optional_id(member_id, "member_id")
    async with deps.uow(write=False) as tx:
        if caller is not None and caller.is_service:
            if whose is None:
                raise InvalidRequest("member_id is required for a service call without a member")
            target = whose
        else:
            actor = await deps.acting_member(tx, caller)
            if whose is not None and whose != actor.id:
                raise NotAllowed("a member may only list its own groups")
            target = whose or actor.id
        items = await tx.list_groups_of(target, after=after, limit=limit + 1)
    return page_of(items, limit, lambda g: g.id)


async def rename_group(deps: Deps, command: RenameGroup) -> Group:
    caller = command.caller
    wanted = rules.parse_id(command.group_id, "group.id")
    if list(command.fields) != ["name"]:
        raise InvalidRequest("update_mask must be exactly [name]")
    name = rules.check_name(command.name, "name", required=True)
    async with deps.uow() as tx:
        actor = await deps.acting_member(tx, caller)
        group = await deps.visible_group(tx, actor, wanted)
        if group.kind is GroupKind.DIRECT:
            raise WrongState("a direct chat has no name to change")
        await tx.rename_group(group.id, name)
        group = replace(group, name=name)
        await deps.commit(tx, group.workspace_id, [GroupChanged(group=group)])
        return group


async def add_group_members(deps: Deps, command: AddGroupMembers) -> Group:
    caller = command.caller
    wanted = rules.parse_id(command.group_id, "group_id")
    adding = rules.parse_ids(command.member_ids, "member_ids")
    if not adding:
        raise InvalidRequest("member_ids is empty")
    async with deps.uow() as tx:
        actor = await deps.acting_member(tx, caller)
        group = await deps.visible_group(tx, actor, wanted)
        if group.kind is GroupKind.DIRECT:
            raise WrongState("a direct chat always has exactly its two members; create a group instead")
        new = tuple(sorted(m for m in adding if m not in group.member_ids))
        if not new:
            return group
        rules.check_group_size(len(group.member_ids) + len(new), deps.limits)
        await deps.check_workspace_members(tx, group.workspace_id, new)
        await tx.add_memberships(group.id, list(new), deps.clock())
        group = replace(group, member_ids=group.member_ids + new)
        await deps.commit(tx, group.workspace_id, [GroupChanged(group=group, added_member_ids=new)])
        return group


async def remove_group_members(deps: Deps, command: RemoveGroupMembers) -> Group:
    caller = command.caller
    wanted = rules.parse_id(command.group_id, "group_id")
    removing = rules.parse_ids(command.member_ids, "member_ids")
    if not removing:
        raise InvalidRequest("member_ids is empty")
    async with deps.uow() as tx:
        actor = await deps.acting_member(tx, caller)
        group = await deps.visible_group(tx, actor, wanted)
        if group.kind is GroupKind.DIRECT:
            raise WrongState("members cannot be removed from a direct chat")
        others = [m for m in removing if m != actor.id]
        if others and actor.id != group.creator_id:
            raise NotAllowed("only the group's creator may remove other members; anyone may leave")
        gone = tuple(m for m in removing if m in group.member_ids)
        if not gone:
            return group
        await tx.remove_memberships(group.id, list(gone))
        group = replace(group, member_ids=tuple(m for m in group.member_ids if m not in gone))
        await deps.commit(tx, group.workspace_id, [GroupChanged(group=group, removed_member_ids=gone)])
        return group
