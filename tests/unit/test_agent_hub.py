"""`AgentHub`: live agent events fanned out to bounded watcher queues."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest

from services.runtime.domain.errors import HubClosed, WatcherFellBehind
from services.runtime.domain.llm import ChatMessage, ContentDelta, ReasoningDelta, Role, ToolCallDelta
from services.runtime.domain.model import (
    Emitted,
    Step,
    StepCompleted,
    StepDelta,
    StepMetrics,
    StepStarted,
    merge_deltas,
)
from services.runtime.service_layer.hub import COMPACT_FROM, AgentHub, compacted

AGENT = uuid.uuid4()
RUN = uuid.uuid4()
AT = datetime(2026, 1, 1, tzinfo=UTC)


def delta(text: str) -> Emitted:
    return Emitted(AGENT, AT, StepDelta(1, ContentDelta(text)))


async def until_closed(events: AsyncIterator[Emitted]) -> list[Emitted]:
    """Everything a watch delivers before the hub's closing ends it (with `HubClosed`)."""
    got: list[Emitted] = []
    with pytest.raises(HubClosed, match="shutting down"):
        async for emitted in events:
            got.append(emitted)
    return got


async def test_a_watcher_gets_what_happens_after_it_joined_with_the_step_in_flight() -> None:
    hub = AgentHub()
    hub.publish(Emitted(AGENT, AT, StepStarted(uuid.uuid4(), 1, Role.ASSISTANT)))
    hub.publish(delta("a"))
    watcher, flights = hub.watch([AGENT])
    hub.publish(delta("b"))
    hub.publish(Emitted(uuid.uuid4(), AT, StepDelta(1, ContentDelta("another agent"))))
    hub.close()
    got = await asyncio.wait_for(until_closed(watcher.events()), 1)
    assert [f.deltas for f in flights] == [[delta("a")]]
    assert got == [delta("b")]


def started(sequence: int, agent_id: uuid.UUID = AGENT) -> Emitted:
    return Emitted(agent_id, AT, StepStarted(RUN, sequence, Role.ASSISTANT))


def completed(sequence: int, text: str) -> Emitted:
    message = ChatMessage(role=Role.ASSISTANT, content=text)
    step = Step(uuid.uuid4(), AGENT, uuid.uuid4(), RUN, sequence, message, StepMetrics(), AT)
    return Emitted(AGENT, AT, StepCompleted(step))


async def test_a_watcher_that_falls_behind_is_ended_with_an_error_not_silently() -> None:
    hub = AgentHub(max_backlog=3)
    watcher, _ = hub.watch(None)
    events = watcher.events()
    for sequence in range(1, 5):  # nothing to compact
        hub.publish(started(sequence))
    with pytest.raises(WatcherFellBehind, match="ListTasks"):
        await asyncio.wait_for(anext(events), 1)
    hub.publish(delta("e"))  # it no longer receives anything
    assert not hub._watchers


async def test_closing_ends_every_watch_with_an_error_and_nothing_follows_it() -> None:
    hub = AgentHub()
    watcher, _ = hub.watch([AGENT])
    hub.publish(delta("a"))
    hub.close()
    # Runners go on until the calls in flight have drained: their events go nowhere.
    hub.publish(delta("b"))
    assert await asyncio.wait_for(until_closed(watcher.events()), 1) == [delta("a")]
    with pytest.raises(HubClosed):
        hub.watch(None)
    hub.close()  # idempotent


def test_consecutive_fragments_of_a_step_are_merged_and_nothing_else() -> None:
    other = uuid.uuid4()
    events = [
        delta("Hel"),
        delta("lo"),
        Emitted(AGENT, AT, StepDelta(1, ReasoningDelta("hm"))),
        Emitted(AGENT, AT, StepDelta(1, ReasoningDelta("m"))),
        Emitted(AGENT, AT, StepDelta(1, ToolCallDelta(0, id="c1", name="send", arguments='{"a'))),
        Emitted(AGENT, AT, StepDelta(1, ToolCallDelta(0, arguments='": 1}'))),
        Emitted(AGENT, AT, StepDelta(1, ToolCallDelta(1, id="c2", name="list", arguments=""))),
        Emitted(other, AT, StepDelta(1, ContentDelta("another agent"))),
        delta("!"),
        Emitted(AGENT, AT, StepDelta(2, ContentDelta("next step"))),
    ]
    merged = merge_deltas(events)
    assert [(e.agent_id, e.event) for e in merged] == [
        (AGENT, StepDelta(1, ContentDelta("Hello"))),
        (AGENT, StepDelta(1, ReasoningDelta("hmm"))),
        (AGENT, StepDelta(1, ToolCallDelta(0, id="c1", name="send", arguments='{"a": 1}'))),
        (AGENT, StepDelta(1, ToolCallDelta(1, id="c2", name="list", arguments=""))),
        (other, StepDelta(1, ContentDelta("another agent"))),
        (AGENT, StepDelta(1, ContentDelta("!"))),
        (AGENT, StepDelta(2, ContentDelta("next step"))),
    ]


async def test_a_watcher_behind_the_model_gets_fewer_longer_deltas_with_the_same_text() -> None:
    hub = AgentHub()
    watcher, _ = hub.watch([AGENT])
    events = watcher.events()
    hub.publish(delta("a"))
    first = await asyncio.wait_for(anext(events), 1)
    for text in "bcdef":  # queued while the first was being sent
        hub.publish(delta(text))
    hub.publish(Emitted(AGENT, AT, StepStarted(uuid.uuid4(), 2, Role.ASSISTANT)))
    hub.close()
    rest = await asyncio.wait_for(until_closed(events), 1)
    assert first == delta("a")
    assert rest[0].event == StepDelta(1, ContentDelta("bcdef"))
    assert isinstance(rest[1].event, StepStarted) and len(rest) == 2


async def test_a_watcher_behind_is_compacted_before_it_would_be_ended() -> None:
    other = uuid.uuid4()
    hub = AgentHub(max_backlog=8)
    watcher, _ = hub.watch(None)
    published = [
        started(1),
        delta("Hel"),
        started(1, other),
        Emitted(other, AT, StepDelta(1, ContentDelta("Bon"))),
        delta("lo"),
        Emitted(other, AT, StepDelta(1, ContentDelta("jour"))),
        completed(1, "Hello"),
        started(2),
        Emitted(AGENT, AT, StepDelta(2, ContentDelta("a"))),
        Emitted(AGENT, AT, StepDelta(2, ContentDelta("b"))),
    ]
    for emitted in published:
        hub.publish(emitted)
    hub.close()
    got = await asyncio.wait_for(until_closed(watcher.events()), 1)
    # The completed step's deltas are gone, the others joined; nothing else moved.
    assert got == [
        started(1),
        started(1, other),
        Emitted(other, AT, StepDelta(1, ContentDelta("Bonjour"))),
        published[6],
        started(2),
        Emitted(AGENT, AT, StepDelta(2, ContentDelta("ab"))),
    ]
    assert compacted(got) == got


def test_compacting_never_moves_an_agents_delta_before_its_other_events() -> None:
    between = Emitted(AGENT, AT, StepStarted(RUN, 2, Role.TOOL))
    backlog = [delta("a"), between, delta("b")]
    assert compacted(backlog) == backlog


async def test_a_watcher_keeping_up_sees_a_step_stream_in_and_one_far_behind_gets_it_compacted() -> None:
    for waiting, streamed in ((3, True), (COMPACT_FROM + 1, False)):
        hub = AgentHub()
        watcher, _ = hub.watch([AGENT])
        events = watcher.events()
        hub.publish(started(1))
        assert isinstance((await asyncio.wait_for(anext(events), 1)).event, StepStarted)
        # Queued while the start was being sent: deltas, the completion, then other events.
        hub.publish(delta("hel"))
        hub.publish(delta("lo"))
        hub.publish(completed(1, "hello"))
        for sequence in range(2, waiting - 1):
            hub.publish(started(sequence))
        hub.close()
        rest = await asyncio.wait_for(until_closed(events), 1)
        deltas = [e.event for e in rest if isinstance(e.event, StepDelta)]
        assert deltas == ([StepDelta(1, ContentDelta("hello"))] if streamed else [])
        assert any(isinstance(e.event, StepCompleted) for e in rest)
