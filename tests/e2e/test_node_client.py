"""Node.js clients (tests/e2e/node/) against the IM and runtime services run as real processes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from . import ROOT, im_environment, in_ci, migrate_im, running_im

NODE_TESTS = ROOT / "tests" / "e2e" / "node"
NODE_MODULES = ROOT / "node_modules"
_REQUIRED_PACKAGES = ("@grpc/grpc-js", "@grpc/proto-loader")


def _node() -> str:
    node = shutil.which("node")
    missing = [] if node else ["the node command"]
    missing += [f"node_modules/{p}" for p in _REQUIRED_PACKAGES if not (NODE_MODULES / p).is_dir()]
    if missing:
        reason = f"not found: {', '.join(missing)}; run `make install`"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    assert node is not None
    return node


def _count(output: str, name: str) -> int:
    match = re.search(rf"^# {name} (\d+)$", output, re.MULTILINE)
    return int(match[1]) if match else -1


@contextmanager
def running_runtime(env: dict[str, str], im_address: str) -> Iterator[str]:
    """`python -m services.runtime serve` (offline model) beside the IM; yields its address."""
    env = {**env, "IM_ADDRESS": im_address, "RUNTIME_GRPC_ADDRESS": "127.0.0.1:0", "LOG_LEVEL": "WARNING"}
    subprocess.run([sys.executable, "-m", "services.runtime", "migrate"], cwd=ROOT, env=env, check=True)
    process = subprocess.Popen(
        [sys.executable, "-m", "services.runtime", "serve"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("runtime service listening on "), line
        yield line.split()[4]
        process.terminate()
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_node_client_uses_the_im_service_then_the_server_stops_gracefully(tmp_path: Path) -> None:
    node = _node()
    env = im_environment(tmp_path)
    migrate_im(env)
    with running_im(env, tmp_path / "im.log") as im, running_runtime(env, im.address) as runtime:
        result = subprocess.run(
            [node, "--test", "--test-reporter=tap", str(NODE_TESTS)],
            cwd=ROOT,
            env={**os.environ, "IM_ADDRESS": im.address, "RUNTIME_ADDRESS": runtime},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        report = f"node output:\n{result.stdout}\n{result.stderr}\n--- IM server log ---\n{im.log()}"
        assert result.returncode == 0, report
        # A suite that skipped itself (no IM_ADDRESS) would also exit 0.
        assert _count(result.stdout, "pass") > 0, report
        assert _count(result.stdout, "fail") == 0, report
        assert _count(result.stdout, "skipped") == 0, report

        try:
            exit_code = im.terminate(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the IM service ignored SIGTERM for 10 s:\n{im.log()}")
        assert exit_code == 0, f"the IM service exited {exit_code} on SIGTERM:\n{im.log()}"
        assert "shutting down" in im.log()
