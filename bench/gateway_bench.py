"""Benchmark of the HTTP gateway (issue 4): what SSE through the gateway adds,
and how many concurrent SSE clients one gateway process carries.

Every server runs as its own subprocess on a free loopback port, on the
embedded default (SQLite, in-process signals), started by `bench.harness`
as `bench.runtime_bench` starts them: the IM service, the runtime,
`bench.llm_server` (the fake OpenAI server) and the gateway (`python -m
gateway serve`). The clients are this process. Times of different processes
are compared on CLOCK_MONOTONIC (`time.monotonic_ns()`), system-wide on
Linux.

1. Streamed deltas: an agent whose model is the fake server's
   `bench-timed-<n>-<gap_us>` streams n deltas, each carrying the time it was
   written. Two watchers of the same run, side by side in this process: the
   runtime's gRPC WatchAgent stream and the gateway's SSE
   `/v1/agents/{id}/events`. Each takes its receive time minus the stamp;
   the gateway's added latency is the SSE latency minus the gRPC latency of
   the same delta.
2. Concurrent SSE clients: N members of one group, each with its own
   `/v1/events` stream through the gateway (one gRPC stream each to the IM);
   a person sends `--broadcasts` messages to the group, one a second. The
   delivery latency of a message is a client's receive time minus the moment
   SendMessage was called; also the gateway's RSS idle, with the N streams
   open, and after the broadcasts.

Run as `python -m bench.gateway_bench [--runs 3] [--clients 100,1000,5000]
[--no-doc]`. The result is printed and written to the `## Gateway (issue 4)`
section at the end of docs/benchmarks.md (other sections are kept).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from bench.calls import (
    CALL_TIMEOUT_S,
    SETTLE_S,
    bounded,
    create_agent,
    delete_agents,
    direct_chat,
    open_watch,
    send,
    until_run_ended,
)
from bench.harness import (
    PYTHON,
    BenchError,
    Clients,
    backend_on,
    code_version,
    rss_mib,
    running,
)
from bench.report import Recorded, add_doc_option, run_and_record, table_head
from bench.stats import median, ms, percentile
from tests.identities import as_member, learn_member, member_token

T = TypeVar("T")

SECTION = "## Gateway (issue 4)"
DELTA_COUNT = 1000
DELTA_GAP_US = 1000
CLIENT_LEVELS = (100, 1000, 5000)
CONNECT_CONCURRENCY = 200
CREATE_CONCURRENCY = 64
BROADCAST_GAP_S = 1.0
DELIVERY_TIMEOUT_S = 60.0


# --- SSE client -----------------------------------------------------------------------


async def sse_events(response: aiohttp.ClientResponse) -> Any:
    """Yields (kind, data, received_ns) for each event of an open SSE response."""
    kind, data = "message", ""
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif not line and data:
            yield kind, data, time.monotonic_ns()
            kind, data = "message", ""


def bearer(member: str) -> dict[str, str]:
    """The member's access token, as a program sends it to the gateway."""
    return {"Authorization": f"Bearer {member_token(member)}"}


# --- 1. streamed deltas ------------------------------------------------------------------


@dataclass
class DeltaSample:
    grpc_ms: list[float] = field(default_factory=list)
    sse_ms: list[float] = field(default_factory=list)
    added_ms: list[float] = field(default_factory=list)


async def delta_run(
    clients: Clients, http: aiohttp.ClientSession, *, gateway: str, person: str, fake_url: str, run: int
) -> DeltaSample:
    model = rpb.ModelSettings(base_url=fake_url, model=f"bench-timed-{DELTA_COUNT}-{DELTA_GAP_US}")
    agent = await create_agent(clients, person, f"gw-timed-{run}", model=model)
    await asyncio.sleep(SETTLE_S)
    chat = await direct_chat(clients, person, agent.member_id)
    by_grpc: dict[int, int] = {}
    by_sse: dict[int, int] = {}

    def on_grpc(event: Any, received: int) -> None:
        if event.WhichOneof("event") == "step_delta" and event.step_delta.WhichOneof("delta") == "content":
            for stamp in event.step_delta.content.split(";"):
                if stamp:
                    by_grpc[int(stamp)] = received

    async def watch_sse(response: aiohttp.ClientResponse) -> None:
        async for kind, data, received in sse_events(response):
            if kind == "step_delta":
                content = json.loads(data)["event"]["stepDelta"].get("content", "")
                for stamp in content.split(";"):
                    if stamp:
                        by_sse[int(stamp)] = received
            elif kind == "run_ended":
                return

    url = f"http://{gateway}/v1/agents/{agent.id}/events"
    params = {"live_only": "true"}
    async with http.get(
        url, params=params, headers=bearer(person), timeout=aiohttp.ClientTimeout(total=None)
    ) as response:
        if response.status != 200:
            raise BenchError(f"SSE refused: {response.status} {await response.text()}")
        await response.content.readuntil(b"\n\n")  # the opening: subscribed
        call = await open_watch(clients, person, agent.id)
        try:
            sse_task = asyncio.create_task(watch_sse(response))
            await send(clients, person, chat, "stream to me")
            await until_run_ended(call, on_grpc)
            await asyncio.wait_for(sse_task, CALL_TIMEOUT_S)
        finally:
            call.cancel()
    await delete_agents(clients, person, [agent])
    sample = DeltaSample()
    for stamp, received in by_grpc.items():
        sample.grpc_ms.append(ms(received - stamp))
        if stamp in by_sse:
            sample.sse_ms.append(ms(by_sse[stamp] - stamp))
            sample.added_ms.append(ms(by_sse[stamp] - received))
    if len(sample.sse_ms) != DELTA_COUNT or len(sample.grpc_ms) != DELTA_COUNT:
        print(f"warning: run {run}: gRPC got {len(by_grpc)}, SSE got {len(by_sse)} of {DELTA_COUNT} deltas")
    return sample


# --- 2. concurrent SSE clients ---------------------------------------------------------------


@dataclass
class FanOutSample:
    clients: int
    connected_s: float
    rss_idle_mib: float
    rss_open_mib: float
    rss_after_mib: float
    # Per broadcast: delivery latencies (ms) to every client, and how many got it.
    latencies: list[list[float]] = field(default_factory=list)
    delivered: list[int] = field(default_factory=list)


async def _all(calls: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Runs the calls, at most `limit` at a time; every one must succeed."""
    results, errors = await bounded(calls, limit)
    if errors:
        raise BenchError(f"calls failed: {dict(errors)}")
    return results


async def fan_out(
    im: Any, http: aiohttp.ClientSession, *, gateway: str, gateway_pid: int, count: int, broadcasts: int
) -> FanOutSample:
    created = await im.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(name=f"fan-{count}", creator_display_name="sender"),
        timeout=CALL_TIMEOUT_S,
    )
    learn_member(created.creator)
    sender = created.creator.id

    async def member(index: int) -> str:
        response = await im.CreateMember(
            im_pb2.CreateMemberRequest(kind=im_pb2.MEMBER_KIND_HUMAN, display_name=f"reader-{index}"),
            metadata=as_member(sender),
            timeout=CALL_TIMEOUT_S,
        )
        learn_member(response.member)
        return str(response.member.id)

    readers = await _all([partial(member, i) for i in range(count)], CREATE_CONCURRENCY)
    group = (
        await im.CreateGroup(
            im_pb2.CreateGroupRequest(name="all"), metadata=as_member(sender), timeout=CALL_TIMEOUT_S
        )
    ).group.id
    for start in range(0, count, 500):
        await im.AddGroupMembers(
            im_pb2.AddGroupMembersRequest(group_id=group, member_ids=readers[start : start + 500]),
            metadata=as_member(sender),
            timeout=CALL_TIMEOUT_S,
        )
    rss_idle = rss_mib(gateway_pid)
    received: dict[int, list[int]] = {b: [] for b in range(broadcasts)}
    all_in: dict[int, asyncio.Event] = {b: asyncio.Event() for b in range(broadcasts)}
    opened = 0
    responses: list[aiohttp.ClientResponse] = []

    async def connect(reader: str) -> None:
        nonlocal opened
        response = await http.get(
            f"http://{gateway}/v1/events",
            headers=bearer(reader),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CALL_TIMEOUT_S),
        )
        if response.status != 200:
            raise BenchError(f"SSE refused: {response.status} {await response.text()}")
        await response.content.readuntil(b"\n\n")
        responses.append(response)
        opened += 1

    async def listen(response: aiohttp.ClientResponse) -> None:
        with contextlib.suppress(aiohttp.ClientError, asyncio.CancelledError):
            async for kind, data, at in sse_events(response):
                if kind == "message_created":
                    index = int(json.loads(data)["messageCreated"]["message"]["content"].split("-")[1])
                    received[index].append(at)
                    if len(received[index]) == count:
                        all_in[index].set()

    started = time.perf_counter()
    await _all([partial(connect, r) for r in readers], CONNECT_CONCURRENCY)
    connected_s = time.perf_counter() - started
    listeners = [asyncio.create_task(listen(r)) for r in responses]
    await asyncio.sleep(1.0)
    rss_open = rss_mib(gateway_pid)
    sample = FanOutSample(count, connected_s, rss_idle, rss_open, float("nan"))
    try:
        for index in range(broadcasts):
            sent_at = time.monotonic_ns()
            await im.SendMessage(
                im_pb2.SendMessageRequest(group_id=group, content=f"broadcast-{index}"),
                metadata=as_member(sender),
                timeout=CALL_TIMEOUT_S,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_in[index].wait(), DELIVERY_TIMEOUT_S)
            sample.latencies.append(sorted(ms(at - sent_at) for at in received[index]))
            sample.delivered.append(len(received[index]))
            await asyncio.sleep(BROADCAST_GAP_S)
        sample.rss_after_mib = rss_mib(gateway_pid)
    finally:
        for task in listeners:
            task.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)
        for response in responses:
            response.close()
    return sample


# --- driver ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    runs: int
    clients: list[int]
    broadcasts: int
    write_doc: bool


@dataclass
class Result:
    deltas: list[DeltaSample] = field(default_factory=list)
    fan_out: list[FanOutSample] = field(default_factory=list)
    rss_start_mib: float = float("nan")


async def run(options: Options) -> tuple[Result, str]:
    result = Result()
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmp:
        workdir = Path(tmp)
        async with contextlib.AsyncExitStack() as stack:
            backend = await backend_on(stack, "embedded", workdir=workdir)
            backend.im_settings["IM_MAX_GROUP_MEMBERS"] = str(max(options.clients) + 10)
            await backend.migrate()
            im = await backend.start_im(stack, name="IM service", log_path=workdir / "im.log")
            llm = await stack.enter_async_context(backend.llm(log_path=workdir / "llm.log"))
            runtime, clients = await stack.enter_async_context(
                backend.runtime("runtime", log_path=workdir / "runtime.log")
            )
            gateway_env = {
                **backend.base_env(),
                "GATEWAY_HTTP_ADDRESS": "127.0.0.1:0",
                "IM_ADDRESS": im.address,
                "RUNTIME_ADDRESS": runtime.address,
            }
            gateway = await stack.enter_async_context(
                running(
                    "gateway",
                    [PYTHON, "-m", "gateway", "serve"],
                    env=gateway_env,
                    log_path=workdir / "gateway.log",
                )
            )
            await asyncio.sleep(1.0)
            result.rss_start_mib = rss_mib(gateway.pid)
            connector = aiohttp.TCPConnector(limit=0)
            http = await stack.enter_async_context(aiohttp.ClientSession(connector=connector))
            creator = (
                await clients.im.CreateWorkspace(
                    im_pb2.CreateWorkspaceRequest(name="deltas", creator_display_name="person"),
                    timeout=CALL_TIMEOUT_S,
                )
            ).creator
            learn_member(creator)
            person = creator.id
            for index in range(options.runs):
                sample = await delta_run(
                    clients,
                    http,
                    gateway=gateway.address,
                    person=person,
                    fake_url=f"http://{llm.address}/v1",
                    run=index,
                )
                result.deltas.append(sample)
                print(
                    f"deltas run {index + 1}: gRPC p50 {percentile(sample.grpc_ms, 0.5):.3f} ms, "
                    f"SSE p50 {percentile(sample.sse_ms, 0.5):.3f} ms, "
                    f"added p50 {percentile(sample.added_ms, 0.5):.3f} ms "
                    f"p99 {percentile(sample.added_ms, 0.99):.3f} ms",
                    flush=True,
                )
            for count in options.clients:
                fan = await fan_out(
                    clients.im,
                    http,
                    gateway=gateway.address,
                    gateway_pid=gateway.pid,
                    count=count,
                    broadcasts=options.broadcasts,
                )
                result.fan_out.append(fan)
                print(
                    f"{count} clients: connected in {fan.connected_s:.1f} s; delivered {fan.delivered}; "
                    f"p50 {median(percentile(lat, 0.5) for lat in fan.latencies):.1f} ms, "
                    f"p99 {median(percentile(lat, 0.99) for lat in fan.latencies):.1f} ms; "
                    f"RSS {fan.rss_idle_mib:.0f} -> {fan.rss_open_mib:.0f} -> {fan.rss_after_mib:.0f} MiB",
                    flush=True,
                )
                await asyncio.sleep(2.0)
    return result, code_version()


def render(result: Result, options: Options, recorded: Recorded) -> str:
    deltas = result.deltas
    lines = [
        SECTION,
        "",
        f"Measured {dt.date.today().isoformat()} on {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, code {recorded.versions[1]}; took {recorded.seconds:.0f} s. "
        "Command:",
        "",
        f"    {recorded.command}",
        "",
        "Embedded default (SQLite, in-process signals); every server its own process, the clients in the",
        "benchmark's process, all on loopback. Medians over runs.",
        "",
        f"### Streamed deltas: SSE through the gateway vs the runtime's gRPC stream ({options.runs} runs)",
        "",
        f"{DELTA_COUNT} deltas, one every {DELTA_GAP_US} µs, from the fake OpenAI server through the "
        "runtime; two watchers of the same run in one process: gRPC `WatchAgent` and the gateway's "
        "`/v1/agents/{id}/events`. Latency from the fake server writing a delta to a watcher reading it.",
        "",
        *table_head("Measurement", "p50", "p99"),
    ]
    for name, attribute in (
        ("gRPC WatchAgent (runtime)", "grpc_ms"),
        ("SSE through the gateway", "sse_ms"),
        ("**added by the gateway** (SSE minus gRPC, same delta)", "added_ms"),
    ):
        values: list[list[float]] = [getattr(sample, attribute) for sample in deltas]
        lines.append(
            f"| {name} | {median(percentile(v, 0.5) for v in values):.3f} ms | "
            f"{median(percentile(v, 0.99) for v in values):.3f} ms |"
        )
    lines += [
        "",
        f"### Concurrent SSE clients on one gateway process ({options.broadcasts} broadcasts each)",
        "",
        "N members of one group, each with its own `/v1/events` stream (one gRPC stream each from the "
        "gateway to the IM); a message to the group, one a second. Delivery latency: from calling "
        "SendMessage to a client reading the event (median over the broadcasts of each percentile). "
        "The client runs in one Python process on the same 2 cores as the IM and the gateway, so it "
        "shares the load.",
        "",
        f"Gateway RSS at start (no stream): {result.rss_start_mib:.0f} MiB.",
        "",
        *table_head(
            "Clients",
            "all connected in",
            "delivered",
            "p50",
            "p99",
            "last client",
            "gateway RSS with streams open",
            "after the broadcasts",
            align="rrrrrrrr",
        ),
    ]
    for fan in result.fan_out:
        delivered = min(fan.delivered) if fan.delivered else 0
        per_stream_kib = (fan.rss_open_mib - fan.rss_idle_mib) / fan.clients * 1024
        lines.append(
            f"| {fan.clients:,} | {fan.connected_s:.1f} s | {delivered:,} of {fan.clients:,} (worst) | "
            f"{median(percentile(lat, 0.5) for lat in fan.latencies):.1f} ms | "
            f"{median(percentile(lat, 0.99) for lat in fan.latencies):.1f} ms | "
            f"{median(lat[-1] if lat else float('nan') for lat in fan.latencies):.1f} ms | "
            f"{fan.rss_open_mib:.0f} MiB (+{per_stream_kib:.0f} KiB per stream) | "
            f"{fan.rss_after_mib:.0f} MiB |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of the deltas part (default 3)")
    parser.add_argument(
        "--clients",
        default=",".join(map(str, CLIENT_LEVELS)),
        help="SSE client counts (default 100,1000,5000)",
    )
    parser.add_argument("--broadcasts", type=int, default=5, help="messages per client count (default 5)")
    add_doc_option(parser)
    args = parser.parse_args(argv)
    options = Options(
        runs=args.runs,
        clients=[int(c) for c in args.clients.split(",") if c],
        broadcasts=args.broadcasts,
        write_doc=not args.no_doc,
    )
    run_and_record(
        "bench.gateway_bench", argv, options, run=run, render=render, title=SECTION, python="python"
    )


if __name__ == "__main__":
    main()
