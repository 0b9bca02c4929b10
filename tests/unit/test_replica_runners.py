"""What one replica tells the owner of an agent it does not run, and the
next owner when the shard moves as the word goes out."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from services.common import errors
from services.runtime.service_layer.replicas import Inbox, Message, ReplicaLink, ReplicaRunners
from tests.unit.runtime_support import fake_runtime
from tests.unit.test_event_relay import an_agent


class RecordingLink(ReplicaLink):
    """Keeps what is told; nobody answers."""

    def __init__(self) -> None:
        self.told: list[tuple[str, str, str]] = []

    @property
    def degraded(self) -> bool:
        return False

    def serve(self, inbox: Inbox, *, missed: Callable[[], None]) -> None:
        pass

    async def tell(self, replica: str, message: Message) -> None:
        self.told.append((replica, str(message["op"]), str(message["agent"])))

    async def ask(self, replica: str, message: Message) -> Message:
        raise errors.Unavailable("no other replica answers here")


async def told(link: RecordingLink, count: int) -> list[tuple[str, str, str]]:
    async with asyncio.timeout(2):
        while len(link.told) < count:  # noqa: ASYNC110 - the runners tell in tasks of their own
            await asyncio.sleep(0)
    await asyncio.sleep(0.01)  # and nothing more
    return link.told


async def test_a_wake_told_to_an_owner_that_gave_the_shard_away_is_told_to_the_next() -> None:
    app = fake_runtime()
    assert app.supervisor is not None
    ada, bea = an_agent(), an_agent()
    for agent in (ada, bea):
        await app.store.add_agent(agent)
    owners: dict[uuid.UUID, str | None] = {ada.workspace_id: "old", bea.workspace_id: "old"}
    now = [0.0]
    link = RecordingLink()
    runners = ReplicaRunners(
        app.supervisor, link, owner_of=owners.get, replica="me", store=app.store, clock=lambda: now[0]
    )
    runners.wake(ada.id)
    assert await told(link, 1) == [("old", "wake", str(ada.id))]
    # The shard moves: between owners first (nobody to tell), then taken.
    owners[ada.workspace_id] = None
    runners.owners_changed()
    assert await told(link, 1) == [("old", "wake", str(ada.id))]
    owners[ada.workspace_id] = "new"
    runners.owners_changed()
    assert (await told(link, 2))[1:] == [("new", "wake", str(ada.id))]
    runners.owners_changed()  # told the new owner once
    assert len(await told(link, 2)) == 2

    # A word older than the moment a shard takes to move is not repeated.
    runners.wake(bea.id)
    await told(link, 3)
    now[0] += 60
    owners[bea.workspace_id] = "new"
    runners.owners_changed()
    assert len(await told(link, 3)) == 3
    await runners.aclose()
