"""The `## Runtime replicas (issue 13)` section of docs/benchmarks.md, from
`bench.replicas_bench`'s results."""

from __future__ import annotations

import datetime as dt
import math
import os
import platform
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import grpc

from bench.replicas import LEASE_MARGIN_S, LEASE_RENEW_S, LEASE_TTL_S, SHARDS, STOP_LIMIT_S
from bench.report import Recorded, fixed, grouped, percent, problems_section, status, table_head
from bench.stats import median, median_of, percentile

if TYPE_CHECKING:
    from bench.replicas_bench import Handoff, Idle, Options, Result


SECTION = "## Runtime replicas (issue 13)"
TARGET_CROSS_WAKE_P50_MS = 10.0
TARGET_DRAIN_P99_S = 2.0
TARGET_FAILOVER_P99_S = LEASE_TTL_S + 2.0


def _p(values: Sequence[float], q: float, digits: int = 2) -> str:
    return fixed(percentile(values, q), digits) if values else "n/a"


def _preamble(recorded: Recorded) -> list[str]:
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    return [
        SECTION,
        "",
        f"Command: `{recorded.command}` (took {recorded.seconds / 60:.1f} min)",
        "",
        f"Code: {recorded.versions[0]}; HEAD {recorded.versions[1]} at the end.",
        "",
        f"Date: {now}. Machine: {os.cpu_count()} cores, {platform.platform()}, Python "
        f"{platform.python_version()}, grpcio {grpc.__version__}; load average at the end {load[0]:.2f}. "
        "**The machine is shared and was noisy**: other sessions ran fault tests (their own replicas, "
        "PostgreSQL and Redis load) during this run, and its 2 cores also run the benchmark client, the IM, "
        "every replica, PostgreSQL and Redis. Read the figures as orders of magnitude; ratios and "
        "differences between rows measured in the same run mean more than absolute times.",
        "",
        "Method: `bench/replicas_bench.py` (module docstring). The IM runs once (PostgreSQL, Redis "
        "signals); "
        f"each runtime replica is `python -m services.runtime serve` of the working tree, started as the "
        f"replica fault tests start them (`tests/faults/harness.py`'s `ServiceProcess`), on the same "
        f"database and Redis, with the default leases: {SHARDS:,} shards, a time to live of "
        f"{LEASE_TTL_S:g} s, renewed every {LEASE_RENEW_S:g} s, trusted until {LEASE_MARGIN_S:g} s before "
        "the end. Agents use the offline model. PostgreSQL here allows 100 connections for every "
        "session on the machine, so each replica and the IM keep at most 12 (`RUNTIME_DB_POOL_SIZE` and "
        "`IM_DB_POOL_SIZE` 6, plus as many overflow) instead of 32.",
        "",
    ]


def _ready(h: Handoff) -> list[float]:
    """Per agent, seconds until it was both owned elsewhere and answering."""
    return [max(o, s) for o, s in zip(h.owned_s, h.started_s, strict=True)]


def _failover(handoffs: Sequence[Handoff]) -> list[str]:
    lines = [
        "### Failover and handoff",
        "",
        "Idle agents, each in a workspace of its own (so their shards spread over the three replicas). A "
        "replica is killed with SIGKILL, or stopped with SIGTERM (it drains: no new work, runs in flight "
        "end, then it releases its leases), each replica in turn; right after the signal the benchmark "
        "submits a task to each of its agents through another replica. From the signal: *shard taken* is "
        "when the lease table (read every 20 ms) shows the agent's shard held by another replica, *owned* "
        "when "
        "the other replica's `GetAgent` names a new owner (as it last saw the leases, so up to one renewal "
        "late), *answering* when the agent's task started on the new owner (its stored start time), and "
        "*both* the later of *owned* and *answering*, per agent. The victim is started again and the "
        "shards settle "
        "before the next fault (during this part a replica gives back up to 1,024 shards per round "
        "instead of 64, so settling takes one round; taking expired or released shards is never "
        "bounded).",
        "",
        *table_head(
            "Fault",
            "Faults",
            "Agents moved",
            "Shard taken p50 / p99 / max s",
            "Owned p50 / p99 / max s",
            "Answering p50 / p99 / max s",
            "Both p50 / p99 s",
            "Exit codes",
        ),
    ]
    for kind, label in (("kill", "SIGKILL"), ("drain", "SIGTERM (drain)")):
        done = [h for h in handoffs if h.kind == kind]
        if not done:
            continue
        taken = [s for h in done for s in h.taken_s]
        owned = [s for h in done for s in h.owned_s]
        started = [s for h in done for s in h.started_s]
        ready = [s for h in done for s in _ready(h)]
        codes = sorted({h.exit_code for h in done if h.exit_code is not None})
        lines.append(
            f"| {label} | {len(done)} | {sum(h.agents for h in done)} "
            f"| {_p(taken, 0.5)} / {_p(taken, 0.99)} / {fixed(max(taken, default=math.nan))} "
            f"| {_p(owned, 0.5)} / {_p(owned, 0.99)} / {fixed(max(owned, default=math.nan))} "
            f"| {_p(started, 0.5)} / {_p(started, 0.99)} / {fixed(max(started, default=math.nan))} "
            f"| {_p(ready, 0.5)} / **{_p(ready, 0.99)}** | {', '.join(map(str, codes)) or '-'} |"
        )
    return [*lines, ""]


def _wakes(result: Result) -> list[str]:
    wakes = result.wakes
    lines = [
        "### Cross-replica wake",
        "",
        "Six idle agents over the three replicas; a task is submitted to one through its owner, then "
        "through another replica (which stores it and tells the owner over Redis), alternately, one at "
        "a time, each once the previous task has ended. Measured from calling SubmitTask to the task's "
        "stored start time (the runner took it), and the SubmitTask call itself (its answer comes once "
        "the task is stored, before or after the start).",
        "",
        *table_head("Route", "Tasks", "To start p50 ms", "p99 ms", "SubmitTask p50 ms", "p99 ms"),
    ]
    for route, values in wakes.to_start.items():
        calls = wakes.call[route]
        lines.append(
            f"| {route} | {len(values)} | **{_p(values, 0.5)}** | {_p(values, 0.99)} "
            f"| {_p(calls, 0.5)} | {_p(calls, 0.99)} |"
        )
    owner, other = wakes.to_start.get("owner", []), wakes.to_start.get("other replica", [])
    if owner and other:
        lines += [
            "",
            "Through another replica the task started "
            f"{percentile(other, 0.5) - percentile(owner, 0.5):.2f} ms "
            f"later at p50 than through its owner (same run, interleaved).",
        ]
    return [*lines, ""]


def _per_replica(values: dict[str, float], digits: int = 0) -> str:
    return " / ".join(grouped(v, digits) for v in values.values())


def _idle_rows(rows: Sequence[Idle]) -> list[str]:
    lines = table_head("Per replica (r0 / r1 / r2 where three)", *(f"{i.agents:,} agents" for i in rows))

    def row(label: str, cell: Callable[[Idle], str]) -> str:
        return f"| {label} | " + " | ".join(cell(i) for i in rows) + " |"

    return [
        *lines,
        row("shards held", lambda i: " / ".join(f"{i.shards[r]:,}" for r in i.cpu_ms)),
        row("agents run", lambda i: " / ".join(f"{i.agents_by_replica[r]:,}" for r in i.cpu_ms)),
        row("RSS MiB", lambda i: _per_replica(i.rss_mib)),
        row(
            "CPU while idle, ms over the window",
            lambda i: _per_replica(i.cpu_ms) + f" (in {i.seconds:.0f} s)",
        ),
        row(
            "CPU while idle, share of a core",
            lambda i: " / ".join(percent(ms / 1000 / i.seconds) for ms in i.cpu_ms.values()),
        ),
        row("renewal, statements sent (measured)", lambda i: fixed(i.cost.renew_statements, 0)),
        row("renewal, rows it extends", lambda i: f"{i.cost.shards:,}"),
        row(
            "renewal, ms p50 / p99 (client side, rolled back)",
            lambda i: f"{_p(i.cost.renew_ms, 0.5)} / {_p(i.cost.renew_ms, 0.99)}",
        ),
        row("lease read after it, statements (measured)", lambda i: fixed(i.cost.view_statements, 0)),
        row(
            "lease read, ms p50 / p99",
            lambda i: f"{_p(i.cost.view_ms, 0.5)} / {_p(i.cost.view_ms, 0.99)}",
        ),
        row("database: transactions per interval", lambda i: fixed(i.per_interval("transactions"), 1)),
        row(
            "database: heartbeats written per interval",
            lambda i: fixed(i.per_interval("replicas.written"), 2),
        ),
        row(
            "database: lease rows written per interval",
            lambda i: fixed(i.per_interval("shard_leases.written"), 0),
        ),
        row("database: scans of `agents` per interval", lambda i: fixed(i.per_interval("agents.scans"), 2)),
        row(
            "database: `agents` rows read per interval", lambda i: grouped(i.per_interval("agents.rows_read"))
        ),
        row("database: scans of `tasks` per interval", lambda i: fixed(i.per_interval("tasks.scans"), 2)),
    ]


def _resident(result: Result) -> list[str]:
    resident = result.resident
    if resident is None or not resident.idle:
        return []
    lines = [
        "### Lease renewal cost, and 10,000 agents over three replicas",
        "",
        "Three replicas, first with the smaller number of agents, then with the larger (created through "
        "CreateAgent, 32 at a time, through the three replicas in turn, in workspaces of 100 agents; the "
        "agents never ran). Once they are idle (each under 2% of a core for 1 s), the window below: CPU "
        "and RSS of each replica, and the database's counters over the window (`pg_stat_database`, "
        "`pg_stat_user_tables`; pg_stat_statements is not loaded on this server), divided by the three "
        f"replicas and by the {LEASE_RENEW_S:g} s renewal interval. Then r0's lease round (`LeaseKeeper."
        "round`: the renewal, then one read of the table) is run 50 times from the benchmark through the "
        "runtime's own `SqlLeases`, the renewal in a transaction that rolls back, counting the statements "
        "SQLAlchemy sends (BEGIN and COMMIT apart).",
        "",
        *_idle_rows(resident.idle),
        "",
    ]
    rate = resident.created / resident.created_s if resident.created_s else math.nan
    lines += [
        *table_head(f"{resident.idle[-1].agents:,} agents", "Value"),
        f"| CreateAgent x {resident.created:,} more (32 at a time, over the three replicas) "
        f"| {resident.created_s:.1f} s ({rate:,.0f}/s) |",
        f"| then SIGTERM to the three at once, until all exited | {resident.stopped_s:.1f} s"
        + (f" ({resident.killed} killed after {STOP_LIMIT_S:.0f} s)" if resident.killed else "")
        + " |",
        f"| started again, at once: until the last `listening` line | {resident.listening_s:.1f} s |",
        f"| until every one of the {SHARDS:,} shards is held (lease table) | **{resident.held_s:.1f} s** |",
        f"| until the three replicas are idle (every runner started) | {resident.quiet_s:.1f} s |",
        "",
    ]
    return lines


def _chatter(result: Result, options: Options) -> list[str]:
    if not result.chatter:
        return []
    lines = [
        "### Agent to agent over 1, 2 and 3 replicas",
        "",
        "`bench.runtime_bench`'s agent-to-agent run (pairs of offline agents answering each other "
        "without end, counted through an IM watch for "
        f"{options.seconds:g} s after 2 s), each pair in a workspace of its own so that the pairs spread "
        "over "
        "the replicas; medians of "
        f"{options.runs} runs. A hop is one message (IM event, wake, run stored, answer sent); hop ms is the "
        "time between consecutive messages of a chat, so at one pair it is the wake-to-answer latency. "
        "CPU per hop: the CPU time of all the runtime replicas (and of the IM) over the window divided by "
        "the hops.",
        "",
        *table_head(
            "Replicas",
            "Pairs",
            "Hops/s (min-max)",
            "Round trips/s",
            "Ratio to 1 replica",
            "Hop p50 ms",
            "Hop p99 ms",
            "Runtime CPU (all replicas)",
            "IM CPU",
            "Runtime / IM CPU per hop ms",
            "Machine busy",
        ),
    ]
    for (count, pairs), samples in sorted(result.chatter.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rates = [s.hops_per_s for s in samples]
        base = result.chatter.get((1, pairs))
        ratio = median(rates) / median(s.hops_per_s for s in base) if base else math.nan

        def runtime(s: object) -> float:
            cores = s.cores  # type: ignore[attr-defined]
            return float(sum(v for k, v in cores.items() if k.startswith("runtime")))

        rt = median_of(samples, runtime)
        im = median_of(samples, lambda s: s.cores.get("IM", math.nan))
        hops = median(rates)
        lines.append(
            f"| {count} | {pairs} | {hops:,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) | **{hops / 2:,.0f}** "
            f"| {fixed(ratio)} | {fixed(median_of(samples, lambda s: percentile(s.hop_ms, 0.5)), 1)} "
            f"| {fixed(median_of(samples, lambda s: percentile(s.hop_ms, 0.99)), 1)} "
            f"| {percent(rt)} | {percent(im)} | {fixed(rt / hops * 1000, 1)} / {fixed(im / hops * 1000, 1)} "
            f"| {percent(median_of(samples, lambda s: s.machine_busy))} |"
        )
    return [*lines, ""]


def _targets(result: Result) -> list[str]:
    rows = []
    taken = [s for h in result.handoffs if h.kind == "kill" for s in h.taken_s]
    if taken:
        p99 = percentile(taken, 0.99)
        rows.append(
            "| failover after SIGKILL, the shard taken by another replica (lease table): p99 under "
            f"TTL + 2 s "
            f"| {p99:.2f} s | {status(p99 < TARGET_FAILOVER_P99_S)} |"
        )
    for kind, label, target in (
        (
            "kill",
            f"failover after SIGKILL, leases of {LEASE_TTL_S:g} s, owned and answering: p99 under TTL + 2 s",
            TARGET_FAILOVER_P99_S,
        ),
        (
            "drain",
            "handoff of an idle agent on SIGTERM, owned and answering: p99 under 2 s",
            TARGET_DRAIN_P99_S,
        ),
    ):
        ready = [s for h in result.handoffs if h.kind == kind for s in _ready(h)]
        if ready:
            p99 = percentile(ready, 0.99)
            rows.append(f"| {label} | {p99:.2f} s | {status(p99 < target)} |")
    other = result.wakes.to_start.get("other replica", [])
    if other:
        p50 = percentile(other, 0.5)
        rows.append(
            f"| cross-replica wake (SubmitTask to task started): p50 under 10 ms | {p50:.2f} ms "
            f"| {status(p50 < TARGET_CROSS_WAKE_P50_MS)} |"
        )
    if result.resident is not None and len(result.resident.idle) == 2:
        small, large = result.resident.idle
        same = small.cost.renew_statements == large.cost.renew_statements == 1
        rows.append(
            f"| lease renewal: one statement per interval whatever the agent count | "
            f"{small.cost.renew_statements:g} at {small.agents:,} agents, {large.cost.renew_statements:g} at "
            f"{large.agents:,} | {status(same)} |"
        )
    if not rows:
        return []
    return ["### Targets (issue 13)", "", *table_head("Target", "Measured", "Status"), *rows, ""]


def render(result: Result, options: Options, recorded: Recorded) -> str:
    lines = _preamble(recorded)
    if result.handoffs:
        lines += _failover(result.handoffs)
    if result.wakes.to_start:
        lines += _wakes(result)
    lines += _resident(result)
    lines += _chatter(result, options)
    lines += _targets(result)
    if result.failed:
        lines += ["### Parts that did not finish", ""]
        lines += [f"- {part}: {error}" for part, error in result.failed.items()]
        lines.append("")
    lines += problems_section(result.problems.items())
    return "\n".join(lines).rstrip() + "\n"
