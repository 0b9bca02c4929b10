"""Benchmark of the agent runtime (issue 3): wake latency, streamed deltas,
agent-to-agent round trips, and thousands of resident agents.

Every server runs as its own subprocess on a free loopback port, per backend:
the IM service (`python -m services.im serve`), the runtime (`python -m
services.runtime serve`, or `bench.runtime_host`, the same service with
timestamps where a wake passes), and `bench.llm_server`, the fake
OpenAI-compatible server of `tests.fake_openai` answering by model name. The
client is this process. Backends: `embedded` (SQLite files, in-process event
signals) and `postgresql` (the database `agentim_bench`, Redis signals for the
IM). The servers run from a copy of the code taken at the start (HEAD's
services by default, `--worktree` for uncommitted ones), so that edits made
during the run do not change what is measured. Times of different processes
are compared on CLOCK_MONOTONIC (`time.monotonic_ns()`), system-wide on Linux.

Measured (`--runs` times each where it makes sense; medians are reported):

1. Wake latency: a person sends sequential messages `bench-<n> hello` to an
   agent in their direct chat; from SendMessage returning to the agent's LLM
   request being sent: with the offline model, the moment the runtime calls
   the LLM's `stream()` (from `bench.runtime_host`'s trace); with the fake
   OpenAI server, the moment the request has arrived there (it writes that
   time into its answer). The trace also splits the time into stages.
2. Streamed deltas: the fake server streams deltas carrying the time each was
   written; a WatchAgent client takes its receive time minus that (the
   latency the runtime adds, with two loopback hops). Then long replies at
   rising rates, and as fast as possible, to one watcher: deltas per second
   delivered, and whether the watch survived.
3. Agent to agent: pairs of agents in direct chats answer each other with the
   offline model (chatter limit lifted); the benchmark seeds each pair with
   one message sent as its first agent and counts, through a trusted IM
   watch, the messages exchanged per second (one hop each; a round trip is
   two hops).
4. Resident agents (once, on one backend): `--agents` agents created through
   CreateAgent, each answering one message, then the runtime restarted: its
   start-up, memory and idle CPU, and the time to wake every agent with a
   message until every run has ended.

The result is printed and written to the `## Agent runtime (issue 3)` section
of docs/benchmarks.md (other sections of that file are kept).

Run as `python -m bench.runtime_bench [--backends embedded,postgresql] [--runs 3]
[--agents 10000] [--parts wake,deltas,chatter,resident] [--no-doc]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from bench.calls import (
    CALL_TIMEOUT_S,
    CREATE_CONCURRENCY,
    RUN_TIMEOUT_S,
    SEND_CONCURRENCY,
    SETTLE_S,
    StreamEnded,
    bounded,
    create_agent,
    delete_agents,
    direct_chat,
    new_workspace,
    open_watch,
    send,
    until_run_ended,
    watching,
)
from bench.harness import (
    PYTHON,
    QUIET_CORES,
    QUIET_WINDOW_S,
    TICKS,
    Backend,
    Clients,
    CpuMeter,
    Ended,
    RuntimeTables,
    Service,
    add_backend_options,
    backend_on,
    listed,
    process_cpu_s,
    rss_mib,
    scratch,
    snapshot_sources,
    wait_quiet,
)
from bench.report import (
    Recorded,
    add_doc_option,
    errors_note,
    fixed,
    grouped,
    percent,
    preamble,
    problems_section,
    run_and_record,
    status,
    table_head,
    tally,
)
from bench.stats import median, median_of, ms, percentile
from tests.identities import as_member, as_service

SECTION = "## Agent runtime (issue 3)"
BACKENDS = ("embedded", "postgresql")
PARTS = ("wake", "deltas", "chatter", "resident")
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/agentim_bench"

WAKE_WARMUP = 10
WAKE_GAP_S = 0.01
# A message whose run has not ended after this long is lost; a run of the
# wake benchmark stops after this many lost messages.
WAKE_TIMEOUT_S = 10.0
WAKE_MAX_LOST = 3
DELTA_COUNT = 1000
DELTA_GAP_US = 1000
# Offered rates of the streamed-deltas sweep, deltas/s; 0 is as fast as possible.
FLOOD_RATES = (2000, 4000, 8000, 0)
FLOOD_SECONDS = 2.0
FLOOD_COUNT = 20_000  # deltas of the as-fast-as-possible reply
CHATTER_WARMUP_S = 2.0
# The agents' first messages are sent this many at a time (see `_history`).
HISTORY_BATCH = 500

TARGET_WAKE_P50_MS = 2.0
TARGET_WAKE_P99_MS = 10.0
TARGET_DELTA_P50_MS = 0.5
TARGET_DELTAS_PER_S = 8000.0
TARGET_RSS_MB = 150.0
TARGET_RSS_MIB = TARGET_RSS_MB * 1e6 / 2**20
TARGET_STARTUP_S = 10.0
AUTOGEN_ROUND_TRIPS = 1200

_ARRIVED = re.compile(r"arrived (\d+)")
_FLOOD_STAMP = re.compile(r"\[(\d+),(\d+)\]")


# --- 1. wake latency ---------------------------------------------------------------

# The points a wake passes, in the order they normally come, and their names.
POINTS = {
    "sent": "SendMessage returned",
    "event": "the IM event reached the runtime",
    "unread": "GetAllUnread called",
    "unread-done": "GetAllUnread answered",
    "markread": "MarkRead called",
    "markread-done": "MarkRead answered",
    "llm": "the LLM called",
    "arrived": "the request at the LLM server",
}


def stages(at: Mapping[str, int]) -> dict[str, float]:
    """The wake's time split between the points it passed on the way to the LLM request.

    Points are taken in the order of POINTS, so that the stages add up to the
    total; a stage is negative when its points came the other way round (the
    IM may deliver the event before the client has its SendMessage answer).
    MarkRead counts only when the runtime made it before calling the LLM.
    """
    end = at.get("llm")
    if end is None:
        return {}
    chain = [
        (point, at[point])
        for point in POINTS
        if point in at and (point not in {"markread", "markread-done"} or at[point] <= end)
    ]
    return {f"{POINTS[a]} → {POINTS[b]}": ms(nb - na) for (a, na), (b, nb) in itertools.pairwise(chain)}


class Trace:
    """Reads `bench.runtime_host`'s trace file incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def points(self) -> dict[str, dict[str, int]]:
        """New trace lines since the last call, as tag -> point -> ns (first occurrence).

        Untagged points (GetAllUnread and MarkRead calls) belong to the next
        tagged `unread-done` / the last one before them; the benchmark has one
        agent busy at a time, and `stages` keeps only the points before the
        LLM call.
        """
        with self.path.open() as trace:
            trace.seek(self._offset)
            lines = trace.read().splitlines()
            self._offset = trace.tell()
        by_tag: dict[str, dict[str, int]] = defaultdict(dict)
        last_unread = 0
        current: str | None = None
        for line in lines:
            stamp, point, tag = line.split(" ")
            ns = int(stamp)
            if point == "unread":
                last_unread = ns
            elif point == "unread-done" and tag != "-":
                current = tag
                by_tag[tag].setdefault("unread", last_unread)
                by_tag[tag].setdefault(point, ns)
            elif point in {"markread", "markread-done"} and current is not None:
                by_tag[current].setdefault(point, ns)
            elif tag != "-":
                by_tag[tag].setdefault(point, ns)
        return by_tag


@dataclass
class WakeSample:
    """One run of sequential messages to one agent."""

    latencies_ms: list[float]  # in send order, warm-up excluded
    stages_ms: dict[str, list[float]]
    failed: int  # messages with no completed run, or none traced
    lost: list[str]  # messages whose run never came, with what the agent had unread


async def wake_run(
    clients: Clients,
    person: str,
    trace: Trace,
    *,
    model: rpb.ModelSettings | None,
    count: int,
    first_tag: int,
) -> WakeSample:
    agent = await create_agent(clients, person, f"wake-{first_tag}", model=model)
    await asyncio.sleep(SETTLE_S)
    chat = await direct_chat(clients, person, agent.member_id)
    sent: dict[str, int] = {}
    arrived: dict[str, int] = {}
    lost: list[str] = []
    failed = 0
    trace.points()  # skip what came before
    call = await open_watch(clients, person, agent.id)
    try:
        for i in range(WAKE_WARMUP + count):
            tag = str(first_tag + i)

            def on_event(event: Any, received: int, tag: str = tag) -> None:
                if event.WhichOneof("event") == "step_completed":
                    found = _ARRIVED.search(event.step_completed.content)
                    if found:
                        arrived[tag] = int(found[1])

            await send(clients, person, chat, f"bench-{tag} hello")
            sent[tag] = time.monotonic_ns()
            try:
                status = await until_run_ended(call, on_event, limit_s=WAKE_TIMEOUT_S)
            except TimeoutError:
                # The timeout cancelled the stream: diagnose, then watch again.
                unread = await clients.im.GetAllUnread(
                    im_pb2.GetAllUnreadRequest(), metadata=as_member(agent.member_id), timeout=CALL_TIMEOUT_S
                )
                lost.append(
                    f"bench-{tag}: no run ended within {WAKE_TIMEOUT_S:g} s of SendMessage; the agent had "
                    f"{len(unread.messages)} unread messages then"
                )
                print(f"warning: {lost[-1]}", file=sys.stderr)
                if len(lost) >= WAKE_MAX_LOST:
                    break
                call = await open_watch(clients, person, agent.id)
                continue
            failed += status != rpb.RUN_STATUS_COMPLETED
            await asyncio.sleep(WAKE_GAP_S)
    finally:
        call.cancel()
    points = trace.points()
    await delete_agents(clients, person, [agent])
    latencies: list[float] = []
    split: dict[str, list[float]] = defaultdict(list)
    for i in range(WAKE_WARMUP, WAKE_WARMUP + count):
        tag = str(first_tag + i)
        if tag not in sent:
            failed += 1
            continue
        at = dict(points.get(tag, {}), sent=sent[tag])
        if tag in arrived:
            at["arrived"] = arrived[tag]
        end = at.get("arrived" if model is not None else "llm")
        if end is None:
            failed += 1
            continue
        latencies.append(ms(end - at["sent"]))
        for label, value in stages(at).items():
            split[label].append(value)
    return WakeSample(latencies, dict(split), failed, lost)


# --- 2. streamed deltas ------------------------------------------------------------


@dataclass
class FloodLevel:
    """One long reply streamed at an offered rate (0: as fast as possible) to one watcher."""

    offered: int
    count: int
    received: int = 0
    rate: float = float("nan")  # deltas/s at the watcher, first to last
    server_rate: float = float("nan")  # deltas/s the fake server wrote at
    cut: bool = False  # the WatchAgent stream ended before the run did
    runtime_cores: float = float("nan")


@dataclass
class DeltaSample:
    latencies_ms: list[float]
    timed_lost: int
    levels: list[FloodLevel]


async def watch_run(
    clients: Clients, person: str, agent: rpb.Agent, content: str, on_event: Callable[[Any, int], None]
) -> bool:
    """Sends a message to the agent and watches its run; False if the stream ended before the run.

    When the runtime ends the stream early, waits for the run to end all the same.
    """
    chat = await direct_chat(clients, person, agent.member_id)
    async with watching(clients, person, agent.id) as call:
        await send(clients, person, chat, content)
        try:
            await until_run_ended(call, on_event)
            return True
        except StreamEnded:
            pass
    async with asyncio.timeout(RUN_TIMEOUT_S):
        while True:
            runs = await clients.runtime.ListRuns(
                rpb.ListRunsRequest(agent_id=agent.id, page_size=1),
                metadata=as_member(person),
                timeout=CALL_TIMEOUT_S,
            )
            if runs.runs and runs.runs[0].status != rpb.RUN_STATUS_RUNNING:
                return False
            await asyncio.sleep(0.1)


async def flood_level(
    clients: Clients, person: str, level: FloodLevel, *, runtime_pid: int, fake_url: str, name: str
) -> FloodLevel:
    model = rpb.ModelSettings(base_url=fake_url, model=f"bench-paced-{level.count}-{level.offered}")
    agent = await create_agent(clients, person, name, model=model)
    await asyncio.sleep(SETTLE_S)
    received_at: list[int] = []
    stamps: list[tuple[int, int]] = []

    def on_event(event: Any, received: int) -> None:
        if event.WhichOneof("event") == "step_delta" and event.step_delta.WhichOneof("delta") == "content":
            # A watcher that falls behind gets consecutive fragments merged:
            # count the characters, each one delta the server sent.
            content = event.step_delta.content
            received_at.extend([received] * content.count("x"))
            if found := _FLOOD_STAMP.search(content):
                stamps.append((int(found[1]), int(found[2])))

    meter = CpuMeter({"runtime": runtime_pid})
    meter.start()
    level.cut = not await watch_run(clients, person, agent, "stream to me", on_event)
    meter.stop()
    await delete_agents(clients, person, [agent])
    level.received = len(received_at)
    level.runtime_cores = meter.cores["runtime"]
    if len(received_at) > 1:
        level.rate = (len(received_at) - 1) / ((received_at[-1] - received_at[0]) / 1e9)
    if stamps and stamps[0][1] > stamps[0][0]:
        level.server_rate = level.count / ((stamps[0][1] - stamps[0][0]) / 1e9)
    return level


async def delta_run(clients: Clients, person: str, runtime_pid: int, fake_url: str, run: int) -> DeltaSample:
    model = rpb.ModelSettings(base_url=fake_url, model=f"bench-timed-{DELTA_COUNT}-{DELTA_GAP_US}")
    timed = await create_agent(clients, person, f"timed-{run}", model=model)
    await asyncio.sleep(SETTLE_S)
    latencies: list[float] = []

    def on_timed(event: Any, received: int) -> None:
        if event.WhichOneof("event") == "step_delta" and event.step_delta.WhichOneof("delta") == "content":
            for stamp in event.step_delta.content.split(";"):
                if stamp:
                    latencies.append(ms(received - int(stamp)))

    await watch_run(clients, person, timed, "stream to me", on_timed)
    await delete_agents(clients, person, [timed])
    levels = [
        await flood_level(
            clients,
            person,
            FloodLevel(rate, round(rate * FLOOD_SECONDS) if rate else FLOOD_COUNT),
            runtime_pid=runtime_pid,
            fake_url=fake_url,
            name=f"flood-{run}-{rate}",
        )
        for rate in FLOOD_RATES
    ]
    return DeltaSample(latencies, DELTA_COUNT - len(latencies), levels)


# --- 3. agent to agent -----------------------------------------------------------


@dataclass
class ChatterSample:
    pairs: int
    hops: int
    seconds: float
    hop_ms: list[float]
    cores: dict[str, float]
    machine_busy: float
    failed_setup: int

    @property
    def hops_per_s(self) -> float:
        return self.hops / self.seconds if self.seconds > 0 else float("nan")


async def chatter_run(
    clients: Clients, pids: Mapping[str, int], *, pairs: int, seconds: float, run: int, workspaces: int = 1
) -> ChatterSample:
    """Pairs of agents answering each other, the pairs spread over
    `workspaces` workspaces (among runtime replicas, a workspace's agents run
    on the replica that holds its shard: one workspace keeps them all on one)."""
    persons = [
        await new_workspace(clients, f"bench-chatter-{pairs}-{run}" + (f"-{w}" if workspaces > 1 else ""))
        for w in range(workspaces)
    ]
    created, errors = await bounded(
        [
            partial(create_agent, clients, persons[i % workspaces], n)
            for i in range(pairs)
            for n in (f"a{i}", f"b{i}")
        ],
        CREATE_CONCURRENCY,
    )
    by_name = {a.name: a for a in created}
    couples = [
        (by_name[f"a{i}"], by_name[f"b{i}"])
        for i in range(pairs)
        if f"a{i}" in by_name and f"b{i}" in by_name
    ]
    await wait_quiet(list(pids.values()), since=time.perf_counter())
    groups = [
        g for g in await asyncio.gather(*(direct_chat(clients, a.member_id, b.member_id) for a, b in couples))
    ]
    watches = []
    for person in persons:
        workspace = (
            await clients.im.GetMember(
                im_pb2.GetMemberRequest(member_id=person), metadata=as_member(person), timeout=CALL_TIMEOUT_S
            )
        ).member.workspace_id
        watches.append(
            clients.im.WatchEvents(
                im_pb2.WatchEventsRequest(workspace_id=workspace), metadata=as_service("runtime")
            )
        )
    last_in_group: dict[str, int] = {}
    hops: list[tuple[int, float]] = []  # (received ns, ms since the previous message of its group)

    async def count(watch: Any) -> None:
        async for response in watch:
            if response.WhichOneof("event") != "message_created":
                continue
            now = time.monotonic_ns()
            group = response.message_created.message.group_id
            previous = last_in_group.get(group)
            last_in_group[group] = now
            if previous is not None:
                hops.append((now, ms(now - previous)))

    counters = [asyncio.create_task(count(w)) for w in watches]
    try:
        for watch in watches:
            await asyncio.wait_for(watch.initial_metadata(), CALL_TIMEOUT_S)
        # Let the runtime's own IM watch take in the new agents before the first message.
        await asyncio.sleep(0.5)
        # Agents answer an agent's answer only when it names them (issue 10):
        # the offline model repeats what it was told, so a first message
        # naming both keeps the two answering each other.
        await asyncio.gather(
            *(
                send(
                    clients,
                    a.member_id,
                    g,
                    f"@{a.name} @{b.name} bench-chatter hello",
                    mentions=[a.member_id, b.member_id],
                )
                for (a, b), g in zip(couples, groups, strict=True)
            )
        )
        await asyncio.sleep(CHATTER_WARMUP_S)
        meter = CpuMeter(pids)
        begin = time.monotonic_ns()
        meter.start()
        await asyncio.sleep(seconds)
        meter.stop()
        end = time.monotonic_ns()
    finally:
        for counter, watch in zip(counters, watches, strict=True):
            counter.cancel()
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await counter
    in_window = [gap for at, gap in hops if begin <= at < end]
    for index, person in enumerate(persons):
        await delete_agents(clients, person, [a for a in created if int(a.name[1:]) % workspaces == index])
    return ChatterSample(
        pairs=len(couples),
        hops=len(in_window),
        seconds=(end - begin) / 1e9,
        hop_ms=in_window,
        cores=dict(meter.cores),
        machine_busy=meter.machine_busy,
        failed_setup=sum(errors.values()),
    )


# --- 4. resident agents ------------------------------------------------------------


@dataclass
class ResidentResult:
    agents: int
    workspaces: int
    empty_rss_mib: float = float("nan")
    empty_idle_cpu_ms: float = float("nan")
    create_s: float = float("nan")
    created: int = 0
    create_errors: Counter[str] = field(default_factory=Counter)
    settle_s: float = float("nan")
    chats_s: float = float("nan")
    chat_errors: Counter[str] = field(default_factory=Counter)
    history_send_s: float = 0.0
    history_send_errors: Counter[str] = field(default_factory=Counter)
    history: Ended = field(default_factory=Ended)
    states_after_history: Counter[str] = field(default_factory=Counter)
    rss_after_history_mib: float = float("nan")
    stop_s: float = float("nan")
    listening_s: float = float("nan")
    banner_agents: int = -1
    quiet_s: float = float("nan")
    states_after_start: Counter[str] = field(default_factory=Counter)
    rss_started_mib: float = float("nan")
    idle_seconds: float = 0.0
    idle_cpu_ms: float = float("nan")
    im_idle_cpu_ms: float = float("nan")
    wake_send_s: float = float("nan")
    wake: Ended = field(default_factory=Ended)
    wake_send_errors: Counter[str] = field(default_factory=Counter)
    states_after_wake: Counter[str] = field(default_factory=Counter)
    rss_after_wake_mib: float = float("nan")
    problems: Counter[str] = field(default_factory=Counter)


async def resident(backend: Backend, options: Options, workdir: Path, im: Service) -> ResidentResult:
    """Creates the agents and their history in one runtime, then measures a restarted one."""
    workspaces = math.ceil(options.agents / options.agents_per_workspace)
    result = ResidentResult(agents=options.agents, workspaces=workspaces)
    tables = RuntimeTables(backend.runtime_url)
    name = backend.name
    try:
        async with backend.runtime(
            f"runtime, resident agents ({name})", log_path=workdir / f"runtime-resident-{name}.log"
        ) as (rt, clients):
            if rt.banner_agents() != 0:
                print(f"warning: the runtime should start with no agent: {rt.banner}", file=sys.stderr)
            await wait_quiet([rt.pid], since=rt.spawned_at)
            result.empty_rss_mib = rss_mib(rt.pid)
            cpu = process_cpu_s(rt.pid)
            await asyncio.sleep(options.idle_seconds)
            result.empty_idle_cpu_ms = (process_cpu_s(rt.pid) - cpu) * 1000
            print(f"[{name}] empty runtime: RSS {result.empty_rss_mib:.0f} MiB", flush=True)
            chats = await _resident_agents(clients, result, options, name, [rt.pid, im.pid])
            result.history = await _history(clients, chats, tables, result)
            result.states_after_history = await tables.agents()
            result.rss_after_history_mib = rss_mib(rt.pid)
            print(
                f"[{name}] history: {_ended(result.history)}; "
                f"agents {dict(result.states_after_history)}; "
                f"RSS {result.rss_after_history_mib:.0f} MiB",
                flush=True,
            )
        result.stop_s = rt.stopped_in_s
        result.problems += rt.problems()
        async with backend.runtime(
            f"runtime, resident agents, restarted ({name})",
            log_path=workdir / f"runtime-restarted-{name}.log",
        ) as (rt, clients):
            await _restarted(
                rt, im, clients=clients, chats=chats, tables=tables, result=result, options=options
            )
        result.problems += rt.problems()
    finally:
        await tables.aclose()
    return result


async def _history(
    clients: Clients, chats: list[tuple[str, str]], tables: RuntimeTables, result: ResidentResult
) -> Ended:
    """Each agent answers one message; sent HISTORY_BATCH at a time, each batch once the last has ended.

    The batches keep the IM from being swamped (see the wake-all phase for
    what happens then), so that every agent gets its history.
    """
    total = Ended(complete=True)
    started = time.perf_counter()
    for first in range(0, len(chats), HISTORY_BATCH):
        batch = chats[first : first + HISTORY_BATCH]
        before = await tables.runs()
        sending = time.perf_counter()
        sent, errors = await bounded(
            [partial(send, clients, person, chat, "hello") for person, chat in batch], SEND_CONCURRENCY
        )
        result.history_send_s += time.perf_counter() - sending
        result.history_send_errors += errors
        ended = await tables.until_ended(len(sent), before=before, since=started)
        total.runs += ended.runs
        total.target += ended.target
        total.seconds = ended.seconds
        total.complete = total.complete and ended.complete
    return total


def _ended(ended: Ended) -> str:
    target = ended.target
    runs = ", ".join(f"{n} {status}" for status, n in sorted(ended.runs.items()))
    if ended.complete:
        return f"all {target} runs ended in {ended.seconds:.1f} s ({runs})"
    done = sum(v for k, v in ended.runs.items() if k != "running")
    return f"only {done} of {target} runs ended ({runs}), the last after {ended.seconds:.1f} s"


async def _resident_agents(
    clients: Clients, result: ResidentResult, options: Options, backend: str, pids: Sequence[int]
) -> list[tuple[str, str]]:
    """Creates the workspaces, the agents and their direct chats; returns (person, chat) per agent."""
    people, _ = await bounded(
        [partial(new_workspace, clients, f"bench-resident-{w}") for w in range(result.workspaces)],
        CREATE_CONCURRENCY,
    )
    per = options.agents_per_workspace
    started = time.perf_counter()
    agents, result.create_errors = await bounded(
        [partial(_resident_agent, clients, people[i // per], i) for i in range(result.agents)],
        CREATE_CONCURRENCY,
    )
    result.create_s = time.perf_counter() - started
    result.created = len(agents)
    print(
        f"[{backend}] created {len(agents)} agents in {result.create_s:.1f} s"
        + (f", errors {dict(result.create_errors)}" if result.create_errors else ""),
        flush=True,
    )
    result.settle_s = await wait_quiet(pids, since=time.perf_counter())
    started = time.perf_counter()
    chats, result.chat_errors = await bounded(
        [partial(_chat_of, clients, made) for made in agents], CREATE_CONCURRENCY
    )
    result.chats_s = time.perf_counter() - started
    return chats


async def _restarted(
    rt: Service,
    im: Service,
    *,
    clients: Clients,
    chats: list[tuple[str, str]],
    tables: RuntimeTables,
    result: ResidentResult,
    options: Options,
) -> None:
    """Start-up, memory and idle CPU of the restarted runtime, then the time to wake every agent."""
    result.listening_s = rt.listening_after_s
    result.banner_agents = rt.banner_agents()
    result.quiet_s = await wait_quiet([rt.pid, im.pid], since=rt.spawned_at)
    result.states_after_start = await tables.agents()
    result.rss_started_mib = rss_mib(rt.pid)
    result.idle_seconds = options.idle_seconds
    cpu, im_cpu = process_cpu_s(rt.pid), process_cpu_s(im.pid)
    await asyncio.sleep(options.idle_seconds)
    result.idle_cpu_ms = (process_cpu_s(rt.pid) - cpu) * 1000
    result.im_idle_cpu_ms = (process_cpu_s(im.pid) - im_cpu) * 1000
    print(
        f"[{rt.name}] {result.banner_agents} agents: listening after {result.listening_s:.1f} s, "
        f"idle after {result.quiet_s:.1f} s (agents {dict(result.states_after_start)}), "
        f"RSS {result.rss_started_mib:.0f} MiB, "
        f"idle CPU {result.idle_cpu_ms:.0f} ms in {options.idle_seconds:g} s",
        flush=True,
    )
    before = await tables.runs()
    started = time.perf_counter()
    sent, result.wake_send_errors = await bounded(
        [partial(send, clients, person, chat, "wake up") for person, chat in chats], SEND_CONCURRENCY
    )
    result.wake_send_s = time.perf_counter() - started
    result.wake = await tables.until_ended(len(sent), before=before, since=started)
    result.states_after_wake = await tables.agents()
    result.rss_after_wake_mib = rss_mib(rt.pid)
    print(
        f"[{rt.name}] wake all: {_ended(result.wake)}; agents {dict(result.states_after_wake)}; "
        f"RSS {result.rss_after_wake_mib:.0f} MiB",
        flush=True,
    )


async def _resident_agent(clients: Clients, person: str, index: int) -> tuple[str, rpb.Agent]:
    return person, await create_agent(clients, person, f"resident-{index}")


async def _chat_of(clients: Clients, made: tuple[str, rpb.Agent]) -> tuple[str, str]:
    person, agent = made
    return person, await direct_chat(clients, person, agent.member_id)


@dataclass
class BackendResult:
    backend: str
    wake_offline: list[WakeSample] = field(default_factory=list)
    wake_fake: list[WakeSample] = field(default_factory=list)
    deltas: list[DeltaSample] = field(default_factory=list)
    chatter: dict[int, list[ChatterSample]] = field(default_factory=dict)
    resident: ResidentResult | None = None
    problems: dict[str, Counter[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Options:
    backends: list[str]
    runs: int
    messages: int
    pairs: list[int]
    seconds: float
    agents: int
    agents_per_workspace: int
    idle_seconds: float
    resident_backend: str
    parts: list[str]
    worktree: bool
    ref: str | None
    keep_logs: bool
    postgres_url: str
    redis_url: str
    write_doc: bool


async def bench_backend(name: str, options: Options, workdir: Path, source: Path) -> BackendResult:
    async with contextlib.AsyncExitStack() as stack:
        backend = await backend_on(
            stack,
            name,
            workdir=workdir,
            source=source,
            postgres_url=options.postgres_url,
            redis_url=options.redis_url,
        )
        result = BackendResult(name)
        await backend.migrate()
        im = await backend.start_im(stack, name=f"IM service ({name})", log_path=workdir / f"im-{name}.log")
        llm = await stack.enter_async_context(backend.llm(log_path=workdir / f"llm-{name}.log"))
        await _parts(backend, options, workdir, result, im=im, fake_url=f"http://{llm.address}/v1")
        result.problems[im.name] = im.problems()
        result.problems[llm.name] = llm.problems()
        return result


async def _parts(
    backend: Backend, options: Options, workdir: Path, result: BackendResult, *, im: Service, fake_url: str
) -> None:
    name = backend.name
    if {"wake", "deltas"} & set(options.parts):
        await _traced_parts(backend, options, workdir, result, fake_url)
    if "chatter" in options.parts:
        await _chatter_part(backend, options, workdir, result, im)
    if "resident" in options.parts and name == options.resident_backend and options.agents > 0:
        result.resident = await resident(backend, options, workdir, im)
        result.problems[f"runtime, resident agents ({name})"] = result.resident.problems


async def _traced_parts(
    backend: Backend, options: Options, workdir: Path, result: BackendResult, fake_url: str
) -> None:
    """1 and 2: wake latency and streamed deltas, on the runtime with its wake traced."""
    name = backend.name
    trace_path = workdir / f"trace-{name}.txt"
    trace_path.touch()
    trace = Trace(trace_path)
    async with backend.runtime(
        f"runtime, traced ({name})",
        argv=[PYTHON, "-m", "bench.runtime_host"],
        log_path=workdir / f"runtime-traced-{name}.log",
        BENCH_TRACE_FILE=str(trace_path),
    ) as (rt, clients):
        person = await new_workspace(clients, "bench-wake")
        tag = 0
        for run in range(1, options.runs + 1 if "wake" in options.parts else 1):
            offline = await wake_run(
                clients, person, trace, model=None, count=options.messages, first_tag=tag
            )
            tag += WAKE_WARMUP + options.messages
            fake_model = rpb.ModelSettings(base_url=fake_url, model="bench-short")
            fake = await wake_run(
                clients, person, trace, model=fake_model, count=options.messages, first_tag=tag
            )
            tag += WAKE_WARMUP + options.messages
            result.wake_offline.append(offline)
            result.wake_fake.append(fake)
            failed = offline.failed + fake.failed
            print(
                f"[{name}] run {run}: wake offline p50 {percentile(offline.latencies_ms, 0.5):.2f} ms "
                f"p99 {percentile(offline.latencies_ms, 0.99):.2f} ms; fake server p50 "
                f"{percentile(fake.latencies_ms, 0.5):.2f} ms "
                f"p99 {percentile(fake.latencies_ms, 0.99):.2f} ms"
                + (f"; failed {failed}" if failed else ""),
                flush=True,
            )
        for run in range(1, options.runs + 1 if "deltas" in options.parts else 1):
            sample = await delta_run(clients, person, rt.pid, fake_url, run)
            result.deltas.append(sample)
            levels = ", ".join(
                f"{lv.offered or 'max'}/s: {lv.received}/{lv.count} at {lv.rate:,.0f}/s"
                + (" CUT" if lv.cut else "")
                for lv in sample.levels
            )
            print(
                f"[{name}] run {run}: delta latency p50 {percentile(sample.latencies_ms, 0.5):.3f} ms "
                f"p99 {percentile(sample.latencies_ms, 0.99):.3f} ms; replies {levels}",
                flush=True,
            )
    result.problems[rt.name] = rt.problems()


async def _chatter_part(
    backend: Backend, options: Options, workdir: Path, result: BackendResult, im: Service
) -> None:
    """3: agents answering each other without limit, on the plain runtime."""
    name = backend.name
    async with backend.runtime(
        f"runtime, agent to agent ({name})",
        log_path=workdir / f"runtime-chatter-{name}.log",
        # Lifted so that the pairs never stop: the chatter limit, and the token
        # budget (each completion counts its whole growing context).
        RUNTIME_AGENT_CHATTER_LIMIT="1000000000",
        RUNTIME_TOKEN_BUDGET="1000000000000",
    ) as (rt, clients):
        for pairs in options.pairs:
            samples = result.chatter.setdefault(pairs, [])
            for run in range(1, options.runs + 1):
                pids = {"runtime": rt.pid, "IM": im.pid}
                chatter = await chatter_run(clients, pids, pairs=pairs, seconds=options.seconds, run=run)
                samples.append(chatter)
                print(
                    f"[{name}] run {run}: {chatter.pairs} pairs: {chatter.hops_per_s:,.0f} hops/s "
                    f"({chatter.hops_per_s / 2:,.0f} round trips/s), "
                    f"hop p50 {percentile(chatter.hop_ms, 0.5):.1f} ms, "
                    f"runtime CPU {percent(chatter.cores['runtime'])}, IM CPU {percent(chatter.cores['IM'])}",
                    flush=True,
                )
    result.problems[rt.name] = rt.problems()


# --- report ----------------------------------------------------------------------


def _wake_rows(result: BackendResult) -> list[str]:
    rows = []
    for label, samples in (("offline model", result.wake_offline), ("fake OpenAI server", result.wake_fake)):
        if not samples:
            continue
        failed = sum(s.failed for s in samples)
        rows.append(
            f"| {result.backend} | {label} | {len(samples[0].latencies_ms)} "
            f"| {fixed(median_of(samples, lambda s: percentile(s.latencies_ms, 0.5)))} "
            f"| {fixed(median_of(samples, lambda s: percentile(s.latencies_ms, 0.99)))} "
            f"| {fixed(max(max(s.latencies_ms, default=math.nan) for s in samples))} "
            f"| {fixed(median_of(samples, lambda s: percentile(s.latencies_ms[:50], 0.5)))} / "
            f"{fixed(median_of(samples, lambda s: percentile(s.latencies_ms[-50:], 0.5)))} | {failed} |"
        )
    return rows


def _stage_table(results: Sequence[BackendResult]) -> list[str]:
    columns = [
        (f"{r.backend}, {label}", samples)
        for r in results
        for label, samples in (("offline", r.wake_offline), ("fake server", r.wake_fake))
        if samples
    ]
    order = list(POINTS.values())
    labels = sorted(
        {label for _, samples in columns for s in samples for label in s.stages_ms},
        key=lambda label: [order.index(part) for part in label.split(" → ")],
    )
    lines = [
        "| From → to (median ms) | " + " | ".join(c for c, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for label in labels:
        cells = []
        for _, samples in columns:
            values = [median(s.stages_ms[label]) for s in samples if s.stages_ms.get(label)]
            cells.append(fixed(median(values)) if values else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _delta_rows(result: BackendResult) -> tuple[str, list[str]]:
    samples = result.deltas
    latency = (
        f"| {result.backend} | {DELTA_COUNT:,} "
        f"| {fixed(median_of(samples, lambda s: percentile(s.latencies_ms, 0.5)), 3)} "
        f"| {fixed(median_of(samples, lambda s: percentile(s.latencies_ms, 0.99)), 3)} "
        f"| {fixed(max(max(s.latencies_ms, default=math.nan) for s in samples), 3)} "
        f"| {sum(s.timed_lost for s in samples)} |"
    )
    floods = []
    for index, rate in enumerate(FLOOD_RATES):
        levels = [s.levels[index] for s in samples]
        rates = [lv.rate for lv in levels]
        floods.append(
            f"| {result.backend} | {f'{rate:,}' if rate else 'as fast as possible'} | {levels[0].count:,} "
            f"| {median([lv.received for lv in levels]):,.0f} "
            f"| {grouped(median(rates))} ({grouped(min(rates))}-{grouped(max(rates))}) "
            f"| {sum(lv.cut for lv in levels)} of {len(levels)} "
            f"| {percent(median([lv.runtime_cores for lv in levels]))} "
            f"| {grouped(median([lv.server_rate for lv in levels]))} |"
        )
    return latency, floods


def sustained_rate(result: BackendResult) -> float:
    """The best watcher rate of an offered rate that every run delivered whole (nan if none)."""
    best = float("nan")
    for index in range(len(FLOOD_RATES)):
        levels = [s.levels[index] for s in result.deltas]
        if levels and all(not lv.cut and lv.received == lv.count for lv in levels):
            rate = median([lv.rate for lv in levels])
            best = rate if math.isnan(best) else max(best, rate)
    return best


def _chatter_rows(result: BackendResult) -> list[str]:
    rows = []
    for pairs, samples in result.chatter.items():
        rates = [s.hops_per_s for s in samples]
        rows.append(
            f"| {result.backend} | {pairs} | {median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) "
            f"| **{median(rates) / 2:,.0f}** "
            f"| {fixed(median_of(samples, lambda s: percentile(s.hop_ms, 0.5)), 1)} "
            f"| {fixed(median_of(samples, lambda s: percentile(s.hop_ms, 0.99)), 1)} "
            f"| {percent(median_of(samples, lambda s: s.cores.get('runtime', math.nan)))} "
            f"| {percent(median_of(samples, lambda s: s.cores.get('IM', math.nan)))} "
            f"| {percent(median_of(samples, lambda s: s.machine_busy))} |"
        )
    return rows


def _phase(ended: Ended, sent_s: float, errors: Counter[str] | None = None) -> str:
    target = ended.target
    if ended.complete:
        head = f"{ended.seconds:.1f} s ({target / ended.seconds:,.0f} agents/s)"
    else:
        done = sum(v for k, v in ended.runs.items() if k != "running")
        head = f"**incomplete**: {done:,} of {target:,} runs ended, the last after {ended.seconds:.1f} s"
    return f"{head}; sending took {sent_s:.1f} s{errors_note(errors or Counter())}; runs: {tally(ended.runs)}"


def _resident_lines(backend: str, r: ResidentResult, options: Options) -> list[str]:
    above = r.rss_started_mib - r.empty_rss_mib
    return [
        f"### Resident agents ({backend})",
        "",
        f"{r.agents:,} agents in {r.workspaces:,} workspaces of {options.agents_per_workspace} agents and "
        "one person each, created through CreateAgent. Each agent has a direct chat with its person, who "
        "sends it one message it answers (its history: one run, two steps, two IM messages); then the "
        "runtime is stopped and started again, and every agent gets a second message. Start-up ends when "
        f"the runtime and the IM have both used less than {QUIET_CORES * 100:g}% of a core for "
        f"{QUIET_WINDOW_S:g} s (each runner's first cycle reads its steps and calls GetAllUnread). Runs "
        "and agent states are read from the runtime's tables. Measured once.",
        "",
        *table_head("Measurement", "Value"),
        f"| empty runtime (no agent): RSS / CPU while idle for {options.idle_seconds:g} s | "
        f"{r.empty_rss_mib:.0f} MiB / {r.empty_idle_cpu_ms:.0f} ms |",
        f"| CreateAgent x {r.agents:,} ({CREATE_CONCURRENCY} at a time) | {r.create_s:.1f} s "
        f"({r.created / r.create_s:,.0f}/s){errors_note(r.create_errors)} |",
        f"| then until the runtime and the IM are idle (before creating chats) | {r.settle_s:.1f} s |",
        f"| direct chats (GetOrCreateDirectGroup x {r.created:,}) "
        f"| {r.chats_s:.1f} s{errors_note(r.chat_errors)} |",
        f"| history: a first message to every agent, in batches of {HISTORY_BATCH:,} ({SEND_CONCURRENCY} "
        "sends at a time, a batch once the previous one's runs have ended), until every run ended "
        f"| {_phase(r.history, r.history_send_s, r.history_send_errors)} |",
        f"| agents then, by state | {tally(r.states_after_history)} |",
        f"| RSS then | {r.rss_after_history_mib:.0f} MiB |",
        f"| shutdown (SIGTERM to exit) | {r.stop_s:.1f} s |",
        f"| restart: process start to the `listening` line ({r.banner_agents:,} agents) "
        f"| {r.listening_s:.1f} s |",
        f"| restart: process start until the runtime and the IM are idle | {r.quiet_s:.1f} s |",
        f"| agents then, by state | {tally(r.states_after_start)} |",
        f"| RSS once idle (above the empty runtime) | {r.rss_started_mib:.0f} MiB (**{above:+.0f} MiB**, "
        f"{1024 * above / max(1, r.created):.1f} KiB per agent) |",
        f"| CPU while idle for {r.idle_seconds:g} s: runtime / IM "
        f"| {r.idle_cpu_ms:.0f} ms / {r.im_idle_cpu_ms:.0f} ms |",
        f"| wake all: a message to every agent until every run ended "
        f"| {_phase(r.wake, r.wake_send_s, r.wake_send_errors)} |",
        f"| agents then, by state | {tally(r.states_after_wake)} |",
        f"| RSS after waking all | {r.rss_after_wake_mib:.0f} MiB |",
        "",
    ]


def targets(results: Sequence[BackendResult]) -> list[str]:
    lines = ["### Targets (issue 3)", "", *table_head("Target", "Measured", "Status", align="lrl")]
    for r in results:
        for label, samples in (("offline model", r.wake_offline), ("fake OpenAI server", r.wake_fake)):
            if not samples:
                continue
            p50 = median_of(samples, lambda s: percentile(s.latencies_ms, 0.5))
            p99 = median_of(samples, lambda s: percentile(s.latencies_ms, 0.99))
            lines.append(
                f"| wake, {r.backend}, {label}: p50 under {TARGET_WAKE_P50_MS:g} ms | {fixed(p50)} ms "
                f"| {status(p50 < TARGET_WAKE_P50_MS)} |"
            )
            lines.append(
                f"| wake, {r.backend}, {label}: p99 under {TARGET_WAKE_P99_MS:g} ms | {fixed(p99)} ms "
                f"| {status(p99 < TARGET_WAKE_P99_MS)} |"
            )
        if r.deltas:
            added = median_of(r.deltas, lambda s: percentile(s.latencies_ms, 0.5))
            rate = sustained_rate(r)
            lines.append(
                f"| deltas, {r.backend}: under {TARGET_DELTA_P50_MS:g} ms added at p50 "
                f"| {fixed(added, 3)} ms "
                f"| {status(added < TARGET_DELTA_P50_MS)} |"
            )
            lines.append(
                f"| deltas, {r.backend}: at least {TARGET_DELTAS_PER_S:,.0f}/s per process (best rate "
                f"delivered whole in every run) | {rate:,.0f}/s | {status(rate >= TARGET_DELTAS_PER_S)} |"
            )
        if r.resident is not None:
            res = r.resident
            above = res.rss_started_mib - res.empty_rss_mib
            idle = res.idle_cpu_ms
            new_errors = max(0, res.states_after_start["error"] - res.states_after_history["error"])
            lines += [
                f"| {res.agents:,} resident agents ({r.backend}): under {TARGET_RSS_MB:g} MB above an "
                "empty runtime "
                f"| {above:.0f} MiB | {status(above < TARGET_RSS_MIB)} |",
                f"| no measurable idle CPU ({res.idle_seconds:g} s; one tick is {1000 / TICKS:.0f} ms) "
                f"| {idle:.0f} ms | {status(idle <= 1000 / TICKS)} |",
                f"| start-up under {TARGET_STARTUP_S:g} s (until idle), every agent running "
                f"| {res.quiet_s:.1f} s, {new_errors:,} agents newly in ERROR "
                f"| {status(res.quiet_s < TARGET_STARTUP_S and not new_errors)} |",
            ]
    for r in results:
        if r.chatter:
            best = max(median_of(s, lambda c: c.hops_per_s) for s in r.chatter.values()) / 2
            lines.append(
                f"| agent-to-agent round trips/s, {r.backend}, durable (reference: AutoGen's "
                f"distributed gRPC runtime, about {AUTOGEN_ROUND_TRIPS:,}/s here, persisting nothing) "
                f"| {best:,.0f}/s "
                f"| {'above' if best >= AUTOGEN_ROUND_TRIPS else 'below'} the reference |"
            )
    return [*lines, ""]


def _method(options: Options) -> list[str]:
    return [
        "Method: every service is a subprocess on a free loopback port with LOG_LEVEL=WARNING: the IM "
        "service, the runtime and `bench/llm_server.py`, the fake OpenAI-compatible server of "
        "`tests/fake_openai.py` answering by model name. Backends: *embedded* (IM and runtime on their "
        "own SQLite files, in-process event signals) and *postgresql* (both in the database "
        "`agentim_bench`, the IM with Redis signals). Times taken in different processes are compared on "
        "CLOCK_MONOTONIC, which is system-wide on Linux. Figures are medians of "
        f"{options.runs} runs unless said otherwise. Chats are created only once the runtime's IM watch "
        "of a new agent's workspace is in place (see *Lost messages* if any was lost all the same).",
        "",
    ]


def _wake_section(results: Sequence[BackendResult], options: Options) -> list[str]:
    lines = [
        "### Wake latency",
        "",
        f"A person sends {options.messages} sequential messages (after {WAKE_WARMUP} unmeasured ones) to "
        "an agent in their direct chat, each once the previous run has ended and "
        f"{WAKE_GAP_S * 1000:.0f} ms have passed, so that each wakes an idle runner; a new agent per run. "
        "Measured from SendMessage returning in the client to the agent's LLM request being sent: with "
        "the offline model, the runtime calling the LLM's `stream()`; with the fake OpenAI server, the "
        "request having arrived there (the server writes that time into its answer). The runtime is "
        "`bench/runtime_host.py`, the runtime service unchanged but for trace points (IM event received, "
        "GetAllUnread, MarkRead, LLM called) that each append a line to a file (a few microseconds); they "
        "also split the time below, taken in the order a wake normally passes them so that the stages add "
        "up to the total (a negative stage: those two points came the other way round). An agent sends all "
        "its steps with every request, so the context grows with each message: hence the first/last 50 "
        "column.",
        "",
        *table_head(
            "Backend",
            "Model",
            "Messages",
            "p50 ms",
            "p99 ms",
            "max ms",
            "p50 first 50 / last 50",
            "Failed",
            align="llrrrrrr",
        ),
    ]
    for r in results:
        lines += _wake_rows(r)
    return [*lines, "", "Where the time goes:", "", *_stage_table(results), ""]


def _delta_section(results: Sequence[BackendResult]) -> list[str]:
    return [
        "### Streamed deltas",
        "",
        f"Latency: the fake server streams {DELTA_COUNT:,} content deltas {DELTA_GAP_US / 1000:g} ms "
        "apart, each carrying the CLOCK_MONOTONIC time it was written to the socket; a WatchAgent client "
        "(this process) subtracts it from the time it receives the step_delta: the latency the runtime "
        "adds, both loopback hops included.",
        "",
        *table_head("Backend", "Deltas", "Added p50 ms", "p99 ms", "max ms", "Lost"),
        *(_delta_rows(r)[0] for r in results if r.deltas),
        "",
        "Throughput: one long reply of one-character deltas streamed to one watcher, at offered rates "
        f"({FLOOD_SECONDS:g} s of deltas each), then as fast as the runtime reads them ({FLOOD_COUNT:,} "
        "deltas). Received/s is counted at the watcher from the first delta to the last. A stream is "
        "*cut* when the runtime ends the WatchAgent stream before the run has ended (with "
        "RESOURCE_EXHAUSTED: the watcher fell more than 10,000 events behind; it would watch again from "
        "its last completed step). Runtime CPU "
        "is over the whole reply; the last column is the pace at which the fake server got to write.",
        "",
        *table_head(
            "Backend",
            "Offered/s",
            "Deltas",
            "Received",
            "Received/s (min-max)",
            "Streams cut",
            "Runtime CPU",
            "Server wrote/s",
        ),
        *(row for r in results if r.deltas for row in _delta_rows(r)[1]),
        "",
    ]


def _chatter_section(results: Sequence[BackendResult], options: Options) -> list[str]:
    lines = [
        "### Agent to agent",
        "",
        "Pairs of agents (offline model) in direct chats, with RUNTIME_AGENT_CHATTER_LIMIT and "
        "RUNTIME_TOKEN_BUDGET lifted so "
        "that they answer each other without end; the benchmark sends each pair's first message as its "
        "first agent (with an access token for it, signed with the IM's key), waits "
        f"{CHATTER_WARMUP_S:g} s, then counts through a service's WatchEvents on the workspace the messages "
        f"exchanged in {options.seconds:g} s. Each is one hop (IM event, wake, GetAllUnread, run stored, "
        "offline completion streamed, step stored, answer sent, MarkRead); a round trip is two hops. Hop "
        "ms is the time between consecutive messages of a chat as the watcher sees them. Each message "
        "and step is committed to the database before the next hop starts; the chats end when the "
        "agents are deleted.",
        "",
        *table_head(
            "Backend",
            "Pairs",
            "Hops/s (min-max)",
            "Round trips/s",
            "Hop p50 ms",
            "Hop p99 ms",
            "Runtime CPU",
            "IM CPU",
            "Machine busy",
        ),
    ]
    for r in results:
        lines += _chatter_rows(r)
    return [
        *lines,
        "",
        f"Reference: AutoGen's distributed gRPC runtime does about {AUTOGEN_ROUND_TRIPS:,} round trips/s "
        "on this machine, and keeps nothing.",
        "",
    ]


def _lost_section(results: Sequence[BackendResult]) -> list[str]:
    lost = [
        (r.backend, label, message)
        for r in results
        for label, samples in (("offline model", r.wake_offline), ("fake OpenAI server", r.wake_fake))
        for sample in samples
        for message in sample.lost
    ]
    if not lost:
        return []
    lines = ["### Lost messages", "", "Wake-latency messages whose run never came:", ""]
    lines += [f"- {backend}, {label}: {message}" for backend, label, message in lost]
    return [*lines, ""]


def render_section(results: Sequence[BackendResult], options: Options, recorded: Recorded) -> str:
    lines = preamble(SECTION, recorded.command, recorded.versions, recorded.seconds) + _method(options)
    if any(r.wake_offline or r.wake_fake for r in results):
        lines += _wake_section(results, options)
    if any(r.deltas for r in results):
        lines += _delta_section(results)
    if any(r.chatter for r in results):
        lines += _chatter_section(results, options)
    for r in results:
        if r.resident is not None:
            lines += _resident_lines(r.backend, r.resident, options)
    lines += targets(results)
    lines += _lost_section(results)
    lines += problems_section(found for r in results for found in r.problems.items())
    return "\n".join(lines).rstrip() + "\n"


# --- entry point -----------------------------------------------------------------


async def run(options: Options) -> tuple[list[BackendResult], str]:
    with scratch("agentim-runtime-bench-") as workdir:
        source = workdir.path / "source"
        version = snapshot_sources(source, worktree=options.worktree, ref=options.ref)
        results = [await bench_backend(b, options, workdir.path, source) for b in options.backends]
        workdir.keep = options.keep_logs or any(found for r in results for found in r.problems.values())
    return results, version


def _numbers(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_options(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.runtime_bench", description=__doc__.split("\n\n")[0]
    )
    add_backend_options(parser, backends=BACKENDS, postgres_url=DEFAULT_POSTGRES_URL)
    parser.add_argument("--runs", type=int, default=3, help="repetitions of each measurement (medians)")
    parser.add_argument("--messages", type=int, default=200, help="sequential messages per wake-latency run")
    parser.add_argument("--pairs", default="1,32", help="agent pairs chatting, comma-separated levels")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per agent-to-agent run")
    parser.add_argument("--agents", type=int, default=10_000, help="resident agents (0 skips that part)")
    parser.add_argument("--agents-per-workspace", type=int, default=100, help="resident agents per workspace")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="idle CPU measurement window")
    parser.add_argument(
        "--resident-backend",
        default="",
        help="backend of the resident-agents part (default: postgresql if run)",
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {','.join(PARTS)}")
    add_doc_option(parser)
    args = parser.parse_args(argv)
    parts = listed(parser, "--parts", args.parts, PARTS)
    backends = listed(parser, "--backends", args.backends, BACKENDS)
    try:
        pairs = _numbers(args.pairs)
    except ValueError:
        parser.error(f"--pairs: expected numbers such as 1,32, got {args.pairs!r}")
    if args.runs < 1 or args.messages < 1 or args.seconds <= 0 or args.agents < 0 or args.idle_seconds <= 0:
        parser.error("--runs and --messages must be >= 1, --seconds and --idle-seconds > 0, --agents >= 0")
    if any(n < 1 for n in pairs):
        parser.error("--pairs: every level must be >= 1")
    resident_backend = args.resident_backend or ("postgresql" if "postgresql" in backends else backends[0])
    if resident_backend not in backends:
        parser.error(f"--resident-backend {resident_backend!r} is not among --backends")
    return Options(
        backends=backends,
        runs=args.runs,
        messages=args.messages,
        pairs=pairs,
        seconds=args.seconds,
        agents=args.agents,
        agents_per_workspace=args.agents_per_workspace,
        idle_seconds=args.idle_seconds,
        resident_backend=resident_backend,
        parts=parts,
        worktree=args.worktree,
        ref=args.ref,
        keep_logs=args.keep_logs,
        postgres_url=args.postgres_url,
        redis_url=args.redis_url,
        write_doc=not args.no_doc,
    )


def main(argv: Sequence[str] | None = None) -> None:
    options = parse_options(argv)
    run_and_record("bench.runtime_bench", argv, options, run=run, render=render_section, title=SECTION)


if __name__ == "__main__":
    main()
