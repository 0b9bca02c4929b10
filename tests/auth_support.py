"""Signing keys and service credentials for tests, made once per test process.

Every IM a test starts gets them through `auth_environment()` (the
PostgreSQL ones need a key; the SQLite ones would otherwise make theirs
under AGENTIM_DATA_DIR), and cheap argon2 parameters: the same algorithm,
at a cost that keeps the suite fast. A test that rotates keys makes a key
directory of its own.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from services.common.tokens import KeyRing
from services.im.adapters.service_credentials import ensure_embedded_credentials

_made: list[Path] = []


def auth_dir() -> Path:
    """The process's directory with `keys/` and `secrets/` (made on first use, removed at exit)."""
    if not _made:
        root = Path(tempfile.mkdtemp(prefix="agentim-test-auth-"))
        atexit.register(shutil.rmtree, root, True)
        KeyRing.generate(root / "keys")
        ensure_embedded_credentials(root / "secrets" / "service-credentials")
        _made.append(root)
    return _made[0]


def auth_environment() -> dict[str, str]:
    """IM settings pointing at the test keys and credentials, with cheap argon2."""
    return {**credentials_environment(), "AUTH_ARGON2_MEMORY_KIB": "8192", "AUTH_ARGON2_TIME_COST": "1"}


def credentials_environment() -> dict[str, str]:
    """Every service's settings naming the test keys and credentials (benchmarks
    start their servers with these, to call them with `tests.identities` tokens)."""
    root = auth_dir()
    return {
        "AUTH_SIGNING_KEYS_DIR": str(root / "keys"),
        "AUTH_SERVICE_CREDENTIALS_FILE": str(root / "secrets" / "service-credentials"),
        # Where the runtime and the memory service find their credentials.
        **service_environment(),
    }


def service_environment() -> dict[str, str]:
    """The runtime's and the memory service's settings naming their credentials."""
    root = auth_dir()
    return {
        "RUNTIME_SERVICE_SECRET_FILE": str(root / "secrets" / "runtime.secret"),
        "MEMORY_SERVICE_SECRET_FILE": str(root / "secrets" / "memory.secret"),
    }


def service_secret(name: str) -> str:
    """The secret of a service configured in the test credentials (runtime, memory)."""
    return (auth_dir() / "secrets" / f"{name}.secret").read_text().strip()
