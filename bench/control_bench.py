"""Benchmark of agent control (issue 5): the serial task queue and crash recovery.

The servers run as in `bench.runtime_bench`, on `bench.harness`: each one
a subprocess on a free loopback port, from a copy of the code taken at the
start (HEAD's services by default, `--worktree` for uncommitted ones), on
two backends: `embedded` (SQLite files, in-process event signals) and
`postgresql` (the database `agentim_control_bench`, Redis signals for the
IM). The client is this process.

Measured:

1. Task queue (`--runs` times, medians reported): `--queue-agents` agents
   with the offline model, `--tasks` short tasks each, submitted through
   SubmitTask with request ids, each agent's one after another (the next
   once the previous SubmitTask has answered), all agents at once. A
   WatchAgents stream of the workspace records every `task_changed` event
   as it arrives. Reported: tasks per second from the first submission to
   the last SUCCEEDED event; the wait (RUNNING event minus the moment
   SubmitTask was called, and GetQueueStats' average_wait_ms averaged over
   the agents); the latency (SUCCEEDED event minus that moment); and per
   agent whether the tasks ran one at a time in submission order: a task
   whose RUNNING event came before its predecessor's SUCCEEDED event is a
   violation, and so, in the stored times (ListTasks), is a task that
   started before its predecessor ended.
2. Crash recovery (once per backend): `--recovery-agents` agents in
   `--recovery-workspaces` workspaces, each pointed at `bench.llm_server`
   with the model `bench-stall-<agents>-<tag>`: the first <agents> requests
   stream one delta and then stall until the client goes away, later ones
   answer at once. Each agent gets a message; once every agent's LLM stream
   has delivered its first delta (seen on WatchAgents), the runtime is
   killed with SIGKILL and started again. From the new process's start: its
   `listening` line, every stale run ended (INTERRUPTED), and every agent
   IDLE with that run ended and a new run COMPLETED (read from the
   runtime's tables every POLL_S), and the agents left in ERROR.

The result is printed and written to the `## Agent control (issue 5)`
section of docs/benchmarks.md (other sections of that file are kept).

Run as `python -m bench.control_bench [--backends embedded,postgresql] [--runs 3]
[--parts queue,recovery] [--no-doc]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import math
import os
import signal
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import sqlalchemy as sa

from agentim.runtime.v1 import runtime_pb2 as rpb
from bench.calls import (
    CALL_TIMEOUT_S,
    CREATE_CONCURRENCY,
    SEND_CONCURRENCY,
    bounded,
    create_agent,
    delete_agents,
    direct_chat,
    new_workspace,
    send,
)
from bench.harness import (
    STALL_S,
    Backend,
    BenchError,
    Clients,
    CpuMeter,
    RuntimeTables,
    Service,
    add_backend_options,
    backend_on,
    listed,
    scratch,
    snapshot_sources,
    wait_quiet,
)
from bench.report import (
    Recorded,
    add_doc_option,
    errors_note,
    grouped,
    percent,
    preamble,
    problems_section,
    run_and_record,
    table_head,
    tally,
)
from bench.stats import mean, median, median_of, ms, percentile
from tests.identities import as_member

SECTION = "## Agent control (issue 5)"
BACKENDS = ("embedded", "postgresql")
PARTS = ("queue", "recovery")
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/agentim_control_bench"

# A queue run gives up when no task has changed for this long.
QUEUE_STALL_S = STALL_S
# How long every agent's run may take to be under way before the kill.
MIDRUN_TIMEOUT_S = 180.0
# How long the restarted runtime may take to recover every agent.
RECOVERY_TIMEOUT_S = 300.0
POLL_S = 0.1
# SubmitTask calls per task before giving up, and the pause between them.
SUBMIT_ATTEMPTS = 3
SUBMIT_RETRY_S = 0.05

TERMINAL = (rpb.TASK_STATUS_SUCCEEDED, rpb.TASK_STATUS_DEAD, rpb.TASK_STATUS_CANCELLED)


def _status_name(status: rpb.TaskStatus.ValueType) -> str:
    return str(rpb.TaskStatus.Name(status)).removeprefix("TASK_STATUS_").lower()


# --- 1. the task queue ---------------------------------------------------------------


@dataclass
class Submitted:
    """One SubmitTask: which agent, its place among that agent's tasks, when it was called."""

    agent: int
    order: int
    called_ns: int
    answered_ns: int


@dataclass
class TaskEvents:
    """The task_changed events of one task: (index in the stream, receive ns) by status."""

    running: list[tuple[int, int]] = field(default_factory=list)
    ended: tuple[int, int, int] | None = None  # (index, ns, status)


@dataclass
class QueueSample:
    agents: int
    tasks: int
    submitted: int = 0
    submit_errors: Counter[str] = field(default_factory=Counter)  # failed calls, retried or not
    resubmitted: int = 0  # tasks submitted at a second or later attempt
    unsubmitted: int = 0  # tasks whose every attempt failed
    submit_ms: list[float] = field(default_factory=list)  # first call to the answer, retries included
    complete: bool = False
    cuts: int = 0  # times the runtime ended the WatchAgents stream
    seconds: float = float("nan")  # first submission to the last SUCCEEDED event
    stored_seconds: float = float("nan")  # first create_time to the last end_time
    stored_wait_ms: list[float] = field(default_factory=list)  # start_time - create_time
    stored_latency_ms: list[float] = field(default_factory=list)  # end_time - create_time
    final: Counter[str] = field(default_factory=Counter)  # stored statuses at the end
    retried: int = 0  # tasks that took more than one attempt
    wait_ms: list[float] = field(default_factory=list)  # RUNNING event - SubmitTask called
    latency_ms: list[float] = field(default_factory=list)  # SUCCEEDED event - SubmitTask called
    stats_wait_ms: float = float("nan")  # GetQueueStats average_wait_ms, averaged over agents
    stats_left: int = 0  # tasks still queued or running according to GetQueueStats
    no_events: int = 0  # tasks missing a RUNNING or an end event
    overlaps: int = 0  # RUNNING event before the predecessor's SUCCEEDED event
    reordered: int = 0  # RUNNING event before the predecessor's RUNNING event
    stored_overlaps: int = 0  # stored start_time before the predecessor's end_time
    stored_reordered: int = 0  # stored start_time before the predecessor's start_time
    cores: dict[str, float] = field(default_factory=dict)
    machine_busy: float = float("nan")

    @property
    def rate(self) -> float:
        return self.final["succeeded"] / self.seconds if self.seconds > 0 else float("nan")

    @property
    def stored_rate(self) -> float:
        return self.final["succeeded"] / self.stored_seconds if self.stored_seconds > 0 else float("nan")


class TaskWatch:
    """Reads a WatchAgents stream of a workspace and keeps its task_changed events.

    When the runtime ends the stream (the watcher fell too far behind), it
    watches again at once; the events in between are lost, and counted
    through the tasks left without events.
    """

    def __init__(self, open_call: Callable[[], Any]) -> None:
        self._open = open_call
        self._call: Any = None
        self.events: dict[str, TaskEvents] = defaultdict(TaskEvents)
        self.ended: set[str] = set()
        self.last_end_ns = 0
        self.changed = asyncio.Event()
        self.cuts = 0
        self._index = 0
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._call = await self._subscribed()
        self._reader = asyncio.create_task(self._read())

    async def _subscribed(self) -> Any:
        call = self._open()
        await asyncio.wait_for(call.initial_metadata(), CALL_TIMEOUT_S)
        return call

    async def _read(self) -> None:
        while True:
            try:
                async for response in self._call:
                    self._record(response.event, time.monotonic_ns())
                return
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                self.cuts += 1
                print(f"warning: the WatchAgents stream was cut ({error.details()})", file=sys.stderr)
                self._call = await self._subscribed()

    def _record(self, event: Any, received: int) -> None:
        if event.WhichOneof("event") != "task_changed":
            return
        task = event.task_changed
        self._index += 1
        seen = self.events[task.id]
        if task.status == rpb.TASK_STATUS_RUNNING:
            seen.running.append((self._index, received))
        elif task.status in TERMINAL:
            seen.ended = (self._index, received, task.status)
            self.ended.add(task.id)
            self.last_end_ns = max(self.last_end_ns, received)
        self.changed.set()

    async def aclose(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self._reader


async def list_tasks(clients: Clients, person: str, agent_id: str) -> list[rpb.Task]:
    tasks: list[rpb.Task] = []
    token = ""
    while True:
        page = await clients.runtime.ListTasks(
            rpb.ListTasksRequest(agent_id=agent_id, page_size=200, page_token=token),
            metadata=as_member(person),
            timeout=CALL_TIMEOUT_S,
        )
        tasks.extend(page.tasks)
        token = page.next_page_token
        if not token:
            return tasks


async def _submit_all(
    clients: Clients, person: str, agents: Sequence[rpb.Agent], sample: QueueSample, tag: str
) -> dict[str, Submitted]:
    """Each agent's tasks one after another, every agent at once.

    A call that fails is tried again with the same request id (which is what
    request ids are for), up to SUBMIT_ATTEMPTS times.
    """
    submitted: dict[str, Submitted] = {}

    async def submit(index: int, order: int, agent: rpb.Agent) -> None:
        request = rpb.SubmitTaskRequest(
            agent_id=agent.id,
            input=f"short task {order} of agent {index}",
            request_id=f"bench-{tag}-{index}-{order}",
        )
        called = time.monotonic_ns()
        for attempt in range(1, SUBMIT_ATTEMPTS + 1):
            try:
                response = await clients.runtime.SubmitTask(
                    request, metadata=as_member(person), timeout=CALL_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as error:
                sample.submit_errors[error.code().name] += 1
                if attempt == SUBMIT_ATTEMPTS:
                    sample.unsubmitted += 1
                    return
                await asyncio.sleep(SUBMIT_RETRY_S)
                continue
            answered = time.monotonic_ns()
            sample.submit_ms.append(ms(answered - called))
            sample.resubmitted += attempt > 1
            submitted[response.task.id] = Submitted(index, order, called, answered)
            return

    async def agent_tasks(index: int, agent: rpb.Agent) -> None:
        for order in range(sample.tasks):
            await submit(index, order, agent)

    await asyncio.gather(*(agent_tasks(i, a) for i, a in enumerate(agents)))
    sample.submitted = len(submitted)
    return submitted


async def _until_done(watch: TaskWatch, ids: set[str], stored: Callable[[], Awaitable[int]]) -> bool:
    """Waits until every task has an end event, or nothing changes for QUEUE_STALL_S.

    After a quiet second, `stored` (tasks ended, from ListTasks) says whether
    the tasks whose end event was lost with a cut stream are done.
    """
    last_change, last_count = time.perf_counter(), -1
    while True:
        count = len(ids & watch.ended)
        if count >= len(ids):
            return True
        now = time.perf_counter()
        if count != last_count:
            last_change, last_count = now, count
        elif watch.cuts and now - last_change > 1.0 and await stored() >= len(ids):
            return True
        if now - last_change > QUEUE_STALL_S:
            return False
        watch.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(watch.changed.wait(), 1.0)


def _event_order(sample: QueueSample, submitted: dict[str, Submitted], watch: TaskWatch) -> None:
    """Waits, latencies, and one-at-a-time-in-order as the events show it."""
    by_agent: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for task_id, sub in submitted.items():
        by_agent[sub.agent].append((sub.order, task_id))
        seen = watch.events.get(task_id)
        if seen is None or not seen.running or seen.ended is None:
            sample.no_events += 1
            continue
        sample.wait_ms.append(ms(seen.running[0][1] - sub.called_ns))
        if seen.ended[2] == rpb.TASK_STATUS_SUCCEEDED:
            sample.latency_ms.append(ms(seen.ended[1] - sub.called_ns))
    for tasks in by_agent.values():
        tasks.sort()
        for (_, before), (_, after) in itertools.pairwise(tasks):
            previous, current = watch.events.get(before), watch.events.get(after)
            if previous is None or current is None or not current.running:
                continue
            started = current.running[0][0]
            if previous.ended is not None and started < previous.ended[0]:
                sample.overlaps += 1
            if previous.running and started < previous.running[0][0]:
                sample.reordered += 1


def _stored_order(sample: QueueSample, submitted: dict[str, Submitted], stored: Sequence[rpb.Task]) -> None:
    """The same check on the times the runtime stored (one clock, microseconds)."""
    by_agent: dict[int, list[tuple[int, rpb.Task]]] = defaultdict(list)
    first_created, last_ended = math.inf, -math.inf
    for task in stored:
        sub = submitted.get(task.id)
        if sub is None:
            continue
        by_agent[sub.agent].append((sub.order, task))
        sample.final[_status_name(task.status)] += 1
        sample.retried += task.attempts > 1
        created = task.create_time.ToNanoseconds()
        first_created = min(first_created, created)
        if task.HasField("start_time"):
            sample.stored_wait_ms.append(ms(task.start_time.ToNanoseconds() - created))
        if task.status == rpb.TASK_STATUS_SUCCEEDED and task.HasField("end_time"):
            ended = task.end_time.ToNanoseconds()
            sample.stored_latency_ms.append(ms(ended - created))
            last_ended = max(last_ended, ended)
    if last_ended > first_created:
        sample.stored_seconds = (last_ended - first_created) / 1e9
    for tasks in by_agent.values():
        tasks.sort(key=lambda pair: pair[0])
        for (_, before), (_, after) in itertools.pairwise(tasks):
            if not after.HasField("start_time"):
                continue
            started = after.start_time.ToNanoseconds()
            if before.HasField("end_time") and started < before.end_time.ToNanoseconds():
                sample.stored_overlaps += 1
            if before.HasField("start_time") and started < before.start_time.ToNanoseconds():
                sample.stored_reordered += 1


async def queue_run(
    clients: Clients, pids: dict[str, int], *, agents: int, tasks: int, tag: str
) -> QueueSample:
    sample = QueueSample(agents=agents, tasks=tasks)
    person = await new_workspace(clients, f"bench-queue-{tag}")
    created, errors = await bounded(
        [partial(create_agent, clients, person, f"queue-{i}") for i in range(agents)], CREATE_CONCURRENCY
    )
    if errors:
        raise BenchError(f"CreateAgent failed: {dict(errors)}")
    await wait_quiet(list(pids.values()), since=time.perf_counter())

    async def stored_ended() -> int:
        found = [t for a in created for t in await list_tasks(clients, person, a.id)]
        return sum(t.status in TERMINAL for t in found)

    watch = TaskWatch(
        lambda: clients.runtime.WatchAgents(rpb.WatchAgentsRequest(), metadata=as_member(person))
    )
    await watch.start()
    meter = CpuMeter(pids)
    try:
        meter.start()
        first = time.monotonic_ns()
        submitted = await _submit_all(clients, person, created, sample, tag)
        sample.complete = await _until_done(watch, set(submitted), stored_ended)
        meter.stop()
    finally:
        await watch.aclose()
    sample.cuts = watch.cuts
    if watch.last_end_ns:
        sample.seconds = (watch.last_end_ns - first) / 1e9
    sample.cores, sample.machine_busy = dict(meter.cores), meter.machine_busy
    _event_order(sample, submitted, watch)
    stored = [t for a in created for t in await list_tasks(clients, person, a.id)]
    _stored_order(sample, submitted, stored)
    stats = await asyncio.gather(
        *(
            clients.runtime.GetQueueStats(
                rpb.GetQueueStatsRequest(agent_id=a.id), metadata=as_member(person), timeout=CALL_TIMEOUT_S
            )
            for a in created
        )
    )
    sample.stats_wait_ms = mean([s.average_wait_ms for s in stats])
    sample.stats_left = sum(s.queued + int(s.running) for s in stats)
    await delete_agents(clients, person, created)
    return sample


async def queue_part(
    backend: Backend, options: Options, workdir: Path, im: Service, problems: dict[str, Counter[str]]
) -> list[QueueSample]:
    name = backend.name
    samples: list[QueueSample] = []
    async with backend.runtime(
        f"runtime, task queue ({name})", log_path=workdir / f"runtime-queue-{name}.log"
    ) as (rt, clients):
        for run in range(1, options.runs + 1):
            sample = await queue_run(
                clients,
                {"runtime": rt.pid, "IM": im.pid},
                agents=options.queue_agents,
                tasks=options.tasks,
                tag=f"{name}-{run}-{uuid.uuid4().hex[:8]}",
            )
            samples.append(sample)
            print(
                f"[{name}] queue run {run}: {sample.final['succeeded']}/{sample.submitted} succeeded in "
                f"{sample.seconds:.1f} s ({sample.rate:,.0f} tasks/s; "
                f"stored times {sample.stored_rate:,.0f}/s); "
                f"wait mean {mean(sample.wait_ms):.0f} ms (stored {mean(sample.stored_wait_ms):.0f} ms, "
                f"GetQueueStats {sample.stats_wait_ms:.0f} ms); "
                f"latency p50 {percentile(sample.latency_ms, 0.5):.0f} ms "
                f"p99 {percentile(sample.latency_ms, 0.99):.0f} ms; "
                f"violations {sample.overlaps}/{sample.reordered} (events), "
                f"{sample.stored_overlaps}/{sample.stored_reordered} (stored)"
                + ("" if sample.complete else "; INCOMPLETE")
                + (f"; SubmitTask errors {dict(sample.submit_errors)}" if sample.submit_errors else "")
                + (f"; watch cut {sample.cuts} times" if sample.cuts else ""),
                flush=True,
            )
    problems[rt.name] = rt.problems()
    return samples


# --- 2. crash recovery ---------------------------------------------------------------


class RecoveryTables(RuntimeTables):
    """Per agent: its state and its runs by status, from the runtime's tables."""

    async def agent_runs(self, ids: set[uuid.UUID]) -> dict[uuid.UUID, tuple[str, Counter[str]]]:
        query = sa.text(
            f"SELECT a.id, a.state, r.status, count(r.id) FROM {self._schema}agents a "
            f"LEFT JOIN {self._schema}runs r ON r.agent_id = a.id WHERE NOT a.deleted "
            "GROUP BY a.id, a.state, r.status"
        )
        async with self._engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        found: dict[uuid.UUID, tuple[str, Counter[str]]] = {}
        for agent_id, state, status, count in rows:
            key = agent_id if isinstance(agent_id, uuid.UUID) else uuid.UUID(str(agent_id))
            if key not in ids:
                continue
            runs = found.setdefault(key, (str(state), Counter()))[1]
            if status is not None:
                runs[str(status)] += int(count)
        return found

    async def completed_at(self, ids: set[uuid.UUID]) -> list[dt.datetime]:
        """When each agent's first COMPLETED run ended."""
        query = sa.text(
            f"SELECT agent_id, min(ended_at) FROM {self._schema}runs WHERE status = 'completed' "
            "GROUP BY agent_id"
        )
        async with self._engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        ended = []
        for agent_id, at in rows:
            key = agent_id if isinstance(agent_id, uuid.UUID) else uuid.UUID(str(agent_id))
            if key in ids and at is not None:
                stamp = at if isinstance(at, dt.datetime) else dt.datetime.fromisoformat(str(at))
                ended.append(stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC))
        return ended


def _recovered(state: str, runs: Counter[str]) -> bool:
    return state == "idle" and runs["interrupted"] >= 1 and runs["completed"] >= 1 and not runs["running"]


def _pattern(runs: Counter[str]) -> str:
    return " + ".join(f"{n} {status}" for status, n in sorted(runs.items())) or "no run"


@dataclass
class RecoveryResult:
    agents: int
    workspaces: int
    created: int = 0
    create_s: float = float("nan")
    create_errors: Counter[str] = field(default_factory=Counter)
    setup_errors: Counter[str] = field(default_factory=Counter)
    midrun: int = 0
    midrun_s: float = float("nan")  # first message sent to every agent's first delta
    states_at_kill: Counter[str] = field(default_factory=Counter)
    runs_at_kill: Counter[str] = field(default_factory=Counter)
    banner_agents: int = -1
    listening_s: float = float("nan")
    interrupted_s: float = float("nan")  # process start to every stale run ended
    recovered_s: float = float("nan")  # process start to every agent recovered
    agent_recovered_s: list[float] = field(default_factory=list)  # per agent: start to its run completed
    recovered: int = 0
    complete: bool = False
    error_seen: int = 0  # most agents in ERROR at one poll
    states_after: Counter[str] = field(default_factory=Counter)
    patterns: Counter[str] = field(default_factory=Counter)
    stop_s: float = float("nan")


async def _recovery_agents(
    clients: Clients, result: RecoveryResult, model: rpb.ModelSettings, pids: Sequence[int]
) -> list[tuple[str, rpb.Agent]]:
    """The workspaces and agents; returns (person, agent) per agent."""
    people, errors = await bounded(
        [partial(new_workspace, clients, f"bench-recovery-{w}") for w in range(result.workspaces)],
        CREATE_CONCURRENCY,
    )
    if errors:
        raise BenchError(f"CreateWorkspace failed: {dict(errors)}")
    per = math.ceil(result.agents / len(people))

    async def one(index: int) -> tuple[str, rpb.Agent]:
        person = people[index // per]
        return person, await create_agent(clients, person, f"recover-{index}", model=model)

    started = time.perf_counter()
    agents, result.create_errors = await bounded(
        [partial(one, i) for i in range(result.agents)], CREATE_CONCURRENCY
    )
    result.create_s = time.perf_counter() - started
    result.created = len(agents)
    # Chats only once the runtime's IM watches of the new agents are in place.
    await wait_quiet(pids, since=time.perf_counter())
    return agents


async def _until_midrun(
    clients: Clients, agents: Sequence[tuple[str, rpb.Agent]], chats: Sequence[tuple[str, str]]
) -> tuple[set[str], float]:
    """Sends every agent its message; returns the agents whose LLM stream has
    delivered a delta (within MIDRUN_TIMEOUT_S) and how long that took."""
    streaming: set[str] = set()
    progress = asyncio.Event()
    by_person: dict[str, list[str]] = defaultdict(list)
    for person, agent in agents:
        by_person[person].append(agent.id)
    calls = [
        clients.runtime.WatchAgents(rpb.WatchAgentsRequest(agent_ids=ids), metadata=as_member(person))
        for person, ids in by_person.items()
    ]

    async def read(call: Any) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for response in call:
                if response.event.WhichOneof("event") == "step_delta":
                    streaming.add(response.event.agent_id)
                    progress.set()

    readers = [asyncio.create_task(read(c)) for c in calls]
    try:
        await asyncio.gather(*(asyncio.wait_for(c.initial_metadata(), CALL_TIMEOUT_S) for c in calls))
        started = time.perf_counter()
        await bounded(
            [partial(send, clients, person, chat, "hello") for person, chat in chats], SEND_CONCURRENCY
        )
        deadline = started + MIDRUN_TIMEOUT_S
        while len(streaming) < len(agents) and time.perf_counter() < deadline:
            progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(progress.wait(), 1.0)
        return set(streaming), time.perf_counter() - started
    finally:
        for call in calls:
            call.cancel()
        for reader in readers:
            with contextlib.suppress(asyncio.CancelledError):
                await reader


async def _killed_runtime(
    backend: Backend,
    *,
    workdir: Path,
    im: Service,
    result: RecoveryResult,
    model: rpb.ModelSettings,
    tables: RecoveryTables,
    problems: dict[str, Counter[str]],
) -> set[uuid.UUID]:
    """Creates the agents, starts a run on each, and SIGKILLs the runtime mid-runs."""
    name = backend.name
    async with backend.runtime(
        f"runtime, killed ({name})",
        log_path=workdir / f"runtime-killed-{name}.log",
        exit_codes=(-signal.SIGKILL,),
    ) as (rt, clients):
        agents = await _recovery_agents(clients, result, model, [rt.pid, im.pid])
        print(f"[{name}] created {result.created} agents in {result.create_s:.1f} s", flush=True)
        chats, result.setup_errors = await bounded(
            [partial(_chat, clients, person, agent) for person, agent in agents], CREATE_CONCURRENCY
        )
        streaming, result.midrun_s = await _until_midrun(clients, agents, chats)
        result.midrun = len(streaming)
        ids = {uuid.UUID(agent.id) for _, agent in agents}
        at_kill = await tables.agent_runs(ids)
        result.states_at_kill = Counter(state for state, _ in at_kill.values())
        result.runs_at_kill = sum((runs for _, runs in at_kill.values()), Counter())
        os.kill(rt.pid, signal.SIGKILL)
        print(
            f"[{name}] {result.midrun} of {result.created} agents mid-run after {result.midrun_s:.1f} s "
            f"(agents {dict(result.states_at_kill)}, runs {dict(result.runs_at_kill)}): SIGKILL",
            flush=True,
        )
    problems[rt.name] = rt.problems()
    return ids


async def _chat(clients: Clients, person: str, agent: rpb.Agent) -> tuple[str, str]:
    return person, await direct_chat(clients, person, agent.member_id)


async def _watch_recovery(
    rt: Service, tables: RecoveryTables, ids: set[uuid.UUID], result: RecoveryResult
) -> None:
    """Polls the runtime's tables until every agent has recovered (or nothing changes for STALL_S)."""
    last_change, last = time.perf_counter(), (-1, -1)
    deadline = rt.spawned_at + RECOVERY_TIMEOUT_S
    while True:
        found = await tables.agent_runs(ids)
        now = time.perf_counter()
        ended = sum(runs["interrupted"] >= 1 and not runs["running"] for _, runs in found.values())
        recovered = sum(_recovered(state, runs) for state, runs in found.values())
        result.error_seen = max(result.error_seen, sum(state == "error" for state, _ in found.values()))
        if ended >= len(ids) and math.isnan(result.interrupted_s):
            result.interrupted_s = now - rt.spawned_at
        if recovered >= len(ids):
            result.recovered_s, result.complete = now - rt.spawned_at, True
            break
        if (ended, recovered) != last:
            last_change, last = now, (ended, recovered)
        if now - last_change > STALL_S or now > deadline:
            break
        await asyncio.sleep(POLL_S)
    result.recovered = last[1] if not result.complete else len(ids)


async def recovery_part(
    backend: Backend, options: Options, workdir: Path, im: Service, problems: dict[str, Counter[str]]
) -> RecoveryResult:
    name = backend.name
    result = RecoveryResult(agents=options.recovery_agents, workspaces=options.recovery_workspaces)
    tables = RecoveryTables(backend.runtime_url)
    try:
        async with backend.llm(log_path=workdir / f"llm-{name}.log") as llm:
            stall = f"bench-stall-{options.recovery_agents}-{name}-{uuid.uuid4().hex[:8]}"
            model = rpb.ModelSettings(base_url=f"http://{llm.address}/v1", model=stall)
            ids = await _killed_runtime(
                backend, workdir=workdir, im=im, result=result, model=model, tables=tables, problems=problems
            )
            async with backend.runtime(
                f"runtime, restarted after SIGKILL ({name})",
                log_path=workdir / f"runtime-restarted-{name}.log",
            ) as (rt, _):
                result.listening_s = rt.listening_after_s
                # The process start on the wall clock, which the runtime stores its times in.
                spawned = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=time.perf_counter() - rt.spawned_at)
                result.banner_agents = rt.banner_agents()
                await _watch_recovery(rt, tables, ids, result)
                found = await tables.agent_runs(ids)
                result.states_after = Counter(state for state, _ in found.values())
                result.patterns = Counter(_pattern(runs) for _, runs in found.values())
                result.agent_recovered_s = [
                    (at - spawned).total_seconds() for at in await tables.completed_at(ids)
                ]
            result.stop_s = rt.stopped_in_s
            problems[rt.name] = rt.problems()
        problems[llm.name] = llm.problems()
    finally:
        await tables.aclose()
    print(
        f"[{name}] restarted: listening after {result.listening_s:.1f} s, stale runs ended after "
        f"{result.interrupted_s:.1f} s, {result.recovered} of {len(ids)} agents recovered"
        + (f" after {result.recovered_s:.1f} s" if result.complete else " (INCOMPLETE)")
        + f"; agents {dict(result.states_after)}; runs per agent {dict(result.patterns)}",
        flush=True,
    )
    return result


# --- one backend -----------------------------------------------------------------


@dataclass
class ControlResult:
    backend: str
    queue: list[QueueSample] = field(default_factory=list)
    recovery: RecoveryResult | None = None
    problems: dict[str, Counter[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Options:
    backends: list[str]
    parts: list[str]
    runs: int
    queue_agents: int
    tasks: int
    recovery_agents: int
    recovery_workspaces: int
    worktree: bool
    ref: str | None
    keep_logs: bool
    postgres_url: str
    redis_url: str
    write_doc: bool


async def bench_backend(name: str, options: Options, workdir: Path, source: Path) -> ControlResult:
    result = ControlResult(name)
    async with contextlib.AsyncExitStack() as stack:
        # On postgresql, the benchmarks' advisory lock, in this benchmark's own database.
        backend = await backend_on(
            stack,
            name,
            workdir=workdir,
            source=source,
            postgres_url=options.postgres_url,
            redis_url=options.redis_url,
        )
        await backend.migrate()
        im = await backend.start_im(stack, name=f"IM service ({name})", log_path=workdir / f"im-{name}.log")
        if "queue" in options.parts:
            result.queue = await queue_part(backend, options, workdir, im, result.problems)
        if "recovery" in options.parts:
            result.recovery = await recovery_part(backend, options, workdir, im, result.problems)
        result.problems[im.name] = im.problems()
    return result


# --- report ----------------------------------------------------------------------


def _method(options: Options) -> list[str]:
    return [
        "Method: `bench/control_bench.py`, on the same harness as `bench/runtime_bench.py` "
        "(`bench/harness.py`): every service is a subprocess on a free loopback port with "
        "LOG_LEVEL=WARNING (the IM service, the runtime and, for the recovery, `bench/llm_server.py`); "
        "the client is the benchmark's process. Backends: "
        "*embedded* (IM and runtime on their own SQLite files, in-process event signals) and *postgresql* "
        "(both in the database `agentim_control_bench`, the IM with Redis signals). Task-queue figures are "
        f"medians of {options.runs} runs (a new workspace and new agents each, on one runtime process); "
        "the recovery is measured once per backend.",
        "",
    ]


def _cell(samples: Sequence[QueueSample], get: Callable[[QueueSample], float]) -> str:
    return grouped(median_of(samples, get))


def _p50_p99(samples: Sequence[QueueSample], get: Callable[[QueueSample], list[float]]) -> str:
    """The median over runs of each run's p50, then of its p99."""
    return " / ".join(grouped(median([percentile(get(x), q) for x in samples])) for q in (0.5, 0.99))


def _queue_section(results: Sequence[ControlResult], options: Options) -> list[str]:
    lines = [
        f"### Task queue: {options.queue_agents * options.tasks:,} short tasks over "
        f"{options.queue_agents} agents (offline model)",
        "",
        f"{options.queue_agents} agents (CreateAgent, offline model) in a new workspace; once the runtime "
        f"and the IM are idle, every agent gets {options.tasks} tasks through SubmitTask, each with a "
        "request id: an agent's tasks one after another (the next once the previous SubmitTask has "
        "answered), all agents at once. A failed SubmitTask is tried again with the same request id (up to "
        f"{SUBMIT_ATTEMPTS} calls). A WatchAgents stream of the workspace, opened before, records each "
        "`task_changed` event as it arrives (if the runtime cuts it, it is opened again). *Events* columns "
        "are measured in this process: from the moment a task's first SubmitTask call was made to its "
        "RUNNING event (wait) or its SUCCEEDED event (latency); tasks/s is the succeeded tasks over the "
        "time from the first SubmitTask call to the last SUCCEEDED event. *Stored* columns come from the "
        "tasks' times as the runtime stored them (ListTasks afterwards: start_time or end_time minus "
        "create_time; tasks/s from the first create_time to the last end_time). GetQueueStats: its "
        "average_wait_ms once every task has ended, averaged over the agents. SubmitTask: from the first "
        "call to the answer. CPU is over the whole run (100% = one core).",
        "",
        *table_head(
            "Backend",
            "Tasks/s, events (min-max)",
            "Tasks/s, stored",
            "Wait ms, events: mean / p50",
            "Wait ms, stored: mean",
            "Wait ms, GetQueueStats",
            "Latency ms, events: p50 / p99",
            "Latency ms, stored: p50 / p99",
            "SubmitTask ms: p50 / p99",
            "Runtime CPU",
            "IM CPU",
        ),
    ]
    for r in results:
        if not r.queue:
            continue
        rates = [x.rate for x in r.queue]

        lines.append(
            f"| {r.backend} | **{grouped(median(rates))}** ({grouped(min(rates))}-{grouped(max(rates))}) "
            f"| {_cell(r.queue, lambda x: x.stored_rate)} "
            f"| {_cell(r.queue, lambda x: mean(x.wait_ms))} "
            f"/ {_cell(r.queue, lambda x: percentile(x.wait_ms, 0.5))} "
            f"| {_cell(r.queue, lambda x: mean(x.stored_wait_ms))} "
            f"| {_cell(r.queue, lambda x: x.stats_wait_ms)} "
            f"| {_p50_p99(r.queue, lambda x: x.latency_ms)} "
            f"| {_p50_p99(r.queue, lambda x: x.stored_latency_ms)} "
            f"| {_p50_p99(r.queue, lambda x: x.submit_ms)} "
            f"| {percent(median_of(r.queue, lambda x: x.cores.get('runtime', math.nan)))} "
            f"| {percent(median_of(r.queue, lambda x: x.cores.get('IM', math.nan)))} |"
        )
    lines += [
        "",
        "Correctness, per run. Order: per agent, a task whose RUNNING event came before its predecessor's "
        "SUCCEEDED event (it overlapped it, or ran ahead of it) is a violation; *reordered* counts the "
        "tasks whose RUNNING event came before their predecessor's. The same two counts from the stored "
        "times (start_time against the predecessor's end_time and start_time) follow the slash. All "
        "should be 0; *no events* counts tasks whose RUNNING or end event never arrived.",
        "",
        *table_head(
            "Backend",
            "Run",
            "Tasks succeeded",
            "Other end",
            "SubmitTask errors (calls)",
            "Submitted after a retry",
            "Never submitted",
            "Violations (events / stored)",
            "Reordered (events / stored)",
            "Watch cut",
            "No events",
            "Left in queue",
            align="lrrllrrrrrrr",
        ),
    ]
    for r in results:
        for run, x in enumerate(r.queue, 1):
            other = ", ".join(f"{n:,} {k}" for k, n in sorted(x.final.items()) if k != "succeeded")
            lines.append(
                f"| {r.backend} | {run} | {x.final['succeeded']:,} of {x.agents * x.tasks:,} "
                f"| {other or '-'}{'' if x.complete else ' (gave up waiting)'} "
                f"| {errors_note(x.submit_errors).removeprefix('; errors: ') or '0'} | {x.resubmitted:,} "
                f"| {x.unsubmitted:,} | {x.overlaps} / {x.stored_overlaps} "
                f"| {x.reordered} / {x.stored_reordered} "
                f"| {x.cuts} | {x.no_events:,} | {x.stats_left} |"
            )
    return [*lines, ""]


def _recovery_section(results: Sequence[ControlResult], options: Options) -> list[str]:
    done = [(r.backend, r.recovery) for r in results if r.recovery is not None]
    if not done:
        return []
    first = done[0][1]
    head = "| Measurement | " + " | ".join(b for b, _ in done) + " |"

    def row(label: str, cells: Sequence[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    def took(value: float) -> str:
        return f"{value:.1f} s" if not math.isnan(value) else "never"

    rows = [
        row(
            f"CreateAgent x {first.agents:,} ({CREATE_CONCURRENCY} at a time)",
            [f"{x.created:,} in {x.create_s:.1f} s{errors_note(x.create_errors)}" for _, x in done],
        ),
        row(
            "mid-run at the kill: LLM stream open, first delta streamed (time from the first message)",
            [f"{x.midrun:,} of {x.created:,} ({x.midrun_s:.1f} s)" for _, x in done],
        ),
        row("agents at the kill, by state", [tally(x.states_at_kill) for _, x in done]),
        row("runs at the kill, by status", [tally(x.runs_at_kill) for _, x in done]),
        row(
            "restart: process start → `listening` line",
            [f"**{took(x.listening_s)}** ({x.banner_agents:,} agents)" for _, x in done],
        ),
        row(
            "→ every interrupted run ended (INTERRUPTED)",
            [took(x.interrupted_s) for _, x in done],
        ),
        row(
            "→ every agent IDLE, its interrupted run ended and a new run COMPLETED",
            [
                f"**{took(x.recovered_s)}**" if x.complete else f"**incomplete**: {x.recovered:,} agents"
                for _, x in done
            ],
        ),
        row(
            "per agent, process start → its new run COMPLETED (stored end time): p50 / p90 / max",
            [
                " / ".join(took(percentile(x.agent_recovered_s, q)) for q in (0.5, 0.9, 1.0))
                if x.agent_recovered_s
                else "n/a"
                for _, x in done
            ],
        ),
        row(
            "agents in ERROR (most seen at one poll / at the end)",
            [f"{x.error_seen} / {x.states_after['error']}" for _, x in done],
        ),
        row("agents at the end, by state", [tally(x.states_after) for _, x in done]),
        row(
            "runs per agent at the end",
            [", ".join(f"{n:,} x ({k})" for k, n in x.patterns.most_common()) for _, x in done],
        ),
        row("then SIGTERM to exit", [took(x.stop_s) for _, x in done]),
    ]
    return [
        f"### Crash recovery: {first.agents:,} agents killed mid-run",
        "",
        f"{first.agents:,} agents in {first.workspaces} workspaces (CreateAgent), each with a direct chat "
        "with its workspace's person and its model pointed at `bench/llm_server.py` with the model "
        f"`bench-stall-{first.agents}-<tag>`: the server streams the first {first.agents:,} requests naming "
        "it one delta and then holds them open (a `.` every 5 s, so that no idle timeout fires) until the "
        "client goes away, and answers every later request at once. Each person sends each of its agents "
        "`hello`; once a WatchAgents stream has shown a step_delta of every agent (each run under way, "
        "its LLM request stalled mid-stream), the runtime is killed with SIGKILL and a new runtime "
        "process started on the same database. Its resumed runs are the later requests, answered at once. "
        f"Times from the new process's start; agent states and runs are read from the runtime's tables "
        f"every {POLL_S * 1000:.0f} ms (an agent counts as recovered when it is IDLE, has an INTERRUPTED "
        "run and a COMPLETED one, and none RUNNING). Measured once per backend.",
        "",
        head,
        "|---|" + "---:|" * len(done),
        *rows,
        "",
    ]


def render_section(results: Sequence[ControlResult], options: Options, recorded: Recorded) -> str:
    lines = preamble(SECTION, recorded.command, recorded.versions, recorded.seconds) + _method(options)
    if any(r.queue for r in results):
        lines += _queue_section(results, options)
    lines += _recovery_section(results, options)
    lines += problems_section(found for r in results for found in r.problems.items())
    return "\n".join(lines).rstrip() + "\n"


# --- entry point -----------------------------------------------------------------


async def run(options: Options) -> tuple[list[ControlResult], str]:
    with scratch("agentim-control-bench-") as workdir:
        source = workdir.path / "source"
        version = snapshot_sources(source, worktree=options.worktree, ref=options.ref)
        results = [await bench_backend(b, options, workdir.path, source) for b in options.backends]
        workdir.keep = options.keep_logs or any(found for r in results for found in r.problems.values())
    return results, version


def parse_options(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.control_bench", description=__doc__.split("\n\n")[0]
    )
    add_backend_options(parser, backends=BACKENDS, postgres_url=DEFAULT_POSTGRES_URL)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {','.join(PARTS)}")
    parser.add_argument("--runs", type=int, default=3, help="repetitions of the task-queue measurement")
    parser.add_argument("--queue-agents", type=int, default=100, help="agents of the task-queue part")
    parser.add_argument("--tasks", type=int, default=10, help="tasks per agent in the task-queue part")
    parser.add_argument("--recovery-agents", type=int, default=1000, help="agents killed mid-run")
    parser.add_argument("--recovery-workspaces", type=int, default=10, help="workspaces they are spread over")
    add_doc_option(parser)
    args = parser.parse_args(argv)
    parts = listed(parser, "--parts", args.parts, PARTS)
    backends = listed(parser, "--backends", args.backends, BACKENDS)
    counts = (args.runs, args.queue_agents, args.tasks, args.recovery_agents, args.recovery_workspaces)
    if min(counts) < 1:
        parser.error(
            "--runs, --queue-agents, --tasks, --recovery-agents and --recovery-workspaces must be >= 1"
        )
    return Options(
        backends=backends,
        parts=parts,
        runs=args.runs,
        queue_agents=args.queue_agents,
        tasks=args.tasks,
        recovery_agents=args.recovery_agents,
        recovery_workspaces=args.recovery_workspaces,
        worktree=args.worktree,
        ref=args.ref,
        keep_logs=args.keep_logs,
        postgres_url=args.postgres_url,
        redis_url=args.redis_url,
        write_doc=not args.no_doc,
    )


def main(argv: Sequence[str] | None = None) -> None:
    options = parse_options(argv)
    run_and_record("bench.control_bench", argv, options, run=run, render=render_section, title=SECTION)


if __name__ == "__main__":
    main()
