"""`AgentHub`: live agent events fanned out to bounded watcher queues."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import pytest

from services.runtime.domain.llm import ContentDelta, Role
from services.runtime.domain.model import Emitted, StepDelta, StepStarted
from services.runtime.service_layer.hub import AgentHub, WatcherFellBehind

AGENT = uuid.uuid4()
AT = datetime(2026, 1, 1, tzinfo=UTC)


def delta(text: str) -> Emitted:
    return Emitted(AGENT, AT, StepDelta(1, ContentDelta(text)))


async def test_a_watcher_gets_what_happens_after_it_joined_with_the_step_in_flight() -> None:
    hub = AgentHub()
    hub.publish(Emitted(AGENT, AT, StepStarted(uuid.uuid4(), 1, Role.ASSISTANT)))
    hub.publish(delta("a"))
    watcher, flights = hub.watch([AGENT])
    hub.publish(delta("b"))
    hub.publish(Emitted(uuid.uuid4(), AT, StepDelta(1, ContentDelta("another agent"))))
    hub.close()
    got = [e async for e in watcher.events()]
    assert [f.deltas for f in flights] == [[delta("a")]]
    assert got == [delta("b")]


async def test_a_watcher_that_falls_behind_is_ended_with_an_error_not_silently() -> None:
    hub = AgentHub(max_backlog=3)
    watcher, _ = hub.watch(None)
    events = watcher.events()
    for text in "abcd":
        hub.publish(delta(text))
    with pytest.raises(WatcherFellBehind, match="after_sequence"):
        await asyncio.wait_for(anext(events), 1)
    hub.publish(delta("e"))  # it no longer receives anything
    assert not hub._watchers
