"""What every IM handler is given (`Deps`), and the checks they share: who
the caller is, what it may see, how a change is committed and signalled.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Generic, TypeVar

from services.common import audit
from services.common.identity import Caller
from services.im.domain import rules
from services.im.domain.errors import (
    InvalidRequest,
    NotAllowed,
    NotAMember,
    NotFound,
    RequestIdReused,
    Unauthenticated,
)
from services.im.domain.model import (
    Event,
    Group,
    Member,
    MemberKind,
    RecordedEvent,
    Workspace,
    as_recorded,
    event_group_id,
)
from services.im.service_layer.ports import (
    EventSignal,
    Inbox,
    MessageLog,
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


def utc_now() -> datetime:
    return datetime.now(UTC)


T = TypeVar("T")


class Page(Generic[T]):
    """One page of results and the token for the next one."""

    __slots__ = ("items", "next_token")

    def __init__(self, items: list[T], next_token: str) -> None:
        self.items = items
        self.next_token = next_token


class Deps:
    """What the IM's handlers share. Every replica can serve every call: the
    only state kept between calls is a cache of immutable member identities.

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
        self.uow = uow
        self.messages = messages
        self.inbox = inbox or TransactionalInbox(uow)
        self.on_committed = on_committed
        self.signal = signal
        self.limits = limits or rules.Limits()
        self.quotas = quotas or rules.Quotas()
        self.clock = clock
        self._identities: dict[uuid.UUID, Member] = {}

    # -- who calls ----------------------------------------------------------

    async def acting_member(self, tx: Transaction, caller: Caller | None) -> Member:
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

    async def caller_member(self, caller: Caller | None) -> Member:
        """`acting_member` outside a transaction: usually answered from the cache."""
        if caller is not None and caller.member_id is not None and caller.view_as is None:
            cached = self._identities.get(caller.member_id)
            if cached is not None:
                return _token_matches(caller, cached)
        async with self.uow(write=False) as tx:
            return await self.acting_member(tx, caller)

    async def caller_workspace(self, tx: Transaction, caller: Caller | None, requested: str) -> uuid.UUID:
        """The workspace a call is about: the actor's own, or for a service, the one named."""
        wanted = rules.parse_optional_id(requested, "workspace_id")
        if caller is not None and caller.is_service:
            if wanted is None:
                raise InvalidRequest("workspace_id is required for a service call without a member")
            if await tx.get_workspace(wanted) is None:
                raise NotFound(f"workspace {wanted} not found")
            return wanted
        member = await self.acting_member(tx, caller)
        if wanted is not None and wanted != member.workspace_id:
            raise NotFound(f"workspace {wanted} not found")
        return member.workspace_id

    # -- what the caller may see ----------------------------------------------

    @staticmethod
    async def visible_group(tx: Transaction, member: Member, group_id: uuid.UUID) -> Group:
        group = await tx.get_group(group_id)
        if group is None or group.workspace_id != member.workspace_id:
            raise NotFound(f"group {group_id} not found")
        if member.id not in group.member_ids:
            raise NotAMember(f"member {member.id} is not in group {group_id}")
        return group

    @staticmethod
    async def check_workspace_members(
        tx: Transaction, workspace_id: uuid.UUID, member_ids: tuple[uuid.UUID, ...]
    ) -> None:
        found = await tx.get_members(list(member_ids))
        for member_id in member_ids:
            member = found.get(member_id)
            if member is None or member.workspace_id != workspace_id:
                raise NotFound(f"member {member_id} not found")

    # -- changes ------------------------------------------------------------

    async def commit(self, tx: Transaction, workspace_id: uuid.UUID, events: list[Event]) -> None:
        """Records the events, commits, then wakes the event hubs."""
        now = self.clock()
        sequences = [await tx.append_event(workspace_id, event, now) for event in events]
        await tx.commit()
        if events:
            await self.signal_committed(
                [
                    recorded(workspace_id, sequence, now, event)
                    for sequence, event in zip(sequences, events, strict=True)
                ]
            )

    async def signal_committed(self, events: list[RecordedEvent]) -> None:
        """Offers the events just committed to this process's hub, then wakes every hub."""
        workspace_id = events[-1].workspace_id
        if self.on_committed is not None:
            try:
                self.on_committed(events)
            except Exception:
                # The signal below still makes the hub read them.
                logger.warning("could not hand out new events of workspace %s", workspace_id, exc_info=True)
        try:
            await self.signal.publish(workspace_id, events[-1].sequence)
        except Exception:
            # The events are committed; subscribers catch up on the next signal.
            logger.warning("could not signal new events of workspace %s", workspace_id, exc_info=True)

    @staticmethod
    async def replay(
        tx: Transaction, scope: uuid.UUID, request_id: str | None, fingerprint: str
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


# -- pages --------------------------------------------------------------------


def page_start(page_token: str) -> uuid.UUID | None:
    """The id a page of a list by id starts after."""
    if not page_token:
        return None
    return rules.parse_id(rules.decode_page_token(page_token, {"after"})["after"], "page_token")


def page_of(items: list[T], limit: int, key: Callable[[T], uuid.UUID]) -> Page[T]:
    """A page of `limit` items out of `limit + 1` read (the extra one says there are more)."""
    if len(items) <= limit:
        return Page(items, "")
    items = items[:limit]
    return Page(items, rules.encode_page_token({"after": str(key(items[-1]))}))


# -- helpers ------------------------------------------------------------------


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


def recorded(workspace_id: uuid.UUID, sequence: int, at: datetime, event: Event) -> RecordedEvent:
    """A just-committed event as the event log will give it back."""
    return RecordedEvent(
        workspace_id=workspace_id,
        sequence=sequence,
        recorded_at=at,
        event=as_recorded(event),
        group_id=event_group_id(event),
    )
