"""Agents' events between replicas: the codec, the relayed hub (stale
epochs, own echoes, runners that lost their lease) and what a watch makes of
events from two replicas across a handoff (aborted steps, gaps, repeats)."""

from __future__ import annotations

import asyncio
import dataclasses
import typing
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from datetime import UTC, datetime

import pytest

from services.runtime.adapters import event_codec
from services.runtime.domain.llm import (
    ChatMessage,
    ContentDelta,
    ModelSettings,
    Role,
    ToolCall,
    ToolCallDelta,
)
from services.runtime.domain.model import (
    Agent,
    AgentEvent,
    AgentState,
    Emitted,
    MainSessionChanged,
    Origin,
    OwnerChanged,
    Run,
    RunEnded,
    RunStarted,
    RunStatus,
    Session,
    StateChanged,
    Step,
    StepAborted,
    StepCompleted,
    StepDelta,
    StepKind,
    StepMetrics,
    StepsRewritten,
    StepStarted,
    Task,
    TaskChanged,
    TaskStatus,
)
from services.runtime.domain.shards import shard_of
from services.runtime.service_layer.leases import Fence
from services.runtime.service_layer.relay import RelayedHub
from tests.unit.lease_fakes import LoopbackRelays
from tests.unit.runtime_fakes import Script
from tests.unit.test_runner import Harness, harness

NOW = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
SHARDS = 16


def a_step(agent: Agent, sequence: int, text: str = "") -> Step:
    return Step(
        id=uuid.uuid4(),
        agent_id=agent.id,
        session_id=agent.session_id,
        run_id=uuid.uuid4(),
        sequence=sequence,
        message=ChatMessage(Role.ASSISTANT, text or f"step {sequence}"),
        metrics=StepMetrics(duration_ms=1.5, input_tokens=3, model="m"),
        created_at=NOW,
    )


def an_agent(workspace: uuid.UUID | None = None) -> Agent:
    return Agent(
        id=uuid.uuid4(),
        workspace_id=workspace or uuid.uuid4(),
        member_id=uuid.uuid4(),
        name="ada",
        role="",
        system_prompt="",
        model=ModelSettings(model="m", temperature=0.5),
        tools=("send_message",),
        parent_id=None,
        created_at=NOW,
        updated_at=NOW,
    )


# -- the codec ---------------------------------------------------------------------------


def every_kind_of_event(agent: Agent) -> list[Emitted]:
    run = Run(uuid.uuid4(), agent.id, agent.session_id, RunStatus.RUNNING, (uuid.uuid4(), uuid.uuid4()), NOW)
    said = dataclasses.replace(
        a_step(agent, 4),
        message=ChatMessage(Role.ASSISTANT, None, reasoning="hm", tool_calls=(ToolCall("c1", "send", "{}"),)),
        kind=StepKind.CUT,
        origin=Origin(group_id=uuid.uuid4(), group_name="team", direct=False, sender_id=uuid.uuid4()),
    )
    task = Task(uuid.uuid4(), agent.id, agent.session_id, "do it", TaskStatus.RUNNING, NOW, started_at=NOW)
    events: list[AgentEvent] = [
        RunStarted(run),
        RunEnded(dataclasses.replace(run, status=RunStatus.FAILED, error="x", ended_at=NOW)),
        StepStarted(run.id, 4, Role.ASSISTANT),
        StepDelta(4, ContentDelta("he")),
        StepDelta(4, ToolCallDelta(0, "c1", "send", '{"a"')),
        StepDelta(4, ToolCallDelta(0, None, None, "1}")),
        StepCompleted(said),
        StepAborted(run.id, 5, "moved"),
        StateChanged(AgentState.PAUSED, "why", pause_pending=True, version=7),
        TaskChanged(task),
        MainSessionChanged(
            Session(uuid.uuid4(), agent.id, NOW, forked_from=uuid.uuid4(), forked_at_sequence=3)
        ),
        StepsRewritten(agent.session_id, 2),
        OwnerChanged(),
    ]
    assert {type(e) for e in events} == set(typing.get_args(AgentEvent)), "one of each kind"
    return [Emitted(agent.id, NOW, event) for event in events]


def test_every_kind_of_event_reads_back_equal() -> None:
    for emitted in every_kind_of_event(an_agent()):
        assert event_codec.decode(event_codec.encode(emitted)) == emitted


def test_a_field_added_by_a_newer_replica_is_ignored_and_a_dropped_one_takes_its_default() -> None:
    emitted = Emitted(uuid.uuid4(), NOW, StateChanged(AgentState.IDLE, version=3))
    encoded = event_codec.encode(emitted)
    encoded["event"]["colour"] = "blue"
    del encoded["event"]["pause_pending"]
    assert event_codec.decode(encoded) == emitted


@pytest.mark.parametrize(
    "change",
    [
        lambda e: e.update({"event": {"type": "Agent", "name": "x"}}),  # not an event's part
        lambda e: e.update({"event": {"type": "os.system"}}),
        lambda e: e["event"].pop("state"),  # required
        lambda e: e.update({"agent_id": "not an id"}),
        lambda e: e["event"].update({"state": "DANCING"}),
        lambda e: e.update({"type": "StepStarted"}),
    ],
)
def test_a_message_that_is_not_a_known_event_is_refused(change: object) -> None:
    encoded = event_codec.encode(Emitted(uuid.uuid4(), NOW, StateChanged(AgentState.IDLE)))
    change(encoded)  # type: ignore[operator]
    with pytest.raises(event_codec.UnreadableEvent):
        event_codec.decode(encoded)


# -- the relayed hub --------------------------------------------------------------------


@dataclasses.dataclass
class Replica:
    hub: RelayedHub
    runs: dict[uuid.UUID, Agent]
    epochs: dict[int, int]


def replica(relays: LoopbackRelays, name: str) -> Replica:
    runs: dict[uuid.UUID, Agent] = {}
    epochs: dict[int, int] = {}

    def fence(shard: int) -> Fence | None:
        return Fence(shard, epochs[shard], name) if shard in epochs else None

    hub = RelayedHub(relays.relay(), replica=name, shard_count=SHARDS, fence=fence, live=runs.get)
    return Replica(hub, runs, epochs)


async def heard(watcher_events: AsyncIterator[Emitted], count: int) -> list[Emitted]:
    got = []
    for _ in range(count):
        got.append(await asyncio.wait_for(anext(watcher_events), 1.0))
    return got


def nothing_waits(hub: RelayedHub, agent: Agent) -> bool:
    watcher, flights = hub.watch([agent.id])
    hub.unwatch(watcher)
    return not flights


async def test_an_agents_events_reach_a_watcher_on_another_replica_once() -> None:
    relays = LoopbackRelays()
    a, b = replica(relays, "a"), replica(relays, "b")
    ada = an_agent()
    a.runs[ada.id] = ada
    a.epochs[shard_of(ada.workspace_id, SHARDS)] = 1
    here, _ = a.hub.watch([ada.id])
    there, _ = b.hub.watch([ada.id])
    started = Emitted(ada.id, NOW, StepStarted(uuid.uuid4(), 1, Role.ASSISTANT))
    async with a.hub.following([ada.workspace_id]), b.hub.following([ada.workspace_id]):
        a.hub.publish(started)
        assert await heard(there.events(), 1) == [started]
        here_events = here.events()
        assert await heard(here_events, 1) == [started]
        with pytest.raises(TimeoutError):  # its own echo from the relay is not heard twice
            await asyncio.wait_for(anext(here_events), 0.05)


async def test_a_watcher_hears_nothing_of_a_shard_it_does_not_follow() -> None:
    relays = LoopbackRelays()
    a, b = replica(relays, "a"), replica(relays, "b")
    ada = an_agent()
    a.runs[ada.id] = ada
    a.epochs[shard_of(ada.workspace_id, SHARDS)] = 1
    there, _ = b.hub.watch(None)
    a.hub.publish(Emitted(ada.id, NOW, StepStarted(uuid.uuid4(), 1, Role.ASSISTANT)))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(there.events()), 0.05)


async def test_what_a_stale_owner_sends_after_its_successor_is_dropped() -> None:
    relays = LoopbackRelays()
    old, new, watching = replica(relays, "old"), replica(relays, "new"), replica(relays, "w")
    ada = an_agent()
    shard = shard_of(ada.workspace_id, SHARDS)
    old.runs[ada.id] = new.runs[ada.id] = ada
    old.epochs[shard], new.epochs[shard] = 4, 5  # `old` froze past its lease, `new` took it
    watcher, _ = watching.hub.watch([ada.id])
    run = uuid.uuid4()
    async with watching.hub.following([ada.workspace_id]):
        new.hub.publish(Emitted(ada.id, NOW, StepStarted(run, 3, Role.ASSISTANT)))
        old.hub.publish(Emitted(ada.id, NOW, StepDelta(3, ContentDelta("stale"))))
        new.hub.publish(Emitted(ada.id, NOW, StepDelta(3, ContentDelta("fresh"))))
        got = await heard(watcher.events(), 2)
    assert [type(e.event) for e in got] == [StepStarted, StepDelta]
    assert got[1].event == StepDelta(3, ContentDelta("fresh"))
    assert watching.hub.stale_dropped == 1


async def test_a_frozen_owner_stopping_its_runner_late_does_not_abort_its_successors_step() -> None:
    relays = LoopbackRelays()
    old, new, watching = replica(relays, "old"), replica(relays, "new"), replica(relays, "w")
    ada = an_agent()
    shard = shard_of(ada.workspace_id, SHARDS)
    new.runs[ada.id] = ada
    new.epochs[shard] = 5
    watcher, _ = watching.hub.watch([ada.id])
    run = uuid.uuid4()
    async with watching.hub.following([ada.workspace_id]):
        new.hub.publish(Emitted(ada.id, NOW, StepStarted(run, 3, Role.ASSISTANT)), from_runner=True)
        # `old` wakes from SIGSTOP: its runner (no longer among its runners,
        # its lease unprovable) says the step it had in flight aborted.
        old.hub.publish(
            Emitted(ada.id, NOW, StepAborted(run, 3, "stopped")),
            workspace_id=ada.workspace_id,
            from_runner=True,
        )
        new.hub.publish(Emitted(ada.id, NOW, StepDelta(3, ContentDelta("fresh"))), from_runner=True)
        got = await heard(watcher.events(), 2)
    assert [type(e.event) for e in got] == [StepStarted, StepDelta]
    assert old.hub.unrelayed == 1


async def test_a_runner_that_cannot_prove_its_lease_relays_nothing_and_a_call_elsewhere_always_does() -> None:
    relays = LoopbackRelays()
    a, b = replica(relays, "a"), replica(relays, "b")
    ada = an_agent()
    a.runs[ada.id] = ada  # but no provable lease: a.epochs is empty
    a.hub.publish(Emitted(ada.id, NOW, StepStarted(uuid.uuid4(), 1, Role.ASSISTANT)))
    assert a.hub.unrelayed == 1 and relays.relays[0].sent == []
    # A task submitted at b for an agent b does not run: epoch 0, never stale.
    b.epochs[shard_of(ada.workspace_id, SHARDS)] = 9
    task = Task(uuid.uuid4(), ada.id, ada.session_id, "x", TaskStatus.QUEUED, NOW)
    b.hub.publish(Emitted(ada.id, NOW, TaskChanged(task)), workspace_id=ada.workspace_id)
    (sent,) = relays.relays[1].sent
    assert (sent.origin, sent.epoch, sent.shard) == ("b", 0, shard_of(ada.workspace_id, SHARDS))
    # Without the agent's workspace nobody elsewhere could place it: kept here.
    b.hub.publish(Emitted(uuid.uuid4(), NOW, TaskChanged(task)))
    assert b.hub.unrelayed == 1


async def test_a_remote_step_in_flight_is_forgotten_once_its_shard_is_no_longer_followed() -> None:
    relays = LoopbackRelays()
    a, b = replica(relays, "a"), replica(relays, "b")
    ada = an_agent()
    a.runs[ada.id] = ada
    a.epochs[shard_of(ada.workspace_id, SHARDS)] = 1
    async with b.hub.following([ada.workspace_id]):
        a.hub.publish(Emitted(ada.id, NOW, StepStarted(uuid.uuid4(), 1, Role.ASSISTANT)))
        assert not nothing_waits(b.hub, ada), "a watcher joining now is given the step so far"
    # Its end would never come here now: a later watcher must not wait for it.
    assert nothing_waits(b.hub, ada)


# -- a watch across a handoff --------------------------------------------------------------


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    async for value in harness():
        yield value


async def watching(h: Harness, agent: Agent, *, after: int = 0) -> AsyncGenerator[Emitted, None]:
    stream = await h.watches.watch_agent(h.me, str(agent.id), after_sequence=after, live_only=False)
    return stream


async def take(stream: AsyncGenerator[Emitted, None], count: int) -> list[Emitted]:
    got = []
    for _ in range(count):
        got.append(await asyncio.wait_for(anext(stream), 2.0))
    return got


def said(h: Harness, agent: Agent, event: object) -> None:
    h.hub.publish(Emitted(agent.id, NOW, event), workspace_id=agent.workspace_id)  # type: ignore[arg-type]


async def test_a_step_started_again_before_it_completed_is_said_aborted_first(h: Harness) -> None:
    ada = await h.agent()
    stream = await watching(h, ada)
    run = uuid.uuid4()
    said(h, ada, StepStarted(run, 1, Role.ASSISTANT))
    said(h, ada, StepDelta(1, ContentDelta("half an ans")))
    # The replica running it died; the next owner starts the step again.
    said(h, ada, StepStarted(run, 1, Role.ASSISTANT))
    said(h, ada, StepDelta(1, ContentDelta("the whole answer")))
    said(h, ada, StepCompleted(a_step(ada, 1, "the whole answer")))
    got = [e.event for e in await take(stream, 6)]
    await stream.aclose()
    assert [type(e) for e in got] == [
        StepStarted,
        StepDelta,
        StepAborted,
        StepStarted,
        StepDelta,
        StepCompleted,
    ]
    aborted = got[2]
    assert isinstance(aborted, StepAborted) and (aborted.run_id, aborted.sequence) == (run, 1)


async def test_an_abort_said_by_the_stopping_replica_is_passed_on_once(h: Harness) -> None:
    ada = await h.agent()
    stream = await watching(h, ada)
    run = uuid.uuid4()
    said(h, ada, StepStarted(run, 1, Role.ASSISTANT))
    said(h, ada, StepAborted(run, 1, "stopped"))
    said(h, ada, StepStarted(run, 1, Role.ASSISTANT))
    said(h, ada, StepCompleted(a_step(ada, 1)))
    got = [type(e.event) for e in await take(stream, 4)]
    await stream.aclose()
    assert got == [StepStarted, StepAborted, StepStarted, StepCompleted]


async def test_steps_lost_between_replicas_come_from_the_store_in_order(h: Harness) -> None:
    ada = await h.agent()
    stream = await watching(h, ada)
    for sequence in (1, 2, 3):
        await h.store.append_step(a_step(ada, sequence))
    # Only the last completion reached this replica.
    said(h, ada, StepCompleted(a_step(ada, 3)))
    said(h, ada, StepCompleted(a_step(ada, 3)))  # and a repeat of it
    said(h, ada, StepStarted(uuid.uuid4(), 4, Role.ASSISTANT))
    got = await take(stream, 4)
    await stream.aclose()
    completed = [e.event.step.sequence for e in got if isinstance(e.event, StepCompleted)]
    assert completed == [1, 2, 3]
    assert isinstance(got[3].event, StepStarted) and got[3].event.sequence == 4


def numbered(event: AgentEvent) -> tuple[str, int]:
    """A step's event by its kind and the step's sequence."""
    if isinstance(event, StepCompleted):
        return type(event).__name__, event.step.sequence
    assert isinstance(event, StepStarted | StepAborted | StepDelta)
    return type(event).__name__, event.sequence


async def test_a_completion_lost_before_the_next_steps_start_comes_from_the_store(h: Harness) -> None:
    """The old owner stored step 2 and died before its completion left; the
    next owner's start of step 3 shows the watch what it missed."""
    ada = await h.agent()
    await h.store.append_step(a_step(ada, 1))
    stream = await watching(h, ada)
    run = uuid.uuid4()
    got = await take(stream, 1)  # step 1, replayed
    said(h, ada, StepStarted(run, 2, Role.ASSISTANT))
    got += await take(stream, 1)
    await h.store.append_step(a_step(ada, 2))
    said(h, ada, StepStarted(run, 3, Role.ASSISTANT))
    await h.store.append_step(a_step(ada, 3))
    said(h, ada, StepCompleted(a_step(ada, 3)))
    got += await take(stream, 3)
    await stream.aclose()
    assert [numbered(e.event) for e in got] == [
        ("StepCompleted", 1),
        ("StepStarted", 2),
        ("StepCompleted", 2),  # whole from the store, not said aborted: it was not
        ("StepStarted", 3),
        ("StepCompleted", 3),
    ]


async def test_a_step_whose_announcement_died_with_its_owner_comes_when_the_next_owner_takes_over(
    h: Harness,
) -> None:
    """The last owner stored the run's last step and died before announcing
    it; nothing else happens to the agent. The next owner's word that it
    took the agent brings the step from the store (and is not shown)."""
    ada = await h.agent()
    await h.store.append_step(a_step(ada, 1))
    stream = await watching(h, ada)
    got = await take(stream, 1)  # step 1, replayed
    await h.store.append_step(a_step(ada, 2))
    said(h, ada, OwnerChanged())
    said(h, ada, StateChanged(AgentState.IDLE))
    got += await take(stream, 2)
    await stream.aclose()
    assert [numbered(e.event) if not isinstance(e.event, StateChanged) else "state" for e in got] == [
        ("StepCompleted", 1),
        ("StepCompleted", 2),
        "state",
    ]


async def test_deltas_of_a_step_whose_start_this_watch_never_saw_wait_for_its_completion(h: Harness) -> None:
    ada = await h.agent()
    stream = await watching(h, ada)
    said(h, ada, StepDelta(1, ContentDelta("the middle of something")))
    said(h, ada, StepCompleted(a_step(ada, 1)))
    (got,) = await take(stream, 1)
    await stream.aclose()
    assert isinstance(got.event, StepCompleted)


async def test_a_run_ended_mid_step_ends_the_step_without_an_abort_later(h: Harness) -> None:
    ada = await h.agent()
    stream = await watching(h, ada)
    run = Run(uuid.uuid4(), ada.id, ada.session_id, RunStatus.FAILED, (), NOW, ended_at=NOW)
    said(h, ada, StepStarted(run.id, 1, Role.ASSISTANT))
    said(h, ada, RunEnded(run))
    said(h, ada, StepStarted(uuid.uuid4(), 1, Role.ASSISTANT))
    got = [type(e.event) for e in await take(stream, 3)]
    await stream.aclose()
    assert got == [StepStarted, RunEnded, StepStarted]


async def test_a_runner_stopped_mid_step_says_the_step_aborted() -> None:
    gate, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        gate.set()
        await release.wait()

    async for h in harness(Script(content="never finished", before=hold)):
        ada = await h.agent()
        chat = h.im.group("", h.human, ada.member_id, direct=True)
        stream = await h.watches.watch_agent(h.me, str(ada.id), after_sequence=0, live_only=True)
        h.im.post(h.human, chat.id, "question")
        await asyncio.wait_for(gate.wait(), 2.0)
        await h.supervisor.stop_agent(ada.id)
        kinds: list[object] = []
        while not kinds or not isinstance(kinds[-1], StepAborted):
            kinds.append((await asyncio.wait_for(anext(stream), 2.0)).event)
        await stream.aclose()
        started = [k for k in kinds if isinstance(k, StepStarted) and k.role is Role.ASSISTANT]
        aborted = kinds[-1]
        assert isinstance(aborted, StepAborted) and started and aborted.sequence == started[-1].sequence
