"""The IM's keys and service credentials as an operator meets them: made on
first start by the embedded default (private, never printed), rotated with
`keygen --next` and SIGHUP, and required on PostgreSQL."""

from __future__ import annotations

import signal
import stat
import subprocess
import time
from pathlib import Path

import grpc

from agentim.im.v1 import auth_pb2, auth_pb2_grpc

from . import ROOT, im_environment, migrate_im, python_module, running_im


def _signing_kids(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        response = auth_pb2_grpc.AuthServiceStub(channel).GetSigningKeys(
            auth_pb2.GetSigningKeysRequest(), timeout=5
        )
        return [key.kid for key in response.keys]


def _keygen(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        python_module("services.im", "keygen", *args),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_embedded_default_makes_private_keys_and_a_sighup_publishes_the_next_one(tmp_path: Path) -> None:
    env = im_environment(tmp_path)
    migrate_im(env)
    with running_im(env, tmp_path / "im.log") as im:
        keys = sorted((tmp_path / "keys").glob("*.pem"))
        secrets = tmp_path / "secrets"
        made = [*keys, secrets / "service-credentials", secrets / "runtime.secret", secrets / "memory.secret"]
        assert len(keys) == 1
        for path in made:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
        first = _signing_kids(im.address)
        assert first == [keys[0].name.removesuffix(".pem")]
        made_next = _keygen(env, "--next")
        assert made_next.returncode == 0, made_next.stderr
        im.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while len(kids := _signing_kids(im.address)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(kids) == 2 and first[0] in kids
        assert im.terminate() == 0
        # Nothing secret was printed or logged.
        printed = im.log()
        for path in made:
            secret = path.read_text().strip()
            for line in secret.splitlines():
                if not line.startswith(("-----", "#")):
                    assert line not in printed
    # `keygen --if-missing` leaves a directory that has a key alone.
    again = _keygen(env, "--if-missing")
    assert again.returncode == 0 and "already" in again.stdout
    assert len(list((tmp_path / "keys").glob("*.pem"))) == 2


def test_on_postgresql_the_im_refuses_to_start_without_a_signing_key(tmp_path: Path) -> None:
    env = im_environment(
        tmp_path,
        DATABASE_URL="postgresql://nobody@127.0.0.1:1/none",
        AUTH_SIGNING_KEYS_DIR=str(tmp_path / "no-keys"),
        AUTH_SERVICE_CREDENTIALS_FILE=str(tmp_path / "missing-credentials"),
    )
    result = subprocess.run(
        python_module("services.im", "serve"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    # Every problem is listed at once.
    assert "AUTH_SIGNING_KEYS_DIR" in result.stderr and "keygen" in result.stderr
    assert "AUTH_SERVICE_CREDENTIALS_FILE" in result.stderr
    assert not (tmp_path / "no-keys").exists()
