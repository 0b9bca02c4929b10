"""The fakes' own behaviour: the handler tests are only as good as they are."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone

import pytest

from services.im.domain.model import (
    NIL_ID,
    ContentType,
    Group,
    GroupKind,
    Member,
    MemberKind,
    Message,
    MessageCreated,
    Workspace,
)
from services.im.service_layer.ports import DuplicateRequest
from tests.unit.fakes import FakeClock, InMemoryStore, IntegrityError, RecordingSignal

NOW = datetime(2026, 1, 1, tzinfo=UTC)
TIMEOUT = 2.0


def workspace() -> Workspace:
    return Workspace(id=uuid.uuid4(), name="w", created_at=NOW)


def member(workspace_id: uuid.UUID) -> Member:
    return Member(
        id=uuid.uuid4(),
        workspace_id=workspace_id,
        kind=MemberKind.HUMAN,
        display_name="m",
        avatar="",
        created_at=NOW,
    )


def message(group_id: uuid.UUID, sender_id: uuid.UUID, *, request_id: str | None = None) -> Message:
    return Message(
        id=uuid.uuid4(),
        workspace_id=uuid.uuid4(),
        group_id=group_id,
        sender_id=sender_id,
        content_type=ContentType.TEXT,
        content="x",
        mentions=(),
        reply_to=None,
        metadata={},
        sent_at=NOW,
        request_id=request_id,
    )


async def test_commit_applies_and_rollback_discards() -> None:
    store = InMemoryStore()
    kept, dropped = workspace(), workspace()
    async with store.transaction() as tx:
        await tx.add_workspace(kept)
        assert await tx.get_workspace(kept.id) == kept
        assert store.state.workspaces == {}  # not before commit
        await tx.commit()
    async with store.transaction() as tx:
        await tx.add_workspace(dropped)
    assert set(store.state.workspaces) == {kept.id}
    assert (store.commits, store.rollbacks) == (1, 1)


async def test_a_read_transaction_sees_its_snapshot_and_may_not_write() -> None:
    store = InMemoryStore()
    reader = store.transaction(write=False)
    async with reader:
        async with store.transaction() as tx:
            await tx.add_workspace(workspace())
            await tx.commit()
        assert await reader.list_workspaces(ids=None, after=None, limit=10) == []
        with pytest.raises(AssertionError):
            await reader.add_workspace(workspace())
    async with store.transaction(write=False) as tx:
        assert len(await tx.list_workspaces(ids=None, after=None, limit=10)) == 1


async def test_a_transaction_cannot_be_used_after_it_ends() -> None:
    store = InMemoryStore()
    async with store.transaction() as tx:
        await tx.commit()
    with pytest.raises(AssertionError):
        await tx.get_workspace(uuid.uuid4())


async def test_a_duplicate_request_id_aborts_the_transaction() -> None:
    store = InMemoryStore()
    scope = uuid.uuid4()
    async with store.transaction() as tx:
        await tx.remember_request(scope, "r", "f", uuid.uuid4())
        await tx.commit()
    async with store.transaction() as tx:
        with pytest.raises(DuplicateRequest):
            await tx.remember_request(scope, "r", "g", uuid.uuid4())
        with pytest.raises(AssertionError):
            await tx.find_request(scope, "r")
    assert store.state.requests[(scope, "r")][0] == "f"


async def test_message_request_ids_are_unique_per_sender() -> None:
    store = InMemoryStore()
    group, sender = uuid.uuid4(), uuid.uuid4()
    async with store.transaction() as tx:
        await tx.add_message(message(group, sender, request_id="r"))
        await tx.add_message(message(group, uuid.uuid4(), request_id="r"))
        await tx.add_message(message(group, sender))
        await tx.add_message(message(group, sender))  # no request_id: no constraint
        with pytest.raises(DuplicateRequest):
            await tx.add_message(message(group, sender, request_id="r"))


async def test_an_insert_waits_for_an_open_transaction_with_the_same_key() -> None:
    store = InMemoryStore()
    scope = uuid.uuid4()
    first = store.transaction()
    await first.__aenter__()
    await first.remember_request(scope, "r", "f", uuid.uuid4())
    second = store.transaction()
    async with second:
        attempt = asyncio.create_task(second.remember_request(scope, "r", "f", uuid.uuid4()))
        await first.commit()
        with pytest.raises(DuplicateRequest):
            await asyncio.wait_for(attempt, TIMEOUT)
    # Had the first rolled back, the second would have succeeded.
    third, fourth = store.transaction(), store.transaction()
    await third.__aenter__()
    await third.remember_request(scope, "s", "f", uuid.uuid4())
    async with fourth:
        attempt = asyncio.create_task(fourth.remember_request(scope, "s", "f", uuid.uuid4()))
        await third.rollback()
        await asyncio.wait_for(attempt, TIMEOUT)
        await fourth.commit()
    assert (scope, "s") in store.state.requests
    assert store.open_claims() == 0


async def test_event_sequences_are_gap_free_and_decoded() -> None:
    store = InMemoryStore()
    w = workspace()
    async with store.transaction() as tx:
        await tx.add_workspace(w)
        await tx.commit()
    event = MessageCreated(message(uuid.uuid4(), uuid.uuid4()))
    async with store.transaction() as tx:
        assert await tx.append_event(w.id, event, NOW) == 1
        assert await tx.append_event(w.id, event, NOW) == 2
    async with store.transaction() as tx:  # the rolled back ones are not used up
        assert await tx.append_event(w.id, event, NOW) == 1
        await tx.commit()
    async with store.transaction(write=False) as tx:
        assert await tx.last_event_sequence(w.id) == 1
        (recorded,) = await tx.read_events(w.id, after=0, up_to=None, limit=10)
        assert recorded.sequence == 1
        assert recorded.group_id == event.message.group_id
        assert isinstance(recorded.event, MessageCreated)
        assert recorded.event.message.id == event.message.id
    async with store.transaction() as tx:
        with pytest.raises(LookupError):
            await tx.append_event(uuid.uuid4(), event, NOW)


async def test_groups_memberships_and_read_positions() -> None:
    store = InMemoryStore()
    w = workspace()
    a, b = member(w.id), member(w.id)
    group = Group(
        id=uuid.uuid4(),
        workspace_id=w.id,
        name="g",
        kind=GroupKind.DIRECT,
        creator_id=a.id,
        created_at=NOW,
        member_ids=(b.id, a.id),
        direct_key="k",
    )
    async with store.transaction() as tx:
        await tx.add_group(group)
        with pytest.raises(DuplicateRequest):
            await tx.add_group(replace(group, id=uuid.uuid4()))
    async with store.transaction() as tx:
        await tx.add_group(group)
        with pytest.raises(IntegrityError):
            await tx.add_memberships(group.id, [a.id], NOW)
    async with store.transaction() as tx:
        await tx.add_group(group)
        await tx.commit()
    async with store.transaction() as tx:
        stored = await tx.get_group(group.id)
        assert stored is not None
        assert stored.member_ids == tuple(sorted((a.id, b.id)))
        membership = await tx.get_membership(group.id, a.id)
        assert membership is not None
        assert membership.last_read_message_id == NIL_ID
        later, earlier = uuid.UUID(int=10), uuid.UUID(int=5)
        assert await tx.advance_read(group.id, a.id, later)
        assert not await tx.advance_read(group.id, a.id, earlier)
        assert not await tx.advance_read(group.id, uuid.uuid4(), later)
        await tx.commit()
    assert store.state.memberships[group.id][a.id].last_read_message_id == uuid.UUID(int=10)


def test_fake_clock() -> None:
    clock = FakeClock(tick=timedelta(seconds=2))
    first = clock()
    assert first.tzinfo is not None
    assert first.utcoffset() == timedelta(0)
    assert clock() == first + timedelta(seconds=2)
    clock.set(datetime(2030, 1, 1, 12, tzinfo=timezone(timedelta(hours=2))))
    assert clock() == datetime(2030, 1, 1, 10, tzinfo=UTC)
    assert clock.advance(timedelta(hours=1)) == datetime(2030, 1, 1, 11, 0, 2, tzinfo=UTC)
    with pytest.raises(ValueError):
        clock.set(datetime(2030, 1, 1))


async def test_recording_signal() -> None:
    signal = RecordingSignal()
    heard: list[tuple[uuid.UUID | None, int]] = []
    signal.connect(lambda w, s: heard.append((w, s)))
    w = uuid.uuid4()
    await signal.publish(w, 3)
    signal.forward = False
    await signal.publish(w, 4)
    signal.deliver(None, 0)
    assert signal.published == [(w, 3), (w, 4)]
    assert signal.sequences(w) == [3, 4]
    assert heard == [(w, 3), (None, 0)]
    signal.fail_with = ConnectionError("down")
    with pytest.raises(ConnectionError):
        await signal.publish(w, 5)
