"""Benchmark of the runtime replicas (issue 13): failover, handoff,
cross-replica wakes, lease renewal cost, 10,000 agents over three replicas,
and agent-to-agent traffic over one, two and three replicas.

The IM service runs once (`bench.harness.Backend`, PostgreSQL with Redis
signals); the runtime replicas are processes of the working tree's
`services.runtime` on the same database and Redis (`bench.replicas`), leases
of 10 s renewed every 2 s with a 2 s margin and 1,024 shards, the defaults.
The client is this process. Parts (`--parts`):

1. `failover`: agents, each in a workspace of its own so that their shards
   spread, idle. A replica is killed with SIGKILL (`--kills` times, each
   replica in turn) or stopped with SIGTERM (`--drains` times); right after
   the signal a task is submitted to each of its agents through another
   replica. Measured from the signal: when the other replica names a new
   owner (`GetAgent.replica`, as it last saw the leases) and when the task
   started (its stored start time): the agent is owned and answering. The
   victim is then started again and the shards settle before the next fault.
2. `wake`: SubmitTask to an idle agent through its owner and through a
   replica that is not its owner (which stores the task and tells the owner
   over Redis), alternately: from the call to the task's stored start.
3. `leases`: three replicas with `--small` agents, then `--agents` (in
   `--workspaces` workspaces), idle: the CPU and RSS of each replica, the
   database's transactions and rows per lease interval (its statistics), and
   one replica's lease round run as its keeper runs it, in transactions that
   roll back (statements and their time); then all three restarted: the time
   until every shard is held and until they are idle.
4. `chatter`: pairs of agents answering each other (`bench.runtime_bench`'s
   agent-to-agent run), in `--pairs` pairs spread over as many workspaces,
   with 1, 2 and 3 replicas (`--replicas`).

Run as `python -m bench.replicas_bench [--parts failover,wake,leases,chatter]
[--postgres-url ...] [--redis-url ...] [--no-doc]`; the result goes to the
`## Runtime replicas (issue 13)` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from bench import replicas_report
from bench.calls import CREATE_CONCURRENCY, bounded, create_agent, new_workspace
from bench.harness import (
    DEFAULT_REDIS_URL,
    Backend,
    BenchError,
    backend_on,
    code_version,
    listed,
    process_cpu_s,
    rss_mib,
    scratch,
    wait_quiet,
)
from bench.replicas import (
    DB_POOL_SIZE,
    LEASE_RENEW_S,
    STOP_LIMIT_S,
    TASK_LIMIT_S,
    Desk,
    LeaseTable,
    ReplicaSet,
    RoundCost,
    desks,
    owner,
    replica_set,
    round_cost,
    started_at,
    submit,
    until_task,
)
from bench.report import Recorded, add_doc_option, run_and_record
from bench.runtime_bench import ChatterSample, chatter_run

# The 10,000 agents of `leases` stay in the database: it comes last.
PARTS = ("failover", "wake", "chatter", "leases")
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/agentim_bench"
# Shards released per round while the cluster settles again after a fault
# (64 by default): the victim's shards come back in one round instead of
# six, so the next fault starts sooner. Failover takes expired shards all at
# once whatever this says.
SETTLE_MOVES = "1024"


# --- 1. failover and handoff ------------------------------------------------------------------


@dataclass
class Handoff:
    """One fault: the victim's agents, and per agent seconds from the signal
    to a new owner named and to its task started."""

    kind: str
    agents: int
    taken_s: list[float]
    owned_s: list[float]
    started_s: list[float]
    exit_code: int | None = None  # after SIGTERM; None after SIGKILL, or killed after SIGTERM


async def handoff(
    replicas: ReplicaSet, table: LeaseTable, all_desks: list[Desk], index: int, kind: str
) -> Handoff:
    victim = replicas.replicas[index % len(replicas.replicas)]
    survivor = replicas.replicas[(index + 1) % len(replicas.replicas)]
    ran = [d for d in all_desks if await owner(survivor, d.person, d.agent) == victim.id]
    signalled_wall, signalled = time.time(), time.monotonic()
    exiting: asyncio.Task[int | None] | None = None
    if kind == "kill":
        await replicas.kill(victim)
    else:
        exiting = asyncio.create_task(replicas.terminate(victim))

    async def followed(desk: Desk) -> tuple[float, float]:
        task_id = await submit(survivor, desk, f"{kind}-{index}-{desk.agent[-8:]}")
        async with asyncio.timeout(TASK_LIMIT_S):
            while await owner(survivor, desk.person, desk.agent) in ("", victim.id):  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        owned = time.monotonic() - signalled
        task = await until_task(survivor, desk, task_id, done=False)
        return owned, started_at(task) - signalled_wall

    async def taken() -> list[float]:
        """Per agent, seconds until the lease table shows its shard held by another replica."""
        waiting, found = {d.shard for d in ran}, {}
        async with asyncio.timeout(TASK_LIMIT_S):
            while waiting:
                owners = await table.owners()
                for shard in [s for s in waiting if owners.get(s, victim.id) != victim.id]:
                    found[shard] = time.monotonic() - signalled
                    waiting.discard(shard)
                await asyncio.sleep(0.02)
        return [found[d.shard] for d in ran]

    taking = asyncio.create_task(taken())
    measured = await asyncio.gather(*(followed(d) for d in ran))
    taken_s = await taking
    code = await exiting if exiting is not None else None
    await replicas.start(victim)
    await table.settled(replicas.ids())
    return Handoff(kind, len(ran), taken_s, [m[0] for m in measured], [m[1] for m in measured], code)


async def failover_part(backend: Backend, logs: Path, options: Options, result: Result) -> None:
    async with (
        replica_set(
            backend, logs, options.redis_url, 3, RUNTIME_SHARD_MOVES_PER_ROUND=SETTLE_MOVES
        ) as replicas,
        LeaseTable(backend.runtime_url) as table,
    ):
        made = await desks(replicas, options.failover_agents, "bench-failover")
        await wait_quiet([r.pid for r in replicas.replicas], since=time.perf_counter())
        faults = [("kill", i) for i in range(options.kills)] + [("drain", i) for i in range(options.drains)]
        for turn, (kind, index) in enumerate(faults):
            done = await handoff(replicas, table, made, turn, kind)
            result.handoffs.append(done)
            print(
                f"[failover] {kind} {index + 1}: {done.agents} agents, owned after max "
                f"{max(done.owned_s, default=0):.2f} s, tasks started after max "
                f"{max(done.started_s, default=0):.2f} s"
                + (f", exit code {done.exit_code}" if done.exit_code is not None else ""),
                flush=True,
            )
        result.problems["failover replicas"] = replicas.problems()


# --- 2. cross-replica wake --------------------------------------------------------------------


@dataclass
class Wakes:
    """Milliseconds from SubmitTask called to the task's stored start, and the call itself, by route."""

    to_start: dict[str, list[float]] = field(default_factory=dict)
    call: dict[str, list[float]] = field(default_factory=dict)


async def wake_part(backend: Backend, logs: Path, options: Options, result: Result) -> None:
    async with replica_set(backend, logs, options.redis_url, 3) as replicas:
        made = await desks(replicas, 6, "bench-wake")
        by_id = {r.id: r for r in replicas.replicas}
        owners = {d.agent: by_id[await owner(replicas.replicas[0], d.person, d.agent)] for d in made}
        await wait_quiet([r.pid for r in replicas.replicas], since=time.perf_counter())
        wakes = result.wakes
        others = itertools.cycle((1, 2))
        for index in range(options.wakes + options.warmup):
            desk = made[index % len(made)]
            home = owners[desk.agent]
            other = [r for r in replicas.replicas if r is not home][next(others) - 1]
            for route, via in (("owner", home), ("other replica", other)):
                started = time.time()
                task_id = await submit(via, desk, f"wake-{route.split()[0]}-{index}")
                called = time.time()
                task = await until_task(via, desk, task_id, done=True)
                if index >= options.warmup:
                    wakes.to_start.setdefault(route, []).append((started_at(task) - started) * 1000)
                    wakes.call.setdefault(route, []).append((called - started) * 1000)
                await asyncio.sleep(0.01)
        print(f"[wake] {options.wakes} of each route measured", flush=True)
        result.problems["wake replicas"] = replicas.problems()


# --- 3. lease renewal cost, 10,000 agents ---------------------------------------------------


@dataclass
class Idle:
    """Three replicas left alone with `agents` agents."""

    agents: int
    seconds: float
    cpu_ms: dict[str, float]
    rss_mib: dict[str, float]
    counted: dict[str, int]
    cost: RoundCost
    shards: Counter[str]
    agents_by_replica: Counter[str]

    def per_interval(self, key: str) -> float:
        """A database counter per replica per lease renewal interval."""
        return self.counted.get(key, 0) / len(self.cpu_ms) / (self.seconds / LEASE_RENEW_S)


@dataclass
class Resident:
    idle: list[Idle] = field(default_factory=list)
    created: int = 0
    created_s: float = float("nan")
    stopped_s: float = float("nan")
    listening_s: float = float("nan")
    held_s: float = float("nan")
    quiet_s: float = float("nan")
    killed: int = 0  # replicas that had not exited STOP_LIMIT_S after SIGTERM


async def idle(replicas: ReplicaSet, table: LeaseTable, url: str, agents: int, seconds: float) -> Idle:
    pids = {r.id: r.pid for r in replicas.replicas}
    await wait_quiet(list(pids.values()), since=time.perf_counter())
    before, cpu = await table.counters(), {n: process_cpu_s(p) for n, p in pids.items()}
    started = time.monotonic()
    await asyncio.sleep(seconds)
    after = await table.counters()
    window = time.monotonic() - started
    used = {n: (process_cpu_s(p) - cpu[n]) * 1000 for n, p in pids.items()}
    first = replicas.replicas[0]
    return Idle(
        agents=agents,
        seconds=window,
        cpu_ms=used,
        rss_mib={n: rss_mib(p) for n, p in pids.items()},
        counted={k: after[k] - before.get(k, 0) for k in after},
        cost=await round_cost(url, first.id, first.process.address, repeats=50),
        shards=Counter((await table.owners()).values()),
        agents_by_replica=await table.agents_by_owner(),
    )


def spread(persons: Sequence[str], have: int, want: int) -> list[tuple[str, int]]:
    """Which agents to add to go from `have` agents spread evenly over the
    persons' workspaces to `want`: (person, index in its workspace), the
    workspaces taken in turn."""

    def count(total: int, index: int) -> int:
        return total // len(persons) + (index < total % len(persons))

    return [
        (person, n)
        for n in range(count(want, 0))
        for index, person in enumerate(persons)
        if count(have, index) <= n < count(want, index)
    ]


async def leases_part(backend: Backend, logs: Path, options: Options, result: Result) -> None:
    resident = result.resident = Resident()
    async with (
        replica_set(backend, logs, options.redis_url, 3) as replicas,
        LeaseTable(backend.runtime_url) as table,
    ):
        count = options.workspaces
        clients = [replicas.clients(r) for r in replicas.replicas]
        persons, errors = await bounded(
            [partial(new_workspace, clients[0], f"bench-leases-{i}") for i in range(count)],
            CREATE_CONCURRENCY,
        )
        made, errors = await bounded(
            [
                partial(create_agent, clients[i % 3], p, f"a{n}")
                for i, (p, n) in enumerate(spread(persons, 0, options.small))
            ],
            CREATE_CONCURRENCY,
        )
        resident.idle.append(
            await idle(replicas, table, backend.runtime_url, len(made), options.idle_seconds)
        )
        print(f"[leases] {len(made)} agents idle: {resident.idle[-1].cpu_ms} ms CPU", flush=True)
        plan = spread(persons, options.small, options.agents)
        started = time.perf_counter()
        grown, errors = await bounded(
            [partial(create_agent, clients[i % 3], p, f"a{n}") for i, (p, n) in enumerate(plan)],
            CREATE_CONCURRENCY,
        )
        resident.created, resident.created_s = len(grown), time.perf_counter() - started
        if errors:
            result.problems["leases: CreateAgent"] = errors
        print(f"[leases] {len(grown)} more agents in {resident.created_s:.1f} s", flush=True)
        total = len(made) + len(grown)
        resident.idle.append(await idle(replicas, table, backend.runtime_url, total, options.idle_seconds))
        print(f"[leases] {total} agents idle: {resident.idle[-1].cpu_ms} ms CPU", flush=True)
        started = time.perf_counter()
        codes = await asyncio.gather(
            *(replicas.terminate(r, limit_s=STOP_LIMIT_S) for r in replicas.replicas)
        )
        resident.stopped_s = time.perf_counter() - started
        resident.killed = codes.count(None)
        since, since_perf = time.monotonic(), time.perf_counter()
        await asyncio.gather(*(replicas.start(r) for r in replicas.replicas))
        resident.listening_s = time.monotonic() - since
        resident.held_s = await table.until_held(replicas.ids(), since=since)
        resident.quiet_s = await wait_quiet([r.pid for r in replicas.replicas], since=since_perf)
        print(f"[leases] restarted: every shard held after {resident.held_s:.1f} s", flush=True)
        result.problems["leases replicas"] = replicas.problems()


# --- 4. agent to agent over 1, 2 and 3 replicas ---------------------------------------------------


async def chatter_part(backend: Backend, logs: Path, options: Options, result: Result, im_pid: int) -> None:
    for count in options.replica_counts:
        async with replica_set(
            backend,
            logs,
            options.redis_url,
            count,
            RUNTIME_AGENT_CHATTER_LIMIT="1000000000",
            RUNTIME_TOKEN_BUDGET="1000000000000",
        ) as replicas:
            pids = {"IM": im_pid, **{f"runtime {i}": r.pid for i, r in enumerate(replicas.replicas)}}
            for pairs in options.pairs:
                for run in range(1, options.runs + 1):
                    sample = await chatter_run(
                        replicas.clients(replicas.replicas[0]),
                        pids,
                        pairs=pairs,
                        seconds=options.seconds,
                        run=run,
                        workspaces=pairs,
                    )
                    result.chatter.setdefault((count, pairs), []).append(sample)
                    print(
                        f"[chatter] {count} replicas, {pairs} pairs, run {run}: "
                        f"{sample.hops_per_s:,.0f} hops/s",
                        flush=True,
                    )
            result.problems[f"chatter replicas ({count})"] = replicas.problems()


# --- entry point ---------------------------------------------------------------------------------


@dataclass
class Result:
    handoffs: list[Handoff] = field(default_factory=list)
    wakes: Wakes = field(default_factory=Wakes)
    resident: Resident | None = None
    chatter: dict[tuple[int, int], list[ChatterSample]] = field(default_factory=dict)
    problems: dict[str, Counter[str]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Options:
    parts: list[str]
    kills: int
    drains: int
    failover_agents: int
    wakes: int
    warmup: int
    small: int
    agents: int
    workspaces: int
    idle_seconds: float
    replica_counts: list[int]
    pairs: list[int]
    runs: int
    seconds: float
    postgres_url: str
    redis_url: str
    keep_logs: bool
    write_doc: bool


async def run(options: Options) -> tuple[Result, str]:
    result = Result()
    version = code_version()
    with scratch("agentim-replicas-bench-") as workdir:
        async with contextlib.AsyncExitStack() as stack:
            backend = await backend_on(
                stack,
                "postgresql",
                workdir=workdir.path,
                postgres_url=options.postgres_url,
                redis_url=options.redis_url,
            )
            backend.im_settings["IM_DB_POOL_SIZE"] = DB_POOL_SIZE
            await backend.migrate()
            im = await backend.start_im(stack, name="IM service", log_path=workdir.path / "im.log")
            parts = {"failover": failover_part, "wake": wake_part, "leases": leases_part}
            for part in [p for p in PARTS if p in options.parts]:
                logs = workdir.path / part
                logs.mkdir()
                try:
                    if part == "chatter":
                        await chatter_part(backend, logs, options, result, im.pid)
                    else:
                        await parts[part](backend, logs, options, result)
                except (BenchError, TimeoutError) as error:
                    # The parts measured so far are still worth a report.
                    result.failed[part] = str(error)
                    print(f"[{part}] failed: {error}", flush=True)
                # What is measured so far, in case a later part takes the run down.
                print(
                    replicas_report.render(result, options, Recorded("(so far)", (version, ""), 0.0)),
                    flush=True,
                )
            result.problems["IM service"] = im.problems()
        workdir.keep = options.keep_logs or bool(result.failed) or any(result.problems.values())
    return result, f"{version} (the working tree's services)"


def _numbers(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{flag}: expected numbers such as 1,2,3, got {text!r}")
    if not values or min(values) < 1:
        parser.error(f"{flag}: every value must be >= 1")
    return values


def parse_options(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.replicas_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--postgres-url",
        default=DEFAULT_POSTGRES_URL,
        help="benchmark database (created if missing; its im and runtime schemas are dropped first)",
    )
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL, help="Redis of the IM and the replicas")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {','.join(PARTS)}")
    parser.add_argument("--kills", type=int, default=6, help="SIGKILLs of a replica")
    parser.add_argument("--drains", type=int, default=6, help="SIGTERMs of a replica")
    parser.add_argument("--failover-agents", type=int, default=24, help="agents of the failover part")
    parser.add_argument("--wakes", type=int, default=100, help="measured SubmitTask calls per route")
    parser.add_argument("--warmup", type=int, default=6, help="unmeasured SubmitTask calls per route first")
    parser.add_argument("--small", type=int, default=100, help="agents of the first lease measurement")
    parser.add_argument("--agents", type=int, default=10_000, help="agents of the second")
    parser.add_argument("--workspaces", type=int, default=100, help="workspaces the agents are spread over")
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="idle measurement window")
    parser.add_argument("--replicas", default="1,2,3", help="replica counts of the agent-to-agent part")
    parser.add_argument(
        "--pairs", default="1,12", help="agent pairs chatting, each pair in its own workspace"
    )
    parser.add_argument("--runs", type=int, default=3, help="agent-to-agent runs per level (medians)")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per agent-to-agent run")
    parser.add_argument("--keep-logs", action="store_true", help="keep the services' logs after a clean run")
    add_doc_option(parser)
    args = parser.parse_args(argv)
    parts = listed(parser, "--parts", args.parts, PARTS)
    if min(args.kills, args.drains) < 0 or min(args.failover_agents, args.wakes, args.runs) < 1:
        parser.error("--kills and --drains must be >= 0, --failover-agents, --wakes and --runs >= 1")
    if args.agents < args.small or args.small < args.workspaces:
        parser.error("expected --workspaces <= --small <= --agents")
    return Options(
        parts=parts,
        kills=args.kills,
        drains=args.drains,
        failover_agents=args.failover_agents,
        wakes=args.wakes,
        warmup=args.warmup,
        small=args.small,
        agents=args.agents,
        workspaces=args.workspaces,
        idle_seconds=args.idle_seconds,
        replica_counts=_numbers(parser, "--replicas", args.replicas),
        pairs=_numbers(parser, "--pairs", args.pairs),
        runs=args.runs,
        seconds=args.seconds,
        postgres_url=args.postgres_url,
        redis_url=args.redis_url,
        keep_logs=args.keep_logs,
        write_doc=not args.no_doc,
    )


def main(argv: Sequence[str] | None = None) -> None:
    options = parse_options(argv)
    run_and_record(
        "bench.replicas_bench",
        argv,
        options,
        run=run,
        render=replicas_report.render,
        title=replicas_report.SECTION,
    )


if __name__ == "__main__":
    main()
