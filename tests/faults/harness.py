"""Real processes for fault tests: started, killed, frozen and stopped by pid.

Every service runs the way an operator runs it (`python -m services.im
serve`, `python -m services.runtime serve`), on loopback, on a free port
read back from the line it prints, with its log in a file the test can show
when it fails. Whatever a test does, `ServiceProcess` leaves no process
behind (its context manager kills what is still running).

`FAULTS_LONG=1` (set by `make faults`) makes the cases repeat their faults
more often: `scaled(n, long=m)` is how a case says how many.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.auth_support import auth_environment

ROOT = Path(__file__).resolve().parents[2]
LONG = os.environ.get("FAULTS_LONG", "").strip().lower() in {"1", "true", "yes"}

# A developer's or CI's own settings must not leak into the processes.
_OWN_PREFIXES = ("AGENTIM_", "IM_", "GRPC_", "RUNTIME_", "OPENAI_", "LLM_", "GATEWAY_", "TOOL_", "AUTH_")
_OWN_NAMES = {"DATABASE_URL", "REDIS_URL", "LOG_LEVEL", "SHUTDOWN_GRACE_SECONDS"}
_LISTENING = re.compile(rb"listening on (?P<host>[^\s:]+):(?P<port>\d+)")


def scaled(short: int, *, long: int) -> int:
    """How many times a case repeats its fault: `long` under FAULTS_LONG=1."""
    return long if LONG else short


UNLIMITED = {"LIMIT_SEND_PER_SECOND": "0", "LIMIT_CREATE_PER_SECOND": "0"}


def clean_environment(**settings: str) -> dict[str, str]:
    """This process's environment without any service setting, plus `settings`."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(_OWN_PREFIXES) and key not in _OWN_NAMES
    }
    env.update(LOG_LEVEL="WARNING", SHUTDOWN_GRACE_SECONDS="5")
    # The faults come with load from a few members, far past any member's
    # rate limit (those limits have tests of their own).
    env.update(UNLIMITED)
    # The IM's signing key and service credentials (an IM on PostgreSQL needs a key).
    env.update(auth_environment())
    env.update(settings)
    return env


def migrate(module: str, env: Mapping[str, str], *, timeout: float = 120.0) -> None:
    """Runs `python -m <module> migrate`; fails with its output if it fails."""
    result = subprocess.run(
        [sys.executable, "-m", module, "migrate"],
        cwd=ROOT,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(
            f"{module} migrate exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )


@dataclass
class ServiceProcess:
    """A service running as a child process; `address` is where it listens."""

    module: str
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    address: str = ""
    starts: int = field(default=0)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, *, timeout: float = 60.0) -> ServiceProcess:
        """Starts `python -m <module> serve` and waits for its listening line.

        The first start picks a free port (when the environment says port 0);
        later starts (after a kill) listen on the same address again, so that
        clients reconnect as they would to a restarted server.
        """
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts + 1} ---\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module, "serve"],
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        self.starts += 1
        address = self._read_address(timeout)
        if address is None:
            self.kill()
            raise AssertionError(f"{self.module} printed no listening line within {timeout}s:\n{self.log()}")
        self.address = address
        return self

    def _read_address(self, timeout: float) -> str | None:
        assert self.process is not None and self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        seen = b""
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while (remaining := deadline - time.monotonic()) > 0:
                if not selector.select(remaining):
                    break
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                seen += chunk
                if match := _LISTENING.search(seen):
                    return f"{match['host'].decode()}:{match['port'].decode()}"
        return None

    def pin_address(self, variable: str) -> None:
        """Makes later starts listen where this one does (`variable`: its address setting)."""
        self.env[variable] = self.address

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: the process dies at once, mid-whatever."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        self._reap(10.0)

    def terminate(self, *, timeout: float = 30.0) -> int:
        """SIGTERM, then waits for the exit; returns the exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=timeout)
        self._reap(1.0)
        return code

    def freeze(self) -> None:
        """SIGSTOP: the process stays, answering nothing, until `thaw`."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def _reap(self, timeout: float) -> None:
        if self.process is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *_: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.thaw()
            self.kill()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class RedisProcess:
    """A private redis-server on a free loopback port, to kill and restart
    without touching the machine's own Redis."""

    directory: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *, timeout: float = 10.0) -> RedisProcess:
        binary = shutil.which("redis-server")
        if binary is None:
            raise AssertionError("redis-server is not installed")
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return self
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"redis-server did not listen on port {self.port} within {timeout}s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def __enter__(self) -> RedisProcess:
        return self

    def __exit__(self, *_: object) -> None:
        self.kill()


class PostgresUnavailable(Exception):
    """No PostgreSQL server binaries here, or no user they may run as."""


@dataclass
class PostgresProcess:
    """A private PostgreSQL cluster (initdb in a temporary directory) on a
    free loopback port, to restart without touching the machine's own server.

    initdb and postgres refuse to run as root: as root, they run as the
    `postgres` user, in a directory that user owns. The cluster trades
    durability on power loss for speed (`fsync=off`), never on a crash of the
    server: every commit is written before it returns, so an `immediate`
    stop loses no committed transaction.
    """

    port: int = field(default_factory=free_port)
    directory: Path | None = None
    _as_user: list[str] = field(default_factory=list)
    _bin: Path = Path()
    _options: str = ""

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def log_path(self) -> Path:
        assert self.directory is not None
        return self.directory / "server.log"

    def start(self) -> PostgresProcess:
        """Creates the cluster and starts it.

        Raises:
            PostgresUnavailable: no initdb here, or no user to run it as.
        """
        self._bin = _postgres_binaries()
        owner = None
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresUnavailable("running as root and there is no postgres user") from None
            self._as_user = ["runuser", "-u", "postgres", "--"]
        self.directory = Path(tempfile.mkdtemp(prefix="agentim-pg-"))
        if owner is not None:
            os.chown(self.directory, owner.pw_uid, owner.pw_gid)
        self._run("initdb", "-D", str(self._data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")
        self._options = " ".join(
            [
                f"-p {self.port}",
                "-c listen_addresses=127.0.0.1",
                f"-c unix_socket_directories={self.directory}",
                "-c fsync=off",
                "-c full_page_writes=off",
                "-c max_connections=200",
                "-c shared_buffers=32MB",
            ]
        )
        self._ctl("start", "-o", self._options)
        return self

    def restart(self, *, down_for: float = 0.0) -> None:
        """Stops the server at once (`immediate`: as a crash would, its
        clients cut mid-statement), keeps it down `down_for` seconds, starts
        it again, and waits until it accepts connections (after its crash recovery)."""
        if down_for <= 0:
            self._ctl("restart", "-m", "immediate")
            return
        self._ctl("stop", "-m", "immediate")
        time.sleep(down_for)
        self._ctl("start", "-o", self._options)

    def stop(self) -> None:
        """Stops the cluster (at once) and removes its directory; safe to call again."""
        if self.directory is None:
            return
        pid_file = self._data / "postmaster.pid"
        if pid_file.exists():
            try:
                self._ctl("stop", "-m", "immediate")
            except (AssertionError, subprocess.TimeoutExpired):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = None

    @property
    def _data(self) -> Path:
        assert self.directory is not None
        return self.directory / "data"

    def _ctl(self, action: str, *arguments: str) -> None:
        # The server's output goes to its log: were it left on pg_ctl's
        # stdout, the server would hold that pipe open after pg_ctl exits.
        self._run("pg_ctl", action, "-D", str(self._data), "-l", str(self.log_path), "-w", *arguments)

    def log(self) -> str:
        if self.directory is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def _run(self, program: str, *arguments: str, timeout: float = 120.0) -> None:
        with tempfile.TemporaryFile() as output:
            result = subprocess.run(
                [*self._as_user, str(self._bin / program), *arguments],
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
            output.seek(0)
            said = output.read().decode(errors="replace")
        if result.returncode != 0:
            raise AssertionError(
                f"{program} {arguments[0]} exited {result.returncode}:\n{said}\n{self.log()}"
            )

    def __enter__(self) -> PostgresProcess:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def _postgres_binaries() -> Path:
    """The directory of initdb, pg_ctl and postgres: on the PATH, or Debian's newest."""
    found = shutil.which("initdb")
    if found is not None:
        return Path(found).parent
    debian = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if debian:
        return Path(debian[-1]).parent
    raise PostgresUnavailable("PostgreSQL's server binaries (initdb, pg_ctl) are not installed")
