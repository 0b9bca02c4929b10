"""Closed-loop benchmark of the IM service against a bare gRPC echo ceiling.

Each server under test runs as its own subprocess on a free loopback port:
the IM service (`python -m services.im serve`) once per database backend,
and `bench.echo_server`, a raw `grpc.aio` echo with the same server options,
as the ceiling measured in the same run. The client is this process: N
asyncio workers issue calls back-to-back on one shared channel.

Measured, `--runs` times each (medians are reported):

- echo at 32 in flight (the ceiling);
- SendMessage at 1 and at 32 in flight: one workspace of 32 members, each
  worker sending as its own member into its own group of 2-3 members;
- GetAllUnread (50 sequential calls) for a member of 50 groups holding
  10,000 messages, with all of them unread (a page of 1000 plus
  remaining_count), then after marking each group read up to its
  second-to-last message (50 unread).

The result is printed and written to the `## IM service (issue 2)` section of
docs/benchmarks.md (other sections of that file are kept).

With `--mode wake` it measures instead, one call at a time, what an agent's
wake goes through: GetAllUnread of a few unread messages, MarkRead (which
records a ReadUpdated event), and the delay from SendMessage returning to the
message's event reaching a WatchEvents subscriber, each with the server's CPU
time per call; the bare echo round trip is the floor. It only prints.

Run as `python -m bench.im_bench [--mode full|wake] [--backends sqlite,postgresql] [--runs 3] [--seconds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from agentim.im.v1 import im_pb2, im_pb2_grpc
from bench import echo_server
from bench.speedscope import render, summarise
from tests.auth_support import credentials_environment
from tests.identities import as_member, learn_member

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## IM service (issue 2)"
BACKENDS = ("sqlite", "postgresql")
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/agentim_bench"

CONCURRENCY = 32
SEND_MEMBERS = 32
CONTENT_BYTES = 100
ECHO_PAYLOAD = b"x" * CONTENT_BYTES
UNREAD_GROUPS = 50
UNREAD_MESSAGES = 10_000
UNREAD_AUTHORS = 4
UNREAD_PAGE = 1000
UNREAD_CALLS = 50
SEED_WORKERS = 16

CALL_TIMEOUT_S = 10.0
UNREAD_TIMEOUT_S = 30.0
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
MIGRATE_TIMEOUT_S = 120.0
SEED_TIMEOUT_S = 180.0
TARGET_RATIO = 0.5
TARGET_P99_MS = 20.0

_BANNER = re.compile(r"listening on (\S+:\d+)")
_PROBLEM = re.compile(r"\b(WARNING|ERROR|CRITICAL|Traceback)\b")

Metadata = tuple[tuple[str, str], ...]


class BenchError(Exception):
    """The benchmark could not run (a server did not start, setup failed...)."""


def learned(member: im_pb2.Member) -> str:
    """The member's id, once its access tokens can be signed (`as_member`)."""
    learn_member(member)
    return member.id


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..1)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --- CPU accounting (Linux /proc; None elsewhere) -----------------------------

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    # utime and stime are fields 14 and 15 of stat; [2] above starts at field 3.
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _machine_cpu() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return float(sum(values) - idle), float(sum(values))


@dataclass
class CpuWindow:
    """CPU used by a process and by this (client) process, in cores, and the machine's busy share."""

    pid: int | None
    _wall: float = 0.0
    _process: float | None = None
    _client: float = 0.0
    _machine: tuple[float, float] | None = None
    process_cores: float | None = None
    client_cores: float | None = None
    machine_busy: float | None = None

    def start(self) -> None:
        self._wall = time.perf_counter()
        self._process = _process_cpu_s(self.pid) if self.pid else None
        self._client = time.process_time()
        self._machine = _machine_cpu()

    def stop(self) -> None:
        wall = time.perf_counter() - self._wall
        process = _process_cpu_s(self.pid) if self.pid else None
        if process is not None and self._process is not None and wall > 0:
            self.process_cores = (process - self._process) / wall
        if wall > 0:
            self.client_cores = (time.process_time() - self._client) / wall
        machine = _machine_cpu()
        if machine is not None and self._machine is not None and machine[1] > self._machine[1]:
            self.machine_busy = (machine[0] - self._machine[0]) / (machine[1] - self._machine[1])


# --- closed-loop load -----------------------------------------------------------


@dataclass
class LoadSample:
    """One closed-loop measurement."""

    concurrency: int
    seconds: float
    latencies_ms: list[float]
    errors: Counter[str]
    server_cores: float | None
    client_cores: float | None
    machine_busy: float | None

    @property
    def throughput(self) -> float:
        return len(self.latencies_ms) / self.seconds if self.seconds > 0 else 0.0

    def p(self, q: float) -> float:
        return percentile(sorted(self.latencies_ms), q)

    @property
    def max_ms(self) -> float:
        return max(self.latencies_ms, default=float("nan"))


async def closed_loop(
    call: Callable[[int], Awaitable[object]],
    *,
    concurrency: int,
    seconds: float,
    warmup: float,
    server_pid: int | None,
) -> LoadSample:
    """Runs `concurrency` workers calling `call(worker)` back-to-back.

    Calls that start during the warm-up are not counted; no call starts after
    the window ends, so the whole thing lasts warmup + seconds + one call.
    """
    begin = time.perf_counter()
    measure_from = begin + warmup
    measure_until = measure_from + seconds
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    cpu = CpuWindow(server_pid)

    async def worker(index: int) -> None:
        while (started := time.perf_counter()) < measure_until:
            failure: str | None = None
            try:
                await call(index)
            except grpc.aio.AioRpcError as error:
                failure = error.code().name
            if started >= measure_from:
                if failure is None:
                    latencies.append((time.perf_counter() - started) * 1000.0)
                else:
                    errors[failure] += 1

    async def meter() -> None:
        await asyncio.sleep(max(0.0, measure_from - time.perf_counter()))
        cpu.start()
        await asyncio.sleep(max(0.0, measure_until - time.perf_counter()))
        cpu.stop()

    await asyncio.gather(meter(), *(worker(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - measure_from
    return LoadSample(
        concurrency, elapsed, latencies, errors, cpu.process_cores, cpu.client_cores, cpu.machine_busy
    )


# --- server subprocesses -------------------------------------------------------


@dataclass
class ServerProcess:
    name: str
    pid: int
    address: str
    log_path: Path

    def problems(self) -> list[str]:
        """Warning and error lines the server logged so far."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if _PROBLEM.search(line)]


async def _stop_process(process: asyncio.subprocess.Process, name: str) -> int:
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
async def running_server(
    name: str, argv: Sequence[str], *, env: Mapping[str, str], log_path: Path
) -> AsyncIterator[ServerProcess]:
    """Starts a server subprocess, waits for its `listening on` line, and always SIGTERMs it."""
    with log_path.open("ab") as log:
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=ROOT,
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
        try:
            try:
                line = await asyncio.wait_for(stdout.readline(), START_TIMEOUT_S)
            except TimeoutError:
                raise BenchError(
                    f"{name} printed nothing in {START_TIMEOUT_S:.0f} s; see {log_path}"
                ) from None
            found = _BANNER.search(line.decode(errors="replace"))
            if found is None:
                raise BenchError(f"{name} did not start (first line {line!r}); see {log_path}")
            drainer = asyncio.create_task(drain())
            yield ServerProcess(name, process.pid, found.group(1), log_path)
        finally:
            code = await _stop_process(process, name)
            if drainer is not None:
                drainer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drainer
            if code != 0:
                print(f"warning: {name} exited with status {code}; see {log_path}", file=sys.stderr)


async def run_command(argv: Sequence[str], *, env: Mapping[str, str], limit_s: float) -> None:
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=ROOT,
        env=dict(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), limit_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise BenchError(f"{' '.join(argv)} took longer than {limit_s:.0f} s") from None
    if process.returncode != 0:
        raise BenchError(
            f"{' '.join(argv)} failed ({process.returncode}):\n{output.decode(errors='replace')}"
        )


# Held for a whole backend run: two benchmarks sharing the database would drop each other's schema.
_BENCH_LOCK_KEY = 0x61676E62656E6368  # "agnbench"


@contextlib.asynccontextmanager
async def exclusive_postgres(url: str) -> AsyncIterator[None]:
    """Creates the benchmark database if missing, locks it for this run, and drops its `im` schema."""
    target = make_url(url).set(drivername="postgresql+asyncpg")
    database = target.database or ""
    if "bench" not in database:
        # Dropping `im` in a database that tests (or people) use would destroy their data.
        raise BenchError(f"refusing to reset the im schema of {database!r}: use a database named *bench*")
    admin = create_async_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            exists = await conn.scalar(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": database}
            )
            if not exists:
                await conn.execute(sa.text(f'CREATE DATABASE "{database}"'))
    finally:
        await admin.dispose()
    engine = create_async_engine(target, isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=0)
    try:
        async with engine.connect() as conn:
            locked = await conn.scalar(sa.text("SELECT pg_try_advisory_lock(:key)"), {"key": _BENCH_LOCK_KEY})
            if not locked:
                raise BenchError(f"another benchmark is using the database {database!r}; try again later")
            try:
                await conn.execute(sa.text("DROP SCHEMA IF EXISTS im CASCADE"))
                yield
            finally:
                await conn.execute(sa.text("SELECT pg_advisory_unlock(:key)"), {"key": _BENCH_LOCK_KEY})
    finally:
        await engine.dispose()


# --- workloads -----------------------------------------------------------------


def _content(index: int) -> str:
    text = f"benchmark message from sender {index:02d}: "
    return (text + "lorem ipsum dolor sit amet " * 5)[:CONTENT_BYTES]


@dataclass(frozen=True)
class Sender:
    metadata: Metadata
    request: im_pb2.SendMessageRequest


async def setup_senders(stub: Any) -> list[Sender]:
    """One workspace, 32 members, and for each a group of 2-3 members to send to."""
    created = await stub.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(name="bench-send", creator_display_name="bench creator"),
        timeout=CALL_TIMEOUT_S,
    )
    creator = as_member(learned(created.creator))
    responses = await asyncio.gather(
        *(
            stub.CreateMember(
                im_pb2.CreateMemberRequest(kind=im_pb2.MEMBER_KIND_HUMAN, display_name=f"sender {i:02d}"),
                metadata=creator,
                timeout=CALL_TIMEOUT_S,
            )
            for i in range(SEND_MEMBERS)
        )
    )
    ids = [learned(r.member) for r in responses]
    n = len(ids)
    groups = await asyncio.gather(
        *(
            stub.CreateGroup(
                im_pb2.CreateGroupRequest(
                    name=f"send {i:02d}",
                    member_ids=[ids[(i + 1) % n], *([ids[(i + 2) % n]] if i % 2 else [])],
                ),
                metadata=as_member(ids[i]),
                timeout=CALL_TIMEOUT_S,
            )
            for i in range(n)
        )
    )
    return [
        Sender(
            as_member(ids[i]),
            im_pb2.SendMessageRequest(group_id=groups[i].group.id, content=_content(i)),
        )
        for i in range(n)
    ]


@dataclass(frozen=True)
class Reader:
    metadata: Metadata
    second_to_last: dict[str, str]


async def setup_reader(stub: Any) -> Reader:
    """A member of 50 groups holding 10,000 messages that others sent, all unread."""
    created = await stub.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(name="bench-unread", creator_display_name="bench reader"),
        timeout=CALL_TIMEOUT_S,
    )
    reader = as_member(learned(created.creator))
    authors = [
        learned(
            (
                await stub.CreateMember(
                    im_pb2.CreateMemberRequest(kind=im_pb2.MEMBER_KIND_HUMAN, display_name=f"author {i}"),
                    metadata=reader,
                    timeout=CALL_TIMEOUT_S,
                )
            ).member
        )
        for i in range(UNREAD_AUTHORS)
    ]
    group_ids = [
        (
            await stub.CreateGroup(
                im_pb2.CreateGroupRequest(
                    name=f"unread {g:02d}",
                    member_ids=[authors[g % UNREAD_AUTHORS], authors[(g + 1) % UNREAD_AUTHORS]],
                ),
                metadata=reader,
                timeout=CALL_TIMEOUT_S,
            )
        ).group.id
        for g in range(UNREAD_GROUPS)
    ]
    per_group = UNREAD_MESSAGES // UNREAD_GROUPS
    pending: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in enumerate(group_ids):
        pending.put_nowait(item)
    second_to_last: dict[str, str] = {}

    async def seed() -> None:
        # One worker per group at a time, so responses come back in send order.
        while not pending.empty():
            g, group_id = pending.get_nowait()
            last: list[str] = []
            for k in range(per_group):
                author = authors[(g + k % 2) % UNREAD_AUTHORS]
                sent = await stub.SendMessage(
                    im_pb2.SendMessageRequest(group_id=group_id, content=_content(k % 100)),
                    metadata=as_member(author),
                    timeout=CALL_TIMEOUT_S,
                )
                last = [*last[-1:], sent.message.id]
            second_to_last[group_id] = last[0]

    await asyncio.wait_for(asyncio.gather(*(seed() for _ in range(SEED_WORKERS))), SEED_TIMEOUT_S)
    return Reader(reader, second_to_last)


async def mark_all_but_last_read(stub: Any, reader: Reader) -> None:
    await asyncio.gather(
        *(
            stub.MarkRead(
                im_pb2.MarkReadRequest(group_id=group_id, up_to_message_id=message_id),
                metadata=reader.metadata,
                timeout=CALL_TIMEOUT_S,
            )
            for group_id, message_id in reader.second_to_last.items()
        )
    )


@dataclass
class UnreadSample:
    latencies_ms: list[float]
    returned: Counter[int]
    remaining: Counter[int]
    response_bytes: int
    mismatches: int

    def p(self, q: float) -> float:
        return percentile(sorted(self.latencies_ms), q)


async def measure_unread(stub: Any, reader: Reader, *, expect: tuple[int, int]) -> UnreadSample:
    """50 sequential GetAllUnread calls (after 3 unmeasured ones)."""
    request = im_pb2.GetAllUnreadRequest(page_size=UNREAD_PAGE)
    sample = UnreadSample([], Counter(), Counter(), 0, 0)
    for i in range(3 + UNREAD_CALLS):
        started = time.perf_counter()
        response = await stub.GetAllUnread(request, metadata=reader.metadata, timeout=UNREAD_TIMEOUT_S)
        elapsed = (time.perf_counter() - started) * 1000.0
        if i < 3:
            continue
        sample.latencies_ms.append(elapsed)
        got = (len(response.messages), response.remaining_count)
        sample.returned[got[0]] += 1
        sample.remaining[got[1]] += 1
        sample.response_bytes = response.ByteSize()
        sample.mismatches += got != expect
    return sample


# --- one backend -----------------------------------------------------------------


@dataclass
class BackendResult:
    backend: str
    echo: list[LoadSample] = field(default_factory=list)
    send1: list[LoadSample] = field(default_factory=list)
    send32: list[LoadSample] = field(default_factory=list)
    unread_all: list[UnreadSample] = field(default_factory=list)
    unread_typical: list[UnreadSample] = field(default_factory=list)
    seed_seconds: float = 0.0
    server_problems: list[str] = field(default_factory=list)
    profile: str | None = None

    def ratios(self) -> list[float]:
        return [
            s.throughput / e.throughput for s, e in zip(self.send32, self.echo, strict=True) if e.throughput
        ]


@dataclass(frozen=True)
class Options:
    backends: list[str]
    runs: int
    seconds: float
    warmup: float
    postgres_url: str
    profile_dir: Path | None
    profile_seconds: float
    profile_native: bool
    write_doc: bool
    mode: str = "full"


def _server_env(database_url: str, data_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("REDIS_URL", None)  # in-process event signals: one server, nothing else measured
    env.update(
        DATABASE_URL=database_url,
        IM_GRPC_ADDRESS="127.0.0.1:0",
        LOG_LEVEL="WARNING",
        AGENTIM_DATA_DIR=str(data_dir),
        PYTHONUNBUFFERED="1",
        # The test keys and credentials: the benchmark signs its members' access tokens with them.
        **credentials_environment(),
        # The path is measured, not the per-member rate limits (32 senders would hit them).
        LIMIT_SEND_PER_SECOND="0",
        LIMIT_CREATE_PER_SECOND="0",
    )
    return env


def _py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


async def profile_send(
    stub: Any, senders: list[Sender], server: ServerProcess, options: Options, backend: str
) -> str | None:
    """A dedicated SendMessage@32 run while py-spy samples the server."""
    assert options.profile_dir is not None
    tool = _py_spy()
    if tool is None:
        print("py-spy not found: no profile", file=sys.stderr)
        return None
    options.profile_dir.mkdir(parents=True, exist_ok=True)
    out = options.profile_dir / f"im-send32-{backend}.speedscope.json"
    seconds = max(1, round(options.profile_seconds))
    argv = [tool, "record", "-d", str(seconds), "-o", str(out), "--format", "speedscope", "--full-filenames"]
    # --native sees into C extensions and system calls, but must pause the process for each sample.
    argv += ["--native"] if options.profile_native else ["--nonblocking"]
    argv += ["--pid", str(server.pid)]

    async def send(i: int) -> object:
        s = senders[i % len(senders)]
        return await stub.SendMessage(s.request, metadata=s.metadata, timeout=CALL_TIMEOUT_S)

    load = asyncio.create_task(
        closed_loop(
            send, concurrency=CONCURRENCY, seconds=seconds + 2.0, warmup=options.warmup, server_pid=server.pid
        )
    )
    await asyncio.sleep(options.warmup + 0.5)
    spy = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        output, _ = await asyncio.wait_for(spy.communicate(), seconds + 30.0)
    except TimeoutError:
        spy.kill()
        await spy.wait()
        output = b"py-spy timed out"
    sample = await load
    if spy.returncode != 0 or not out.exists():
        print(f"py-spy failed: {output.decode(errors='replace')}", file=sys.stderr)
        return None
    print(
        f"[{backend}] profiled SendMessage@32: {sample.throughput:.0f} calls/s, "
        f"server {_cores(sample.server_cores)}; profile in {out}",
        flush=True,
    )
    return f"Profile file: `{out}` ({sample.throughput:.0f} calls/s while sampled).\n\n" + render(
        summarise(out)
    )


async def bench_backend(backend: str, echo: ServerProcess, options: Options, workdir: Path) -> BackendResult:
    data_dir = workdir / backend
    data_dir.mkdir(parents=True, exist_ok=True)
    async with contextlib.AsyncExitStack() as stack:
        if backend == "sqlite":
            database_url = f"sqlite:///{data_dir / 'im.db'}"
        else:
            await stack.enter_async_context(exclusive_postgres(options.postgres_url))
            database_url = options.postgres_url
        return await _bench_backend(backend, database_url, echo, options, workdir)


async def _bench_backend(
    backend: str, database_url: str, echo: ServerProcess, options: Options, workdir: Path
) -> BackendResult:
    data_dir = workdir / backend
    env = _server_env(database_url, data_dir)
    python = sys.executable
    await run_command([python, "-m", "services.im", "migrate"], env=env, limit_s=MIGRATE_TIMEOUT_S)
    result = BackendResult(backend)
    log_path = workdir / f"im-{backend}.log"
    async with (
        running_server(
            f"IM service ({backend})", [python, "-m", "services.im", "serve"], env=env, log_path=log_path
        ) as server,
        grpc.aio.insecure_channel(server.address) as im_channel,
        grpc.aio.insecure_channel(echo.address) as echo_channel,
    ):
        stub = im_pb2_grpc.IMServiceStub(im_channel)
        echo_call = echo_channel.unary_unary(echo_server.METHOD)
        senders = await setup_senders(stub)

        async def do_echo(i: int) -> object:
            return await echo_call(ECHO_PAYLOAD, timeout=CALL_TIMEOUT_S)

        async def do_send(i: int) -> object:
            s = senders[i]
            return await stub.SendMessage(s.request, metadata=s.metadata, timeout=CALL_TIMEOUT_S)

        async def measure(call: Callable[[int], Awaitable[object]], concurrency: int, pid: int) -> LoadSample:
            return await closed_loop(
                call, concurrency=concurrency, seconds=options.seconds, warmup=options.warmup, server_pid=pid
            )

        for run in range(1, options.runs + 1):
            # Interleaved, so that the ceiling and the service see the same noise.
            result.echo.append(await measure(do_echo, CONCURRENCY, echo.pid))
            result.send1.append(await measure(do_send, 1, server.pid))
            result.send32.append(await measure(do_send, CONCURRENCY, server.pid))
            e, s1, s32 = result.echo[-1], result.send1[-1], result.send32[-1]
            print(
                f"[{backend}] run {run}: echo@32 {e.throughput:.0f}/s, "
                f"SendMessage@1 {s1.throughput:.0f}/s p50 {s1.p(0.5):.2f} ms, "
                f"SendMessage@32 {s32.throughput:.0f}/s p50 {s32.p(0.5):.2f} ms p99 {s32.p(0.99):.2f} ms"
                + (f", errors {dict(s1.errors + s32.errors)}" if s1.errors or s32.errors else ""),
                flush=True,
            )

        started = time.perf_counter()
        reader = await setup_reader(stub)
        result.seed_seconds = time.perf_counter() - started
        print(f"[{backend}] seeded {UNREAD_MESSAGES} messages in {result.seed_seconds:.1f} s", flush=True)
        everything = (UNREAD_PAGE, UNREAD_MESSAGES - UNREAD_PAGE)
        for _ in range(options.runs):
            result.unread_all.append(await measure_unread(stub, reader, expect=everything))
        await mark_all_but_last_read(stub, reader)
        for _ in range(options.runs):
            result.unread_typical.append(await measure_unread(stub, reader, expect=(UNREAD_GROUPS, 0)))
        a, t = result.unread_all[-1], result.unread_typical[-1]
        print(
            f"[{backend}] GetAllUnread: all unread p50 {a.p(0.5):.1f} ms, 50 unread p50 {t.p(0.5):.1f} ms",
            flush=True,
        )

        if options.profile_dir is not None:
            result.profile = await profile_send(stub, senders, server, options, backend)
        result.server_problems = server.problems()
    return result


# --- wake mode: the calls an agent's wake goes through, one at a time --------------

WAKE_GROUPS = 3
WAKE_CALLS = 300


@dataclass
class WakeSample:
    """Latencies (ms) and server CPU per call (ms) of one wake-mode run."""

    echo_ms: list[float] = field(default_factory=list)
    unread_ms: list[float] = field(default_factory=list)
    unread_cpu_ms: float | None = None
    mark_ms: list[float] = field(default_factory=list)
    mark_cpu_ms: float | None = None
    send_ms: list[float] = field(default_factory=list)
    delivery_ms: list[float] = field(default_factory=list)
    send_cpu_ms: float | None = None
    mismatches: int = 0


async def _timed_calls(
    count: int, call: Callable[[int], Awaitable[object]], pid: int | None, into: list[float]
) -> float | None:
    """Runs `call` `count` times in a row (after 10 unmeasured); returns the server CPU ms per call."""
    for i in range(10):
        await call(-1 - i)
    before = _process_cpu_s(pid) if pid else None
    for i in range(count):
        started = time.perf_counter()
        await call(i)
        into.append((time.perf_counter() - started) * 1000.0)
    after = _process_cpu_s(pid) if pid else None
    return None if before is None or after is None else (after - before) * 1000.0 / count


async def measure_wake(stub: Any, echo_call: Any, server_pid: int) -> WakeSample:
    """One run: a reader with a few unread messages, an author, and a watch on the reader."""
    sample = WakeSample()
    created = await stub.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(name="bench-wake", creator_display_name="bench reader"),
        timeout=CALL_TIMEOUT_S,
    )
    reader = as_member(learned(created.creator))
    author_id = learned(
        (
            await stub.CreateMember(
                im_pb2.CreateMemberRequest(kind=im_pb2.MEMBER_KIND_AGENT, display_name="bench author"),
                metadata=reader,
                timeout=CALL_TIMEOUT_S,
            )
        ).member
    )
    author = as_member(author_id)
    groups = [
        (
            await stub.CreateGroup(
                im_pb2.CreateGroupRequest(name=f"wake {g}", member_ids=[author_id]),
                metadata=reader,
                timeout=CALL_TIMEOUT_S,
            )
        ).group.id
        for g in range(WAKE_GROUPS)
    ]

    async def send(group_id: str) -> Any:
        request = im_pb2.SendMessageRequest(group_id=group_id, content=_content(1))
        return (await stub.SendMessage(request, metadata=author, timeout=CALL_TIMEOUT_S)).message

    for group_id in groups:
        await send(group_id)

    await _timed_calls(
        WAKE_CALLS, lambda i: echo_call(ECHO_PAYLOAD, timeout=CALL_TIMEOUT_S), None, sample.echo_ms
    )

    unread_request = im_pb2.GetAllUnreadRequest()

    async def get_unread(i: int) -> object:
        response = await stub.GetAllUnread(unread_request, metadata=reader, timeout=CALL_TIMEOUT_S)
        sample.mismatches += (len(response.messages), response.remaining_count) != (WAKE_GROUPS, 0)
        return response

    sample.unread_cpu_ms = await _timed_calls(WAKE_CALLS, get_unread, server_pid, sample.unread_ms)

    # MarkRead of a fresh message each time, so each call moves and records an event.
    marks: list[im_pb2.MarkReadRequest] = []
    for i in range(WAKE_CALLS + 10):
        group_id = groups[i % WAKE_GROUPS]
        marks.append(im_pb2.MarkReadRequest(group_id=group_id, up_to_message_id=(await send(group_id)).id))
    mark_iter = iter(marks)

    async def mark(i: int) -> object:
        request = next(mark_iter)
        response = await stub.MarkRead(request, metadata=reader, timeout=CALL_TIMEOUT_S)
        sample.mismatches += response.read_state.last_read_message_id != request.up_to_message_id
        return response

    sample.mark_cpu_ms = await _timed_calls(WAKE_CALLS, mark, server_pid, sample.mark_ms)

    await measure_delivery(stub, reader, send=send, groups=groups, server_pid=server_pid, sample=sample)
    return sample


async def measure_delivery(
    stub: Any,
    reader: Metadata,
    *,
    send: Callable[[str], Awaitable[Any]],
    groups: list[str],
    server_pid: int,
    sample: WakeSample,
) -> None:
    """SendMessage returns, then the reader's watch receives the message: how long in between."""
    stream = stub.WatchEvents(im_pb2.WatchEventsRequest(), metadata=reader)
    await asyncio.wait_for(stream.wait_for_connection(), CALL_TIMEOUT_S)
    arrived: dict[str, float] = {}
    waiters: dict[str, asyncio.Future[float]] = {}

    async def watch() -> None:
        async for event in stream:
            if event.WhichOneof("event") == "message_created":
                message_id = event.message_created.message.id
                arrived[message_id] = time.perf_counter()
                waiter = waiters.pop(message_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(arrived[message_id])

    watcher = asyncio.create_task(watch())
    send_ms: list[float] = []

    async def send_and_deliver(i: int) -> object:
        group_id = groups[i % WAKE_GROUPS]
        started = time.perf_counter()
        message = await send(group_id)
        returned = time.perf_counter()
        if message.id in arrived:
            when = arrived[message.id]
        else:
            waiter: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            waiters[message.id] = waiter
            when = await asyncio.wait_for(waiter, CALL_TIMEOUT_S)
        if i >= 0:
            send_ms.append((returned - started) * 1000.0)
            sample.delivery_ms.append(max(0.0, when - returned) * 1000.0)
        return message

    try:
        sample.send_cpu_ms = await _timed_calls(WAKE_CALLS, send_and_deliver, server_pid, [])
    finally:
        stream.cancel()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await watcher
    sample.send_ms = send_ms


async def wake_backend(
    backend: str, echo: ServerProcess, options: Options, workdir: Path
) -> list[WakeSample]:
    data_dir = workdir / backend
    data_dir.mkdir(parents=True, exist_ok=True)
    async with contextlib.AsyncExitStack() as stack:
        if backend == "sqlite":
            database_url = f"sqlite:///{data_dir / 'im.db'}"
        else:
            await stack.enter_async_context(exclusive_postgres(options.postgres_url))
            database_url = options.postgres_url
        env = _server_env(database_url, data_dir)
        python = sys.executable
        await run_command([python, "-m", "services.im", "migrate"], env=env, limit_s=MIGRATE_TIMEOUT_S)
        samples: list[WakeSample] = []
        async with (
            running_server(
                f"IM service ({backend})",
                [python, "-m", "services.im", "serve"],
                env=env,
                log_path=workdir / f"im-wake-{backend}.log",
            ) as server,
            grpc.aio.insecure_channel(server.address) as im_channel,
            grpc.aio.insecure_channel(echo.address) as echo_channel,
        ):
            stub = im_pb2_grpc.IMServiceStub(im_channel)
            echo_call = echo_channel.unary_unary(echo_server.METHOD)
            for run in range(1, options.runs + 1):
                sample = await measure_wake(stub, echo_call, server.pid)
                samples.append(sample)
                print(f"[{backend}] wake run {run}: " + _wake_line(sample), flush=True)
            problems = server.problems()
            if problems:
                print(
                    f"[{backend}] the server logged {len(problems)} warning/error lines:",
                    *problems[:5],
                    sep="\n",
                )
        return samples


def _cpu(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _wake_line(s: WakeSample) -> str:
    def p50(values: list[float]) -> float:
        return percentile(sorted(values), 0.5)

    return (
        f"echo p50 {p50(s.echo_ms):.3f} ms; GetAllUnread p50 {p50(s.unread_ms):.3f} ms "
        f"(server CPU {_cpu(s.unread_cpu_ms)} ms/call); MarkRead p50 {p50(s.mark_ms):.3f} ms "
        f"(CPU {_cpu(s.mark_cpu_ms)}); SendMessage p50 {p50(s.send_ms):.3f} ms, then event delivery "
        f"p50 {p50(s.delivery_ms):.3f} ms p90 {percentile(sorted(s.delivery_ms), 0.9):.3f} ms "
        f"(send+deliver CPU {_cpu(s.send_cpu_ms)}); unexpected answers {s.mismatches}"
    )


def wake_report(backend: str, samples: list[WakeSample]) -> str:
    def row(name: str, values: list[list[float]], cpu: list[float | None]) -> str:
        p50s = [percentile(sorted(v), 0.5) for v in values]
        p90s = [percentile(sorted(v), 0.9) for v in values]
        return (
            f"| {name} | {median(p50s):.3f} | {min(p50s):.3f}-{max(p50s):.3f} | {median(p90s):.3f} "
            f"| {_cpu(_med_opt(cpu))} |"
        )

    return "\n".join(
        [
            f"### {backend}: one call at a time, median of {len(samples)} runs of {WAKE_CALLS} calls",
            "",
            "| Call | p50 ms (median) | p50 ms (min-max) | p90 ms | server CPU ms/call |",
            "|---|---:|---:|---:|---:|",
            row("echo (floor)", [s.echo_ms for s in samples], [None]),
            row(
                f"GetAllUnread ({WAKE_GROUPS} unread)",
                [s.unread_ms for s in samples],
                [s.unread_cpu_ms for s in samples],
            ),
            row(
                "MarkRead (moves, records ReadUpdated)",
                [s.mark_ms for s in samples],
                [s.mark_cpu_ms for s in samples],
            ),
            row("SendMessage", [s.send_ms for s in samples], [s.send_cpu_ms for s in samples]),
            row("SendMessage returned -> event at watcher", [s.delivery_ms for s in samples], [None]),
            "",
            f"Unexpected answers: {sum(s.mismatches for s in samples)}. The CPU of the last two rows is "
            "per message sent and delivered.",
            "",
        ]
    )


async def run_wake(options: Options) -> list[str]:
    workdir = Path(tempfile.mkdtemp(prefix="agentim-bench-wake-"))
    reports: list[str] = []
    try:
        async with running_server(
            "echo server",
            [sys.executable, "-m", "bench.echo_server", "--address", "127.0.0.1:0"],
            env=dict(os.environ),
            log_path=workdir / "echo.log",
        ) as echo:
            for backend in options.backends:
                reports.append(wake_report(backend, await wake_backend(backend, echo, options, workdir)))
    except BenchError as error:
        raise BenchError(f"{error}\n(server logs kept in {workdir})") from None
    shutil.rmtree(workdir, ignore_errors=True)
    return reports


# --- report ----------------------------------------------------------------------


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}"


def _cores(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def _med_opt(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return median(present) if present else None


def _load_row(name: str, samples: list[LoadSample], ratio: str) -> str:
    rates = [s.throughput for s in samples]
    errors = sum((s.errors for s in samples), Counter[str]())
    error_text = ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) or "0"
    return (
        f"| {name} | {median(rates):,.0f} | {min(rates):,.0f}-{max(rates):,.0f} "
        f"| {_ms(median([s.p(0.5) for s in samples]))} | {_ms(median([s.p(0.99) for s in samples]))} "
        f"| {_ms(max(s.max_ms for s in samples))} | {error_text} "
        f"| {_cores(_med_opt([s.server_cores for s in samples]))} "
        f"| {_cores(_med_opt([s.client_cores for s in samples]))} "
        f"| {_cores(_med_opt([s.machine_busy for s in samples]))} | {ratio} |"
    )


def _unread_row(name: str, samples: list[UnreadSample]) -> str:
    returned = sum((s.returned for s in samples), Counter[int]())
    remaining = sum((s.remaining for s in samples), Counter[int]())
    mismatches = sum(s.mismatches for s in samples)
    return (
        f"| {name} | {'/'.join(str(k) for k in sorted(returned))} "
        f"| {'/'.join(str(k) for k in sorted(remaining))} | {samples[-1].response_bytes / 1024:,.0f} "
        f"| {_ms(median([s.p(0.5) for s in samples]))} | {_ms(median([s.p(0.99) for s in samples]))} "
        f"| {_ms(max(max(s.latencies_ms) for s in samples))} | {mismatches} |"
    )


def backend_section(result: BackendResult, options: Options) -> list[str]:
    title = {"sqlite": "SQLite (WAL, aiosqlite)", "postgresql": "PostgreSQL (asyncpg)"}[result.backend]
    ratios = result.ratios()
    lines = [
        f"### {title}",
        "",
        "| Measurement | Calls/s (median) | Calls/s (min-max) | p50 ms | p99 ms | max ms | Errors "
        "| Server CPU | Client CPU | Machine busy | Ratio to echo@32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        _load_row("echo@32 (ceiling)", result.echo, "1.00"),
        _load_row("SendMessage@1", result.send1, "-"),
        _load_row(
            "SendMessage@32",
            result.send32,
            f"**{median(ratios):.2f}** ({', '.join(f'{r:.2f}' for r in ratios)})" if ratios else "n/a",
        ),
        "",
        f"GetAllUnread, page_size {UNREAD_PAGE}, for a member of {UNREAD_GROUPS} groups holding "
        f"{UNREAD_MESSAGES:,} messages ({UNREAD_CALLS} sequential calls per run; seeding through "
        f"SendMessage took {result.seed_seconds:.1f} s):",
        "",
        "| Case | Messages returned | remaining_count | Response KiB | p50 ms | p99 ms | max ms "
        "| Unexpected answers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        _unread_row(f"all {UNREAD_MESSAGES:,} unread (first page)", result.unread_all),
        _unread_row(f"typical: last message of each group unread ({UNREAD_GROUPS})", result.unread_typical),
        "",
    ]
    if result.server_problems:
        lines += [f"The server logged {len(result.server_problems)} warning/error lines, first ones:", ""]
        lines += [f"    {line}" for line in result.server_problems[:5]]
        lines.append("")
    else:
        lines += ["The server logged no warning or error.", ""]
    if result.profile:
        if options.profile_native:
            mode = "py-spy --native"
            caveat = (
                "Caveats: with --native py-spy pauses the process for each sample and cannot tell a "
                "thread blocked in a system call (epoll_wait, a futex wait in a worker thread) from a "
                "busy one, so waiting shows up as libc time."
            )
        else:
            mode = "py-spy --nonblocking"
            caveat = (
                "Caveats: without --native, time in C extensions entered from the event loop (grpc's "
                "Cython callbacks, asyncpg's protocol, the socket writes they trigger) shows as asyncio "
                "`Handle._run` or transport frames; run with --profile-native to see into them."
            )
        caveat += (
            " py-spy judges idleness from the thread's state at the instant of the sample, and threads "
            "that wake thousands of times a second (the event loop's select, aiosqlite's worker queue) "
            "are often caught as active while they wait: the active seconds can exceed the Server CPU "
            "measured above, so read samples at those waits as waiting, not work."
        )
        lines += [
            f"#### Server CPU profile during SendMessage@32 ({mode})",
            "",
            caveat,
            "",
            result.profile,
            "",
        ]
    return lines


def targets(results: list[BackendResult]) -> list[str]:
    postgres = next((r for r in results if r.backend == "postgresql"), None)
    lines = ["### Targets (issue 2)", ""]
    if postgres is None:
        return [*lines, "Not evaluated: PostgreSQL was not measured in this run.", ""]
    ratio = median(postgres.ratios())
    p99 = median([s.p(0.99) for s in postgres.send32])
    ratio_met = ratio >= TARGET_RATIO
    p99_met = p99 < TARGET_P99_MS
    return [
        *lines,
        "| Target | Measured | Status |",
        "|---|---:|---|",
        f"| SendMessage on PostgreSQL at 32 clients reaches at least half of the echo ceiling "
        f"measured in the same run | {ratio:.2f} x echo@32 | {'met' if ratio_met else '**not met**'} |",
        f"| SendMessage on PostgreSQL at 32 clients: p99 under {TARGET_P99_MS:.0f} ms | {p99:.2f} ms "
        f"| {'met' if p99_met else '**not met**'} |",
        "",
    ]


def code_version() -> str:
    """The commit the servers ran from, flagged if the service code had uncommitted changes."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "services", "protos", "gen"],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (git unavailable)"
    if not commit:
        return "unknown (not a git checkout)"
    return f"{commit} with uncommitted changes to the service" if dirty else commit


def render_section(
    results: list[BackendResult], options: Options, command: str, versions: tuple[str, str]
) -> str:
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    lines = [
        SECTION,
        "",
        f"Command: `{command}`",
        "",
        f"Code: {versions[0]}"
        + (
            ""
            if versions[0] == versions[1]
            else f" at the start, {versions[1]} at the end (it changed during the run!)"
        )
        + ".",
        "",
        f"Date: {now}. Machine: {os.cpu_count()} cores, {platform.platform()}, Python "
        f"{platform.python_version()}, grpcio {grpc.__version__}; load average at the end "
        f"{load[0]:.2f}. The machine is shared and noisy, and its 2 cores run the client, the "
        "server under test and PostgreSQL together, so read the figures as orders of magnitude "
        "and compare rows of the same run rather than across runs.",
        "",
        f"Method: closed loop, N asyncio workers in the benchmark process calling back-to-back on one "
        f"shared channel for {options.seconds:g} s after a {options.warmup:g} s warm-up; each figure is "
        f"the median of {options.runs} runs (min-max of throughput shown). The ceiling is "
        "`bench/echo_server.py`, a bare grpc.aio unary echo (100-byte payload, same server options) in "
        "its own process, measured in each run right before SendMessage; the ratio is SendMessage@32 over "
        "echo@32 of the same run (median, then each run). SendMessage: one workspace of 32 members, each "
        f"worker sends {CONTENT_BYTES}-byte messages as its own member into its own group of 2-3 members. "
        "The IM server runs as a subprocess with LOG_LEVEL=WARNING and in-process event signals (no Redis); "
        "Server CPU is the server process's CPU time over the window and Client CPU the benchmark "
        "process's (100% = one core); Machine busy is the share of both cores in use.",
        "",
    ]
    for result in results:
        lines += backend_section(result, options)
    lines += targets(results)
    return "\n".join(lines).rstrip() + "\n"


def update_doc(path: Path, section: str) -> None:
    """Replaces (or appends) this benchmark's section, keeping the file's other sections."""
    if path.exists():
        text = path.read_text()
        start = text.find(SECTION)
        if start < 0:
            text = text.rstrip() + "\n\n" + section
        else:
            following = re.compile(r"^## ", re.MULTILINE).search(text, start + len(SECTION))
            rest = text[following.start() :] if following else ""
            text = text[:start] + section + ("\n" + rest if rest else "")
    else:
        text = (
            "# Benchmarks\n\nMeasured performance of the Agent IM services. Each section is written by its "
            "benchmark script and regenerated when the script runs again.\n\n" + section
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --- entry point -----------------------------------------------------------------


async def run(options: Options) -> list[BackendResult]:
    # Kept when something fails, for the servers' logs; removed after a clean run.
    workdir = Path(tempfile.mkdtemp(prefix="agentim-bench-"))
    results: list[BackendResult] = []
    try:
        async with running_server(
            "echo server",
            [sys.executable, "-m", "bench.echo_server", "--address", "127.0.0.1:0"],
            env=dict(os.environ),
            log_path=workdir / "echo.log",
        ) as echo:
            for backend in options.backends:
                results.append(await bench_backend(backend, echo, options, workdir))
    except BenchError as error:
        raise BenchError(f"{error}\n(server logs kept in {workdir})") from None
    shutil.rmtree(workdir, ignore_errors=True)
    return results


def parse_options(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench.im_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mode",
        choices=("full", "wake"),
        default="full",
        help="full: throughput and GetAllUnread of a big backlog (writes the doc); "
        "wake: one-at-a-time latency and server CPU of GetAllUnread, MarkRead and event delivery "
        "(prints only)",
    )
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: sqlite,postgresql")
    parser.add_argument("--runs", type=int, default=3, help="repetitions of each measurement (medians)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per closed-loop run")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each run")
    parser.add_argument(
        "--postgres-url",
        default=DEFAULT_POSTGRES_URL,
        help="benchmark database (created if missing; its im schema is dropped first)",
    )
    parser.add_argument(
        "--profile-dir",
        type=Path,
        help="also profile the server with py-spy during a dedicated SendMessage@32 run per backend",
    )
    parser.add_argument("--profile-seconds", type=float, default=5.0, help="py-spy sampling duration")
    parser.add_argument(
        "--profile-native",
        action="store_true",
        help="py-spy --native (C extensions and system calls; pauses the server for each sample)",
    )
    parser.add_argument("--no-doc", action="store_true", help=f"do not update {DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        parser.error(f"--backends: expected some of {','.join(BACKENDS)}, got {args.backends!r}")
    if args.runs < 1 or args.seconds <= 0 or args.warmup < 0 or args.profile_seconds <= 0:
        parser.error("--runs must be >= 1, --seconds and --profile-seconds > 0, --warmup >= 0")
    return Options(
        backends=backends,
        runs=args.runs,
        seconds=args.seconds,
        warmup=args.warmup,
        postgres_url=args.postgres_url,
        profile_dir=args.profile_dir,
        profile_seconds=args.profile_seconds,
        profile_native=args.profile_native,
        write_doc=not args.no_doc,
        mode=args.mode,
    )


def main(argv: Sequence[str] | None = None) -> None:
    options = parse_options(argv)
    arguments = list(sys.argv[1:] if argv is None else argv)
    command = " ".join([".venv/bin/python -m bench.im_bench", *arguments])
    started = time.perf_counter()
    if options.mode == "wake":
        try:
            reports = asyncio.run(run_wake(options))
        except BenchError as error:
            raise SystemExit(f"benchmark failed: {error}") from None
        print()
        print("\n".join(reports))
        print(f"total time {time.perf_counter() - started:.0f} s")
        return
    # Other people may commit while this runs: record what the servers ran from.
    version_before = code_version()
    try:
        results = asyncio.run(run(options))
    except BenchError as error:
        raise SystemExit(f"benchmark failed: {error}") from None
    section = render_section(results, options, command, (version_before, code_version()))
    print()
    print(section)
    if options.write_doc:
        update_doc(DOC, section)
        print(f"updated {DOC.relative_to(ROOT)}")
    print(f"total time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
