"""The web UI in a real browser: the whole system as `make run` starts it, driven by headless Chromium.

The script (tests/e2e/browser/ui.test.mjs, playwright-core) creates a
workspace with a password (its creator signed in by an HttpOnly session
cookie), signs out and in again (login and password: no workspace id),
links the owner's account at a real OpenID provider (npm's oidc-provider,
tests/e2e/oidc/provider.mjs), signs out and in with the organisation,
creates two agents, chats, watches an
agent's steps stream, and checks replies, mentions and that hostile content
stays inert. The owner invites a second person from the account dialog (the
link shown once); a second browser opens the link, joins and is signed in,
and sees an unread badge appear live. That person creates a read-only
personal access token (shown once), which a program uses to read but not to
send, and revokes it; signing out returns to the sign-in page, and the old
cookie is refused. The main journey (a workspace, an agent, a chat with long
words, unbroken text, a URL and code, the agent panel, the chat list) runs
first on a desktop window and then at phone size (390x844), checking at each
screen that nothing overflows sideways and that a phone shows one column at
a time. Then agent control: it pauses a third agent (a
message sent meanwhile waits), edits one of its steps and adds a note,
resumes it and sees it go on from the corrected context and answer; forks
from a step into a new session that becomes the main thread (and makes the
first main again); creates a checkpoint; queues tasks while paused, cancels
one and sees the other succeed (the queue's counters agreeing with its
list); restores the checkpoint; terminates and starts the agent.
Screenshots go to artifacts/browser/.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from tests.fake_openai import FakeOpenAI, Received, Reply, text_reply

from . import ROOT, in_ci

CHROMIUM = Path("/usr/bin/chromium")
SCRIPT = ROOT / "tests" / "e2e" / "browser" / "ui.test.mjs"
ARTIFACTS = ROOT / "artifacts" / "browser"
PLAYWRIGHT = ROOT / "node_modules" / "playwright-core"
GATEWAY = ROOT / "gateway"
RUNNING = "Agent IM is running"
START_SECONDS = 90.0
BROWSER_SECONDS = 240.0
STOP_SECONDS = 30.0
# "IM service listening on 127.0.0.1:50051 (...)" -> {"IM service": "127.0.0.1:50051"}
_LISTENING = re.compile(r"^(?P<what>.+?) listening on (?P<address>[^\s:]+:\d+)")
# Settings the test chooses itself: a developer's own must not leak in.
_SERVICE_PREFIXES = (
    "AGENTIM_",
    "IM_",
    "RUNTIME_",
    "GATEWAY_",
    "OPENAI_",
    "GRPC_",
    "LLM_",
    "TOOL_",
    "AUTH_",
    "OIDC_",
    "MEMORY_",
)
PROVIDER_SCRIPT = ROOT / "tests" / "e2e" / "oidc" / "provider.mjs"
OIDC_CLIENT_ID = "agentim-browser-test"
OIDC_CLIENT_SECRET = "browser-test-secret"
# The owner's organisation account, which the browser links and signs in with.
OIDC_LOGIN = "ada@acme.example"
_SERVICE_NAMES = {"DATABASE_URL", "REDIS_URL", "LOG_LEVEL", "SHUTDOWN_GRACE_SECONDS"}


def _missing_or_skip() -> str:
    """The node command; skips (fails in CI) when something the test needs is missing."""
    node = shutil.which("node")
    missing = []
    if not CHROMIUM.exists():
        missing.append(f"{CHROMIUM} (`make install` as root installs Debian's chromium)")
    if not (GATEWAY / "__main__.py").is_file() or not (GATEWAY / "static" / "index.html").is_file():
        missing.append("the HTTP gateway and its web UI (gateway/__main__.py, gateway/static/index.html)")
    if node is None:
        missing.append("the node command")
    if not PLAYWRIGHT.is_dir():
        missing.append("node_modules/playwright-core (run `make install`)")
    if missing:
        reason = f"browser test needs: {'; '.join(missing)}"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    assert node is not None
    return node


def _environment(data_dir: Path) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(_SERVICE_PREFIXES) and key not in _SERVICE_NAMES
    }
    env.update(
        AGENTIM_DATA_DIR=str(data_dir),
        IM_GRPC_ADDRESS="127.0.0.1:0",
        RUNTIME_GRPC_ADDRESS="127.0.0.1:0",
        # Not the fixed default: another system on this machine may hold it.
        MEMORY_GRPC_ADDRESS="127.0.0.1:0",
        GATEWAY_HTTP_ADDRESS="127.0.0.1:0",
        LOG_LEVEL="WARNING",
        SHUTDOWN_GRACE_SECONDS="2",
        # An agent's failing endpoint (the flaky one) fails its run at once.
        LLM_MAX_RETRIES="0",
        # The fake model servers listen on loopback, which agents may not use unless listed.
        RUNTIME_LLM_ALLOWED_HOSTS="127.0.0.1",
    )
    return env


# The fake endpoint's models: the flaky one is down for its first request
# and answers after; the slow one streams its answer over a few seconds.
FLAKY_MODEL = "fake-model"
SLOW_MODEL = "slow-model"


@contextmanager
def _fake_models() -> Iterator[str]:
    """An OpenAI-compatible endpoint, in a thread of its own, serving the
    flaky and the slow model (by the request's model name); yields its URL."""
    loop = asyncio.new_event_loop()
    fake = FakeOpenAI()
    flaky_calls = itertools.count()
    down = Reply(503, body={"error": {"message": "the model is loading", "type": "server_error"}})

    def respond(request: Received) -> Reply:
        if request.body.get("model") == SLOW_MODEL:
            return replace(text_reply("Slowly, slowly: here is my considered answer."), delay=0.25)
        return down if next(flaky_calls) == 0 else text_reply("Back now: here is my answer.")

    fake.responder = respond
    thread = threading.Thread(target=loop.run_forever, name="fake-models", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(fake.start(), loop).result(10)
    try:
        yield fake.url
    finally:
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _announced_listening(lines: list[str]) -> bool:
    return any(" listening on " in line for line in lines)


@dataclass
class Service:
    """A child process whose stdout lines announce where it listens."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    lines: list[str] = field(default_factory=list)

    def addresses(self) -> dict[str, str]:
        found = (_LISTENING.match(line) for line in self.lines)
        return {m["what"]: m["address"] for m in found if m}

    def read_until(self, done: Callable[[list[str]], bool], timeout: float) -> dict[str, str]:
        """Reads stdout lines until `done(lines)`; returns the addresses announced so far."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        pending = b""
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while not done(self.lines):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not selector.select(remaining):
                    raise AssertionError(f"no sign of readiness within {timeout}s:\n{self.report()}")
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise AssertionError(f"the process exited ({self.process.wait()}):\n{self.report()}")
                pending += chunk
                *complete, pending = pending.split(b"\n")
                self.lines += [line.decode(errors="replace").strip() for line in complete]
        return self.addresses()

    def report(self) -> str:
        log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "--- stdout ---\n" + "\n".join(self.lines) + f"\n--- stderr ({self.log_path.name}) ---\n{log}"

    def terminate(self) -> int:
        """SIGTERM, then waits; kills it if it ignores that. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"{self.name} ignored SIGTERM:\n{self.report()}") from None


@contextmanager
def _service(module: str, env: Mapping[str, str], log_path: Path) -> Iterator[Service]:
    """Runs `python -m module`; whatever happens, it is stopped when the block ends."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", module],
            cwd=ROOT,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
        )
    service = Service(module, process, log_path)
    try:
        yield service
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()


@contextmanager
def _oidc_provider(node: str) -> Iterator[tuple[str, Callable[[str], None]]]:
    """A real OpenID provider (tests/e2e/oidc/provider.mjs); yields its issuer URL and
    a function that registers the gateway's callback URL with it."""
    process = subprocess.Popen(
        [node, str(PROVIDER_SCRIPT)],
        cwd=ROOT,
        env={
            **os.environ,
            "OIDC_TEST_CLIENT_ID": OIDC_CLIENT_ID,
            "OIDC_TEST_CLIENT_SECRET": OIDC_CLIENT_SECRET,
        },
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout

    def configure(callback: str) -> None:
        stdin.write(json.dumps({"redirect_uris": [callback]}) + "\n")
        stdin.flush()
        assert json.loads(stdout.readline()) == {"ready": True}

    try:
        yield json.loads(stdout.readline())["issuer"], configure
    finally:
        stdin.close()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _run_browser(node: str, url: str, model_url: str) -> tuple[int, str]:
    """Runs the Playwright script; on a timeout it is stopped (SIGTERM lets it close Chromium)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "AGENTIM_UI_URL": url,
        "AGENTIM_FAKE_LLM_URL": model_url,
        "AGENTIM_ARTIFACTS": str(ARTIFACTS),
        "CHROMIUM": str(CHROMIUM),
        "AGENTIM_OIDC_LOGIN": OIDC_LOGIN,
    }
    process = subprocess.Popen(
        [node, str(SCRIPT)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=BROWSER_SECONDS)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        return -1, f"the browser script took over {BROWSER_SECONDS}s\n{output}"
    return process.returncode, output


@pytest.mark.timeout(START_SECONDS + BROWSER_SECONDS + 2 * STOP_SECONDS)
def test_the_web_ui_drives_the_whole_system_in_a_real_browser(tmp_path: Path) -> None:
    node = _missing_or_skip()
    env = _environment(tmp_path)
    with ExitStack() as stack:
        issuer, register_callback = stack.enter_context(_oidc_provider(node))
        env.update(OIDC_ISSUER=issuer, OIDC_CLIENT_ID=OIDC_CLIENT_ID, OIDC_CLIENT_SECRET=OIDC_CLIENT_SECRET)
        system = stack.enter_context(_service("services.run_all", env, tmp_path / "run_all.log"))
        addresses = system.read_until(lambda lines: any(RUNNING in line for line in lines), START_SECONDS)
        assert "IM service" in addresses and "runtime service" in addresses, system.report()
        assert "offline model" in "\n".join(system.lines), "the test expects the built-in offline model"
        services = [system]
        url_address = next((a for what, a in addresses.items() if "gateway" in what.lower()), None)
        if url_address is None:
            # run_all does not start the gateway (yet): run it beside the system, as an operator would.
            gateway_env = {
                **env,
                "IM_ADDRESS": addresses["IM service"],
                "RUNTIME_ADDRESS": addresses["runtime service"],
            }
            gateway = stack.enter_context(_service("gateway", gateway_env, tmp_path / "gateway.log"))
            announced = gateway.read_until(_announced_listening, START_SECONDS)
            url_address = next(iter(announced.values()), None)
            assert url_address is not None, gateway.report()
            services.insert(0, gateway)

        register_callback(f"http://{url_address}/v1/auth/oidc/callback")
        model_url = stack.enter_context(_fake_models())
        code, output = _run_browser(node, f"http://{url_address}/", model_url)
        logs = "\n".join(service.report() for service in services)
        assert code == 0, f"browser script failed (exit {code}); screenshots in {ARTIFACTS}\n{output}\n{logs}"
        assert "all browser checks passed" in output, output

        for service in services:
            assert service.terminate() == 0, f"{service.name} did not stop cleanly:\n{logs}"
