"""Agents' read positions in the IM, moved in batches (service_layer/read_positions.py)."""

from __future__ import annotations

import asyncio
import uuid

from services.runtime.domain.errors import IMUnavailable
from services.runtime.service_layer.read_positions import ReadPositions
from tests.unit.runtime_fakes import FakeIM


class CountingIM(FakeIM):
    def __init__(self) -> None:
        super().__init__()
        self.marks: list[tuple[uuid.UUID, uuid.UUID, uuid.UUID]] = []
        self.failures = 0

    async def mark_read(self, as_member: uuid.UUID, group_id: uuid.UUID, up_to: uuid.UUID) -> None:
        if self.failures:
            self.failures -= 1
            raise IMUnavailable("the IM is restarting")
        self.marks.append((as_member, group_id, up_to))
        await super().mark_read(as_member, group_id, up_to)


def ids(count: int) -> list[uuid.UUID]:
    return [uuid.UUID(int=n + 1) for n in range(count)]


async def test_the_moves_of_a_chat_made_meanwhile_go_as_one_call_with_the_furthest() -> None:
    im = CountingIM()
    positions = ReadPositions(im, delay_seconds=0.05)
    agent, chat, other = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    messages = ids(5)
    for message in messages:
        positions.move(agent, [(chat, message)])
    positions.move(agent, [(chat, messages[1])])  # never backwards
    positions.move(agent, [(other, messages[0])])
    await asyncio.sleep(0.2)
    assert sorted(im.marks) == sorted([(agent, chat, messages[-1]), (agent, other, messages[0])])
    await positions.aclose()


async def test_a_move_that_fails_is_sent_again() -> None:
    im = CountingIM()
    im.failures = 1
    positions = ReadPositions(im, delay_seconds=0.01)
    agent, chat = uuid.uuid4(), uuid.uuid4()
    positions.move(agent, [(chat, ids(1)[0])])
    for _ in range(100):
        if im.marks:
            break
        await asyncio.sleep(0.02)
    assert im.marks == [(agent, chat, ids(1)[0])]
    await positions.aclose()


async def test_flush_sends_one_members_moves_at_once_and_close_sends_the_rest() -> None:
    im = CountingIM()
    positions = ReadPositions(im, delay_seconds=60)
    ada, bea, chat = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    positions.move(ada, [(chat, ids(1)[0])])
    positions.move(bea, [(chat, ids(2)[1])])
    await positions.flush(ada)
    assert im.marks == [(ada, chat, ids(1)[0])]
    await positions.aclose()
    assert im.marks[-1] == (bea, chat, ids(2)[1])
    await positions.aclose()  # idempotent
