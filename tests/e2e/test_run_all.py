"""`make run`'s launcher: migrates, starts every service, stops them all cleanly."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example(lead: str = "From Python") -> str:
    """The README's Python example after the paragraph starting with `lead`."""
    match = re.search(re.escape(lead) + r"[^\n]*\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert match is not None, f"the README has lost its Python example after {lead!r}"
    return match.group(1)


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def test_run_all_starts_the_system_and_stops_it(tmp_path: Path) -> None:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("AGENTIM_", "IM_", "RUNTIME_", "MEMORY_", "OPENAI_", "GATEWAY_", "AUTH_"))
        and key not in {"DATABASE_URL", "REDIS_URL"}
    }
    env.update(
        AGENTIM_DATA_DIR=str(tmp_path),
        IM_GRPC_ADDRESS="127.0.0.1:0",
        RUNTIME_GRPC_ADDRESS="127.0.0.1:0",
        MEMORY_GRPC_ADDRESS="127.0.0.1:0",
        GATEWAY_HTTP_ADDRESS="127.0.0.1:0",
        LOG_LEVEL="WARNING",
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "services.run_all"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        im_line = process.stdout.readline()
        memory_line = process.stdout.readline()
        runtime_line = process.stdout.readline()
        assert im_line.startswith("IM service listening on 127.0.0.1:"), im_line
        assert memory_line.startswith("memory service listening on 127.0.0.1:"), memory_line
        assert f"IM at {im_line.split()[4]}" in memory_line
        assert runtime_line.startswith("runtime service listening on 127.0.0.1:"), runtime_line
        assert "offline model" in runtime_line
        gateway_line = process.stdout.readline()
        open_line = process.stdout.readline()
        assert gateway_line.startswith("HTTP gateway listening on 127.0.0.1:"), gateway_line
        gateway = gateway_line.split()[4]
        assert f"IM at {im_line.split()[4]}" in gateway_line
        assert f"runtime at {runtime_line.split()[4]}" in gateway_line
        assert open_line.strip() == f"Open http://{gateway}/ in a browser", open_line
        with urllib.request.urlopen(f"http://{gateway}/healthz", timeout=10) as health:
            assert json.load(health)["status"] == "SERVING"
        with urllib.request.urlopen(f"http://{gateway}/", timeout=10) as page:
            assert page.status == 200 and "html" in page.headers["Content-Type"]
        assert serving(im_line.split()[4])
        assert serving(runtime_line.split()[4])
        assert serving(memory_line.split()[4])
        assert (tmp_path / "im.db").exists() and (tmp_path / "runtime.db").exists()
        assert (tmp_path / "memory.db").exists()
        # The README's Python example works against it as written (but for the ports).
        example = readme_example().replace("127.0.0.1:50051", im_line.split()[4])
        example = example.replace("127.0.0.1:50052", runtime_line.split()[4])
        ran = subprocess.run(
            [sys.executable, "-c", example], check=False, capture_output=True, text=True, timeout=60
        )
        assert ran.returncode == 0, ran.stderr
        assert "You said: hello!" in ran.stdout
        control = readme_example("Pausing an agent, correcting it and handing it work")
        control = control.replace("127.0.0.1:50051", im_line.split()[4])
        control = control.replace("127.0.0.1:50052", runtime_line.split()[4])
        ran = subprocess.run(
            [sys.executable, "-c", control], check=False, capture_output=True, text=True, timeout=60
        )
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.splitlines()[0] == "True True"
        assert ran.stdout.splitlines()[1].startswith("done: ") and "summarise the week" in ran.stdout
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
