"""The read path (`SqliteReadPath`, `PostgresReadPath`) against real databases.

Each answer is compared with the reference implementations over SQLAlchemy
(`TransactionalInbox`, `TransactionalEventLog`) on the same data.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import pytest
from uuid_utils.compat import uuid7

from services.im.adapters import codec
from services.im.adapters.read_path import (
    PostgresReadPath,
    ReadPath,
    SqliteReadPath,
    open_read_path,
)
from services.im.adapters.sql import Database
from services.im.domain.model import (
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
    Workspace,
)
from services.im.service_layer.ports import (
    ReadOutcome,
    TransactionalEventLog,
    TransactionalInbox,
)

T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


@pytest.fixture
async def database(database_url: str) -> AsyncIterator[Database]:
    db = Database(database_url)
    yield db
    await db.aclose()


@pytest.fixture
async def read_path(database: Database) -> AsyncIterator[ReadPath]:
    path = open_read_path(database)
    yield path
    await path.aclose()


@dataclass
class Team:
    workspace: Workspace
    alice: Member
    bob: Member
    carol: Member
    group: Group
    other_group: Group  # alice and bob only


def _member(workspace: Workspace, name: str) -> Member:
    return Member(uuid7(), workspace.id, MemberKind.HUMAN, name, "", T0)


async def make_team(database: Database) -> Team:
    workspace = Workspace(uuid7(), "ws", T0)
    alice, bob, carol = (_member(workspace, n) for n in ("alice", "bob", "carol"))
    group = Group(uuid7(), workspace.id, "g", GroupKind.GROUP, alice.id, T0, (alice.id, bob.id, carol.id))
    other = Group(uuid7(), workspace.id, "h", GroupKind.GROUP, alice.id, T0, (alice.id, bob.id))
    async with database.transaction() as tx:
        await tx.add_workspace(workspace)
        for member in (alice, bob, carol):
            await tx.add_member(member)
        await tx.add_group(group)
        await tx.add_group(other)
        await tx.commit()
    return Team(workspace, alice, bob, carol, group, other)


async def send(database: Database, sender: Member, group: Group, content: str, **fields: object) -> Message:
    message = Message(
        id=uuid7(),
        workspace_id=sender.workspace_id,
        group_id=group.id,
        sender_id=sender.id,
        content_type=ContentType.TEXT,
        content=content,
        mentions=(),
        reply_to=None,
        metadata={},
        sent_at=T0 + timedelta(seconds=1),
    )
    message = replace(message, **fields)  # type: ignore[arg-type]
    async with database.transaction() as tx:
        await tx.add_message(message)
        await tx.commit()
    return message


def test_the_backend_gets_its_own_read_path(database: Database) -> None:
    expected = SqliteReadPath if database.is_sqlite else PostgresReadPath
    assert isinstance(open_read_path(database), expected)


async def test_unread_matches_the_reference(database: Database, read_path: ReadPath) -> None:
    team = await make_team(database)
    reference = TransactionalInbox(database.transaction)
    assert await read_path.unread(team.alice.id, limit=10) == ([], 0)
    first = await send(database, team.bob, team.group, "first")
    rich = await send(
        database,
        team.carol,
        team.group,
        "rich: ünïcödé",
        content_type=ContentType.CODE,
        mentions=(team.alice.id, team.bob.id),
        reply_to=first.id,
        metadata={"k": [1, 2.5, None, "v"], "nested": {"ok": True}},
        edited_at=T0 + timedelta(minutes=5),
        request_id="req-1",
        request_hash="f" * 64,
    )
    await send(database, team.alice, team.group, "mine is never unread")
    elsewhere = await send(database, team.bob, team.other_group, "other group")
    got = await read_path.unread(team.alice.id, limit=10)
    assert got == await reference.unread(team.alice.id, limit=10)
    assert [m.id for m in got[0]] == [first.id, rich.id, elsewhere.id]
    assert got[0][1] == rich
    assert all(type(m.id) is uuid.UUID and m.sent_at.tzinfo is not None for m in got[0])
    # A full page also counts the rest.
    assert await read_path.unread(team.alice.id, limit=2) == ([first, rich], 3)
    assert await read_path.unread(team.alice.id, limit=2) == await reference.unread(team.alice.id, limit=2)
    # Reading moves the start.
    async with database.transaction() as tx:
        await tx.advance_read(team.group.id, team.alice.id, rich.id)
        await tx.commit()
    assert await read_path.unread(team.alice.id, limit=10) == ([elsewhere], 1)
    assert await read_path.unread(uuid7(), limit=10) == ([], 0)


async def test_events_match_the_reference(database: Database, read_path: ReadPath) -> None:
    team = await make_team(database)
    reference = TransactionalEventLog(database.transaction)
    assert await read_path.last_sequence(team.workspace.id) == 0
    assert await read_path.read(team.workspace.id, after=0, up_to=None, limit=10) == []
    message = await send(database, team.bob, team.group, "hi", metadata={"x": "é"})
    events: list[Event] = [
        GroupChanged(group=team.group, added_member_ids=(team.bob.id,)),
        MessageCreated(message=message),
        MessageEdited(message=message),
        ReadUpdated(read_state=ReadState(team.group.id, team.alice.id, message.id, 0)),
        GroupChanged(group=team.other_group, removed_member_ids=(team.carol.id,)),
    ]
    async with database.transaction() as tx:
        for offset, event in enumerate(events):
            await tx.append_event(team.workspace.id, event, T0 + timedelta(milliseconds=offset))
        await tx.commit()
    assert await read_path.last_sequence(team.workspace.id) == 5
    everything = await read_path.read(team.workspace.id, after=0, up_to=None, limit=10)
    assert everything == await reference.read(team.workspace.id, after=0, up_to=None, limit=10)
    assert [e.sequence for e in everything] == [1, 2, 3, 4, 5]
    assert everything[3].recorded_at == T0 + timedelta(milliseconds=3)
    assert everything[1].group_id == team.group.id and type(everything[1].group_id) is uuid.UUID
    for after, up_to, limit in [(1, None, 2), (1, 3, 10), (0, 2, 1), (5, None, 10), (2, 2, 10)]:
        window = await read_path.read(team.workspace.id, after=after, up_to=up_to, limit=limit)
        assert window == await reference.read(team.workspace.id, after=after, up_to=up_to, limit=limit)
    # Another workspace's events are not mixed in.
    assert await read_path.read(uuid7(), after=0, up_to=None, limit=10) == []


async def test_mark_read_refusals(database: Database, read_path: ReadPath) -> None:
    team = await make_team(database)
    stranger_team = await make_team(database)
    message = await send(database, team.bob, team.group, "in group")
    other_message = await send(database, team.bob, team.other_group, "in the other group")
    before = await read_path.last_sequence(team.workspace.id)

    async def outcome(member: Member, group: Group | uuid.UUID, up_to: uuid.UUID) -> ReadOutcome:
        group_id = group.id if isinstance(group, Group) else group
        marked = await read_path.mark_read(member, group_id, up_to, T0)
        assert marked.state is None and marked.sequence is None
        return marked.outcome

    assert await outcome(team.alice, uuid7(), message.id) is ReadOutcome.NO_GROUP
    # A group of another workspace does not exist for the member.
    assert await outcome(stranger_team.alice, team.group, message.id) is ReadOutcome.NO_GROUP
    assert await outcome(team.carol, team.other_group, other_message.id) is ReadOutcome.NOT_A_MEMBER
    # Not a member comes before a wrong message.
    assert await outcome(team.carol, team.other_group, uuid7()) is ReadOutcome.NOT_A_MEMBER
    assert await outcome(team.alice, team.group, other_message.id) is ReadOutcome.NOT_IN_GROUP
    assert await outcome(team.alice, team.group, uuid7()) is ReadOutcome.NOT_IN_GROUP
    assert await read_path.last_sequence(team.workspace.id) == before


async def test_mark_read_moves_forward_only_and_records_its_event(
    database: Database, read_path: ReadPath
) -> None:
    team = await make_team(database)
    reference = TransactionalEventLog(database.transaction)
    one = await send(database, team.bob, team.group, "one")
    await send(database, team.alice, team.group, "alice's own")
    two = await send(database, team.carol, team.group, "two")
    three = await send(database, team.bob, team.group, "three")
    await send(database, team.bob, team.other_group, "elsewhere")
    start = await read_path.last_sequence(team.workspace.id)

    marked = await read_path.mark_read(team.alice, team.group.id, two.id, T0)
    expected = ReadState(team.group.id, team.alice.id, two.id, unread_count=1)
    assert marked.outcome is ReadOutcome.DONE
    assert marked.state == expected
    assert marked.sequence == start + 1
    (recorded,) = await reference.read(team.workspace.id, after=start, up_to=None, limit=10)
    assert recorded.sequence == start + 1
    assert recorded.event == ReadUpdated(read_state=expected)
    assert recorded.group_id == team.group.id
    assert recorded.recorded_at == T0
    # The stored payload is exactly what the codec writes.
    async with database.transaction(write=False) as tx:
        stored = await tx.read_events(team.workspace.id, after=start, up_to=None, limit=1)
    assert codec.encode_event(stored[0].event) == codec.encode_event(ReadUpdated(read_state=expected))

    # Backwards and in place: the current state, nothing recorded.
    for up_to in (one.id, two.id):
        again = await read_path.mark_read(team.alice, team.group.id, up_to, T0)
        assert again.outcome is ReadOutcome.DONE
        assert again.state == expected
        assert again.sequence is None
    assert await read_path.last_sequence(team.workspace.id) == start + 1

    last = await read_path.mark_read(team.alice, team.group.id, three.id, T0 + timedelta(seconds=1))
    assert last.state == ReadState(team.group.id, team.alice.id, three.id, unread_count=0)
    assert last.sequence == start + 2
    async with database.transaction(write=False) as tx:
        membership = await tx.get_membership(team.group.id, team.alice.id)
    assert membership is not None and membership.last_read_message_id == three.id
    assert await read_path.unread(team.alice.id, limit=10) == (
        await TransactionalInbox(database.transaction).unread(team.alice.id, limit=10)
    )


async def test_concurrent_mark_reads_keep_the_furthest_and_number_events_in_commit_order(
    database: Database, read_path: ReadPath
) -> None:
    team = await make_team(database)
    messages = [await send(database, team.bob, team.group, f"m{i}") for i in range(12)]
    start = await read_path.last_sequence(team.workspace.id)
    order = list(messages)
    random.Random(7).shuffle(order)
    results = await asyncio.gather(*(read_path.mark_read(team.alice, team.group.id, m.id, T0) for m in order))
    moved = [r for r in results if r.sequence is not None]
    assert moved, "the first mark always moves"
    # Each move recorded one event; together they are gap-free.
    assert sorted(r.sequence for r in moved if r.sequence is not None) == list(
        range(start + 1, start + 1 + len(moved))
    )
    # Events in sequence order move strictly forward (sequence order = commit order).
    events = await read_path.read(team.workspace.id, after=start, up_to=None, limit=100)
    positions = [e.event.read_state.last_read_message_id for e in events if isinstance(e.event, ReadUpdated)]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    async with database.transaction(write=False) as tx:
        membership = await tx.get_membership(team.group.id, team.alice.id)
    assert membership is not None and membership.last_read_message_id == messages[-1].id
    for asked, result in zip(order, results, strict=True):
        assert result.outcome is ReadOutcome.DONE and result.state is not None
        if result.sequence is not None:
            assert result.state.last_read_message_id == asked.id
        else:
            # Not moved: somebody had moved it at least as far already.
            assert result.state.last_read_message_id >= asked.id
