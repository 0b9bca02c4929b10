"""End-to-end tests: the system as operators and other-language clients see it.

The helpers here run the IM service the way an operator does, as its own
process (`python -m services.im migrate`, then `serve`), on a fresh SQLite
file, listening on a free port read back from the line it prints.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_LISTENING = re.compile(rb"^IM service listening on (?P<host>\S+):(?P<port>\d+) ", re.MULTILINE)
# Settings the tests choose themselves: a developer's or CI's own values
# (for example AGENTIM_DATA_DIR from the Makefile) must not leak in.
_SERVICE_PREFIXES = ("AGENTIM_", "IM_", "GRPC_", "AUTH_")
_SERVICE_NAMES = {"DATABASE_URL", "REDIS_URL", "LOG_LEVEL", "SHUTDOWN_GRACE_SECONDS"}


def in_ci() -> bool:
    """True in CI, where a missing tool is a failure rather than a skip."""
    return os.environ.get("CI", "").strip().lower() == "true"


def im_environment(data_dir: Path, **overrides: str) -> dict[str, str]:
    """The environment of an IM process using a SQLite file in `data_dir`."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(_SERVICE_PREFIXES) and key not in _SERVICE_NAMES
    }
    env.update(
        AGENTIM_DATA_DIR=str(data_dir),
        DATABASE_URL=f"sqlite:///{data_dir / 'im.db'}",
        IM_GRPC_ADDRESS="127.0.0.1:0",
        SHUTDOWN_GRACE_SECONDS="2",
        LOG_LEVEL="INFO",
    )
    env.update(overrides)
    return env


def python_module(module: str, *args: str) -> list[str]:
    """The command line running `python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def migrate_im(env: Mapping[str, str], *, timeout: float = 60.0) -> None:
    """Runs `python -m services.im migrate`; fails the test with its output if it fails."""
    result = subprocess.run(
        python_module("services.im", "migrate"),
        cwd=ROOT,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"migrate exited {result.returncode}:\n{result.stdout}\n{result.stderr}")


@dataclass
class IMProcess:
    """An IM server running as a child process."""

    process: subprocess.Popen[bytes]
    address: str
    log_path: Path

    def log(self) -> str:
        """What the server has logged so far (its stderr)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, *, timeout: float = 10.0) -> int:
        """Sends SIGTERM and waits for the exit; returns the exit code.

        Raises:
            subprocess.TimeoutExpired: the server did not exit in time.
        """
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)


@contextmanager
def running_im(env: Mapping[str, str], log_path: Path, *, timeout: float = 30.0) -> Iterator[IMProcess]:
    """Starts `python -m services.im serve` and yields it once it listens.

    The address comes from the one line the server prints on stdout. Whatever
    the test does, the process is gone when the block ends (killed if a
    SIGTERM did not end it).
    """
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            python_module("services.im", "serve"),
            cwd=ROOT,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
        )
    try:
        assert process.stdout is not None
        address = _read_address(process, timeout)
        if address is None:
            process.kill()
            process.wait()
            raise AssertionError(
                f"the IM service printed no listening line within {timeout}s "
                f"(exit code {process.returncode}):\n{log_path.read_text(errors='replace')}"
            )
        yield IMProcess(process=process, address=address, log_path=log_path)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def _read_address(process: subprocess.Popen[bytes], timeout: float) -> str | None:
    assert process.stdout is not None
    fd = process.stdout.fileno()
    deadline = time.monotonic() + timeout
    seen = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (remaining := deadline - time.monotonic()) > 0:
            if not selector.select(remaining):
                break
            chunk = os.read(fd, 4096)
            if not chunk:  # the process closed stdout: it exited
                break
            seen += chunk
            if match := _LISTENING.search(seen):
                return f"{match['host'].decode()}:{match['port'].decode()}"
    return None
