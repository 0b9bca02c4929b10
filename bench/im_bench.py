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
import shutil
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from agentim.im.v1 import im_pb2
from bench import echo_server
from bench.calls import (
    CONTENT_BYTES,
    Metadata,
    Sender,
    learned,
    message_content,
    setup_senders,
)
from bench.harness import (
    PYTHON,
    BenchError,
    LoadSample,
    Service,
    add_backend_options,
    backend_on,
    closed_loop,
    code_version,
    listed,
    process_cpu_s,
    running,
    scratch,
)
from bench.report import Recorded, add_doc_option, fixed, percent, run_and_record, status, table_head
from bench.speedscope import render, summarise
from bench.stats import median, percentile
from tests.identities import as_member

SECTION = "## IM service (issue 2)"
BACKENDS = ("sqlite", "postgresql")
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/agentim_bench"

CONCURRENCY = 32
ECHO_PAYLOAD = b"x" * CONTENT_BYTES
UNREAD_GROUPS = 50
UNREAD_MESSAGES = 10_000
UNREAD_AUTHORS = 4
UNREAD_PAGE = 1000
UNREAD_CALLS = 50
SEED_WORKERS = 16

CALL_TIMEOUT_S = 10.0
UNREAD_TIMEOUT_S = 30.0
SEED_TIMEOUT_S = 180.0
TARGET_RATIO = 0.5
TARGET_P99_MS = 20.0


# --- workloads -----------------------------------------------------------------


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
                    im_pb2.SendMessageRequest(group_id=group_id, content=message_content(k % 100)),
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
        return percentile(self.latencies_ms, q)


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


def _py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


async def profile_send(
    stub: Any, senders: list[Sender], server: Service, options: Options, backend: str
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
        f"server {percent(sample.server_cores)}; profile in {out}",
        flush=True,
    )
    return f"Profile file: `{out}` ({sample.throughput:.0f} calls/s while sampled).\n\n" + render(
        summarise(out)
    )


async def im_service(
    stack: contextlib.AsyncExitStack, backend: str, options: Options, workdir: Path, *, log_name: str
) -> tuple[Service, Any]:
    """The IM service on a new database of the backend (in-process event
    signals: one server, nothing else measured) and a stub of it, for the rest of `stack`."""
    on = await backend_on(stack, backend, workdir=workdir, postgres_url=options.postgres_url)
    await on.migrate(runtime=False)
    server = await on.start_im(stack, name=f"IM service ({backend})", log_path=workdir / log_name)
    return server, on.im_stub


async def bench_backend(backend: str, echo: Service, options: Options, workdir: Path) -> BackendResult:
    result = BackendResult(backend)
    async with contextlib.AsyncExitStack() as stack:
        server, stub = await im_service(stack, backend, options, workdir, log_name=f"im-{backend}.log")
        echo_channel = await stack.enter_async_context(grpc.aio.insecure_channel(echo.address))
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
        result.server_problems = server.problem_lines()
    return result


# --- wake mode: the calls an agent's wake goes through, one at a time --------------

WAKE_GROUPS = 3
WAKE_CALLS = 300


@dataclass
class WakeSample:
    """Latencies (ms) and server CPU per call (ms) of one wake-mode run."""

    echo_ms: list[float] = field(default_factory=list)
    unread_ms: list[float] = field(default_factory=list)
    unread_cpu_ms: float = float("nan")
    mark_ms: list[float] = field(default_factory=list)
    mark_cpu_ms: float = float("nan")
    send_ms: list[float] = field(default_factory=list)
    delivery_ms: list[float] = field(default_factory=list)
    send_cpu_ms: float = float("nan")
    mismatches: int = 0


async def _timed_calls(
    count: int, call: Callable[[int], Awaitable[object]], pid: int | None, into: list[float]
) -> float:
    """Runs `call` `count` times in a row (after 10 unmeasured); returns the
    server CPU ms per call (nan without a server)."""
    for i in range(10):
        await call(-1 - i)
    before = process_cpu_s(pid) if pid else math.nan
    for i in range(count):
        started = time.perf_counter()
        await call(i)
        into.append((time.perf_counter() - started) * 1000.0)
    after = process_cpu_s(pid) if pid else math.nan
    return (after - before) * 1000.0 / count


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
        request = im_pb2.SendMessageRequest(group_id=group_id, content=message_content(1))
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


async def wake_backend(backend: str, echo: Service, options: Options, workdir: Path) -> list[WakeSample]:
    samples: list[WakeSample] = []
    async with contextlib.AsyncExitStack() as stack:
        server, stub = await im_service(stack, backend, options, workdir, log_name=f"im-wake-{backend}.log")
        echo_channel = await stack.enter_async_context(grpc.aio.insecure_channel(echo.address))
        echo_call = echo_channel.unary_unary(echo_server.METHOD)
        for run in range(1, options.runs + 1):
            sample = await measure_wake(stub, echo_call, server.pid)
            samples.append(sample)
            print(f"[{backend}] wake run {run}: " + _wake_line(sample), flush=True)
        problems = server.problem_lines()
        if problems:
            print(
                f"[{backend}] the server logged {len(problems)} warning/error lines:",
                *problems[:5],
                sep="\n",
            )
        return samples


def _wake_line(s: WakeSample) -> str:
    def p50(values: list[float]) -> float:
        return percentile(values, 0.5)

    return (
        f"echo p50 {p50(s.echo_ms):.3f} ms; GetAllUnread p50 {p50(s.unread_ms):.3f} ms "
        f"(server CPU {fixed(s.unread_cpu_ms)} ms/call); MarkRead p50 {p50(s.mark_ms):.3f} ms "
        f"(CPU {fixed(s.mark_cpu_ms)}); SendMessage p50 {p50(s.send_ms):.3f} ms, then event delivery "
        f"p50 {p50(s.delivery_ms):.3f} ms p90 {percentile(s.delivery_ms, 0.9):.3f} ms "
        f"(send+deliver CPU {fixed(s.send_cpu_ms)}); unexpected answers {s.mismatches}"
    )


def wake_report(backend: str, samples: list[WakeSample]) -> str:
    def row(name: str, values: list[list[float]], cpu: list[float]) -> str:
        p50s = [percentile(v, 0.5) for v in values]
        p90s = [percentile(v, 0.9) for v in values]
        return (
            f"| {name} | {median(p50s):.3f} | {min(p50s):.3f}-{max(p50s):.3f} | {median(p90s):.3f} "
            f"| {fixed(median(cpu))} |"
        )

    return "\n".join(
        [
            f"### {backend}: one call at a time, median of {len(samples)} runs of {WAKE_CALLS} calls",
            "",
            *table_head("Call", "p50 ms (median)", "p50 ms (min-max)", "p90 ms", "server CPU ms/call"),
            row("echo (floor)", [s.echo_ms for s in samples], [math.nan]),
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
            row("SendMessage returned -> event at watcher", [s.delivery_ms for s in samples], [math.nan]),
            "",
            f"Unexpected answers: {sum(s.mismatches for s in samples)}. The CPU of the last two rows is "
            "per message sent and delivered.",
            "",
        ]
    )


async def run_wake(options: Options) -> list[str]:
    with scratch("agentim-bench-wake-") as workdir:
        async with _echo_server(workdir.path) as echo:
            return [
                wake_report(backend, await wake_backend(backend, echo, options, workdir.path))
                for backend in options.backends
            ]


def _echo_server(workdir: Path) -> contextlib.AbstractAsyncContextManager[Service]:
    """`bench.echo_server`, the ceiling: a bare grpc.aio echo with the IM's server options."""
    return running(
        "echo server",
        [PYTHON, "-m", "bench.echo_server", "--address", "127.0.0.1:0"],
        env=dict(os.environ),
        log_path=workdir / "echo.log",
    )


# --- report ----------------------------------------------------------------------


def _load_row(name: str, samples: list[LoadSample], ratio: str) -> str:
    rates = [s.throughput for s in samples]
    errors = sum((s.errors for s in samples), Counter[str]())
    error_text = ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) or "0"
    return (
        f"| {name} | {median(rates):,.0f} | {min(rates):,.0f}-{max(rates):,.0f} "
        f"| {fixed(median([s.p(0.5) for s in samples]))} | {fixed(median([s.p(0.99) for s in samples]))} "
        f"| {fixed(max(s.max_ms for s in samples))} | {error_text} "
        f"| {percent(median([s.server_cores for s in samples]))} "
        f"| {percent(median([s.client_cores for s in samples]))} "
        f"| {percent(median([s.machine_busy for s in samples]))} | {ratio} |"
    )


def _unread_row(name: str, samples: list[UnreadSample]) -> str:
    returned = sum((s.returned for s in samples), Counter[int]())
    remaining = sum((s.remaining for s in samples), Counter[int]())
    mismatches = sum(s.mismatches for s in samples)
    return (
        f"| {name} | {'/'.join(str(k) for k in sorted(returned))} "
        f"| {'/'.join(str(k) for k in sorted(remaining))} | {samples[-1].response_bytes / 1024:,.0f} "
        f"| {fixed(median([s.p(0.5) for s in samples]))} | {fixed(median([s.p(0.99) for s in samples]))} "
        f"| {fixed(max(max(s.latencies_ms) for s in samples))} | {mismatches} |"
    )


def backend_section(result: BackendResult, options: Options) -> list[str]:
    title = {"sqlite": "SQLite (WAL, aiosqlite)", "postgresql": "PostgreSQL (asyncpg)"}[result.backend]
    ratios = result.ratios()
    lines = [
        f"### {title}",
        "",
        *table_head(
            "Measurement",
            "Calls/s (median)",
            "Calls/s (min-max)",
            "p50 ms",
            "p99 ms",
            "max ms",
            "Errors",
            "Server CPU",
            "Client CPU",
            "Machine busy",
            "Ratio to echo@32",
        ),
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
        *table_head(
            "Case",
            "Messages returned",
            "remaining_count",
            "Response KiB",
            "p50 ms",
            "p99 ms",
            "max ms",
            "Unexpected answers",
        ),
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
        *table_head("Target", "Measured", "Status", align="lrl"),
        f"| SendMessage on PostgreSQL at 32 clients reaches at least half of the echo ceiling "
        f"measured in the same run | {ratio:.2f} x echo@32 | {status(ratio_met)} |",
        f"| SendMessage on PostgreSQL at 32 clients: p99 under {TARGET_P99_MS:.0f} ms | {p99:.2f} ms "
        f"| {status(p99_met)} |",
        "",
    ]


def render_section(results: list[BackendResult], options: Options, recorded: Recorded) -> str:
    command, versions = recorded.command, recorded.versions
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


# --- entry point -----------------------------------------------------------------


async def run(options: Options) -> tuple[list[BackendResult], str]:
    # Other people may commit while this runs: record what the servers ran from.
    version = code_version()
    with scratch("agentim-bench-") as workdir:
        async with _echo_server(workdir.path) as echo:
            results = [
                await bench_backend(backend, echo, options, workdir.path) for backend in options.backends
            ]
    return results, version


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
    add_backend_options(parser, backends=BACKENDS, postgres_url=DEFAULT_POSTGRES_URL, snapshot=False)
    parser.add_argument("--runs", type=int, default=3, help="repetitions of each measurement (medians)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per closed-loop run")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each run")
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
    add_doc_option(parser)
    args = parser.parse_args(argv)
    backends = listed(parser, "--backends", args.backends, BACKENDS)
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
    if options.mode == "wake":
        started = time.perf_counter()
        try:
            reports = asyncio.run(run_wake(options))
        except BenchError as error:
            raise SystemExit(f"benchmark failed: {error}") from None
        print()
        print("\n".join(reports))
        print(f"total time {time.perf_counter() - started:.0f} s")
        return
    run_and_record("bench.im_bench", argv, options, run=run, render=render_section, title=SECTION)


if __name__ == "__main__":
    main()
