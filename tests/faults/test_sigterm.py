"""Fault case 5: SIGTERM under load stops a service gracefully.

Twenty callers loop unary writes (each with its own request id) and streams
are open when the IM, or the runtime, gets SIGTERM. The process must say
NOT_SERVING first, finish every call it had accepted, refuse later ones with
UNAVAILABLE (never CANCELLED, which standard retry policies do not retry),
end its streams with UNAVAILABLE and a message saying where to resume, and
exit 0 within its grace. Refused calls must have done nothing: after a
restart the stored writes are exactly the acknowledged ones. The gateway gets
the same over HTTP: requests in flight finish, later ones find the port
closed, SSE streams end with an `event: error` carrying UNAVAILABLE, and it
exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from agentim.im.v1 import im_pb2, im_pb2_grpc
from agentim.runtime.v1 import runtime_pb2 as rpb
from agentim.runtime.v1 import runtime_pb2_grpc
from tests.faults.harness import ServiceProcess, clean_environment, free_port, migrate, scaled
from tests.faults.load import (
    NOT_SERVING,
    OK,
    SERVING,
    UNAVAILABLE,
    UNREACHABLE,
    Failed,
    HealthWatch,
    LoopingCallers,
    StreamEnd,
    Streams,
    watching_health,
)
from tests.faults.test_im_kill import all_contents
from tests.identities import as_member, learning_channel, member_token

CALLERS = 20
LOAD_SECONDS = 0.6
GRACE_SECONDS = 5.0
TIMEOUT_S = 10.0

Metadata = tuple[tuple[str, str], ...]


@dataclass
class Stop:
    """One SIGTERM under load: the traffic around it and how the process went."""

    callers: LoopingCallers
    streams: list[StreamEnd]
    health: HealthWatch | None
    sent_at: float
    took: float
    exit_code: int


async def sigterm_under_load(
    service: ServiceProcess,
    call: Callable[[str], Awaitable[None]],
    open_streams: Callable[[Streams], None],
    *,
    prefix: str,
    health: bool = True,
) -> Stop:
    """Opens streams and starts the callers; once traffic flows, SIGTERM and wait for the exit."""
    streams = Streams()
    open_streams(streams)
    callers = LoopingCallers(call, count=CALLERS, prefix=prefix)
    watching: contextlib.AbstractAsyncContextManager[HealthWatch | None] = (
        watching_health(service.address) if health else contextlib.nullcontext()
    )
    async with watching as watch:
        callers.start()
        await streams.flowing()
        await asyncio.sleep(LOAD_SECONDS)
        sent_at = time.monotonic()
        code = await asyncio.to_thread(service.terminate)
        took = time.monotonic() - sent_at
        await callers.stop()
        await streams.ended()
    return Stop(callers, streams.ends, watch, sent_at, took, code)


@dataclass
class Figures:
    """What one or more SIGTERMs under load did, summed up."""

    stops: int = 0
    in_flight: int = 0
    in_flight_ok: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    refused: int = 0
    unreachable: int = 0
    streams: int = 0
    streams_unavailable: int = 0
    not_serving_lead: float | None = None
    longest_stop: float = 0.0
    exit_codes: list[int] = field(default_factory=list)
    acknowledged: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    def add(self, stop: Stop, *, resume_field: str | None = None, resumable: int = 0) -> None:
        """Adds a stop; its first `resumable` streams' ends must name `resume_field`."""
        calls = stop.callers.calls
        in_flight = stop.callers.in_flight_at(stop.sent_at)
        self.stops += 1
        self.in_flight += len(in_flight)
        self.in_flight_ok += sum(c.code == OK for c in in_flight)
        self.codes.update(c.code for c in calls)
        self.refused += sum(c.refused_while_stopping for c in calls)
        self.unreachable += sum(c.unreachable for c in calls)
        self.acknowledged |= {c.key for c in calls if c.code == OK}
        self.failed |= {c.key for c in calls if c.code != OK}
        self.streams += len(stop.streams)
        self.streams_unavailable += sum(s.code == UNAVAILABLE for s in stop.streams)
        self.problems += [
            f"stream ended {s.code}: {s.details}" for s in stop.streams if s.code != UNAVAILABLE
        ]
        self.problems += [
            f"stream ended without {resume_field!r} in {end.details!r}"
            for end in stop.streams[:resumable]
            if resume_field is not None and resume_field not in end.details
        ]
        self.longest_stop = max(self.longest_stop, stop.took)
        self.exit_codes.append(stop.exit_code)
        if stop.health is not None:
            self._add_health(
                stop.health, port_closed=min((c.ended for c in calls if c.unreachable), default=None)
            )

    def _add_health(self, health: HealthWatch, *, port_closed: float | None) -> None:
        seen = [status for _, status in health.statuses]
        if not seen or seen[0] != SERVING or seen[-1] != NOT_SERVING:
            self.problems.append(f"health watch saw {seen}")
        if health.end.code != UNAVAILABLE:
            self.problems.append(f"health watch ended {health.end.code}: {health.end.details}")
        not_serving = health.first(NOT_SERVING)
        if not_serving is not None and port_closed is not None:
            lead = port_closed - not_serving
            self.not_serving_lead = (
                lead if self.not_serving_lead is None else min(lead, self.not_serving_lead)
            )

    def summary(self, name: str) -> str:
        others = sum(
            n for code, n in self.codes.items() if code not in {OK, UNAVAILABLE, UNREACHABLE, "CANCELLED"}
        )
        lead = (
            ""
            if self.not_serving_lead is None
            else f"; NOT_SERVING {self.not_serving_lead:.3f} s before the port closed"
        )
        return (
            f"sigterm {name}: {self.stops} stops under {CALLERS} looping callers;"
            f" in flight at SIGTERM {self.in_flight}, of which {self.in_flight_ok} completed OK;"
            f" {self.codes[OK]} OK, {self.refused} refused UNAVAILABLE while stopping,"
            f" {self.unreachable} unreachable after the port closed, {self.codes['CANCELLED']} CANCELLED,"
            f" {others} other failures; streams {self.streams_unavailable}/{self.streams} ended UNAVAILABLE"
            f"{lead}; longest stop {self.longest_stop:.2f} s; exit codes {self.exit_codes}"
        )

    def check(self, stored: Counter[str]) -> None:
        assert self.exit_codes == [0] * self.stops, f"exit codes {self.exit_codes}"
        assert self.in_flight >= self.stops * CALLERS // 2, f"too little load: {self.in_flight} in flight"
        bad = {code: n for code, n in self.codes.items() if code not in {OK, UNAVAILABLE, UNREACHABLE}}
        assert not bad, f"calls failed: {bad}"
        assert not self.problems, self.problems
        assert self.longest_stop < GRACE_SECONDS, f"a stop took {self.longest_stop:.2f} s"
        # Every call the service took finished; no refused one did anything.
        assert set(stored) == self.acknowledged, (
            f"{len(self.acknowledged - set(stored))} acknowledged writes not stored,"
            f" {len(set(stored) & self.failed)} failed ones stored"
        )
        assert max(stored.values()) == 1, "a write was stored twice"


# --- the IM ---------------------------------------------------------------------


@dataclass(frozen=True)
class Chat:
    member_id: str
    group_id: str
    workspace_id: str

    @property
    def md(self) -> Metadata:
        return as_member(self.member_id)


async def new_chat(address: str) -> Chat:
    async with learning_channel(address) as channel:
        stub = im_pb2_grpc.IMServiceStub(channel)
        created = await stub.CreateWorkspace(
            im_pb2.CreateWorkspaceRequest(name=f"sigterm-{uuid.uuid4().hex[:6]}", creator_display_name="ada"),
            timeout=TIMEOUT_S,
        )
        me = created.creator.id
        group = await stub.CreateGroup(
            im_pb2.CreateGroupRequest(name="g"), metadata=as_member(me), timeout=TIMEOUT_S
        )
        return Chat(me, group.group.id, created.workspace.id)


async def send_message(stub: im_pb2_grpc.IMServiceStub, chat: Chat, key: str) -> None:
    request = im_pb2.SendMessageRequest(group_id=chat.group_id, content=key, request_id=key)
    await stub.SendMessage(request, metadata=chat.md, timeout=TIMEOUT_S)


def watch_events(stub: im_pb2_grpc.IMServiceStub, chat: Chat, streams: Streams) -> None:
    for _ in range(3):
        streams.open(stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=chat.md))


async def stored_messages(address: str, chat: Chat) -> Counter[str]:
    async with learning_channel(address) as channel:
        return Counter(await all_contents(im_pb2_grpc.IMServiceStub(channel), chat.group_id, chat.member_id))


def database_kind(database_url: str) -> str:
    return database_url.partition(":")[0]


async def test_sigterm_of_the_im_under_load_is_graceful(database_url: str, tmp_path: Path) -> None:
    env = clean_environment(
        DATABASE_URL=database_url, IM_GRPC_ADDRESS="127.0.0.1:0", SHUTDOWN_GRACE_SECONDS=str(GRACE_SECONDS)
    )
    migrate("services.im", env)
    figures = Figures()
    with ServiceProcess("services.im", env, tmp_path / "im.log") as im:
        im.start()
        im.pin_address("IM_GRPC_ADDRESS")
        chat = await new_chat(im.address)
        for round_ in range(scaled(1, long=5)):
            if round_:
                im.start()
            async with learning_channel(im.address) as channel:
                stub = im_pb2_grpc.IMServiceStub(channel)
                stop = await sigterm_under_load(
                    im,
                    functools.partial(send_message, stub, chat),
                    functools.partial(watch_events, stub, chat),
                    prefix=f"r{round_}c",
                )
            figures.add(stop, resume_field="after_cursor", resumable=len(stop.streams))
        im.start()
        stored = await stored_messages(im.address, chat)
        im.terminate()
        log = im.log()

    print(figures.summary(f"im ({database_kind(database_url)})"))
    figures.check(stored)
    assert "Traceback" not in log, log[-3000:]


# --- the runtime ----------------------------------------------------------------


async def submit_task(
    stub: runtime_pb2_grpc.RuntimeServiceStub, agent_ids: list[str], md: Metadata, key: str
) -> None:
    # Keys end in the caller's sequence number: spread over the agents.
    agent_id = agent_ids[int(key.rpartition("-")[2]) % len(agent_ids)]
    request = rpb.SubmitTaskRequest(agent_id=agent_id, input=key, request_id=key)
    await stub.SubmitTask(request, metadata=md, timeout=TIMEOUT_S)


def watch_agents(
    stub: runtime_pb2_grpc.RuntimeServiceStub, agent_ids: list[str], md: Metadata, streams: Streams
) -> None:
    for agent_id in agent_ids:
        streams.open(stub.WatchAgent(rpb.WatchAgentRequest(agent_id=agent_id, live_only=True), metadata=md))
    streams.open(stub.WatchAgents(rpb.WatchAgentsRequest(), metadata=md))


async def stored_tasks(address: str, agent_ids: list[str], md: Metadata) -> Counter[str]:
    inputs: Counter[str] = Counter()
    async with learning_channel(address) as channel:
        stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
        for agent_id in agent_ids:
            token = ""
            while True:
                page = await stub.ListTasks(
                    rpb.ListTasksRequest(agent_id=agent_id, page_size=200, page_token=token),
                    metadata=md,
                    timeout=TIMEOUT_S,
                )
                inputs.update(t.input for t in page.tasks)
                token = page.next_page_token
                if not token:
                    break
    return inputs


async def test_sigterm_of_the_runtime_under_load_is_graceful(
    database_url: str, own_runtime_url: str, tmp_path: Path
) -> None:
    runtime_url = own_runtime_url
    im_env = clean_environment(DATABASE_URL=database_url, IM_GRPC_ADDRESS="127.0.0.1:0")
    migrate("services.im", im_env)
    figures = Figures()
    with ServiceProcess("services.im", im_env, tmp_path / "im.log") as im:
        im.start()
        env = clean_environment(
            RUNTIME_DATABASE_URL=runtime_url,
            RUNTIME_GRPC_ADDRESS="127.0.0.1:0",
            IM_ADDRESS=im.address,
            SHUTDOWN_GRACE_SECONDS=str(GRACE_SECONDS),
        )
        chat = await new_chat(im.address)
        with ServiceProcess("services.runtime", env, tmp_path / "runtime.log") as runtime:
            runtime.start()
            runtime.pin_address("RUNTIME_GRPC_ADDRESS")
            async with learning_channel(runtime.address) as channel:
                stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
                agent_ids = [
                    (await stub.CreateAgent(rpb.CreateAgentRequest(name=name), metadata=chat.md)).agent.id
                    for name in ("ada", "bob")
                ]
            for round_ in range(scaled(1, long=5)):
                if round_:
                    runtime.start()
                async with learning_channel(runtime.address) as channel:
                    stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
                    stop = await sigterm_under_load(
                        runtime,
                        functools.partial(submit_task, stub, agent_ids, chat.md),
                        functools.partial(watch_agents, stub, agent_ids, chat.md),
                        prefix=f"r{round_}c",
                    )
                # WatchAgent says where to resume; WatchAgents has no resume point.
                figures.add(stop, resume_field="after_sequence", resumable=len(agent_ids))
            runtime.start()
            stored = await stored_tasks(runtime.address, agent_ids, chat.md)
            runtime.terminate()
            log = runtime.log()
        im.terminate()

    print(figures.summary(f"runtime ({database_kind(database_url)})"))
    figures.check(stored)
    assert "Traceback" not in log, log[-3000:]


# --- the gateway ----------------------------------------------------------------


def signed_in(chat: Chat) -> dict[str, str]:
    """The member's access token, as a program sends it to the gateway."""
    return {"Authorization": f"Bearer {member_token(chat.member_id)}"}


async def post_message(session: aiohttp.ClientSession, base: str, chat: Chat, key: str) -> None:
    try:
        async with session.post(
            f"{base}/v1/groups/{chat.group_id}/messages",
            json={"content": key, "requestId": key},
            headers=signed_in(chat),
        ) as response:
            body = await response.json(content_type=None)
    except aiohttp.ClientError as error:
        # The port closed, or the connection was closed before this request was read.
        raise Failed(UNREACHABLE, repr(error)) from None
    if response.status != 200:
        raise Failed(body["error"]["status"], body["error"]["message"])


def event_streams(session: aiohttp.ClientSession, base: str, chat: Chat, streams: Streams) -> None:
    for _ in range(3):
        streams.open_sse(session, f"{base}/v1/events", signed_in(chat))


async def test_sigterm_of_the_gateway_under_load_is_graceful(tmp_path: Path) -> None:
    im_env = clean_environment(DATABASE_URL=f"sqlite:///{tmp_path / 'im.db'}", IM_GRPC_ADDRESS="127.0.0.1:0")
    migrate("services.im", im_env)
    figures = Figures()
    with ServiceProcess("services.im", im_env, tmp_path / "im.log") as im:
        im.start()
        chat = await new_chat(im.address)
        env = clean_environment(
            GATEWAY_HTTP_ADDRESS="127.0.0.1:0",
            IM_ADDRESS=im.address,
            # Nothing listens there: these routes need only the IM.
            RUNTIME_ADDRESS=f"127.0.0.1:{free_port()}",
            SHUTDOWN_GRACE_SECONDS=str(GRACE_SECONDS),
        )
        with ServiceProcess("gateway", env, tmp_path / "gateway.log") as gateway:
            for round_ in range(scaled(1, long=5)):
                gateway.start()
                base = f"http://{gateway.address}"
                connector = aiohttp.TCPConnector(limit=CALLERS + 10)
                async with aiohttp.ClientSession(
                    connector=connector, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)
                ) as session:
                    stop = await sigterm_under_load(
                        gateway,
                        functools.partial(post_message, session, base, chat),
                        functools.partial(event_streams, session, base, chat),
                        prefix=f"r{round_}c",
                        health=False,
                    )
                figures.add(stop, resume_field="Last-Event-ID", resumable=len(stop.streams))
            log = gateway.log()
        stored = await stored_messages(im.address, chat)
        im.terminate()

    print(figures.summary("gateway"))
    figures.check(stored)
    assert "Traceback" not in log, log[-3000:]
