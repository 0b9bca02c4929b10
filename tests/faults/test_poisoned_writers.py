"""Fault case 1: poisoned writers among honest writers.

Sends are written in shared batches (one statement on PostgreSQL, one
transaction on SQLite), so one item a database refuses used to fail every
caller of its batch. Two levels are tried, on SQLite and PostgreSQL:

- over the wire, honest senders and poisoned senders (NUL characters,
  non-finite or too deeply nested metadata) send to a real IM at once: every
  honest send succeeds, every poisoned one is INVALID_ARGUMENT;
- straight to the adapters (the IM's message log, the runtime's journal),
  bypassing the edge's checks, with items that no database can store: each
  fails alone and every other item of its batch is written.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import grpc
import sqlalchemy as sa
from google.protobuf import struct_pb2
from uuid_utils.compat import uuid7

from agentim.im.v1 import im_pb2
from services.im.adapters import tables as im_tables
from services.im.adapters.message_log import open_message_log
from services.im.adapters.sql import Database as IMDatabase
from services.im.domain.model import ContentType, Message
from services.runtime.adapters import tables as runtime_tables
from services.runtime.adapters.journal import Write, open_journal
from services.runtime.adapters.sql import Database as RuntimeDatabase
from services.runtime.domain.llm import ChatMessage, Role
from services.runtime.domain.model import Step, StepMetrics
from tests.conftest import RunningIM, make_world
from tests.faults.harness import scaled
from tests.integration.test_im_read_path import make_team

HONEST_SENDERS = 20


@dataclass
class Tally:
    sent: int = 0
    failed: int = 0
    refused: int = 0  # INVALID_ARGUMENT
    other: list[str] | None = None


def deep_struct(levels: int) -> struct_pb2.Struct:
    top = struct_pb2.Struct()
    current = top
    for _ in range(levels - 1):
        current = current.fields["a"].struct_value
    current.fields["leaf"].string_value = "deep"
    return top


def poisoned_requests(group_id: str, sender: int, index: int) -> im_pb2.SendMessageRequest:
    request = im_pb2.SendMessageRequest(group_id=group_id, content=f"poison {sender}-{index}")
    match sender % 3:
        case 0:
            request.content = f"poison\x00{sender}-{index}"
        case 1:
            request.metadata.fields["score"].number_value = float("nan") if index % 2 else float("inf")
        case _:
            request.metadata.CopyFrom(deep_struct(40 if index % 2 else 33))
    return request


async def test_poisoned_senders_never_fail_honest_ones(im: RunningIM, database_url: str) -> None:
    sends = scaled(15, long=150)
    poisoned_senders = 3
    world = await make_world(im.stub, people=HONEST_SENDERS + poisoned_senders)
    creator = world.md(0)
    group = (
        await im.stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="crowd", member_ids=[m.id for m in world.members[1:]]),
            metadata=creator,
        )
    ).group
    honest, poisoned = Tally(other=[]), Tally(other=[])

    async def send_honestly(sender: int) -> None:
        for index in range(sends):
            request = im_pb2.SendMessageRequest(
                group_id=group.id, content=f"honest {sender}-{index}", request_id=f"h{sender}-{index}"
            )
            request.metadata.update({"n": index, "tags": ["a", "b"]})
            honest.sent += 1
            try:
                await im.stub.SendMessage(request, metadata=world.md(sender), timeout=20)
            except grpc.aio.AioRpcError as error:
                honest.failed += 1
                assert honest.other is not None
                honest.other.append(f"{error.code().name}: {error.details()}")

    async def send_poison(sender: int) -> None:
        member = HONEST_SENDERS + sender
        for index in range(sends):
            poisoned.sent += 1
            try:
                await im.stub.SendMessage(
                    poisoned_requests(group.id, sender, index), metadata=world.md(member), timeout=20
                )
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    poisoned.refused += 1
                    continue
                assert poisoned.other is not None
                poisoned.other.append(f"{error.code().name}: {error.details()}")
            else:
                assert poisoned.other is not None
                poisoned.other.append("accepted")

    started = time.perf_counter()
    await asyncio.gather(
        *(send_honestly(s) for s in range(HONEST_SENDERS)),
        *(send_poison(s) for s in range(poisoned_senders)),
    )
    elapsed = time.perf_counter() - started
    stored = await count_messages(im, group.id, world.md(0))
    backend = database_url.split(":", 1)[0]
    print(
        f"poisoned writers ({backend}): {HONEST_SENDERS} honest senders, {honest.sent} sends,"
        f" {honest.failed} failed; {poisoned_senders} poisoned senders, {poisoned.sent} sends,"
        f" {poisoned.refused} INVALID_ARGUMENT, {len(poisoned.other or [])} otherwise;"
        f" {stored} stored; {elapsed:.1f} s"
    )
    assert honest.failed == 0, (honest.other or [])[:5]
    assert poisoned.refused == poisoned.sent, (poisoned.other or [])[:5]
    assert stored == honest.sent


async def count_messages(im: RunningIM, group_id: str, md: Any) -> int:
    count, token = 0, ""
    while True:
        page = await im.stub.ListMessages(
            im_pb2.ListMessagesRequest(group_id=group_id, page_size=200, page_token=token), metadata=md
        )
        count += len(page.messages)
        token = page.next_page_token
        if not token:
            return count


# --- straight to the adapters -------------------------------------------------------

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
# What no database stores and the edge no longer lets through: a lone
# surrogate is not UTF-8 (neither SQLite's driver nor asyncpg encodes it), and
# a set is not JSON. PostgreSQL also refuses NUL in text and NaN in json.
Poison = str | dict[str, Any]
EVERYWHERE: list[Poison] = ["\ud800 lone surrogate", {"not json": {1, 2}}]
POSTGRES_ONLY: list[Poison] = ["a NUL \x00 here", {"score": float("nan")}]


def poisons(url: str) -> list[Poison]:
    return EVERYWHERE + (POSTGRES_ONLY if url.startswith("postgres") else [])


async def test_a_poisoned_message_fails_alone_in_its_batch(database_url: str) -> None:
    database = IMDatabase(database_url)
    log = open_message_log(database)
    try:
        team = await make_team(database)

        def message(content: str, metadata: dict[str, Any] | None = None) -> Message:
            return Message(
                id=uuid7(),
                workspace_id=team.workspace.id,
                group_id=team.group.id,
                sender_id=team.alice.id,
                content_type=ContentType.TEXT,
                content=content,
                mentions=(),
                reply_to=None,
                metadata=metadata or {},
                sent_at=T0,
            )

        honest = [message(f"honest {i}") for i in range(scaled(40, long=400))]
        poisoned = [
            message(p) if isinstance(p, str) else message("bad metadata", metadata=p)
            for p in poisons(database_url)
        ]
        # Poison spread through the batch: first, middle, last.
        batch = list(honest)
        for place, item in zip((0, len(batch) // 2, len(batch)), poisoned, strict=False):
            batch.insert(place, item)
        batch += poisoned[3:]
        started = time.perf_counter()
        # One gather: every append joins the same batch.
        results = await asyncio.gather(*(log.append(m, T0) for m in batch), return_exceptions=True)
        elapsed = time.perf_counter() - started
        outcome = dict(zip((m.id for m in batch), results, strict=True))
        failed_honest = [m.content for m in honest if not isinstance(outcome[m.id], int)]
        stored_poison = [m.content for m in poisoned if not isinstance(outcome[m.id], Exception)]
        sequences = sorted(r for r in results if isinstance(r, int))
        async with database.engine.connect() as conn:
            stored = set(
                (
                    await conn.execute(
                        sa.select(im_tables.messages.c.id).where(
                            im_tables.messages.c.group_id == team.group.id
                        )
                    )
                ).scalars()
            )
    finally:
        await log.aclose()
        await database.aclose()
    print(
        f"poisoned batch, message log ({database_url.split(':', 1)[0]}): {len(honest)} honest and"
        f" {len(poisoned)} poisoned messages in one batch; {len(failed_honest)} honest failed,"
        f" {len(poisoned) - len(stored_poison)} poisoned failed alone; {elapsed * 1000:.0f} ms"
    )
    assert failed_honest == []
    assert stored_poison == []
    assert stored == {m.id for m in honest}
    # Every stored message has its event, numbered without a gap.
    assert sequences == list(range(sequences[0], sequences[0] + len(honest)))


async def test_a_poisoned_step_fails_alone_in_its_batch(runtime_url: str) -> None:
    database = RuntimeDatabase(runtime_url)
    journal = open_journal(database)
    agent_id, run_id = uuid.uuid4(), uuid.uuid4()

    def write(content: str) -> Write:
        step = Step(
            id=uuid7(),
            agent_id=agent_id,
            session_id=uuid.uuid4(),
            run_id=run_id,
            sequence=1,
            message=ChatMessage(role=Role.ASSISTANT, content=content),
            metrics=StepMetrics(model="fake"),
            created_at=T0,
        )
        return Write(steps=[step])

    honest = [write(f"honest {i}") for i in range(scaled(40, long=400))]
    poisoned = [write(p) for p in poisons(runtime_url) if isinstance(p, str)]
    batch = [*poisoned[:1], *honest[:20], *poisoned[1:], *honest[20:]]
    try:
        results = await asyncio.gather(*(journal.write(w) for w in batch), return_exceptions=True)
        outcome = {id(w): r for w, r in zip(batch, results, strict=True)}
        steps = runtime_tables.steps
        async with database.engine.connect() as conn:
            stored = set(
                (await conn.execute(sa.select(steps.c.id).where(steps.c.agent_id == agent_id))).scalars()
            )
    finally:
        await journal.aclose()
        await database.aclose()
    print(
        f"poisoned batch, journal ({runtime_url.split(':', 1)[0]}): {len(honest)} honest and"
        f" {len(poisoned)} poisoned writes in one batch;"
        f" {sum(outcome[id(w)] is not None for w in honest)} honest failed"
    )
    assert [outcome[id(w)] for w in honest] == [None] * len(honest)
    assert all(isinstance(outcome[id(w)], Exception) for w in poisoned)
    assert stored == {w.steps[0].id for w in honest}
