"""A replica's status: its shards and lease counters from its keeper, its
agents and runs in flight from its supervisor, its link's health; and an
agent's replica as the views give it."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import pytest

from services.common import errors
from services.runtime.domain.commands import CreateAgent
from services.runtime.domain.errors import NotAllowed
from services.runtime.domain.model import AgentDraft
from services.runtime.service_layer.access import AgentAccess
from services.runtime.service_layer.leases import Fence, LeaseKeeper, LeaseLost, LeaseSettings
from services.runtime.service_layer.replica_status import ReplicaMonitor, ReplicaStatus, ReplicaViews
from services.runtime.service_layer.replicas import Inbox, Message, ReplicaLink, ReplicaRunners
from tests.identities import caller_of
from tests.unit.lease_fakes import Clock, InMemoryLeases
from tests.unit.runtime_fakes import FakeIM, Script, ScriptedLLM
from tests.unit.runtime_support import fake_runtime

SHARDS = 8


class QuietLink(ReplicaLink):
    """A link with no other replica on it, up or down as the test says."""

    def __init__(self) -> None:
        self.down = False

    @property
    def degraded(self) -> bool:
        return self.down

    def serve(self, inbox: Inbox, *, missed: object) -> None:
        pass

    async def tell(self, replica: str, message: Message) -> None:
        pass

    async def ask(self, replica: str, message: Message) -> Message:
        raise errors.Unavailable("no other replica")


def keeper_of(store: InMemoryLeases, clock: Clock) -> LeaseKeeper:
    async def changed(shards: frozenset[int]) -> None:
        pass

    return LeaseKeeper(
        store=store,
        settings=LeaseSettings(
            replica="r1", shard_count=SHARDS, ttl_seconds=10, renew_seconds=2, margin_seconds=2
        ),
        gained=changed,
        lost=changed,
        monotonic=clock,
    )


async def test_the_status_follows_the_leases_and_the_link() -> None:
    clock = Clock()
    store = InMemoryLeases(clock)
    await store.prepare(SHARDS)
    keeper = keeper_of(store, clock)
    app = fake_runtime()
    assert app.supervisor is not None
    link = QuietLink()
    monitor = ReplicaMonitor(keeper, app.supervisor, link, app.store)
    assert monitor.status() == ReplicaStatus(
        replica="r1",
        shards=0,
        agents=0,
        runs_in_flight=0,
        leases_proven=False,
        link_degraded=False,
        renewals=0,
        renewal_failures=0,
        shards_taken=0,
        shards_released=0,
        shards_lost=0,
        refused_fenced_writes=0,
    ), "before its first round it proves nothing"

    await keeper.round()  # the first only says it is there
    await keeper.round()
    status = monitor.status()
    assert (status.shards, status.leases_proven, status.renewals, status.shards_taken) == (
        SHARDS,
        True,
        2,
        SHARDS,
    )

    store.down = True
    link.down = True
    with pytest.raises(errors.Unavailable):
        await keeper.round()
    clock.now += 8  # past the proof (ttl - margin) of the last renewal
    status = monitor.status()
    assert (status.shards, status.leases_proven, status.renewal_failures) == (0, False, 1)
    assert status.link_degraded
    assert "0 shards" in status.summary() and "NOT PROVEN" in status.summary()

    # A write under a lease the store does not know (another replica's now) is refused, and counted.
    with pytest.raises(LeaseLost):
        await app.store.save_watch_cursors({uuid.uuid4(): "c1"}, fences=[Fence(0, 1, "r1")])
    assert monitor.status().refused_fenced_writes == 1


async def test_the_status_counts_the_agents_and_their_runs_in_flight() -> None:
    gate = asyncio.Event()
    im = FakeIM()
    human = im.human("alice").id
    script = Script(content="Hello!", hold_after=0, gate=gate)
    app = fake_runtime(im=im, llm=ScriptedLLM(script))
    assert app.supervisor is not None
    clock = Clock()
    monitor = ReplicaMonitor(keeper_of(InMemoryLeases(clock), clock), app.supervisor, QuietLink(), app.store)
    await app.start()
    try:
        ada = await app.bus.handle(
            CreateAgent(caller=caller_of(human, im.workspace, roles=("owner",)), draft=AgentDraft(name="ada"))
        )
        assert (monitor.status().agents, monitor.status().runs_in_flight) == (1, 0)
        chat = im.group("", human, ada.member_id, direct=True)
        im.post(human, chat.id, "hi ada")
        await asyncio.wait_for(script.reached.wait(), 3)
        assert monitor.status().runs_in_flight == 1
        gate.set()
        runner = app.runner(ada.id)
        assert runner is not None
        await asyncio.sleep(0)
        await asyncio.wait_for(runner.idle.wait(), 3)
        assert monitor.status().runs_in_flight == 0
    finally:
        await app.stop()


async def test_the_monitor_logs_the_status_until_closed(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    app = fake_runtime()
    assert app.supervisor is not None
    monitor = ReplicaMonitor(
        keeper_of(InMemoryLeases(clock), clock), app.supervisor, QuietLink(), app.store, log_seconds=0.01
    )
    with caplog.at_level(logging.INFO, logger="services.runtime.service_layer.replica_status"):
        monitor.start()
        async with asyncio.timeout(3):
            while not any("replica r1: 0 shards" in r.getMessage() for r in caplog.records):  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        await monitor.aclose()
        await monitor.aclose()
        logged = len(caplog.records)
        await asyncio.sleep(0.05)
        assert len(caplog.records) == logged, "closed, it logs no more"


async def test_one_runtime_names_no_replica_for_its_agents() -> None:
    im = FakeIM()
    app = fake_runtime(im=im)
    owner = caller_of(im.human("alice").id, im.workspace, roles=("owner",))
    ada = await app.bus.handle(CreateAgent(caller=owner, draft=AgentDraft(name="ada")))
    assert app.agents.replica_of(await app.agents.get_agent(owner, str(ada.id))) == ""


async def test_among_replicas_an_agent_is_named_with_its_shards_owner() -> None:
    im = FakeIM()
    app = fake_runtime(im=im)
    assert app.supervisor is not None
    owner = caller_of(im.human("alice").id, im.workspace, roles=("owner",))
    ada = await app.bus.handle(CreateAgent(caller=owner, draft=AgentDraft(name="ada")))
    owners: dict[object, str | None] = {im.workspace: "r2"}
    runners = ReplicaRunners(app.supervisor, QuietLink(), owner_of=owners.get, replica="r1", store=app.store)
    assert runners.replica_of(ada) == "r2"
    owners[im.workspace] = None  # its shard is moving
    assert runners.replica_of(ada) == ""


async def test_every_replica_lists_the_others_as_they_reported_with_their_renewals() -> None:
    im = FakeIM()
    clock = Clock()
    store = InMemoryLeases(clock)
    await store.prepare(SHARDS)
    app = fake_runtime(im=im)
    assert app.supervisor is not None
    mine = keeper_of(store, clock)
    monitor = ReplicaMonitor(mine, app.supervisor, QuietLink(), app.store)
    mine.report = lambda: monitor.status().as_json()
    access = AgentAccess(store=app.store, runners=app.runners)
    views = ReplicaViews(access=access, supervisor=app.supervisor, keeper=mine, monitor=monitor)
    owner = caller_of(im.human("alice").id, im.workspace, roles=("owner",))
    # Another replica reported with its renewal (a newer one, saying more than this one knows).
    other = ReplicaStatus("r0", 3, 5, 2, True, True, 7, 0, 3, 0, 0, 1)
    report = json.loads(other.as_json()) | {"gpu_count": 4}
    await store.renew("r0", "10.0.0.9:50052", 10, json.dumps(report))
    await mine.round()

    listed = await views.list(owner)
    assert [(r.status.replica, r.answering, r.address) for r in listed] == [
        ("r0", False, "10.0.0.9:50052"),
        ("r1", True, ""),
    ]
    assert listed[0].status == other
    assert listed[1].status == monitor.status()
    assert all(r.reported_at is not None and r.started_at is not None for r in listed)

    # A report cut short, or of an older replica, reads as zeros; the row still counts.
    await store.renew("r0", "", 10, '{"shards": 2, "agents"')
    (first, _) = await views.list(owner)
    assert (first.status.replica, first.status.shards, first.status.leases_proven) == ("r0", 0, False)

    member = caller_of(im.human("bob").id, im.workspace, roles=("member",))
    with pytest.raises(NotAllowed, match="owners and admins"):
        await views.list(member)
