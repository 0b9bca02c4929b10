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
import datetime as dt
import io
import itertools
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter, defaultdict, deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Container,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from agentim.im.v1 import im_pb2, im_pb2_grpc
from agentim.runtime.v1 import runtime_pb2 as rpb
from agentim.runtime.v1 import runtime_pb2_grpc
from bench.im_bench import BenchError, code_version, exclusive_postgres, percentile
from tests.auth_support import credentials_environment
from tests.identities import as_member, as_service, learn_agent, learn_member

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Agent runtime (issue 3)"
BACKENDS = ("embedded", "postgresql")
PARTS = ("wake", "deltas", "chatter", "resident")
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/agentim_bench"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

WAKE_WARMUP = 10
WAKE_GAP_S = 0.01
# After CreateAgent, the runtime re-opens its IM watch of the workspace; a
# chat created while the IM sets that watch up is never delivered to it (the
# IM reads the memberships and the starting sequence in two transactions), so
# chats are created once the watch is in place: this long after one agent,
# after many once the runtime and the IM are idle.
SETTLE_S = 0.5
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
CREATE_CONCURRENCY = 32
SEND_CONCURRENCY = 64
# The agents' first messages are sent this many at a time (see `_history`).
HISTORY_BATCH = 500
QUIET_WINDOW_S = 1.0
QUIET_CORES = 0.02

CALL_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 30.0
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
MIGRATE_TIMEOUT_S = 120.0
QUIET_TIMEOUT_S = 300.0
ALL_RUNS_TIMEOUT_S = 900.0
# A phase waiting for runs gives up when nothing has changed for this long,
# or for SETTLED_S once every message is accounted for (see `until_ended`).
STALL_S = 30.0
SETTLED_S = 3.0

TARGET_WAKE_P50_MS = 2.0
TARGET_WAKE_P99_MS = 10.0
TARGET_DELTA_P50_MS = 0.5
TARGET_DELTAS_PER_S = 8000.0
TARGET_RSS_MB = 150.0
TARGET_RSS_MIB = TARGET_RSS_MB * 1e6 / 2**20
TARGET_STARTUP_S = 10.0
AUTOGEN_ROUND_TRIPS = 1200

_BANNER = re.compile(r"listening on (\S+:\d+)")
_AGENTS = re.compile(r"\((\d+) agents")
_LEVEL = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b .*")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|0x[0-9a-f]{6,}")
_ARRIVED = re.compile(r"arrived (\d+)")
_FLOOD_STAMP = re.compile(r"\[(\d+),(\d+)\]")

Metadata = tuple[tuple[str, str], ...]


class StreamEnded(BenchError):
    """A WatchAgent stream ended (with status OK) before the run it showed did."""


def median(values: Iterable[float]) -> float:
    present = [v for v in values if not math.isnan(v)]
    return statistics.median(present) if present else float("nan")


def p(values: Sequence[float], q: float) -> float:
    return percentile(sorted(values), q)


def ms(ns: int) -> float:
    return ns / 1e6


# --- processes: CPU, memory ------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    # utime and stime are fields 14 and 15 of stat; the split starts at field 3.
    return (int(fields[11]) + int(fields[12])) / _TICKS


def rss_mib(pid: int) -> float:
    """VmRSS of a process in MiB (nan if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def machine_jiffies() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return float(sum(values) - idle), float(sum(values))


@dataclass
class CpuMeter:
    """CPU used by some processes over a window, in cores, and the machine's busy share."""

    pids: Mapping[str, int]
    cores: dict[str, float] = field(default_factory=dict)
    machine_busy: float = float("nan")
    _start: tuple[float, dict[str, float], tuple[float, float]] | None = None

    def start(self) -> None:
        self._start = (
            time.perf_counter(),
            {n: process_cpu_s(pid) for n, pid in self.pids.items()},
            machine_jiffies(),
        )

    def stop(self) -> None:
        assert self._start is not None
        wall0, cpu0, (busy0, total0) = self._start
        wall = time.perf_counter() - wall0
        for name, pid in self.pids.items():
            self.cores[name] = (process_cpu_s(pid) - cpu0[name]) / wall if wall > 0 else float("nan")
        busy, total = machine_jiffies()
        if total > total0:
            self.machine_busy = (busy - busy0) / (total - total0)


async def wait_quiet(pids: Sequence[int], *, since: float) -> float:
    """Seconds from `since` (perf_counter) until the processes use almost no CPU.

    Quiet means each used less than QUIET_CORES of a core over the last
    QUIET_WINDOW_S; the time returned is the start of that window.
    """
    history: deque[tuple[float, list[float]]] = deque()
    deadline = time.perf_counter() + QUIET_TIMEOUT_S
    while time.perf_counter() < deadline:
        now = time.perf_counter()
        history.append((now, [process_cpu_s(pid) for pid in pids]))
        # Keep as the oldest sample the latest one that is a whole window old.
        while len(history) > 1 and now - history[1][0] >= QUIET_WINDOW_S:
            history.popleft()
        then, before = history[0]
        if now - then >= QUIET_WINDOW_S and all(
            (after - old) / (now - then) < QUIET_CORES
            for after, old in zip(history[-1][1], before, strict=True)
        ):
            return then - since
        await asyncio.sleep(0.1)
    raise BenchError(f"the processes {list(pids)} did not become idle within {QUIET_TIMEOUT_S:.0f} s")


# --- server subprocesses -------------------------------------------------------


@dataclass
class Service:
    """A server subprocess: where it listens, its banner, how long it took to start and stop."""

    name: str
    pid: int
    address: str
    banner: str
    log_path: Path
    spawned_at: float
    listening_after_s: float
    stopped_in_s: float = float("nan")

    def problems(self) -> Counter[str]:
        """Warnings and errors the server logged so far, counted by message.

        Ids are replaced by `<id>`; an error followed by a traceback counts
        with the exception the traceback ends in.
        """
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return Counter()
        found: Counter[str] = Counter()
        for index, line in enumerate(lines):
            level = _LEVEL.search(line)
            if level is None:
                continue
            message = level[0]
            if index + 1 < len(lines) and lines[index + 1].startswith("Traceback"):
                raised = next(
                    (
                        n
                        for n in lines[index + 2 :]
                        if n and not n.startswith((" ", "Traceback", "During", "The "))
                    ),
                    "",
                )
                message += " -> " + raised
            found[_UUID.sub("<id>", message)[:400]] += 1
        return found


async def _stop(process: asyncio.subprocess.Process, name: str) -> int:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            print(f"warning: {name} ignored SIGTERM for {STOP_TIMEOUT_S:.0f} s; killing it", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode


@contextlib.asynccontextmanager
async def running(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    cwd: Path,
    exit_codes: Container[int] = (0,),
) -> AsyncIterator[Service]:
    """Starts a server, waits for its `listening on` line, and always SIGTERMs it (timing the stop).

    An exit status outside `exit_codes` is reported (a benchmark that kills
    the server itself expects -9).
    """
    with log_path.open("ab") as log:
        spawned_at = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
        )
        assert process.stdout is not None
        stdout = process.stdout

        async def drain() -> None:
            async for line in stdout:
                log.write(line)

        drainer: asyncio.Task[None] | None = None
        service: Service | None = None
        try:
            try:
                line = await asyncio.wait_for(stdout.readline(), START_TIMEOUT_S)
            except TimeoutError:
                raise BenchError(
                    f"{name} printed nothing in {START_TIMEOUT_S:.0f} s; see {log_path}"
                ) from None
            listening_after = time.perf_counter() - spawned_at
            banner = line.decode(errors="replace").strip()
            log.write(line)
            found = _BANNER.search(banner)
            if found is None:
                raise BenchError(f"{name} did not start (first line {banner!r}); see {log_path}")
            drainer = asyncio.create_task(drain())
            service = Service(name, process.pid, found[1], banner, log_path, spawned_at, listening_after)
            yield service
        finally:
            stopping = time.perf_counter()
            code = await _stop(process, name)
            if service is not None:
                service.stopped_in_s = time.perf_counter() - stopping
            if drainer is not None:
                drainer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drainer
            if code not in exit_codes:
                print(f"warning: {name} exited with status {code}; see {log_path}", file=sys.stderr)


async def run_command(argv: Sequence[str], *, env: Mapping[str, str], cwd: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=dict(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), MIGRATE_TIMEOUT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise BenchError(f"{' '.join(argv)} took longer than {MIGRATE_TIMEOUT_S:.0f} s") from None
    if process.returncode != 0:
        raise BenchError(
            f"{' '.join(argv)} failed ({process.returncode}):\n{output.decode(errors='replace')}"
        )


def snapshot_sources(dest: Path, *, worktree: bool) -> str:
    """Copies the code the servers run to `dest`; returns which code that is.

    Other people edit the working tree while a benchmark runs: servers started
    from the copy all run the same code. By default the services and stubs are
    those of the commit at HEAD (`git archive`), so that the figures belong to
    a commit; with `worktree` they are the working tree's, uncommitted changes
    included. The benchmark's own helpers always come from the working tree.
    """
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    if worktree:
        version = code_version()
        for name in ("services", "gen"):
            shutil.copytree(ROOT / name, dest / name, ignore=skip)
    else:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
            archive = subprocess.run(
                ["git", "archive", commit, "services", "gen"], cwd=ROOT, capture_output=True, check=True
            ).stdout
        except (OSError, subprocess.CalledProcessError) as error:
            raise BenchError(f"cannot take the services from git (use --worktree): {error}") from None
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")
        version = f"{commit} (services and stubs as committed, run from `git archive`)"
    shutil.copytree(ROOT / "bench", dest / "bench", ignore=skip)
    (dest / "tests").mkdir(parents=True)
    for name in ("__init__.py", "fake_openai.py"):
        shutil.copy2(ROOT / "tests" / name, dest / "tests" / name)
    return version


# --- calls -----------------------------------------------------------------------


async def bounded(calls: Sequence[Callable[[], Awaitable[T]]], limit: int) -> tuple[list[T], Counter[str]]:
    """Runs the calls, at most `limit` at a time; returns the results and the gRPC errors by code."""
    semaphore = asyncio.Semaphore(limit)
    errors: Counter[str] = Counter()
    results: list[T] = []

    async def one(call: Callable[[], Awaitable[T]]) -> None:
        async with semaphore:
            try:
                results.append(await call())
            except grpc.aio.AioRpcError as error:
                errors[error.code().name] += 1

    await asyncio.gather(*(one(c) for c in calls))
    return results, errors


@dataclass
class Clients:
    """Stubs of the IM and of the runtime under test."""

    im: Any
    runtime: Any


async def new_workspace(clients: Clients, name: str) -> str:
    """A workspace; returns its first member (a person), who acts for the benchmark."""
    created = await clients.im.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(name=name, creator_display_name="bench person"), timeout=CALL_TIMEOUT_S
    )
    learn_member(created.creator)  # its access tokens are signed with the test key (as_member)
    return str(created.creator.id)


async def create_agent(
    clients: Clients, person: str, name: str, *, model: rpb.ModelSettings | None = None
) -> rpb.Agent:
    response = await clients.runtime.CreateAgent(
        rpb.CreateAgentRequest(name=name, model=model), metadata=as_member(person), timeout=CALL_TIMEOUT_S
    )
    learn_agent(response.agent)
    return response.agent


async def delete_agents(clients: Clients, person: str, agents: Iterable[rpb.Agent]) -> None:
    await bounded(
        [
            partial(
                clients.runtime.DeleteAgent,
                rpb.DeleteAgentRequest(agent_id=a.id),
                metadata=as_member(person),
                timeout=CALL_TIMEOUT_S,
            )
            for a in agents
        ],
        CREATE_CONCURRENCY,
    )


async def direct_chat(clients: Clients, member: str, peer: str) -> str:
    response = await clients.im.GetOrCreateDirectGroup(
        im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=peer),
        metadata=as_member(member),
        timeout=CALL_TIMEOUT_S,
    )
    return str(response.group.id)


async def send(
    clients: Clients, member: str, group: str, content: str, *, mentions: Sequence[str] = ()
) -> None:
    await clients.im.SendMessage(
        im_pb2.SendMessageRequest(group_id=group, content=content, mentions=list(mentions)),
        metadata=as_member(member),
        timeout=CALL_TIMEOUT_S,
    )


async def open_watch(clients: Clients, person: str, agent_id: str) -> Any:
    """A live WatchAgent stream, subscribed (the runtime sends its headers once it is)."""
    call = clients.runtime.WatchAgent(
        rpb.WatchAgentRequest(agent_id=agent_id, live_only=True), metadata=as_member(person)
    )
    try:
        await asyncio.wait_for(call.initial_metadata(), CALL_TIMEOUT_S)
    except BaseException:
        call.cancel()
        raise
    return call


@contextlib.asynccontextmanager
async def watching(clients: Clients, person: str, agent_id: str) -> AsyncIterator[Any]:
    """A live WatchAgent stream for the block."""
    call = await open_watch(clients, person, agent_id)
    try:
        yield call
    finally:
        call.cancel()


async def until_run_ended(
    call: Any, on_event: Callable[[Any, int], None] | None = None, *, limit_s: float = RUN_TIMEOUT_S
) -> int:
    """Reads agent events until a run ends; returns its status."""
    async with asyncio.timeout(limit_s):
        while True:
            try:
                response = await call.read()
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                raise StreamEnded(f"the runtime ended the watch: {error.details()}") from None
            if response is grpc.aio.EOF:
                raise StreamEnded("the WatchAgent stream ended before the run did")
            received = time.monotonic_ns()
            event = response.event
            if on_event is not None:
                on_event(event, received)
            if event.WhichOneof("event") == "run_ended":
                return int(event.run_ended.status)


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
    clients: Clients, pids: Mapping[str, int], *, pairs: int, seconds: float, run: int
) -> ChatterSample:
    person = await new_workspace(clients, f"bench-chatter-{pairs}-{run}")
    created, errors = await bounded(
        [partial(create_agent, clients, person, n) for i in range(pairs) for n in (f"a{i}", f"b{i}")],
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
    workspace = (
        await clients.im.GetMember(
            im_pb2.GetMemberRequest(member_id=person), metadata=as_member(person), timeout=CALL_TIMEOUT_S
        )
    ).member.workspace_id
    watch = clients.im.WatchEvents(
        im_pb2.WatchEventsRequest(workspace_id=workspace), metadata=as_service("runtime")
    )
    last_in_group: dict[str, int] = {}
    hops: list[tuple[int, float]] = []  # (received ns, ms since the previous message of its group)

    async def count() -> None:
        async for response in watch:
            if response.WhichOneof("event") != "message_created":
                continue
            now = time.monotonic_ns()
            group = response.message_created.message.group_id
            previous = last_in_group.get(group)
            last_in_group[group] = now
            if previous is not None:
                hops.append((now, ms(now - previous)))

    counter = asyncio.create_task(count())
    try:
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
        counter.cancel()
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await counter
    in_window = [gap for at, gap in hops if begin <= at < end]
    await delete_agents(clients, person, created)
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


class RuntimeTables:
    """Reads the runtime's runs and agents straight from its database."""

    def __init__(self, runtime_url: str) -> None:
        url = make_url(runtime_url)
        sqlite = url.get_backend_name() == "sqlite"
        url = url.set(drivername="sqlite+aiosqlite" if sqlite else "postgresql+asyncpg")
        self._schema = "" if sqlite else "runtime."
        self._engine: AsyncEngine = create_async_engine(url, poolclass=sa.pool.NullPool)

    async def _counts(self, query: str) -> Counter[str]:
        async with self._engine.connect() as conn:
            rows = (await conn.execute(sa.text(query.format(schema=self._schema)))).all()
        return Counter({str(key): int(n) for key, n in rows})

    async def runs(self) -> Counter[str]:
        """Runs by status."""
        return await self._counts("SELECT status, count(*) FROM {schema}runs GROUP BY status")

    async def agents(self) -> Counter[str]:
        """Live agents by state."""
        return await self._counts(
            "SELECT state, count(*) FROM {schema}agents WHERE NOT deleted GROUP BY state"
        )

    async def until_ended(self, target: int, *, before: Counter[str], since: float) -> Ended:
        """Waits until `target` more runs than `before` have ended.

        Gives up early when every message is accounted for without that (runs
        started, or agents newly in ERROR, whose runs never come) and nothing
        has changed for SETTLED_S; and in any case when nothing has changed
        for STALL_S.
        """
        errors_before = (await self.agents())["error"]
        last: tuple[int, int, int] | None = None
        last_change = time.perf_counter()
        deadline = last_change + ALL_RUNS_TIMEOUT_S
        while True:
            counts = await self.runs()
            new = +Counter({k: counts[k] - before.get(k, 0) for k in counts})
            ended = sum(v for k, v in new.items() if k != "running")
            errors = (await self.agents())["error"]
            now = time.perf_counter()
            state = (ended, sum(new.values()), errors)
            if state != last:
                last, last_change = state, now
            if ended >= target:
                return Ended(new, now - since, complete=True, target=target)
            accounted = sum(new.values()) + max(0, errors - errors_before) >= target
            quiet = now - last_change
            if (accounted and quiet > SETTLED_S) or quiet > STALL_S or now > deadline:
                return Ended(new, last_change - since, complete=False, target=target)
            await asyncio.sleep(0.2)

    async def aclose(self) -> None:
        await self._engine.dispose()


@dataclass
class Ended:
    """Runs that ended in a phase, by status, and when the last of them did."""

    runs: Counter[str] = field(default_factory=Counter)
    seconds: float = float("nan")
    complete: bool = False
    target: int = 0


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
    env = backend.runtime_env()
    tables = RuntimeTables(backend.runtime_url)
    argv = [sys.executable, "-m", "services.runtime", "serve"]
    name = backend.name
    try:
        async with (
            running(
                f"runtime, resident agents ({name})",
                argv,
                env=env,
                cwd=backend.source,
                log_path=workdir / f"runtime-resident-{name}.log",
            ) as rt,
            grpc.aio.insecure_channel(rt.address) as channel,
        ):
            if _banner_agents(rt.banner) != 0:
                print(f"warning: the runtime should start with no agent: {rt.banner}", file=sys.stderr)
            await wait_quiet([rt.pid], since=rt.spawned_at)
            result.empty_rss_mib = rss_mib(rt.pid)
            cpu = process_cpu_s(rt.pid)
            await asyncio.sleep(options.idle_seconds)
            result.empty_idle_cpu_ms = (process_cpu_s(rt.pid) - cpu) * 1000
            print(f"[{name}] empty runtime: RSS {result.empty_rss_mib:.0f} MiB", flush=True)
            clients = Clients(backend.im_stub, runtime_pb2_grpc.RuntimeServiceStub(channel))
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
        async with running(
            f"runtime, resident agents, restarted ({name})",
            argv,
            env=env,
            cwd=backend.source,
            log_path=workdir / f"runtime-restarted-{name}.log",
        ) as rt:
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
    result.banner_agents = _banner_agents(rt.banner)
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


def _banner_agents(banner: str) -> int:
    found = _AGENTS.search(banner)
    return int(found[1]) if found else -1


async def _resident_agent(clients: Clients, person: str, index: int) -> tuple[str, rpb.Agent]:
    return person, await create_agent(clients, person, f"resident-{index}")


async def _chat_of(clients: Clients, made: tuple[str, rpb.Agent]) -> tuple[str, str]:
    person, agent = made
    return person, await direct_chat(clients, person, agent.member_id)


# --- one backend -----------------------------------------------------------------


@dataclass
class Backend:
    """Where one backend's services keep their data, and how to start them."""

    name: str
    im_url: str
    runtime_url: str
    redis_url: str | None
    data_dir: Path
    source: Path
    im_address: str = ""
    im_stub: Any = None

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for name in (
            "DATABASE_URL",
            "RUNTIME_DATABASE_URL",
            "REDIS_URL",
            "OPENAI_BASE_URL",
            "OPENAI_API_KEY",
            "OPENAI_MODEL",
            "RUNTIME_AGENT_CHATTER_LIMIT",
            "RUNTIME_TOKEN_BUDGET",
        ):
            env.pop(name, None)
        env.update(
            LOG_LEVEL=os.environ.get("BENCH_LOG_LEVEL", "WARNING"),
            AGENTIM_DATA_DIR=str(self.data_dir),
            PYTHONUNBUFFERED="1",
            # Throughput is measured here, not the per-member rate limits.
            LIMIT_SEND_PER_SECOND="0",
            LIMIT_CREATE_PER_SECOND="0",
            # The servers run from `source` (their working directory); the stubs come with it.
            PYTHONPATH=str(self.source / "gen"),
            # The test keys and credentials: the benchmark signs its callers' tokens with them.
            **credentials_environment(),
        )
        return env

    def im_env(self) -> dict[str, str]:
        env = self.base_env()
        env.update(DATABASE_URL=self.im_url, IM_GRPC_ADDRESS="127.0.0.1:0")
        if self.redis_url:
            env["REDIS_URL"] = self.redis_url
        return env

    def runtime_env(self, **extra: str) -> dict[str, str]:
        env = self.base_env()
        env.update(
            RUNTIME_DATABASE_URL=self.runtime_url,
            RUNTIME_GRPC_ADDRESS="127.0.0.1:0",
            IM_ADDRESS=self.im_address or "127.0.0.1:1",
            # The fake model servers the agents are pointed at listen on loopback.
            RUNTIME_LLM_ALLOWED_HOSTS="127.0.0.1",
            **extra,
        )
        return env


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
    keep_logs: bool
    postgres_url: str
    redis_url: str
    write_doc: bool


async def drop_runtime_schema(url: str) -> None:
    target = make_url(url).set(drivername="postgresql+asyncpg")
    if "bench" not in (target.database or ""):
        raise BenchError(
            f"refusing to reset the runtime schema of {target.database!r}: use a database named *bench*"
        )
    engine = create_async_engine(target, isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=0)
    try:
        async with engine.connect() as conn:
            await conn.execute(sa.text("DROP SCHEMA IF EXISTS runtime CASCADE"))
    finally:
        await engine.dispose()


async def bench_backend(name: str, options: Options, workdir: Path, source: Path) -> BackendResult:
    data_dir = workdir / name
    data_dir.mkdir(parents=True, exist_ok=True)
    async with contextlib.AsyncExitStack() as stack:
        if name == "postgresql":
            # Holds the benchmarks' advisory lock for the whole backend run and drops the im schema.
            await stack.enter_async_context(exclusive_postgres(options.postgres_url))
            await drop_runtime_schema(options.postgres_url)
            url = options.postgres_url
            backend = Backend(name, url, url, options.redis_url, data_dir, source)
        else:
            im_db, runtime_db = f"sqlite:///{data_dir / 'im.db'}", f"sqlite:///{data_dir / 'runtime.db'}"
            backend = Backend(name, im_db, runtime_db, None, data_dir, source)
        return await _bench_backend(backend, options, workdir, stack)


async def _bench_backend(
    backend: Backend, options: Options, workdir: Path, stack: contextlib.AsyncExitStack
) -> BackendResult:
    name, python = backend.name, sys.executable
    result = BackendResult(name)
    await run_command([python, "-m", "services.im", "migrate"], env=backend.im_env(), cwd=backend.source)
    await run_command(
        [python, "-m", "services.runtime", "migrate"], env=backend.runtime_env(), cwd=backend.source
    )
    im = await stack.enter_async_context(
        running(
            f"IM service ({name})",
            [python, "-m", "services.im", "serve"],
            env=backend.im_env(),
            cwd=backend.source,
            log_path=workdir / f"im-{name}.log",
        )
    )
    backend.im_address = im.address
    im_channel = await stack.enter_async_context(grpc.aio.insecure_channel(im.address))
    backend.im_stub = im_pb2_grpc.IMServiceStub(im_channel)
    llm = await stack.enter_async_context(
        running(
            "fake OpenAI server",
            [python, "-m", "bench.llm_server"],
            env=backend.base_env(),
            cwd=backend.source,
            log_path=workdir / f"llm-{name}.log",
        )
    )

    if {"wake", "deltas"} & set(options.parts):
        await _traced_parts(backend, options, workdir, result, f"http://{llm.address}/v1")
    if "chatter" in options.parts:
        await _chatter_part(backend, options, workdir, result, im)
    if "resident" in options.parts and name == options.resident_backend and options.agents > 0:
        result.resident = await resident(backend, options, workdir, im)
        result.problems[f"runtime, resident agents ({name})"] = result.resident.problems
    result.problems[im.name] = im.problems()
    result.problems[llm.name] = llm.problems()
    return result


async def _traced_parts(
    backend: Backend, options: Options, workdir: Path, result: BackendResult, fake_url: str
) -> None:
    """1 and 2: wake latency and streamed deltas, on the runtime with its wake traced."""
    name = backend.name
    trace_path = workdir / f"trace-{name}.txt"
    trace_path.touch()
    trace = Trace(trace_path)
    async with (
        running(
            f"runtime, traced ({name})",
            [sys.executable, "-m", "bench.runtime_host"],
            env=backend.runtime_env(BENCH_TRACE_FILE=str(trace_path)),
            cwd=backend.source,
            log_path=workdir / f"runtime-traced-{name}.log",
        ) as rt,
        grpc.aio.insecure_channel(rt.address) as channel,
    ):
        clients = Clients(backend.im_stub, runtime_pb2_grpc.RuntimeServiceStub(channel))
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
                f"[{name}] run {run}: wake offline p50 {p(offline.latencies_ms, 0.5):.2f} ms "
                f"p99 {p(offline.latencies_ms, 0.99):.2f} ms; fake server p50 "
                f"{p(fake.latencies_ms, 0.5):.2f} ms p99 {p(fake.latencies_ms, 0.99):.2f} ms"
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
                f"[{name}] run {run}: delta latency p50 {p(sample.latencies_ms, 0.5):.3f} ms "
                f"p99 {p(sample.latencies_ms, 0.99):.3f} ms; replies {levels}",
                flush=True,
            )
    result.problems[rt.name] = rt.problems()


async def _chatter_part(
    backend: Backend, options: Options, workdir: Path, result: BackendResult, im: Service
) -> None:
    """3: agents answering each other without limit, on the plain runtime."""
    name = backend.name
    async with (
        running(
            f"runtime, agent to agent ({name})",
            [sys.executable, "-m", "services.runtime", "serve"],
            # Lifted so that the pairs never stop: the chatter limit, and the token
            # budget (each completion counts its whole growing context).
            env=backend.runtime_env(
                RUNTIME_AGENT_CHATTER_LIMIT="1000000000", RUNTIME_TOKEN_BUDGET="1000000000000"
            ),
            cwd=backend.source,
            log_path=workdir / f"runtime-chatter-{name}.log",
        ) as rt,
        grpc.aio.insecure_channel(rt.address) as channel,
    ):
        clients = Clients(backend.im_stub, runtime_pb2_grpc.RuntimeServiceStub(channel))
        for pairs in options.pairs:
            samples = result.chatter.setdefault(pairs, [])
            for run in range(1, options.runs + 1):
                pids = {"runtime": rt.pid, "IM": im.pid}
                chatter = await chatter_run(clients, pids, pairs=pairs, seconds=options.seconds, run=run)
                samples.append(chatter)
                print(
                    f"[{name}] run {run}: {chatter.pairs} pairs: {chatter.hops_per_s:,.0f} hops/s "
                    f"({chatter.hops_per_s / 2:,.0f} round trips/s), "
                    f"hop p50 {p(chatter.hop_ms, 0.5):.1f} ms, "
                    f"runtime CPU {_pct(chatter.cores['runtime'])}, IM CPU {_pct(chatter.cores['IM'])}",
                    flush=True,
                )
    result.problems[rt.name] = rt.problems()


# --- report ----------------------------------------------------------------------


def _ms(value: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def _count(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.0f}"


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.0f}%"


def _med(samples: Sequence[Any], get: Callable[[Any], float]) -> float:
    return median([get(s) for s in samples])


def _status(met: bool) -> str:
    return "met" if met else "**not met**"


def _wake_rows(result: BackendResult) -> list[str]:
    rows = []
    for label, samples in (("offline model", result.wake_offline), ("fake OpenAI server", result.wake_fake)):
        if not samples:
            continue
        failed = sum(s.failed for s in samples)
        rows.append(
            f"| {result.backend} | {label} | {len(samples[0].latencies_ms)} "
            f"| {_ms(_med(samples, lambda s: p(s.latencies_ms, 0.5)))} "
            f"| {_ms(_med(samples, lambda s: p(s.latencies_ms, 0.99)))} "
            f"| {_ms(max(max(s.latencies_ms, default=math.nan) for s in samples))} "
            f"| {_ms(_med(samples, lambda s: p(s.latencies_ms[:50], 0.5)))} / "
            f"{_ms(_med(samples, lambda s: p(s.latencies_ms[-50:], 0.5)))} | {failed} |"
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
            cells.append(_ms(median(values)) if values else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _delta_rows(result: BackendResult) -> tuple[str, list[str]]:
    samples = result.deltas
    latency = (
        f"| {result.backend} | {DELTA_COUNT:,} | {_ms(_med(samples, lambda s: p(s.latencies_ms, 0.5)), 3)} "
        f"| {_ms(_med(samples, lambda s: p(s.latencies_ms, 0.99)), 3)} "
        f"| {_ms(max(max(s.latencies_ms, default=math.nan) for s in samples), 3)} "
        f"| {sum(s.timed_lost for s in samples)} |"
    )
    floods = []
    for index, rate in enumerate(FLOOD_RATES):
        levels = [s.levels[index] for s in samples]
        rates = [lv.rate for lv in levels]
        floods.append(
            f"| {result.backend} | {f'{rate:,}' if rate else 'as fast as possible'} | {levels[0].count:,} "
            f"| {median([lv.received for lv in levels]):,.0f} "
            f"| {_count(median(rates))} ({_count(min(rates))}-{_count(max(rates))}) "
            f"| {sum(lv.cut for lv in levels)} of {len(levels)} "
            f"| {_pct(median([lv.runtime_cores for lv in levels]))} "
            f"| {_count(median([lv.server_rate for lv in levels]))} |"
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
            f"| {_ms(_med(samples, lambda s: p(s.hop_ms, 0.5)), 1)} "
            f"| {_ms(_med(samples, lambda s: p(s.hop_ms, 0.99)), 1)} "
            f"| {_pct(_med(samples, lambda s: s.cores.get('runtime', math.nan)))} "
            f"| {_pct(_med(samples, lambda s: s.cores.get('IM', math.nan)))} "
            f"| {_pct(_med(samples, lambda s: s.machine_busy))} |"
        )
    return rows


def _runs(counts: Counter[str]) -> str:
    return ", ".join(f"{v:,} {k}" for k, v in sorted(counts.items())) or "none"


def _states(states: Counter[str]) -> str:
    return ", ".join(f"{n:,} {state}" for state, n in sorted(states.items())) or "none"


def _phase(ended: Ended, sent_s: float, errors: Counter[str] | None = None) -> str:
    target = ended.target
    if ended.complete:
        head = f"{ended.seconds:.1f} s ({target / ended.seconds:,.0f} agents/s)"
    else:
        done = sum(v for k, v in ended.runs.items() if k != "running")
        head = f"**incomplete**: {done:,} of {target:,} runs ended, the last after {ended.seconds:.1f} s"
    return f"{head}; sending took {sent_s:.1f} s{_errors(errors or Counter())}; runs: {_runs(ended.runs)}"


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
        "| Measurement | Value |",
        "|---|---:|",
        f"| empty runtime (no agent): RSS / CPU while idle for {options.idle_seconds:g} s | "
        f"{r.empty_rss_mib:.0f} MiB / {r.empty_idle_cpu_ms:.0f} ms |",
        f"| CreateAgent x {r.agents:,} ({CREATE_CONCURRENCY} at a time) | {r.create_s:.1f} s "
        f"({r.created / r.create_s:,.0f}/s){_errors(r.create_errors)} |",
        f"| then until the runtime and the IM are idle (before creating chats) | {r.settle_s:.1f} s |",
        f"| direct chats (GetOrCreateDirectGroup x {r.created:,}) "
        f"| {r.chats_s:.1f} s{_errors(r.chat_errors)} |",
        f"| history: a first message to every agent, in batches of {HISTORY_BATCH:,} ({SEND_CONCURRENCY} "
        "sends at a time, a batch once the previous one's runs have ended), until every run ended "
        f"| {_phase(r.history, r.history_send_s, r.history_send_errors)} |",
        f"| agents then, by state | {_states(r.states_after_history)} |",
        f"| RSS then | {r.rss_after_history_mib:.0f} MiB |",
        f"| shutdown (SIGTERM to exit) | {r.stop_s:.1f} s |",
        f"| restart: process start to the `listening` line ({r.banner_agents:,} agents) "
        f"| {r.listening_s:.1f} s |",
        f"| restart: process start until the runtime and the IM are idle | {r.quiet_s:.1f} s |",
        f"| agents then, by state | {_states(r.states_after_start)} |",
        f"| RSS once idle (above the empty runtime) | {r.rss_started_mib:.0f} MiB (**{above:+.0f} MiB**, "
        f"{1024 * above / max(1, r.created):.1f} KiB per agent) |",
        f"| CPU while idle for {r.idle_seconds:g} s: runtime / IM "
        f"| {r.idle_cpu_ms:.0f} ms / {r.im_idle_cpu_ms:.0f} ms |",
        f"| wake all: a message to every agent until every run ended "
        f"| {_phase(r.wake, r.wake_send_s, r.wake_send_errors)} |",
        f"| agents then, by state | {_states(r.states_after_wake)} |",
        f"| RSS after waking all | {r.rss_after_wake_mib:.0f} MiB |",
        "",
    ]


def _errors(errors: Counter[str]) -> str:
    return f"; errors: {', '.join(f'{k} {v}' for k, v in sorted(errors.items()))}" if errors else ""


def targets(results: Sequence[BackendResult]) -> list[str]:
    lines = ["### Targets (issue 3)", "", "| Target | Measured | Status |", "|---|---:|---|"]
    for r in results:
        for label, samples in (("offline model", r.wake_offline), ("fake OpenAI server", r.wake_fake)):
            if not samples:
                continue
            p50 = _med(samples, lambda s: p(s.latencies_ms, 0.5))
            p99 = _med(samples, lambda s: p(s.latencies_ms, 0.99))
            lines.append(
                f"| wake, {r.backend}, {label}: p50 under {TARGET_WAKE_P50_MS:g} ms | {_ms(p50)} ms "
                f"| {_status(p50 < TARGET_WAKE_P50_MS)} |"
            )
            lines.append(
                f"| wake, {r.backend}, {label}: p99 under {TARGET_WAKE_P99_MS:g} ms | {_ms(p99)} ms "
                f"| {_status(p99 < TARGET_WAKE_P99_MS)} |"
            )
        if r.deltas:
            added = _med(r.deltas, lambda s: p(s.latencies_ms, 0.5))
            rate = sustained_rate(r)
            lines.append(
                f"| deltas, {r.backend}: under {TARGET_DELTA_P50_MS:g} ms added at p50 | {_ms(added, 3)} ms "
                f"| {_status(added < TARGET_DELTA_P50_MS)} |"
            )
            lines.append(
                f"| deltas, {r.backend}: at least {TARGET_DELTAS_PER_S:,.0f}/s per process (best rate "
                f"delivered whole in every run) | {rate:,.0f}/s | {_status(rate >= TARGET_DELTAS_PER_S)} |"
            )
        if r.resident is not None:
            res = r.resident
            above = res.rss_started_mib - res.empty_rss_mib
            idle = res.idle_cpu_ms
            new_errors = max(0, res.states_after_start["error"] - res.states_after_history["error"])
            lines += [
                f"| {res.agents:,} resident agents ({r.backend}): under {TARGET_RSS_MB:g} MB above an "
                "empty runtime "
                f"| {above:.0f} MiB | {_status(above < TARGET_RSS_MIB)} |",
                f"| no measurable idle CPU ({res.idle_seconds:g} s; one tick is {1000 / _TICKS:.0f} ms) "
                f"| {idle:.0f} ms | {_status(idle <= 1000 / _TICKS)} |",
                f"| start-up under {TARGET_STARTUP_S:g} s (until idle), every agent running "
                f"| {res.quiet_s:.1f} s, {new_errors:,} agents newly in ERROR "
                f"| {_status(res.quiet_s < TARGET_STARTUP_S and not new_errors)} |",
            ]
    for r in results:
        if r.chatter:
            best = max(_med(s, lambda c: c.hops_per_s) for s in r.chatter.values()) / 2
            lines.append(
                f"| agent-to-agent round trips/s, {r.backend}, durable (reference: AutoGen's "
                f"distributed gRPC runtime, about {AUTOGEN_ROUND_TRIPS:,}/s here, persisting nothing) "
                f"| {best:,.0f}/s "
                f"| {'above' if best >= AUTOGEN_ROUND_TRIPS else 'below'} the reference |"
            )
    return [*lines, ""]


def _header(options: Options, command: str, versions: tuple[str, str], seconds: float) -> list[str]:
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    moved = versions[0].split()[0] != versions[1].split()[0]
    return [
        SECTION,
        "",
        f"Command: `{command}` (took {seconds / 60:.1f} min)",
        "",
        f"Code: {versions[0]}" + (f"; HEAD was {versions[1]} at the end" if moved else "") + ". The servers "
        "run from a copy of that code taken at the start, so edits made meanwhile do not affect them.",
        "",
        f"Date: {now}. Machine: {os.cpu_count()} cores, {platform.platform()}, Python "
        f"{platform.python_version()}, grpcio {grpc.__version__}; load average at the end {load[0]:.2f}. "
        "The machine is shared and noisy, and its 2 cores run the benchmark client, the IM, the runtime, "
        "the fake LLM server, PostgreSQL and Redis together: read the figures as orders of magnitude.",
        "",
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
        "| Backend | Model | Messages | p50 ms | p99 ms | max ms | p50 first 50 / last 50 | Failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
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
        "| Backend | Deltas | Added p50 ms | p99 ms | max ms | Lost |",
        "|---|---:|---:|---:|---:|---:|",
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
        "| Backend | Offered/s | Deltas | Received | Received/s (min-max) | Streams cut | Runtime CPU "
        "| Server wrote/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
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
        "| Backend | Pairs | Hops/s (min-max) | Round trips/s | Hop p50 ms | Hop p99 ms | Runtime CPU "
        "| IM CPU | Machine busy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
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


def _problems_section(results: Sequence[BackendResult]) -> list[str]:
    problems = [(name, found) for r in results for name, found in r.problems.items() if found]
    if not problems:
        return ["No service logged a warning or an error.", ""]
    lines = ["### Logged warnings and errors", "", "Counted by message (ids replaced by `<id>`):", ""]
    for name, found in problems:
        lines += [f"{name}: {sum(found.values()):,} lines", ""]
        lines += [f"    {n:>6,} x {message}" for message, n in found.most_common(8)]
        lines.append("")
    return lines


def render_section(
    results: Sequence[BackendResult],
    options: Options,
    command: str,
    versions: tuple[str, str],
    seconds: float,
) -> str:
    lines = _header(options, command, versions, seconds)
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
    lines += _problems_section(results)
    return "\n".join(lines).rstrip() + "\n"


def update_doc(path: Path, section: str, title: str = SECTION) -> None:
    """Replaces (or appends) the section headed `title`, keeping the file's other sections."""
    text = (
        path.read_text()
        if path.exists()
        else (
            "# Benchmarks\n\nMeasured performance of the Agent IM services. Each section is written by its "
            "benchmark script and regenerated when the script runs again.\n"
        )
    )
    start = text.find(title)
    if start < 0:
        text = text.rstrip() + "\n\n" + section
    else:
        following = re.compile(r"^## ", re.MULTILINE).search(text, start + len(title))
        rest = text[following.start() :] if following else ""
        text = text[:start] + section + ("\n" + rest if rest else "")
    path.write_text(text)


# --- entry point -----------------------------------------------------------------


async def run(options: Options) -> tuple[list[BackendResult], str]:
    # Kept when something fails, for the servers' logs; removed after a clean run.
    workdir = Path(tempfile.mkdtemp(prefix="agentim-runtime-bench-"))
    source = workdir / "source"
    version = snapshot_sources(source, worktree=options.worktree)
    results: list[BackendResult] = []
    try:
        for backend in options.backends:
            results.append(await bench_backend(backend, options, workdir, source))
    except BenchError as error:
        raise BenchError(f"{error}\n(server logs kept in {workdir})") from None
    if options.keep_logs or any(found for r in results for found in r.problems.values()):
        print(f"the services' logs are kept in {workdir}", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return results, version


def _numbers(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_options(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.runtime_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: embedded,postgresql")
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
    parser.add_argument(
        "--postgres-url",
        default=DEFAULT_POSTGRES_URL,
        help="benchmark database (created if missing; its im and runtime schemas are dropped first)",
    )
    parser.add_argument(
        "--redis-url", default=DEFAULT_REDIS_URL, help="Redis of the IM on the postgresql backend"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {','.join(PARTS)}")
    parser.add_argument(
        "--worktree",
        action="store_true",
        help="run the services of the working tree, uncommitted changes included (default: HEAD's)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the services' logs after a clean run")
    parser.add_argument("--no-doc", action="store_true", help=f"do not update {DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--parts: expected some of {','.join(PARTS)}, got {args.parts!r}")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        parser.error(f"--backends: expected some of {','.join(BACKENDS)}, got {args.backends!r}")
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
        keep_logs=args.keep_logs,
        postgres_url=args.postgres_url,
        redis_url=args.redis_url,
        write_doc=not args.no_doc,
    )


def main(argv: Sequence[str] | None = None) -> None:
    options = parse_options(argv)
    run_and_record(
        "bench.runtime_bench",
        argv,
        lambda: run(options),
        render=render_section,
        options=options,
        write_doc=options.write_doc,
        title=SECTION,
    )


def run_and_record(
    module: str,
    argv: Sequence[str] | None,
    bench: Callable[[], Coroutine[Any, Any, tuple[Any, str]]],
    *,
    render: Callable[..., str],
    options: Any,
    write_doc: bool,
    title: str,
) -> None:
    """Runs a benchmark, prints its section and writes it to docs/benchmarks.md under `title`."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    command = " ".join([f".venv/bin/python -m {module}", *arguments])
    started = time.perf_counter()
    try:
        results, version = asyncio.run(bench())
    except BenchError as error:
        raise SystemExit(f"benchmark failed: {error}") from None
    elapsed = time.perf_counter() - started
    # Other people may commit while this runs: say so if HEAD moved.
    section = render(results, options, command, (version, code_version()), elapsed)
    print()
    print(section)
    if write_doc:
        update_doc(DOC, section, title)
        print(f"updated {DOC.relative_to(ROOT)}")
    print(f"total time {elapsed:.0f} s")


if __name__ == "__main__":
    main()
