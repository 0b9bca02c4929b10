"""The IM's use cases: each checks the caller's rights, changes state in one
transaction together with the event describing the change, then signals it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from uuid_utils.compat import uuid7

from services.common import audit
from services.common.identity import Caller
from services.im.domain import rules
from services.im.domain.errors import (
    Conflict,
    InvalidRequest,
    NotAllowed,
    NotAMember,
    NotFound,
    RequestIdReused,
    Unauthenticated,
    WrongState,
)
from services.im.domain.model import (
    Chat,
    ContentType,
    Event,
    Group,
    GroupChanged,
    GroupKind,
    Member,
    MemberKind,
    Message,
    MessageCreated,
    MessageEdited,
    ReadState,
    ReadUpdated,
    RecordedEvent,
    Role,
    Workspace,
    as_recorded,
    event_group_id,
)
from services.im.service_layer.ports import (
    DuplicateRequest,
    EventSignal,
    Inbox,
    MessageLog,
    ReadOutcome,
    Transaction,
    TransactionalInbox,
    UnitOfWorkFactory,
)

logger = logging.getLogger(__name__)

Clock = Callable[[], datetime]
# Work done in the transaction that creates a workspace (the creator's account).
CreationHook = Callable[[Transaction, Workspace, Member], Awaitable[None]]

# Members whose identity (id, workspace) each process remembers.
IDENTITY_CACHE_SIZE = 100_000
# Agents per SetAgentOwners call.
MAX_AGENT_OWNERS = 100


def utc_now() -> datetime:
    return datetime.now(UTC)


T = TypeVar("T")


class Page(Generic[T]):
    """One page of results and the token for the next one."""

    __slots__ = ("items", "next_token")

    def __init__(self, items: list[T], next_token: str) -> None:
        self.items = items
        self.next_token = next_token


class IMService:
    """The IM's handlers. Every replica can serve every call: the only state
    kept between calls is a cache of immutable member identities.

    Args:
        uow: makes a new transaction.
        messages: appends messages (the hot path).
        inbox: reads and marks members' unread messages (the other hot
            path); by default each call is a transaction of `uow`.
        on_committed: given the events just committed (in sequence order,
            as the event log will give them back) before they are signalled;
            lets this process's event hub hand them out without reading them.
        signal: tells event hubs (in this process or, with Redis, every
            replica) that events were committed.
        limits: the configured limits.
        quotas: how many people, agents and groups a workspace may have.
        clock: current time, replaceable in tests.
    """

    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        messages: MessageLog,
        signal: EventSignal,
        inbox: Inbox | None = None,
        on_committed: Callable[[Sequence[RecordedEvent]], None] | None = None,
        limits: rules.Limits | None = None,
        quotas: rules.Quotas | None = None,
        clock: Clock = utc_now,
    ) -> None:
        self.quotas = quotas or rules.Quotas()
        self._uow = uow
        self._messages = messages
        self._inbox = inbox or TransactionalInbox(uow)
        self._on_committed = on_committed
        self._signal = signal
        self._identities: dict[uuid.UUID, Member] = {}
        self.limits = limits or rules.Limits()
        self._clock = clock

    # -- identity -----------------------------------------------------------

    async def _acting_member(self, tx: Transaction, caller: Caller | None) -> Member:
        """The member the call acts as: the member of its token (or the agent
        whose view a person reads).

        Only the member's id and workspace are to be used: they never change
        (members are never deleted or moved), which is what makes the cache
        safe on every replica. Its name may be stale.
        """
        if caller is not None and caller.member_id is None:
            raise NotAllowed("this call is made as a member, and a service's token names none")
        if caller is None or caller.member_id is None:
            raise Unauthenticated("this call needs the caller: authorization: Bearer <access token>")
        # A view's agent is read afresh: who owns it may have changed.
        member = self._identities.get(caller.member_id) if caller.view_as is None else None
        if member is None:
            member = await tx.get_member(caller.member_id)
            if member is None:
                raise Unauthenticated(f"member {caller.member_id} does not exist")
            if len(self._identities) >= IDENTITY_CACHE_SIZE:
                self._identities.pop(next(iter(self._identities)))
            self._identities[member.id] = member
        return _token_matches(caller, member)

    async def _caller(self, caller: Caller | None) -> Member:
        """`_acting_member` outside a transaction: usually answered from the cache."""
        if caller is not None and caller.member_id is not None and caller.view_as is None:
            cached = self._identities.get(caller.member_id)
            if cached is not None:
                return _token_matches(caller, cached)
        async with self._uow(write=False) as tx:
            return await self._acting_member(tx, caller)

    async def _caller_workspace(self, tx: Transaction, caller: Caller | None, requested: str) -> uuid.UUID:
        """The workspace a call is about: the actor's own, or for a service, the one named."""
        wanted = rules.parse_optional_id(requested, "workspace_id")
        if caller is not None and caller.is_service:
            if wanted is None:
                raise InvalidRequest("workspace_id is required for a service call without a member")
            if await tx.get_workspace(wanted) is None:
                raise NotFound(f"workspace {wanted} not found")
            return wanted
        member = await self._acting_member(tx, caller)
        if wanted is not None and wanted != member.workspace_id:
            raise NotFound(f"workspace {wanted} not found")
        return member.workspace_id

    async def _visible_group(self, tx: Transaction, member: Member, group_id: uuid.UUID) -> Group:
        group = await tx.get_group(group_id)
        if group is None or group.workspace_id != member.workspace_id:
            raise NotFound(f"group {group_id} not found")
        if member.id not in group.member_ids:
            raise NotAMember(f"member {member.id} is not in group {group_id}")
        return group

    async def _workspace_members(
        self, tx: Transaction, workspace_id: uuid.UUID, member_ids: tuple[uuid.UUID, ...]
    ) -> None:
        found = await tx.get_members(list(member_ids))
        for member_id in member_ids:
            member = found.get(member_id)
            if member is None or member.workspace_id != workspace_id:
                raise NotFound(f"member {member_id} not found")

    async def _commit(self, tx: Transaction, workspace_id: uuid.UUID, events: list[Event]) -> None:
        """Records the events, commits, then wakes the event hubs."""
        now = self._clock()
        sequences = [await tx.append_event(workspace_id, event, now) for event in events]
        await tx.commit()
        if events:
            await self._signal_committed(
                [
                    _recorded(workspace_id, sequence, now, event)
                    for sequence, event in zip(sequences, events, strict=True)
                ]
            )

    async def _signal_committed(self, recorded: list[RecordedEvent]) -> None:
        """Offers the events just committed to this process's hub, then wakes every hub."""
        workspace_id = recorded[-1].workspace_id
        if self._on_committed is not None:
            try:
                self._on_committed(recorded)
            except Exception:
                # The signal below still makes the hub read them.
                logger.warning("could not hand out new events of workspace %s", workspace_id, exc_info=True)
        try:
            await self._signal.publish(workspace_id, recorded[-1].sequence)
        except Exception:
            # The events are committed; subscribers catch up on the next signal.
            logger.warning("could not signal new events of workspace %s", workspace_id, exc_info=True)

    async def _replay(
        self, tx: Transaction, scope: uuid.UUID, request_id: str | None, fingerprint: str
    ) -> uuid.UUID | None:
        """The resource made by an earlier call with this request_id, if any."""
        if request_id is None:
            return None
        found = await tx.find_request(scope, request_id)
        if found is None:
            return None
        used_fingerprint, resource_id = found
        if used_fingerprint != fingerprint:
            raise RequestIdReused(f"request_id {request_id!r} was already used for a different request")
        return resource_id

    # -- workspaces ---------------------------------------------------------

    async def create_workspace(
        self,
        *,
        name: str,
        creator_display_name: str,
        creator_kind: MemberKind | None,
        creator_avatar: str,
        request_id: str,
    ) -> tuple[Workspace, Member]:
        workspace, creator, _ = await self.open_workspace(
            name=name,
            creator_display_name=creator_display_name,
            creator_kind=creator_kind,
            creator_avatar=creator_avatar,
            request_id=request_id,
        )
        return workspace, creator

    async def open_workspace(
        self,
        *,
        name: str,
        creator_display_name: str,
        creator_kind: MemberKind | None,
        creator_avatar: str,
        request_id: str,
        fingerprint_extra: Mapping[str, str] | None = None,
        within: CreationHook | None = None,
    ) -> tuple[Workspace, Member, bool]:
        """Creates a workspace with its creator, who owns it.

        Args:
            fingerprint_extra: more of the request that a retry with the
                same request_id must repeat (the creator's login).
            within: run in the creating transaction before it commits (the
                creator's account); not run when a retry finds the workspace.

        Returns:
            The workspace, its creator, and whether this call created them
            (False: an earlier call with the same request_id did).
        """
        name = rules.check_name(name, "name", required=True)
        display_name = rules.check_name(creator_display_name, "creator_display_name", required=True)
        avatar = rules.check_avatar(creator_avatar)
        kind = creator_kind or MemberKind.HUMAN
        rid = rules.check_request_id(request_id)
        fingerprint = rules.request_fingerprint(
            op="create_workspace",
            name=name,
            creator=display_name,
            kind=kind.value,
            avatar=avatar,
            **dict(fingerprint_extra or {}),
        )
        # With no actor yet, the request_id alone scopes the retry.
        scope = rules.NIL_SCOPE
        for attempt in range(2):
            async with self._uow() as tx:
                existing = await self._replay(tx, scope, rid, fingerprint)
                if existing is not None:
                    workspace, creator = await self._workspace_of_creator(tx, existing)
                    return workspace, creator, False
                now = self._clock()
                workspace = Workspace(id=uuid7(), name=name, created_at=now)
                creator = Member(
                    id=uuid7(),
                    workspace_id=workspace.id,
                    kind=kind,
                    display_name=display_name,
                    avatar=avatar,
                    created_at=now,
                    role=Role.OWNER,
                )
                await tx.add_workspace(workspace)
                await tx.add_member(creator)
                await tx.add_audit(
                    audit.succeeded(
                        None,
                        actor=member_actor(creator),
                        workspace_id=workspace.id,
                        action="CreateWorkspace",
                        target=audit.Target("workspace", str(workspace.id)),
                        at=now,
                        request_id=rid,
                        details={"name": name},
                    )
                )
                if rid is not None:
                    try:
                        await tx.remember_request(scope, rid, fingerprint, creator.id)
                    except DuplicateRequest:
                        if attempt == 0:
                            continue
                        raise
                if within is not None:
                    await within(tx, workspace, creator)
                await tx.commit()
                return workspace, creator, True
        raise AssertionError("unreachable")

    async def _workspace_of_creator(self, tx: Transaction, creator_id: uuid.UUID) -> tuple[Workspace, Member]:
        creator = await tx.get_member(creator_id)
        workspace = await tx.get_workspace(creator.workspace_id) if creator is not None else None
        if creator is None or workspace is None:
            raise NotFound(f"the workspace of member {creator_id} was not found")
        return workspace, creator

    async def get_workspace(self, caller: Caller | None, workspace_id: str) -> Workspace:
        async with self._uow(write=False) as tx:
            wanted = rules.parse_id(workspace_id, "workspace_id")
            resolved = await self._caller_workspace(tx, caller, workspace_id)
            workspace = await tx.get_workspace(resolved)
            if workspace is None or resolved != wanted:
                raise NotFound(f"workspace {wanted} not found")
            return workspace

    async def list_workspaces(
        self, caller: Caller | None, *, page_size: int, page_token: str
    ) -> Page[Workspace]:
        limit = rules.page_size(page_size, self.limits)
        after = self._token_id(page_token)
        async with self._uow(write=False) as tx:
            ids: list[uuid.UUID] | None = None
            if caller is None or not caller.is_service:
                ids = [(await self._acting_member(tx, caller)).workspace_id]
            items = await tx.list_workspaces(ids=ids, after=after, limit=limit + 1)
        return self._page(items, limit, lambda w: w.id)

    # -- members ------------------------------------------------------------

    async def create_member(
        self,
        caller: Caller | None,
        *,
        workspace_id: str,
        kind: MemberKind | None,
        display_name: str,
        avatar: str,
        request_id: str,
        owner_id: str = "",
    ) -> Member:
        if kind is None:
            raise InvalidRequest("kind is required (HUMAN or AGENT)")
        owner = rules.parse_optional_id(owner_id, "owner_id")
        if owner is not None and (kind is not MemberKind.AGENT or caller is None or not caller.is_service):
            raise NotAllowed("only the service that hosts an agent names its owner")
        display_name = rules.check_name(display_name, "display_name", required=True)
        avatar = rules.check_avatar(avatar)
        rid = rules.check_request_id(request_id)
        for attempt in range(2):
            async with self._uow() as tx:
                resolved = await self._caller_workspace(tx, caller, workspace_id)
                scope = self._request_scope(caller, resolved)
                fingerprint = rules.request_fingerprint(
                    op="create_member", ws=str(resolved), kind=kind.value, name=display_name, avatar=avatar
                )
                existing = await self._replay(tx, scope, rid, fingerprint)
                if existing is not None:
                    member = await tx.get_member(existing)
                    if member is None:
                        raise NotFound(f"member {existing} not found")
                    return member
                await self.check_member_quota(tx, resolved, kind)
                if owner is not None:
                    await self._check_owner(tx, resolved, owner)
                member = Member(
                    id=uuid7(),
                    workspace_id=resolved,
                    kind=kind,
                    display_name=display_name,
                    avatar=avatar,
                    created_at=self._clock(),
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

    async def check_member_quota(self, tx: Transaction, workspace_id: uuid.UUID, kind: MemberKind) -> None:
        """Refuses one more member of `kind` over the workspace's quota; holds
        the workspace until the transaction ends (no concurrent create overshoots)."""
        quota = self.quotas.agents if kind is MemberKind.AGENT else self.quotas.members
        if not quota:
            return
        if not await tx.lock_workspace(workspace_id):
            raise NotFound(f"workspace {workspace_id} not found")
        what = "agents" if kind is MemberKind.AGENT else "people"
        rules.check_quota(what, quota, await tx.count_members(workspace_id, kind))

    @staticmethod
    async def _check_owner(tx: Transaction, workspace_id: uuid.UUID, owner_id: uuid.UUID) -> None:
        owner = await tx.get_member(owner_id)
        if owner is None or owner.workspace_id != workspace_id or owner.kind is not MemberKind.HUMAN:
            raise InvalidRequest(f"owner_id {owner_id} is not a person of the workspace")

    async def set_agent_owners(self, caller: Caller | None, owners: Sequence[tuple[str, str]]) -> int:
        """Sets the owners of agents the calling service hosts; returns how many changed."""
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
        async with self._uow() as tx:
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
                    raise InvalidRequest(
                        f"owner_id {owner_id} is not a person of agent {agent_id}'s workspace"
                    )
                if agent.owner_id != owner_id and await tx.set_owner(agent_id, owner_id):
                    changed += 1
                    await tx.add_audit(
                        audit.succeeded(
                            caller,
                            workspace_id=agent.workspace_id,
                            action="SetAgentOwners",
                            target=audit.Target("member", str(agent_id)),
                            at=self._clock(),
                            details={"owner_id": str(owner_id)},
                        )
                    )
            await tx.commit()
        return changed

    @staticmethod
    def _request_scope(caller: Caller | None, workspace_id: uuid.UUID) -> uuid.UUID:
        if caller is not None and caller.member_id is not None:
            return caller.member_id
        return workspace_id

    async def get_member(self, caller: Caller | None, member_id: str) -> Member:
        wanted = rules.parse_id(member_id, "member_id")
        async with self._uow(write=False) as tx:
            member = await tx.get_member(wanted)
            if member is None:
                raise NotFound(f"member {wanted} not found")
            await self._caller_workspace(tx, caller, str(member.workspace_id))
            return member

    async def list_members(
        self, caller: Caller | None, *, workspace_id: str, page_size: int, page_token: str
    ) -> Page[Member]:
        limit = rules.page_size(page_size, self.limits)
        after = self._token_id(page_token)
        async with self._uow(write=False) as tx:
            resolved = await self._caller_workspace(tx, caller, workspace_id)
            items = await tx.list_members(resolved, after=after, limit=limit + 1)
        return self._page(items, limit, lambda m: m.id)

    async def update_member(
        self,
        caller: Caller | None,
        *,
        member_id: str,
        display_name: str,
        avatar: str,
        fields: list[str],
    ) -> Member:
        wanted = rules.parse_id(member_id, "member.id")
        unknown = set(fields) - {"display_name", "avatar"}
        if unknown:
            raise InvalidRequest(f"update_mask names fields that cannot be updated: {sorted(unknown)}")
        if not fields:
            raise InvalidRequest("update_mask is empty: name display_name and/or avatar")
        async with self._uow() as tx:
            member = await tx.get_member(wanted)
            if member is None:
                raise NotFound(f"member {wanted} not found")
            await self._caller_workspace(tx, caller, str(member.workspace_id))
            is_self = caller is not None and caller.member_id == member.id
            if not is_self and not _manages(caller, member):
                raise NotAllowed("a member may only update itself; a service, only the agents it hosts")
            if "display_name" in fields:
                member = replace(
                    member, display_name=rules.check_name(display_name, "display_name", required=True)
                )
            if "avatar" in fields:
                member = replace(member, avatar=rules.check_avatar(avatar))
            await tx.update_member(member)
            await tx.add_audit(
                audit.succeeded(
                    caller,
                    workspace_id=member.workspace_id,
                    action="UpdateMember",
                    target=audit.Target("member", str(member.id)),
                    at=self._clock(),
                    details={"fields": ",".join(sorted(set(fields)))},
                )
            )
            await tx.commit()
            return member

    # -- groups -------------------------------------------------------------

    async def create_group(
        self, caller: Caller | None, *, name: str, member_ids: list[str], request_id: str
    ) -> Group:
        name = rules.check_name(name, "name", required=True)
        others = rules.parse_ids(member_ids, "member_ids")
        rid = rules.check_request_id(request_id)
        for attempt in range(2):
            async with self._uow() as tx:
                actor = await self._acting_member(tx, caller)
                # Sorted as storage returns them: members who joined together, by id.
                everyone = tuple(sorted({actor.id, *others}))
                rules.check_group_size(len(everyone), self.limits)
                fingerprint = rules.request_fingerprint(
                    op="create_group", name=name, members=sorted(str(m) for m in everyone)
                )
                existing = await self._replay(tx, actor.id, rid, fingerprint)
                if existing is not None:
                    return await self._visible_group(tx, actor, existing)
                if self.quotas.groups:
                    await tx.lock_workspace(actor.workspace_id)
                    count = await tx.count_groups(actor.workspace_id, GroupKind.GROUP)
                    rules.check_quota("groups", self.quotas.groups, count)
                await self._workspace_members(tx, actor.workspace_id, everyone)
                group = Group(
                    id=uuid7(),
                    workspace_id=actor.workspace_id,
                    name=name,
                    kind=GroupKind.GROUP,
                    creator_id=actor.id,
                    created_at=self._clock(),
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
                await self._commit(
                    tx, group.workspace_id, [GroupChanged(group=group, added_member_ids=everyone)]
                )
                return group
        raise AssertionError("unreachable")

    async def get_or_create_direct_group(
        self, caller: Caller | None, *, peer_member_id: str
    ) -> tuple[Group, bool]:
        peer_id = rules.parse_id(peer_member_id, "peer_member_id")
        for attempt in range(2):
            async with self._uow() as tx:
                actor = await self._acting_member(tx, caller)
                if peer_id == actor.id:
                    raise InvalidRequest("a direct chat needs another member")
                await self._workspace_members(tx, actor.workspace_id, (peer_id,))
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
                    created_at=self._clock(),
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
                await self._commit(
                    tx, group.workspace_id, [GroupChanged(group=group, added_member_ids=group.member_ids)]
                )
                return group, True
        raise AssertionError("unreachable")

    async def get_group(self, caller: Caller | None, group_id: str) -> Group:
        wanted = rules.parse_id(group_id, "group_id")
        async with self._uow(write=False) as tx:
            actor = await self._acting_member(tx, caller)
            return await self._visible_group(tx, actor, wanted)

    async def list_groups(
        self, caller: Caller | None, *, member_id: str, page_size: int, page_token: str
    ) -> Page[Group]:
        limit = rules.page_size(page_size, self.limits)
        after = self._token_id(page_token)
        whose = rules.parse_optional_id(member_id, "member_id")
        async with self._uow(write=False) as tx:
            if caller is not None and caller.is_service:
                if whose is None:
                    raise InvalidRequest("member_id is required for a service call without a member")
                target = whose
            else:
                actor = await self._acting_member(tx, caller)
                if whose is not None and whose != actor.id:
                    raise NotAllowed("a member may only list its own groups")
                target = whose or actor.id
            items = await tx.list_groups_of(target, after=after, limit=limit + 1)
        return self._page(items, limit, lambda g: g.id)

    async def rename_group(
        self, caller: Caller | None, *, group_id: str, name: str, fields: list[str]
    ) -> Group:
        wanted = rules.parse_id(group_id, "group.id")
        if fields != ["name"]:
            raise InvalidRequest("update_mask must be exactly [name]")
        name = rules.check_name(name, "name", required=True)
        async with self._uow() as tx:
            actor = await self._acting_member(tx, caller)
            group = await self._visible_group(tx, actor, wanted)
            if group.kind is GroupKind.DIRECT:
                raise WrongState("a direct chat has no name to change")
            await tx.rename_group(group.id, name)
            group = replace(group, name=name)
            await self._commit(tx, group.workspace_id, [GroupChanged(group=group)])
            return group

    async def add_group_members(
        self, caller: Caller | None, *, group_id: str, member_ids: list[str]
    ) -> Group:
        wanted = rules.parse_id(group_id, "group_id")
        adding = rules.parse_ids(member_ids, "member_ids")
        if not adding:
            raise InvalidRequest("member_ids is empty")
        async with self._uow() as tx:
            actor = await self._acting_member(tx, caller)
            group = await self._visible_group(tx, actor, wanted)
            if group.kind is GroupKind.DIRECT:
                raise WrongState("a direct chat always has exactly its two members; create a group instead")
            new = tuple(sorted(m for m in adding if m not in group.member_ids))
            if not new:
                return group
            rules.check_group_size(len(group.member_ids) + len(new), self.limits)
            await self._workspace_members(tx, group.workspace_id, new)
            await tx.add_memberships(group.id, list(new), self._clock())
            group = replace(group, member_ids=group.member_ids + new)
            await self._commit(tx, group.workspace_id, [GroupChanged(group=group, added_member_ids=new)])
            return group

    async def remove_group_members(
        self, caller: Caller | None, *, group_id: str, member_ids: list[str]
    ) -> Group:
        wanted = rules.parse_id(group_id, "group_id")
        removing = rules.parse_ids(member_ids, "member_ids")
        if not removing:
            raise InvalidRequest("member_ids is empty")
        async with self._uow() as tx:
            actor = await self._acting_member(tx, caller)
            group = await self._visible_group(tx, actor, wanted)
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
            await self._commit(tx, group.workspace_id, [GroupChanged(group=group, removed_member_ids=gone)])
            return group

    # -- messages -----------------------------------------------------------

    async def send_message(
        self,
        caller: Caller | None,
        *,
        group_id: str,
        content_type: ContentType | None,
        content: str,
        mentions: list[str],
        reply_to_message_id: str,
        metadata: dict[str, Any],
        request_id: str,
    ) -> Message:
        target = rules.parse_id(group_id, "group_id")
        kind = content_type or ContentType.TEXT
        mentioned = rules.parse_ids(mentions, "mentions")
        reply_to = rules.parse_optional_id(reply_to_message_id, "reply_to_message_id")
        rid = rules.check_request_id(request_id)
        rules.check_message(content=content, mentions=mentioned, metadata=metadata, limits=self.limits)
        # Only a request_id needs the payload's fingerprint (to tell a retry from a reuse).
        fingerprint = (
            rules.message_fingerprint(
                group_id=target,
                content_type=kind,
                content=content,
                mentions=mentioned,
                reply_to=reply_to,
                metadata=metadata,
            )
            if rid is not None
            else ""
        )
        # The hot path is one atomic append that stores the message only if
        # the request is valid; only when it stores nothing do we look closer
        # to say why.
        actor = await self._caller(caller)
        message = Message(
            id=uuid7(),
            workspace_id=actor.workspace_id,
            group_id=target,
            sender_id=actor.id,
            content_type=kind,
            content=content,
            mentions=mentioned,
            reply_to=reply_to,
            metadata=metadata,
            sent_at=self._clock(),
            request_id=rid,
            request_hash=fingerprint if rid is not None else None,
        )
        at = self._clock()
        sequence = await self._messages.append(message, at)
        if sequence is not None:
            await self._signal_committed(
                [_recorded(message.workspace_id, sequence, at, MessageCreated(message=message))]
            )
            return message
        access = await self._messages.access(target, [actor.id, *mentioned], reply_to)
        if access is None or access.workspace_id != actor.workspace_id:
            raise NotFound(f"group {target} not found")
        if actor.id not in access.members:
            raise NotAMember(f"member {actor.id} is not in group {target}")
        outsiders = [m for m in mentioned if m not in access.members]
        if outsiders:
            raise InvalidRequest(f"mentioned members are not in the group: {[str(m) for m in outsiders]}")
        if reply_to is not None and access.reply_to_group != target:
            raise InvalidRequest(f"reply_to_message_id {reply_to} is not a message of this group")
        # A valid request that stored nothing: its request_id was used before.
        async with self._uow(write=False) as tx:
            earlier = await tx.find_message_by_request(actor.id, rid) if rid is not None else None
        if earlier is not None:
            return self._retried(earlier, fingerprint, rid or "")
        raise Conflict(f"group {target} changed while the message was sent; send it again")

    @staticmethod
    def _retried(earlier: Message, fingerprint: str, request_id: str) -> Message:
        if earlier.request_hash != fingerprint:
            raise RequestIdReused(f"request_id {request_id!r} was already used for a different message")
        return earlier

    async def edit_message(self, caller: Caller | None, *, message_id: str, content: str) -> Message:
        wanted = rules.parse_id(message_id, "message_id")
        if not content.strip():
            raise InvalidRequest("content is empty")
        rules.check_content(content, self.limits)
        async with self._uow() as tx:
            actor = await self._acting_member(tx, caller)
            message = await self._visible_message(tx, actor, wanted)
            if message.sender_id != actor.id:
                raise NotAllowed("only the sender may edit a message")
            edited = replace(message, content=content, edited_at=self._clock())
            await tx.edit_message(edited.id, content, edited.edited_at or self._clock())
            await self._commit(tx, edited.workspace_id, [MessageEdited(message=edited)])
            return edited

    async def _visible_message(self, tx: Transaction, member: Member, message_id: uuid.UUID) -> Message:
        message = await tx.get_message(message_id)
        if message is None or message.workspace_id != member.workspace_id:
            raise NotFound(f"message {message_id} not found")
        await self._visible_group(tx, member, message.group_id)
        return message

    async def get_message(self, caller: Caller | None, message_id: str) -> Message:
        wanted = rules.parse_id(message_id, "message_id")
        async with self._uow(write=False) as tx:
            actor = await self._acting_member(tx, caller)
            return await self._visible_message(tx, actor, wanted)

    async def list_messages(
        self,
        caller: Caller | None,
        *,
        group_id: str,
        page_size: int,
        page_token: str,
        before_message_id: str,
        after_message_id: str,
    ) -> Page[Message]:
        target = rules.parse_id(group_id, "group_id")
        limit = rules.page_size(page_size, self.limits)
        before = rules.parse_optional_id(before_message_id, "before_message_id")
        after = rules.parse_optional_id(after_message_id, "after_message_id")
        if page_token:
            token = rules.decode_page_token(page_token, {"group", "direction", "cursor"})
            if token["group"] != str(target):
                raise InvalidRequest("page_token belongs to another group")
            cursor = rules.parse_id(token["cursor"], "page_token")
            if token["direction"] not in ("before", "after"):
                raise InvalidRequest("page_token is malformed")
            before, after = (cursor, None) if token["direction"] == "before" else (None, cursor)
        if before is not None and after is not None:
            raise InvalidRequest("set before_message_id or after_message_id, not both")
        async with self._uow(write=False) as tx:
            actor = await self._acting_member(tx, caller)
            await self._visible_group(tx, actor, target)
            items = await tx.list_messages(target, before=before, after=after, limit=limit + 1)
        forward = after is not None
        more = len(items) > limit
        if more:
            items = items[:limit] if forward else items[1:]
        next_token = ""
        if more and items:
            edge = items[-1] if forward else items[0]
            next_token = rules.encode_page_token(
                {"group": str(target), "direction": "after" if forward else "before", "cursor": str(edge.id)}
            )
        return Page(items, next_token)

    # -- read state ---------------------------------------------------------

    async def mark_read(self, caller: Caller | None, *, group_id: str, up_to_message_id: str) -> ReadState:
        target = rules.parse_id(group_id, "group_id")
        up_to = rules.parse_id(up_to_message_id, "up_to_message_id")
        actor = await self._caller(caller)
        at = self._clock()
        marked = await self._inbox.mark_read(actor, target, up_to, at)
        match marked.outcome:
            case ReadOutcome.NO_GROUP:
                raise NotFound(f"group {target} not found")
            case ReadOutcome.NOT_A_MEMBER:
                raise NotAMember(f"member {actor.id} is not in group {target}")
            case ReadOutcome.NOT_IN_GROUP:
                raise InvalidRequest(f"up_to_message_id {up_to} is not a message of this group")
        state = marked.state
        assert state is not None
        if marked.sequence is not None:
            await self._signal_committed(
                [_recorded(actor.workspace_id, marked.sequence, at, ReadUpdated(read_state=state))]
            )
        return state

    async def get_all_unread(self, caller: Caller | None, *, page_size: int) -> tuple[list[Message], int]:
        limit = rules.page_size(
            page_size or self.limits.max_unread_page_size,
            self.limits,
            maximum=self.limits.max_unread_page_size,
        )
        actor = await self._caller(caller)
        messages, total = await self._inbox.unread(actor.id, limit=limit)
        return messages, total - len(messages)

    async def list_chats(self, caller: Caller | None, *, page_size: int, page_token: str) -> Page[Chat]:
        limit = rules.page_size(page_size, self.limits)
        start: tuple[str, str] | None = None
        if page_token:
            token = rules.decode_page_token(page_token, {"activity", "group"})
            start = (token["activity"], token["group"])
        async with self._uow(write=False) as tx:
            actor = await self._acting_member(tx, caller)
            groups = await tx.list_groups_of(actor.id, after=None, limit=None)
            last = await tx.last_messages([g.id for g in groups])

            def activity(group: Group) -> datetime:
                message = last.get(group.id)
                return message.sent_at if message is not None else group.created_at

            def key(group: Group) -> tuple[str, str]:
                return (activity(group).isoformat(), str(group.id))

            ordered = sorted(groups, key=key, reverse=True)
            if start is not None:
                ordered = [g for g in ordered if key(g) < start]
            page = ordered[:limit]
            counts = await tx.unread_counts(actor.id, [g.id for g in page])
        chats = [
            Chat(
                group=g,
                last_message=last.get(g.id),
                unread_count=counts.get(g.id, 0),
                last_activity_at=activity(g),
            )
            for g in page
        ]
        next_token = ""
        if len(ordered) > limit and page:
            activity_text, group_text = key(page[-1])
            next_token = rules.encode_page_token({"activity": activity_text, "group": group_text})
        return Page(chats, next_token)

    # -- helpers ------------------------------------------------------------

    @staticmethod
    def _token_id(page_token: str) -> uuid.UUID | None:
        if not page_token:
            return None
        return rules.parse_id(rules.decode_page_token(page_token, {"after"})["after"], "page_token")

    @staticmethod
    def _page(items: list[T], limit: int, key: Callable[[T], uuid.UUID]) -> Page[T]:
        if len(items) <= limit:
            return Page(items, "")
        items = items[:limit]
        return Page(items, rules.encode_page_token({"after": str(key(items[-1]))}))


def _host_of_new(kind: MemberKind, caller: Caller | None) -> str | None:
    """The host of a member about to be created: the service that creates an agent."""
    if caller is None or caller.service is None:
        return None
    if kind is not MemberKind.AGENT:
        raise NotAllowed("a service creates only agent members")
    return caller.service


def _token_matches(caller: Caller, member: Member) -> Member:
    """The member, once sure its token was issued for its workspace (members never move),
    and that a view through someone else's eyes is an agent's."""
    if caller.view_as is not None:
        claims = caller.claims
        if member.kind is not MemberKind.AGENT or claims.workspace_id != member.workspace_id:
            raise NotAllowed("a person may view as an agent of their workspace, and as no one else")
        if not audit.ADMIN_ROLES & set(claims.roles) and member.owner_id != claims.member_id:
            raise NotAllowed("only the agent's owner and the workspace's admins may view as it")
        return member
    if caller.claims.workspace_id != member.workspace_id:
        raise Unauthenticated("the access token names another workspace than its member's")
    return member


def member_actor(member: Member) -> audit.Actor:
    """The audit actor a member is (for actions whose caller is not yet a member)."""
    kind = audit.ActorKind.AGENT if member.kind is MemberKind.AGENT else audit.ActorKind.HUMAN
    return audit.Actor(kind, member_id=member.id)


def _manages(caller: Caller | None, member: Member) -> bool:
    """Whether a service may change `member`: only an agent it hosts."""
    if caller is None or caller.service is None:
        return False
    return member.kind is MemberKind.AGENT and member.host == caller.service


def _recorded(workspace_id: uuid.UUID, sequence: int, at: datetime, event: Event) -> RecordedEvent:
    """A just-committed event as the event log will give it back."""
    return RecordedEvent(
        workspace_id=workspace_id,
        sequence=sequence,
        recorded_at=at,
        event=as_recorded(event),
        group_id=event_group_id(event),
    )
