"""What the IM's handlers need from the outside world, as abstract ports.

The SQL adapter (`services.im.adapters.sql`) implements them for SQLite and
PostgreSQL; the unit tests implement them in memory.
"""

from __future__ import annotations

import abc
import enum
import uuid
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Protocol, Self

from services.common.audit import AuditRecord
from services.common.signals import Signal
from services.im.domain.model import (
    Event,
    Group,
    GroupKind,
    Member,
    MemberKind,
    Membership,
    Message,
    MessageCreated,
    ReadState,
    ReadUpdated,
    RecordedEvent,
    Workspace,
)
from services.im.service_layer.auth_ports import AuthRecords


class DuplicateRequest(Exception):
    """A message with the same (sender, request_id) was stored first."""


@dataclass(frozen=True, slots=True)
class GroupAccess:
    """What sending to a group needs to know, read in one query.

    Attributes:
        workspace_id: the group's workspace.
        members: those of the asked-about member ids that are in the group.
        reply_to_group: the group of the replied-to message (None: no such message).
    """

    workspace_id: uuid.UUID
    members: frozenset[uuid.UUID]
    reply_to_group: uuid.UUID | None


class Transaction(AuthRecords, abc.ABC):
    """One unit of work: everything in it commits together or not at all.

    Its identity part (accounts, tokens, invites) is `AuthRecords`.

    Used as `async with uow() as tx: ...; await tx.commit()`; leaving the
    block without commit rolls back.
    """

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.rollback()

    @abc.abstractmethod
    async def commit(self) -> None: ...

    @abc.abstractmethod
    async def rollback(self) -> None: ...

    # Workspaces
    @abc.abstractmethod
    async def add_workspace(self, workspace: Workspace) -> None: ...

    @abc.abstractmethod
    async def get_workspace(self, workspace_id: uuid.UUID) -> Workspace | None: ...

    @abc.abstractmethod
    async def list_workspaces(
        self, *, ids: list[uuid.UUID] | None, after: uuid.UUID | None, limit: int
    ) -> list[Workspace]: ...

    # Members
    @abc.abstractmethod
    async def add_member(self, member: Member) -> None: ...

    @abc.abstractmethod
    async def get_member(self, member_id: uuid.UUID) -> Member | None: ...

    @abc.abstractmethod
    async def get_members(self, member_ids: list[uuid.UUID]) -> dict[uuid.UUID, Member]: ...

    @abc.abstractmethod
    async def list_members(
        self, workspace_id: uuid.UUID, *, after: uuid.UUID | None, limit: int
    ) -> list[Member]: ...

    @abc.abstractmethod
    async def update_member(self, member: Member) -> None: ...

    @abc.abstractmethod
    async def set_owner(self, member_id: uuid.UUID, owner_id: uuid.UUID) -> bool:
        """Makes `owner_id` the agent's owner; True if that changed it."""

    # Quotas and the audit log
    @abc.abstractmethod
    async def lock_workspace(self, workspace_id: uuid.UUID) -> bool:
        """Holds the workspace until the transaction ends, so that what is
        counted against its quotas cannot change meanwhile; False if there is
        no such workspace."""

    @abc.abstractmethod
    async def count_members(self, workspace_id: uuid.UUID, kind: MemberKind) -> int: ...

    @abc.abstractmethod
    async def count_groups(self, workspace_id: uuid.UUID, kind: GroupKind) -> int: ...

    @abc.abstractmethod
    async def add_audit(self, record: AuditRecord) -> None:
        """Adds an audit record, which commits with the change it records."""

    # Groups and memberships
    @abc.abstractmethod
    async def add_group(self, group: Group) -> None:
        """Stores the group and a membership for each of its member_ids."""

    @abc.abstractmethod
    async def get_group(self, group_id: uuid.UUID) -> Group | None: ...

    @abc.abstractmethod
    async def find_direct_group(self, workspace_id: uuid.UUID, direct_key: str) -> Group | None: ...

    @abc.abstractmethod
    async def list_groups_of(
        self, member_id: uuid.UUID, *, after: uuid.UUID | None, limit: int | None
    ) -> list[Group]:
        """The member's groups in id order, after a group id, at most limit."""

    @abc.abstractmethod
    async def rename_group(self, group_id: uuid.UUID, name: str) -> None: ...

    @abc.abstractmethod
    async def add_memberships(
        self, group_id: uuid.UUID, member_ids: list[uuid.UUID], joined_at: datetime
    ) -> None: ...

    @abc.abstractmethod
    async def remove_memberships(self, group_id: uuid.UUID, member_ids: list[uuid.UUID]) -> None: ...

    @abc.abstractmethod
    async def get_membership(self, group_id: uuid.UUID, member_id: uuid.UUID) -> Membership | None: ...

    @abc.abstractmethod
    async def group_access(
        self, group_id: uuid.UUID, member_ids: list[uuid.UUID], reply_to: uuid.UUID | None
    ) -> GroupAccess | None:
        """The group's workspace, which of member_ids are in it, and where reply_to is (None: no group)."""

    @abc.abstractmethod
    async def memberships_of(self, member_id: uuid.UUID) -> list[Membership]: ...

    # Messages
    @abc.abstractmethod
    async def add_message(self, message: Message) -> None:
        """Stores a message.

        Raises:
            DuplicateRequest: the sender already used message.request_id.
        """

    @abc.abstractmethod
    async def find_message_by_request(self, sender_id: uuid.UUID, request_id: str) -> Message | None: ...

    @abc.abstractmethod
    async def get_message(self, message_id: uuid.UUID) -> Message | None: ...

    @abc.abstractmethod
    async def edit_message(self, message_id: uuid.UUID, content: str, edited_at: datetime) -> None: ...

    @abc.abstractmethod
    async def list_messages(
        self,
        group_id: uuid.UUID,
        *,
        before: uuid.UUID | None,
        after: uuid.UUID | None,
        limit: int,
    ) -> list[Message]:
        """Messages strictly between the bounds, in id order.

        With `after` set (and `before` not), the oldest `limit` messages
        after it; otherwise the newest `limit` before `before` (or overall).
        """

    @abc.abstractmethod
    async def last_messages(self, group_ids: list[uuid.UUID]) -> dict[uuid.UUID, Message]: ...

    # Read state
    @abc.abstractmethod
    async def advance_read(self, group_id: uuid.UUID, member_id: uuid.UUID, up_to: uuid.UUID) -> bool:
        """Moves the read position to up_to if that is forward; True if it moved."""

    @abc.abstractmethod
    async def unread_counts(self, member_id: uuid.UUID, group_ids: list[uuid.UUID]) -> dict[uuid.UUID, int]:
        """Per group: messages after the member's read position not sent by it."""

    @abc.abstractmethod
    async def unread_messages(self, member_id: uuid.UUID, *, limit: int) -> tuple[list[Message], int]:
        """The member's oldest unread messages across its groups, and how many in all."""

    # Events and idempotency
    @abc.abstractmethod
    async def append_event(self, workspace_id: uuid.UUID, event: Event, at: datetime) -> int:
        """Records an event in this transaction; returns its sequence number."""

    @abc.abstractmethod
    async def read_events(
        self, workspace_id: uuid.UUID, *, after: int, up_to: int | None, limit: int
    ) -> list[RecordedEvent]: ...

    @abc.abstractmethod
    async def group_changes(self, workspace_id: uuid.UUID, *, after: int) -> list[RecordedEvent]:
        """Every GroupChanged event of the workspace after a sequence number, in order."""

    @abc.abstractmethod
    async def last_event_sequence(self, workspace_id: uuid.UUID) -> int: ...

    @abc.abstractmethod
    async def find_request(self, scope: uuid.UUID, request_id: str) -> tuple[str, uuid.UUID] | None:
        """The (fingerprint, resource id) a request_id was used for, if any."""

    @abc.abstractmethod
    async def remember_request(
        self, scope: uuid.UUID, request_id: str, fingerprint: str, resource_id: uuid.UUID
    ) -> None:
        """Records a request_id; raises DuplicateRequest if it was recorded first."""


class UnitOfWorkFactory(Protocol):
    """Makes a transaction; `write=False` promises it only reads."""

    def __call__(self, *, write: bool = True) -> Transaction: ...


class Store(Protocol):
    """Where the IM's state lives (the SQL database; an in-memory fake in unit tests)."""

    def transaction(self, *, write: bool = True) -> Transaction:
        """A new unit of work; it rolls back unless committed."""
        ...

    async def ping(self) -> bool:
        """Whether the store answers (readiness)."""
        ...

    async def aclose(self) -> None:
        """Releases its connections. Idempotent."""
        ...


class MessageLog(abc.ABC):
    """Appends messages: the hot path, one atomic step of its own.

    Kept apart from `Transaction` so that an adapter can make each step a
    single round trip (on PostgreSQL, one statement each: no BEGIN, no
    COMMIT, and the event counter's lock is held only while the appending
    statement runs).
    """

    @abc.abstractmethod
    async def access(
        self, group_id: uuid.UUID, member_ids: list[uuid.UUID], reply_to: uuid.UUID | None
    ) -> GroupAccess | None:
        """What sending to the group needs to know (see `Transaction.group_access`)."""

    @abc.abstractmethod
    async def append(self, message: Message, at: datetime) -> int | None:
        """Stores the message and its MessageCreated event, committed together.

        Only if the request is valid: the message's group is in its workspace,
        the sender and every mentioned member are in the group, the replied-to
        message (if any) is in the group, and the sender has not used
        message.request_id before. Returns the event's sequence number, or
        None when nothing was stored.
        """

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Finishes what was accepted and releases resources. Idempotent."""


class TransactionalMessageLog(MessageLog):
    """The `MessageLog` any unit of work provides: check, insert and record in one transaction."""

    def __init__(self, uow: UnitOfWorkFactory) -> None:
        self._uow = uow

    async def access(
        self, group_id: uuid.UUID, member_ids: list[uuid.UUID], reply_to: uuid.UUID | None
    ) -> GroupAccess | None:
        async with self._uow(write=False) as tx:
            return await tx.group_access(group_id, member_ids, reply_to)

    async def append(self, message: Message, at: datetime) -> int | None:
        async with self._uow() as tx:
            wanted = {message.sender_id, *message.mentions}
            access = await tx.group_access(message.group_id, list(wanted), message.reply_to)
            if (
                access is None
                or access.workspace_id != message.workspace_id
                or access.members != wanted
                or (message.reply_to is not None and access.reply_to_group != message.group_id)
            ):
                return None
            try:
                await tx.add_message(message)
            except DuplicateRequest:
                return None
            sequence = await tx.append_event(message.workspace_id, MessageCreated(message=message), at)
            await tx.commit()
            return sequence


class ReadOutcome(enum.Enum):
    """How a MarkRead request turned out."""

    DONE = "done"
    # The group does not exist in the member's workspace.
    NO_GROUP = "no_group"
    NOT_A_MEMBER = "not_a_member"
    # The read-up-to message is not a message of the group.
    NOT_IN_GROUP = "not_in_group"


@dataclass(frozen=True, slots=True)
class MarkedRead:
    """What `Inbox.mark_read` did.

    Attributes:
        outcome: DONE, or why nothing was done.
        state: the read state after the call (DONE only).
        sequence: the ReadUpdated event's sequence number, if the position moved.
    """

    outcome: ReadOutcome
    state: ReadState | None = None
    sequence: int | None = None


class Inbox(abc.ABC):
    """A member's read state: what an agent reads and marks on each wake.

    Kept apart from `Transaction`, like `MessageLog`, so that an adapter can
    make each call one round trip (or one thread hop).
    """

    @abc.abstractmethod
    async def unread(self, member_id: uuid.UUID, *, limit: int) -> tuple[list[Message], int]:
        """The member's oldest unread messages across its groups, and how many in all
        (see `Transaction.unread_messages`)."""

    @abc.abstractmethod
    async def mark_read(
        self, member: Member, group_id: uuid.UUID, up_to: uuid.UUID, at: datetime
    ) -> MarkedRead:
        """Moves the member's read position in the group forward to `up_to`.

        Checked in this order: the group is in the member's workspace, the
        member is in it, `up_to` is one of its messages. If the position
        moved, the ReadUpdated event (recorded at `at`, with the state
        returned) commits together with it.
        """

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Releases resources. Idempotent."""


class TransactionalInbox(Inbox):
    """The `Inbox` any unit of work provides: each call one transaction."""

    def __init__(self, uow: UnitOfWorkFactory) -> None:
        self._uow = uow

    async def unread(self, member_id: uuid.UUID, *, limit: int) -> tuple[list[Message], int]:
        async with self._uow(write=False) as tx:
            return await tx.unread_messages(member_id, limit=limit)

    async def mark_read(
        self, member: Member, group_id: uuid.UUID, up_to: uuid.UUID, at: datetime
    ) -> MarkedRead:
        async with self._uow() as tx:
            group = await tx.get_group(group_id)
            if group is None or group.workspace_id != member.workspace_id:
                return MarkedRead(ReadOutcome.NO_GROUP)
            if member.id not in group.member_ids:
                return MarkedRead(ReadOutcome.NOT_A_MEMBER)
            message = await tx.get_message(up_to)
            if message is None or message.group_id != group.id:
                return MarkedRead(ReadOutcome.NOT_IN_GROUP)
            moved = await tx.advance_read(group.id, member.id, up_to)
            membership = await tx.get_membership(group.id, member.id)
            assert membership is not None
            unread = (await tx.unread_counts(member.id, [group.id])).get(group.id, 0)
            state = ReadState(
                group_id=group.id,
                member_id=member.id,
                last_read_message_id=membership.last_read_message_id,
                unread_count=unread,
            )
            if not moved:
                return MarkedRead(ReadOutcome.DONE, state)
            sequence = await tx.append_event(group.workspace_id, ReadUpdated(read_state=state), at)
            await tx.commit()
            return MarkedRead(ReadOutcome.DONE, state, sequence)


class EventLog(abc.ABC):
    """Reads a workspace's committed events: what every wake-up of a live feed costs."""

    @abc.abstractmethod
    async def read(
        self, workspace_id: uuid.UUID, *, after: int, up_to: int | None, limit: int
    ) -> list[RecordedEvent]:
        """At most `limit` events after sequence `after` (and up to `up_to`), in order."""

    @abc.abstractmethod
    async def last_sequence(self, workspace_id: uuid.UUID) -> int:
        """The sequence number of the workspace's last committed event (0: none)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Releases resources. Idempotent."""


class TransactionalEventLog(EventLog):
    """The `EventLog` any unit of work provides."""

    def __init__(self, uow: UnitOfWorkFactory) -> None:
        self._uow = uow

    async def read(
        self, workspace_id: uuid.UUID, *, after: int, up_to: int | None, limit: int
    ) -> list[RecordedEvent]:
        async with self._uow(write=False) as tx:
            return await tx.read_events(workspace_id, after=after, up_to=up_to, limit=limit)

    async def last_sequence(self, workspace_id: uuid.UUID) -> int:
        async with self._uow(write=False) as tx:
            return await tx.last_event_sequence(workspace_id)


# Tells every replica's event hub that a workspace has new events (the key is
# the workspace, the sequence its newest event's).
EventSignal = Signal
