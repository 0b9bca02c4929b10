"""Runs the whole system on one machine: `python -m services.run_all`.

Applies every service's migrations, makes the IM's signing key if it has
none (`python -m services.im keygen --if-missing`: on PostgreSQL the IM
makes none itself), starts the IM service, then the memory
service and the agent runtime (both pointed at the IM), then the HTTP
gateway (pointed at the IM and the runtime), prints
where each listens and the URL to open in a browser, and stops them all
(gracefully, in reverse order) on SIGINT or SIGTERM, or when one of them
exits. This is what `make run` does, with the embedded default unless
DATABASE_URL / REDIS_URL say otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from types import FrameType

# Services with a database to migrate; the gateway has none.
SERVICES = ("services.im", "services.memory", "services.runtime")
STOP_SECONDS = 20


def _start(module: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """Starts `python -m module serve`; returns it and its address (from its first line)."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, "serve"], env=env, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line:
        process.wait()
        raise SystemExit(f"{module} did not start (exit code {process.returncode})")
    print(line, flush=True)
    return process, line.split()[4]


def _browser_url(address: str) -> str:
    """The URL of a listening address, with loopback for a wildcard host."""
    host, _, port = address.rpartition(":")
    if host in {"0.0.0.0", "::", "[::]", ""}:
        host = "127.0.0.1"
    return f"http://{host}:{port}/"


def main() -> int:
    env = dict(os.environ)
    for module in SERVICES:
        subprocess.run([sys.executable, "-m", module, "migrate"], env=env, check=True)
    subprocess.run(
        [sys.executable, "-m", "services.im", "keygen", "--if-missing"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    started: list[subprocess.Popen[str]] = []
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        im, im_address = _start("services.im", env)
        started.append(im)
        env["IM_ADDRESS"] = im_address
        memory, memory_address = _start("services.memory", env)
        started.append(memory)
        env["MEMORY_ADDRESS"] = memory_address
        runtime, runtime_address = _start("services.runtime", env)
        started.append(runtime)
        env["RUNTIME_ADDRESS"] = runtime_address
        gateway, gateway_address = _start("gateway", env)
        started.append(gateway)
        print(f"Open {_browser_url(gateway_address)} in a browser", flush=True)
        print("Agent IM is running; press Ctrl-C to stop.", flush=True)
        while not stop.wait(0.5):
            if any(p.poll() is not None for p in started):
                print("a service exited; stopping the others", file=sys.stderr, flush=True)
                break
    finally:
        for process in reversed(started):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(STOP_SECONDS)
                except subprocess.TimeoutExpired:
                    process.kill()
    return max((p.returncode or 0) for p in started) if started else 1


if __name__ == "__main__":
    sys.exit(main())
