"""In-memory fakes of the IM's ports, with the SQL adapter's semantics.

`InMemoryStore` holds the committed state. A `FakeTransaction` reads a
snapshot taken when it began and writes to a private copy, recording each
change; `commit` replays the changes onto the then-current committed state
and swaps it in at once, `rollback` forgets them. Committed `State` objects
are never changed in place, so a snapshot is just a reference.

What the database would do with concurrent transactions is imitated where
the handlers depend on it: a unique key that another open transaction has
just inserted makes an insert wait for that transaction to end (and then
fail with `DuplicateRequest` if it committed), and appending an event holds
the workspace's counter until the end of the transaction, so sequence order
is commit order. After a failed insert the transaction is aborted, as on
PostgreSQL: anything but rollback then fails.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Self, TypeVar

from services.common.audit import AuditRecord
from services.im.adapters import codec
from services.im.domain.model import (
    NIL_ID,
    Event,
    Group,
    GroupChanged,
    GroupKind,
    Member,
    MemberKind,
    Membership,
    Message,
    RecordedEvent,
    Role,
    Workspace,
    event_group_id,
)
from services.im.service_layer.auth_ports import LoginTaken
from services.im.service_layer.ports import DuplicateRequest, EventSignal, GroupAccess, Transaction
from tests.unit.auth_fakes import AuthState, FakeAuthRecords

T = TypeVar("T")

Hook = Callable[["FakeTransaction"], Awaitable[None] | None]
Receiver = Callable[[uuid.UUID | None, int], None]


def failing(error: Exception) -> Hook:
    """A hook that makes the call fail with the error."""

    def hook(tx: FakeTransaction) -> None:
        raise error

    return hook


class IntegrityError(Exception):
    """A constraint the database enforces other than the ones reported as DuplicateRequest."""


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """An events-table row: the event is kept in its stored (encoded) form."""

    sequence: int
    kind: str
    payload: str
    group_id: uuid.UUID | None
    recorded_at: datetime


@dataclass
class State:
    """The tables. Groups are stored without member_ids: memberships hold them."""

    workspaces: dict[uuid.UUID, Workspace] = field(default_factory=dict)
    counters: dict[uuid.UUID, int] = field(default_factory=dict)
    members: dict[uuid.UUID, Member] = field(default_factory=dict)
    groups: dict[uuid.UUID, Group] = field(default_factory=dict)
    # group id -> member id -> membership
    memberships: dict[uuid.UUID, dict[uuid.UUID, Membership]] = field(default_factory=dict)
    messages: dict[uuid.UUID, Message] = field(default_factory=dict)
    events: dict[uuid.UUID, list[StoredEvent]] = field(default_factory=dict)
    # (scope, request_id) -> (fingerprint, resource id)
    requests: dict[tuple[uuid.UUID, str], tuple[str, uuid.UUID]] = field(default_factory=dict)
    # Accounts, tokens, invites, sign-in attempts.
    auth: AuthState = field(default_factory=AuthState)
    audit: list[AuditRecord] = field(default_factory=list)

    def copy(self) -> State:
        return State(
            workspaces=dict(self.workspaces),
            counters=dict(self.counters),
            members=dict(self.members),
            groups=dict(self.groups),
            memberships={g: dict(ms) for g, ms in self.memberships.items()},
            messages=dict(self.messages),
            events={w: list(rows) for w, rows in self.events.items()},
            requests=dict(self.requests),
            auth=self.auth.copy(),
            audit=list(self.audit),
        )

    # -- constraints: each raises what the SQL adapter raises -----------------

    def has_direct_key(self, workspace_id: uuid.UUID, key: str) -> bool:
        return any(g.workspace_id == workspace_id and g.direct_key == key for g in self.groups.values())

    def has_message_request(self, sender_id: uuid.UUID, request_id: str) -> bool:
        return self.message_by_request(sender_id, request_id) is not None

    def message_by_request(self, sender_id: uuid.UUID, request_id: str) -> Message | None:
        for message in self.messages.values():
            if message.sender_id == sender_id and message.request_id == request_id:
                return message
        return None

    # -- changes, replayed on commit ------------------------------------------

    def insert_workspace(self, workspace: Workspace) -> None:
        if workspace.id in self.workspaces:
            raise IntegrityError(f"workspace {workspace.id} exists")
        self.workspaces[workspace.id] = workspace
        self.counters[workspace.id] = 0

    def insert_member(self, member: Member) -> None:
        if member.id in self.members:
            raise IntegrityError(f"member {member.id} exists")
        self.members[member.id] = member

    def insert_group(self, group: Group) -> None:
        if group.id in self.groups:
            if group.direct_key is not None:
                raise DuplicateRequest(group.direct_key)
            raise IntegrityError(f"group {group.id} exists")
        if group.direct_key is not None and self.has_direct_key(group.workspace_id, group.direct_key):
            raise DuplicateRequest(group.direct_key)
        self.groups[group.id] = replace(group, member_ids=())

    def insert_memberships(
        self, group_id: uuid.UUID, member_ids: list[uuid.UUID], joined_at: datetime
    ) -> None:
        rows = self.memberships.setdefault(group_id, {})
        for member_id in member_ids:
            if member_id in rows:
                raise IntegrityError(f"member {member_id} is already in group {group_id}")
            rows[member_id] = Membership(group_id, member_id, NIL_ID, joined_at)

    def insert_message(self, message: Message) -> None:
        clash = message.id in self.messages or (
            message.request_id is not None and self.has_message_request(message.sender_id, message.request_id)
        )
        if clash:
            if message.request_id is None:
                raise IntegrityError(f"message {message.id} exists")
            raise DuplicateRequest(message.request_id)
        self.messages[message.id] = message

    def insert_request(
        self, scope: uuid.UUID, request_id: str, fingerprint: str, resource_id: uuid.UUID
    ) -> None:
        if (scope, request_id) in self.requests:
            raise DuplicateRequest(request_id)
        self.requests[(scope, request_id)] = (fingerprint, resource_id)

    def insert_event(self, workspace_id: uuid.UUID, row: StoredEvent) -> None:
        if workspace_id not in self.counters:
            # The SQL adapter's UPDATE ... RETURNING finds no counter row.
            raise LookupError(f"no event counter for workspace {workspace_id}")
        self.counters[workspace_id] = row.sequence
        self.events.setdefault(workspace_id, []).append(row)

    def advance_read(self, group_id: uuid.UUID, member_id: uuid.UUID, up_to: uuid.UUID) -> bool:
        rows = self.memberships.get(group_id, {})
        current = rows.get(member_id)
        if current is None or not current.last_read_message_id < up_to:
            return False
        rows[member_id] = replace(current, last_read_message_id=up_to)
        return True

    # -- queries --------------------------------------------------------------

    def group(self, row: Group) -> Group:
        rows = self.memberships.get(row.id, {}).values()
        ordered = sorted(rows, key=lambda m: (m.joined_at or datetime.min.replace(tzinfo=UTC), m.member_id))
        return replace(row, member_ids=tuple(m.member_id for m in ordered))

    def unread(self, member_id: uuid.UUID) -> list[Message]:
        positions = {
            group_id: rows[member_id].last_read_message_id
            for group_id, rows in self.memberships.items()
            if member_id in rows
        }
        return sorted(
            (
                m
                for m in self.messages.values()
                if m.group_id in positions and m.id > positions[m.group_id] and m.sender_id != member_id
            ),
            key=lambda m: m.id,
        )


class InMemoryStore:
    """The committed state, shared by the transactions made from it.

    Args:
        yield_on_call: every port call first yields to the event loop, as real
            I/O would, so that concurrent handlers interleave.

    Attributes:
        hooks: port method name -> hook called (and awaited if async) at the
            start of that method, before it does anything; a hook may raise
            to make the call fail.
    """

    def __init__(self, *, yield_on_call: bool = False) -> None:
        self.state = State()
        self.yield_on_call = yield_on_call
        self.hooks: dict[str, Hook] = {}
        self.commits = 0
        self.rollbacks = 0
        self.calls: list[str] = []
        self.closed = False
        # Unique keys (and event counters) held by open transactions.
        self._claims: dict[Hashable, FakeTransaction] = {}

    def transaction(self, *, write: bool = True) -> FakeTransaction:
        """The unit-of-work factory: pass `store.transaction` as `uow`."""
        return FakeTransaction(self, write=write)

    __call__ = transaction

    async def ping(self) -> bool:
        return True

    async def aclose(self) -> None:
        self.closed = True

    def last_sequence(self, workspace_id: uuid.UUID) -> int:
        """The committed event sequence of a workspace."""
        return self.state.counters.get(workspace_id, 0)

    def events_of(self, workspace_id: uuid.UUID) -> list[RecordedEvent]:
        """The workspace's committed events, decoded."""
        return [_recorded(workspace_id, row) for row in self.state.events.get(workspace_id, [])]

    def open_claims(self) -> int:
        return len(self._claims)


def _recorded(workspace_id: uuid.UUID, row: StoredEvent) -> RecordedEvent:
    return RecordedEvent(
        workspace_id=workspace_id,
        sequence=row.sequence,
        recorded_at=row.recorded_at,
        event=codec.decode_event(row.kind, row.payload),
        group_id=row.group_id,
    )


class FakeTransaction(FakeAuthRecords, Transaction):
    """One unit of work against an `InMemoryStore`; see the module docstring."""

    def __init__(self, store: InMemoryStore, *, write: bool) -> None:
        self._store = store
        self.write = write
        self._base = store.state
        self._work: State | None = None
        self._changes: list[Callable[[State], object]] = []
        self._claims: list[Hashable] = []
        self._ended = False
        self._aborted = False
        self.ended = asyncio.Event()
        self.committed = False

    async def __aenter__(self) -> Self:
        self._base = self._store.state
        return self

    # -- plumbing -------------------------------------------------------------

    @property
    def _view(self) -> State:
        return self._work if self._work is not None else self._base

    async def _enter(self, name: str) -> None:
        if self._ended:
            raise AssertionError(f"{name} called after the transaction ended")
        if self._aborted:
            raise AssertionError(f"{name} called in a transaction aborted by a failed statement")
        self._store.calls.append(name)
        if self._store.yield_on_call:
            await asyncio.sleep(0)
        hook = self._store.hooks.get(name)
        if hook is not None:
            result = hook(self)
            if inspect.isawaitable(result):
                await result

    def _change(self, change: Callable[[State], T]) -> T:
        """Applies a change to this transaction's copy and records it for commit."""
        if not self.write:
            raise AssertionError("a transaction opened with write=False must not write")
        if self._work is None:
            self._work = self._base.copy()
        try:
            result = change(self._work)
        except (DuplicateRequest, IntegrityError, LookupError, LoginTaken):
            self._aborted = True
            raise
        self._changes.append(change)
        return result

    def _auth(self) -> AuthState:
        return self._view.auth

    def _auth_change(self, change: Callable[[AuthState], T]) -> T:
        return self._change(lambda s: change(s.auth))

    async def _auth_unique(
        self, key: Hashable, exists: Callable[[AuthState], bool], error: Exception
    ) -> None:
        await self._insert_unique(key, lambda s: exists(s.auth), error)

    def _set_member_role(self, member_id: uuid.UUID, role: Role) -> None:
        def change(s: State) -> None:
            current = s.members.get(member_id)
            if current is not None:
                s.members[member_id] = replace(current, role=role)

        self._change(change)

    async def _hold(self, key: Hashable) -> None:
        """Waits until no other open transaction holds the key, then holds it until the end."""
        while True:
            holder = self._store._claims.get(key)
            if holder is None or holder is self:
                break
            await holder.ended.wait()
        if self._store._claims.get(key) is None:
            self._store._claims[key] = self
            self._claims.append(key)

    async def _insert_unique(self, key: Hashable, exists: Callable[[State], bool], error: Exception) -> None:
        """The database's unique index: sees rows other transactions committed meanwhile."""
        await self._hold(key)
        if exists(self._store.state) or exists(self._view):
            self._aborted = True
            raise error

    def _end(self) -> None:
        self._ended = True
        for key in self._claims:
            if self._store._claims.get(key) is self:
                del self._store._claims[key]
        self._claims.clear()
        self.ended.set()

    async def commit(self) -> None:
        await self._enter("commit")
        try:
            if self._changes:
                state = self._store.state.copy()
                for change in self._changes:
                    change(state)
                self._store.state = state
            self._store.commits += 1
            self.committed = True
        finally:
            self._end()

    async def rollback(self) -> None:
        if self._ended:
            return
        self._store.rollbacks += 1
        self._work = None
        self._changes.clear()
        self._end()

    # -- workspaces -----------------------------------------------------------

    async def add_workspace(self, workspace: Workspace) -> None:
        await self._enter("add_workspace")
        self._change(lambda s: s.insert_workspace(workspace))

    async def get_workspace(self, workspace_id: uuid.UUID) -> Workspace | None:
        await self._enter("get_workspace")
        return self._view.workspaces.get(workspace_id)

    async def list_workspaces(
        self, *, ids: list[uuid.UUID] | None, after: uuid.UUID | None, limit: int
    ) -> list[Workspace]:
        await self._enter("list_workspaces")
        found = sorted(
            (
                w
                for w in self._view.workspaces.values()
                if (ids is None or w.id in ids) and (after is None or w.id > after)
            ),
            key=lambda w: w.id,
        )
        return found[:limit]

    # -- members --------------------------------------------------------------

    async def add_member(self, member: Member) -> None:
        await self._enter("add_member")
        self._change(lambda s: s.insert_member(member))

    async def get_member(self, member_id: uuid.UUID) -> Member | None:
        await self._enter("get_member")
        return self._view.members.get(member_id)

    async def get_members(self, member_ids: list[uuid.UUID]) -> dict[uuid.UUID, Member]:
        await self._enter("get_members")
        members = self._view.members
        return {m: members[m] for m in member_ids if m in members}

    async def list_members(
        self, workspace_id: uuid.UUID, *, after: uuid.UUID | None, limit: int
    ) -> list[Member]:
        await self._enter("list_members")
        found = sorted(
            (
                m
                for m in self._view.members.values()
                if m.workspace_id == workspace_id and (after is None or m.id > after)
            ),
            key=lambda m: m.id,
        )
        return found[:limit]

    async def set_owner(self, member_id: uuid.UUID, owner_id: uuid.UUID) -> bool:
        await self._enter("set_owner")
        current = self._view.members.get(member_id)
        if current is None or current.owner_id == owner_id:
            return False

        def change(s: State) -> None:
            s.members[member_id] = replace(s.members[member_id], owner_id=owner_id)

        self._change(change)
        return True

    async def lock_workspace(self, workspace_id: uuid.UUID) -> bool:
        await self._enter("lock_workspace")
        return workspace_id in self._view.workspaces

    async def count_members(self, workspace_id: uuid.UUID, kind: MemberKind) -> int:
        await self._enter("count_members")
        return sum(
            1 for m in self._view.members.values() if m.workspace_id == workspace_id and m.kind is kind
        )

    async def count_groups(self, workspace_id: uuid.UUID, kind: GroupKind) -> int:
        await self._enter("count_groups")
        groups = self._view.groups.values()
        return sum(1 for g in groups if g.workspace_id == workspace_id and g.kind is kind)

    async def add_audit(self, record: AuditRecord) -> None:
        await self._enter("add_audit")
        self._change(lambda s: s.audit.append(record))

    async def update_member(self, member: Member) -> None:
        await self._enter("update_member")

        def change(s: State) -> None:
            current = s.members.get(member.id)
            if current is not None:
                s.members[member.id] = replace(
                    current, display_name=member.display_name, avatar=member.avatar
                )

        self._change(change)

    # -- groups and memberships -----------------------------------------------

    async def add_group(self, group: Group) -> None:
        await self._enter("add_group")
        if group.direct_key is not None:
            key = group.direct_key
            await self._insert_unique(
                ("direct_key", group.workspace_id, key),
                lambda s: s.has_direct_key(group.workspace_id, key),
                DuplicateRequest(key),
            )
        self._change(lambda s: s.insert_group(group))
        self._change(lambda s: s.insert_memberships(group.id, list(group.member_ids), group.created_at))

    async def get_group(self, group_id: uuid.UUID) -> Group | None:
        await self._enter("get_group")
        row = self._view.groups.get(group_id)
        return self._view.group(row) if row is not None else None

    async def find_direct_group(self, workspace_id: uuid.UUID, direct_key: str) -> Group | None:
        await self._enter("find_direct_group")
        for row in self._view.groups.values():
            if row.workspace_id == workspace_id and row.direct_key == direct_key:
                return self._view.group(row)
        return None

    async def list_groups_of(
        self, member_id: uuid.UUID, *, after: uuid.UUID | None, limit: int | None
    ) -> list[Group]:
        await self._enter("list_groups_of")
        view = self._view
        ids = sorted(
            g for g, rows in view.memberships.items() if member_id in rows and (after is None or g > after)
        )
        if limit is not None:
            ids = ids[:limit]
        return [view.group(view.groups[g]) for g in ids if g in view.groups]

    async def rename_group(self, group_id: uuid.UUID, name: str) -> None:
        await self._enter("rename_group")

        def change(s: State) -> None:
            if group_id in s.groups:
                s.groups[group_id] = replace(s.groups[group_id], name=name)

        self._change(change)

    async def add_memberships(
        self, group_id: uuid.UUID, member_ids: list[uuid.UUID], joined_at: datetime
    ) -> None:
        await self._enter("add_memberships")
        if member_ids:
            ids = list(member_ids)
            self._change(lambda s: s.insert_memberships(group_id, ids, joined_at))

    async def remove_memberships(self, group_id: uuid.UUID, member_ids: list[uuid.UUID]) -> None:
        await self._enter("remove_memberships")
        ids = set(member_ids)

        def change(s: State) -> None:
            rows = s.memberships.get(group_id, {})
            for member_id in ids:
                rows.pop(member_id, None)

        self._change(change)

    async def get_membership(self, group_id: uuid.UUID, member_id: uuid.UUID) -> Membership | None:
        await self._enter("get_membership")
        return self._view.memberships.get(group_id, {}).get(member_id)

    async def group_access(
        self, group_id: uuid.UUID, member_ids: list[uuid.UUID], reply_to: uuid.UUID | None
    ) -> GroupAccess | None:
        await self._enter("group_access")
        row = self._view.groups.get(group_id)
        if row is None:
            return None
        rows = self._view.memberships.get(group_id, {})
        replied = self._view.messages.get(reply_to) if reply_to is not None else None
        return GroupAccess(
            workspace_id=row.workspace_id,
            members=frozenset(m for m in member_ids if m in rows),
            reply_to_group=replied.group_id if replied is not None else None,
        )

    async def memberships_of(self, member_id: uuid.UUID) -> list[Membership]:
        await self._enter("memberships_of")
        return [
            rows[member_id]
            for _, rows in sorted(self._view.memberships.items(), key=lambda item: item[0])
            if member_id in rows
        ]

    # -- messages -------------------------------------------------------------

    async def add_message(self, message: Message) -> None:
        await self._enter("add_message")
        if message.request_id is not None:
            rid = message.request_id
            await self._insert_unique(
                ("message_request", message.sender_id, rid),
                lambda s: s.has_message_request(message.sender_id, rid),
                DuplicateRequest(rid),
            )
        self._change(lambda s: s.insert_message(message))

    async def find_message_by_request(self, sender_id: uuid.UUID, request_id: str) -> Message | None:
        await self._enter("find_message_by_request")
        return self._view.message_by_request(sender_id, request_id)

    async def get_message(self, message_id: uuid.UUID) -> Message | None:
        await self._enter("get_message")
        return self._view.messages.get(message_id)

    async def edit_message(self, message_id: uuid.UUID, content: str, edited_at: datetime) -> None:
        await self._enter("edit_message")

        def change(s: State) -> None:
            if message_id in s.messages:
                s.messages[message_id] = replace(s.messages[message_id], content=content, edited_at=edited_at)

        self._change(change)

    async def list_messages(
        self,
        group_id: uuid.UUID,
        *,
        before: uuid.UUID | None,
        after: uuid.UUID | None,
        limit: int,
    ) -> list[Message]:
        await self._enter("list_messages")
        found = sorted(
            (
                m
                for m in self._view.messages.values()
                if m.group_id == group_id
                and (before is None or m.id < before)
                and (after is None or m.id > after)
            ),
            key=lambda m: m.id,
        )
        if limit <= 0:
            return []
        if after is not None and before is None:
            return found[:limit]
        return found[-limit:]

    async def last_messages(self, group_ids: list[uuid.UUID]) -> dict[uuid.UUID, Message]:
        await self._enter("last_messages")
        wanted = set(group_ids)
        newest: dict[uuid.UUID, Message] = {}
        for message in self._view.messages.values():
            if message.group_id in wanted:
                current = newest.get(message.group_id)
                if current is None or message.id > current.id:
                    newest[message.group_id] = message
        return newest

    # -- read state -----------------------------------------------------------

    async def advance_read(self, group_id: uuid.UUID, member_id: uuid.UUID, up_to: uuid.UUID) -> bool:
        await self._enter("advance_read")
        current = self._view.memberships.get(group_id, {}).get(member_id)
        if current is None or not current.last_read_message_id < up_to:
            return False
        return self._change(lambda s: s.advance_read(group_id, member_id, up_to))

    async def unread_counts(self, member_id: uuid.UUID, group_ids: list[uuid.UUID]) -> dict[uuid.UUID, int]:
        await self._enter("unread_counts")
        wanted = set(group_ids)
        counts: dict[uuid.UUID, int] = {}
        for message in self._view.unread(member_id):
            if message.group_id in wanted:
                counts[message.group_id] = counts.get(message.group_id, 0) + 1
        return counts

    async def unread_messages(self, member_id: uuid.UUID, *, limit: int) -> tuple[list[Message], int]:
        await self._enter("unread_messages")
        unread = self._view.unread(member_id)
        found = unread[: max(limit, 0)]
        if len(found) < limit:
            return found, len(found)
        return found, len(unread)

    # -- events and idempotency -----------------------------------------------

    async def append_event(self, workspace_id: uuid.UUID, event: Event, at: datetime) -> int:
        await self._enter("append_event")
        if not self.write:
            raise AssertionError("a transaction opened with write=False must not write")
        # The counter row stays locked until the end: sequence order is commit order.
        await self._hold(("event_counter", workspace_id))
        committed = self._store.state.counters.get(workspace_id)
        mine = self._view.counters.get(workspace_id)
        if committed is None and mine is None:
            self._aborted = True
            raise LookupError(f"no event counter for workspace {workspace_id}")
        sequence = max(committed or 0, mine or 0) + 1
        kind, payload = codec.encode_event(event)
        row = StoredEvent(sequence, kind, payload, event_group_id(event), at)
        self._change(lambda s: s.insert_event(workspace_id, row))
        return sequence

    async def read_events(
        self, workspace_id: uuid.UUID, *, after: int, up_to: int | None, limit: int
    ) -> list[RecordedEvent]:
        await self._enter("read_events")
        rows = sorted(
            (
                r
                for r in self._view.events.get(workspace_id, [])
                if r.sequence > after and (up_to is None or r.sequence <= up_to)
            ),
            key=lambda r: r.sequence,
        )
        return [_recorded(workspace_id, r) for r in rows[: max(limit, 0)]]

    async def group_changes(self, workspace_id: uuid.UUID, *, after: int) -> list[RecordedEvent]:
        await self._enter("group_changes")
        rows = sorted(
            (r for r in self._view.events.get(workspace_id, []) if r.sequence > after),
            key=lambda r: r.sequence,
        )
        recorded = [_recorded(workspace_id, r) for r in rows]
        return [r for r in recorded if isinstance(r.event, GroupChanged)]

    async def last_event_sequence(self, workspace_id: uuid.UUID) -> int:
        await self._enter("last_event_sequence")
        return self._view.counters.get(workspace_id, 0)

    async def find_request(self, scope: uuid.UUID, request_id: str) -> tuple[str, uuid.UUID] | None:
        await self._enter("find_request")
        return self._view.requests.get((scope, request_id))

    async def remember_request(
        self, scope: uuid.UUID, request_id: str, fingerprint: str, resource_id: uuid.UUID
    ) -> None:
        await self._enter("remember_request")
        await self._insert_unique(
            ("request", scope, request_id),
            lambda s: (scope, request_id) in s.requests,
            DuplicateRequest(request_id),
        )
        self._change(lambda s: s.insert_request(scope, request_id, fingerprint, resource_id))


class FakeClock:
    """A settable clock of timezone-aware UTC datetimes.

    Args:
        start: the first time returned (default 2026-01-01 00:00 UTC).
        tick: how far each reading moves the clock on (default: not at all).
    """

    def __init__(self, start: datetime | None = None, *, tick: timedelta = timedelta(0)) -> None:
        self._now = _utc(start or datetime(2026, 1, 1, tzinfo=UTC))
        self.tick = tick

    def __call__(self) -> datetime:
        now = self._now
        self._now = now + self.tick
        return now

    @property
    def now(self) -> datetime:
        return self._now

    def set(self, when: datetime) -> None:
        self._now = _utc(when)

    def advance(self, delta: timedelta = timedelta(seconds=1)) -> datetime:
        self._now += delta
        return self._now


def _utc(when: datetime) -> datetime:
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"FakeClock needs a timezone-aware datetime, got {when!r}")
    return when.astimezone(UTC)


class RecordingSignal(EventSignal):
    """Records every publish and forwards it to the connected receivers.

    Attributes:
        published: (workspace id, sequence) of every publish, in order.
        forward: False records publishes without delivering them (a lost signal).
        fail_with: if set, publish records and then raises it.
    """

    def __init__(self) -> None:
        self.published: list[tuple[uuid.UUID, int]] = []
        self.forward = True
        self.fail_with: Exception | None = None
        self.started = False
        self.closed = False
        self._receivers: list[Receiver] = []

    def connect(self, on_signal: Receiver) -> None:
        self._receivers.append(on_signal)

    async def publish(self, workspace_id: uuid.UUID, sequence: int) -> None:
        self.published.append((workspace_id, sequence))
        if self.fail_with is not None:
            raise self.fail_with
        if self.forward:
            self.deliver(workspace_id, sequence)

    def deliver(self, workspace_id: uuid.UUID | None, sequence: int) -> None:
        """Signals the receivers directly (None: every workspace)."""
        for receiver in list(self._receivers):
            receiver(workspace_id, sequence)

    def sequences(self, workspace_id: uuid.UUID) -> list[int]:
        return [s for w, s in self.published if w == workspace_id]

    async def start(self) -> None:
        self.started = True

    async def aclose(self) -> None:
        self.closed = True
