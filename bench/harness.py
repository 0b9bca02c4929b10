"""What the benchmarks run on: the services as subprocesses, their databases, and meters.

- Processes: `running` starts a server with its environment, waits for its
  `listening on` line, keeps its log, and always stops it (SIGTERM, then
  SIGKILL), timing the start and the stop; `run_command` runs a one-shot
  command such as a migration.
- Backends: `Backend` holds where one backend's services keep their data and
  starts them (`backend_on` prepares the SQLite files or the benchmark
  PostgreSQL database, locked for the run); `snapshot_sources` copies the
  code the servers run so that edits made during a run change nothing.
- Meters: the CPU of processes over a window (`CpuMeter`), their memory
  (`rss_mib`), `wait_quiet` until they are idle, and `closed_loop` load.
- `RuntimeTables` reads the runtime's runs and agents from its database.
- Around a run: `scratch` (a directory for data and logs, kept when the
  run fails); `add_backend_options` and `listed` for the command lines.

Everything here is Linux-only (it reads /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from agentim.im.v1 import im_pb2_grpc
from agentim.runtime.v1 import runtime_pb2_grpc
from bench.stats import percentile
from tests.auth_support import credentials_environment

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
IM_SERVE = (PYTHON, "-m", "services.im", "serve")
RUNTIME_SERVE = (PYTHON, "-m", "services.runtime", "serve")
LLM_SERVE = (PYTHON, "-m", "bench.llm_server")

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
MIGRATE_TIMEOUT_S = 120.0
QUIET_TIMEOUT_S = 300.0
QUIET_WINDOW_S = 1.0
QUIET_CORES = 0.02
ALL_RUNS_TIMEOUT_S = 900.0
# A phase waiting for runs gives up when nothing has changed for this long,
# or for SETTLED_S once every message is accounted for (see `until_ended`).
STALL_S = 30.0
SETTLED_S = 3.0

_BANNER = re.compile(r"listening on (\S+:\d+)")
_AGENTS = re.compile(r"\((\d+) agents")
_LEVEL = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b .*")
_PROBLEM = re.compile(r"\b(WARNING|ERROR|CRITICAL|Traceback)\b")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|0x[0-9a-f]{6,}")


class BenchError(Exception):
    """The benchmark could not run (a server did not start, setup failed...)."""


# --- processes: CPU, memory ------------------------------------------------------

TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    # utime and stime are fields 14 and 15 of stat; the split starts at field 3.
    return (int(fields[11]) + int(fields[12])) / TICKS


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
    """CPU used over a window, in cores (1.0 = one core busy): by some processes,
    by this (client) process, and the machine's busy share of all its cores."""

    pids: Mapping[str, int]
    cores: dict[str, float] = field(default_factory=dict)
    client_cores: float = float("nan")
    machine_busy: float = float("nan")
    _start: tuple[float, dict[str, float], float, tuple[float, float]] | None = None

    def start(self) -> None:
        self._start = (
            time.perf_counter(),
            {n: process_cpu_s(pid) for n, pid in self.pids.items()},
            time.process_time(),
            machine_jiffies(),
        )

    def stop(self) -> None:
        assert self._start is not None
        wall0, cpu0, client0, (busy0, total0) = self._start
        wall = time.perf_counter() - wall0
        for name, pid in self.pids.items():
            self.cores[name] = (process_cpu_s(pid) - cpu0[name]) / wall if wall > 0 else float("nan")
        if wall > 0:
            self.client_cores = (time.process_time() - client0) / wall
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


# --- closed-loop load ------------------------------------------------------------


@dataclass
class LoadSample:
    """One closed-loop measurement; CPU in cores over its window (nan: not measured)."""

    concurrency: int
    seconds: float
    latencies_ms: list[float]
    errors: Counter[str]
    server_cores: float
    client_cores: float
    machine_busy: float

    @property
    def throughput(self) -> float:
        return len(self.latencies_ms) / self.seconds if self.seconds > 0 else 0.0

    def p(self, q: float) -> float:
        return percentile(self.latencies_ms, q)

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
    cpu = CpuMeter({} if server_pid is None else {"server": server_pid})

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
        concurrency,
        elapsed,
        latencies,
        errors,
        cpu.cores.get("server", float("nan")),
        cpu.client_cores,
        cpu.machine_busy,
    )


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

    def _log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []

    def problem_lines(self) -> list[str]:
        """The warning, error and traceback lines the server logged so far."""
        return [line for line in self._log_lines() if _PROBLEM.search(line)]

    def problems(self) -> Counter[str]:
        """Warnings and errors the server logged so far, counted by message.

        Ids are replaced by `<id>`; an error followed by a traceback counts
        with the exception the traceback ends in.
        """
        lines = self._log_lines()
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

    def banner_agents(self) -> int:
        """The agents the runtime's banner says it started with (-1 if it does not say)."""
        found = _AGENTS.search(self.banner)
        return int(found[1]) if found else -1


async def _stop(process: asyncio.subprocess.Process, name: str, limit_s: float) -> int:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), limit_s)
        except TimeoutError:
            print(f"warning: {name} ignored SIGTERM for {limit_s:.0f} s; killing it", file=sys.stderr)
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
    cwd: Path = ROOT,
    exit_codes: Container[int] = (0,),
    start_timeout_s: float = START_TIMEOUT_S,
    stop_timeout_s: float = STOP_TIMEOUT_S,
) -> AsyncIterator[Service]:
    """Starts a server, waits for its `listening on` line, and always SIGTERMs it (timing the stop).

    Its stdout and stderr go to `log_path`. An exit status outside
    `exit_codes` is reported (a benchmark that kills the server itself
    expects -9).
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
                line = await asyncio.wait_for(stdout.readline(), start_timeout_s)
            except TimeoutError:
                raise BenchError(
                    f"{name} printed nothing in {start_timeout_s:.0f} s; see {log_path}"
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
            code = await _stop(process, name, stop_timeout_s)
            if service is not None:
                service.stopped_in_s = time.perf_counter() - stopping
            if drainer is not None:
                drainer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drainer
            if code not in exit_codes:
                print(f"warning: {name} exited with status {code}; see {log_path}", file=sys.stderr)


async def run_command(
    argv: Sequence[str], *, env: Mapping[str, str], cwd: Path = ROOT, limit_s: float = MIGRATE_TIMEOUT_S
) -> None:
    """Runs a command to its end (a migration); BenchError with its output if it fails."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
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


@dataclass
class Scratch:
    """A benchmark's directory for the servers' data and logs (see `scratch`)."""

    path: Path
    keep: bool = False  # set by the benchmark: keep the logs after a clean run


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Scratch]:
    """A new directory for the run; removed after a clean run unless `keep` was set.

    When the benchmark fails it is kept for the servers' logs, and a
    BenchError says where.
    """
    made = Scratch(Path(tempfile.mkdtemp(prefix=prefix)))
    try:
        yield made
    except BenchError as error:
        raise BenchError(f"{error}\n(server logs kept in {made.path})") from None
    if made.keep:
        print(f"the services' logs are kept in {made.path}", file=sys.stderr)
    else:
        shutil.rmtree(made.path, ignore_errors=True)


# --- the code under test -------------------------------------------------------------


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], check=False, cwd=ROOT, capture_output=True, text=True, timeout=10
    ).stdout.strip()


def code_version() -> str:
    """The commit the servers ran from, flagged if the service code had uncommitted changes."""
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--", "services", "protos", "gen")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git unavailable)"
    if not commit:
        return "unknown (not a git checkout)"
    return f"{commit} with uncommitted changes to the service" if dirty else commit


# Files of bench/ that belong with the services they wrap: with --ref they come
# from that commit too (the traced runtime patches the services' own objects).
_SERVICE_SIDE_BENCH_FILES = ("bench/runtime_host.py",)


def snapshot_sources(dest: Path, *, worktree: bool, ref: str | None = None) -> str:
    """Copies the code the servers run to `dest`; returns which code that is.

    Other people edit the working tree while a benchmark runs: servers started
    from the copy all run the same code. By default the services and stubs are
    those of the commit at HEAD (`git archive`), so that the figures belong to
    a commit; with `ref` those of that commit (a "before" to compare with);
    with `worktree` they are the working tree's, uncommitted changes
    included. The benchmark's own helpers always come from the working tree,
    but for the few that wrap the services (`_SERVICE_SIDE_BENCH_FILES`).
    """
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    if worktree and ref is not None:
        raise BenchError("--worktree and --ref each name the services to run: give one")
    if worktree:
        version = code_version()
        for name in ("services", "gen"):
            shutil.copytree(ROOT / name, dest / name, ignore=skip)
    else:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", ref or "HEAD"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            paths = ["services", "gen", *(_SERVICE_SIDE_BENCH_FILES if ref else ())]
            archive = subprocess.run(
                ["git", "archive", commit, *paths], cwd=ROOT, capture_output=True, check=True
            ).stdout
        except (OSError, subprocess.CalledProcessError) as error:
            raise BenchError(f"cannot take the services from git (use --worktree): {error}") from None
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")
        version = f"{commit} (services and stubs as committed, run from `git archive`)"
    kept = {dest / name for name in _SERVICE_SIDE_BENCH_FILES if (dest / name).exists()}
    shutil.copytree(
        ROOT / "bench",
        dest / "bench",
        ignore=skip,
        dirs_exist_ok=True,
        copy_function=lambda source, target: None if Path(target) in kept else shutil.copy2(source, target),
    )
    (dest / "tests").mkdir(parents=True)
    for name in ("__init__.py", "fake_openai.py"):
        shutil.copy2(ROOT / "tests" / name, dest / "tests" / name)
    return version


# --- databases -------------------------------------------------------------------

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

# Held for a whole backend run: two benchmarks sharing the database would drop each other's schema.
_BENCH_LOCK_KEY = 0x61676E62656E6368  # "agnbench"


def _bench_database(url: str, schema: str) -> URL:
    target = make_url(url).set(drivername="postgresql+asyncpg")
    if "bench" not in (target.database or ""):
        # Dropping a schema in a database that tests (or people) use would destroy their data.
        raise BenchError(
            f"refusing to reset the {schema} schema of {target.database!r}: use a database named *bench*"
        )
    return target


@contextlib.asynccontextmanager
async def exclusive_postgres(url: str) -> AsyncIterator[None]:
    """Creates the benchmark database if missing, locks it for this run, and drops its `im` schema."""
    target = _bench_database(url, "im")
    database = target.database or ""
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


async def drop_runtime_schema(url: str) -> None:
    """Drops the `runtime` schema of the benchmark database."""
    target = _bench_database(url, "runtime")
    engine = create_async_engine(target, isolation_level="AUTOCOMMIT", pool_size=1, max_overflow=0)
    try:
        async with engine.connect() as conn:
            await conn.execute(sa.text("DROP SCHEMA IF EXISTS runtime CASCADE"))
    finally:
        await engine.dispose()


@dataclass
class Ended:
    """Runs that ended in a phase, by status, and when the last of them did."""

    runs: Counter[str] = field(default_factory=Counter)
    seconds: float = float("nan")
    complete: bool = False
    target: int = 0


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


# --- one backend's services -------------------------------------------------------


@dataclass
class Clients:
    """Stubs of the IM and of the runtime under test."""

    im: Any
    runtime: Any


@dataclass
class Backend:
    """Where one backend's services keep their data, and how to start them."""

    name: str
    im_url: str
    runtime_url: str
    redis_url: str | None
    data_dir: Path
    source: Path
    im_settings: dict[str, str] = field(default_factory=dict)  # more of the IM's environment
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
        env.update(DATABASE_URL=self.im_url, IM_GRPC_ADDRESS="127.0.0.1:0", **self.im_settings)
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

    async def migrate(self, *, runtime: bool = True) -> None:
        """Brings the IM's database (and the runtime's) to the latest schema."""
        await run_command([PYTHON, "-m", "services.im", "migrate"], env=self.im_env(), cwd=self.source)
        if runtime:
            await run_command(
                [PYTHON, "-m", "services.runtime", "migrate"], env=self.runtime_env(), cwd=self.source
            )

    async def start_im(self, stack: contextlib.AsyncExitStack, *, name: str, log_path: Path) -> Service:
        """Starts the IM service for the rest of `stack`; the runtimes started later use it."""
        im = await stack.enter_async_context(
            running(name, IM_SERVE, env=self.im_env(), cwd=self.source, log_path=log_path)
        )
        self.im_address = im.address
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(im.address))
        self.im_stub = im_pb2_grpc.IMServiceStub(channel)
        return im

    def llm(
        self, *, log_path: Path, name: str = "fake OpenAI server"
    ) -> contextlib.AbstractAsyncContextManager[Service]:
        """`bench.llm_server`, the fake OpenAI-compatible server."""
        return running(name, LLM_SERVE, env=self.base_env(), cwd=self.source, log_path=log_path)

    @contextlib.asynccontextmanager
    async def runtime(
        self,
        name: str,
        *,
        log_path: Path,
        argv: Sequence[str] = RUNTIME_SERVE,
        exit_codes: Container[int] = (0,),
        **env: str,
    ) -> AsyncIterator[tuple[Service, Clients]]:
        """A runtime on this backend's IM (started first), with `env` added to its settings."""
        async with (
            running(
                name,
                argv,
                env=self.runtime_env(**env),
                cwd=self.source,
                log_path=log_path,
                exit_codes=exit_codes,
            ) as rt,
            grpc.aio.insecure_channel(rt.address) as channel,
        ):
            yield rt, Clients(self.im_stub, runtime_pb2_grpc.RuntimeServiceStub(channel))


async def backend_on(
    stack: contextlib.AsyncExitStack,
    name: str,
    *,
    workdir: Path,
    source: Path = ROOT,
    postgres_url: str = "",
    redis_url: str | None = None,
) -> Backend:
    """One backend's databases, ready for `Backend.migrate`.

    `postgresql`: the benchmark database at `postgres_url`, created if
    missing, locked for the rest of `stack` against other benchmarks, its im
    and runtime schemas dropped. Any other name: SQLite files (the IM's and
    the runtime's) in `workdir/<name>`, with in-process event signals.
    """
    data_dir = workdir / name
    data_dir.mkdir(parents=True, exist_ok=True)
    if name == "postgresql":
        await stack.enter_async_context(exclusive_postgres(postgres_url))
        await drop_runtime_schema(postgres_url)
        return Backend(name, postgres_url, postgres_url, redis_url, data_dir, source)
    im_db, runtime_db = f"sqlite:///{data_dir / 'im.db'}", f"sqlite:///{data_dir / 'runtime.db'}"
    return Backend(name, im_db, runtime_db, None, data_dir, source)


# --- command-line options -------------------------------------------------------------


def add_backend_options(
    parser: argparse.ArgumentParser, *, backends: Sequence[str], postgres_url: str, snapshot: bool = True
) -> None:
    """--backends and --postgres-url; with `snapshot` (the benchmarks that run
    a copy of the services, the IM with Redis on postgresql) also --redis-url,
    --worktree and --keep-logs."""
    parser.add_argument(
        "--backends", default=",".join(backends), help=f"comma-separated: {','.join(backends)}"
    )
    parser.add_argument(
        "--postgres-url",
        default=postgres_url,
        help="benchmark database (created if missing; its im and runtime schemas are dropped first)",
    )
    if not snapshot:
        return
    parser.add_argument(
        "--redis-url", default=DEFAULT_REDIS_URL, help="Redis of the IM on the postgresql backend"
    )
    parser.add_argument(
        "--worktree",
        action="store_true",
        help="run the services of the working tree, uncommitted changes included (default: HEAD's)",
    )
    parser.add_argument(
        "--ref",
        default=None,
        help="run the services of this commit instead of HEAD's (a 'before' to compare with)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the services' logs after a clean run")


def listed(parser: argparse.ArgumentParser, flag: str, text: str, allowed: Sequence[str]) -> list[str]:
    """The comma-separated names given to `flag`: at least one, each one of `allowed` (else a usage error)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or set(names) - set(allowed):
        parser.error(f"{flag}: expected some of {','.join(allowed)}, got {text!r}")
    return names
