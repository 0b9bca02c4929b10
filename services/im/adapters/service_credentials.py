"""Service credentials: which services may get access tokens, and with which secret.

The IM reads a file (`AUTH_SERVICE_CREDENTIALS_FILE`) of lines
`name:<sha256 hex of the secret>` (blank lines and `#` comments allowed),
so that it holds no secret itself. The embedded default makes one on first
start, with a secret for each of the services that run beside the IM,
each written to `<name>.secret` in the same directory for that service to
read; all files are mode 0600 and nothing is printed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

EMBEDDED_SERVICES = ("runtime", "memory")
SERVICE_SECRET_PREFIX = "aim_svc_"
_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class CredentialsError(Exception):
    """The credentials file cannot be used; `problems` lists why."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def read_credentials(path: Path) -> dict[str, str]:
    """Service name -> SHA-256 hex of its secret.

    Raises:
        CredentialsError: unreadable, or a line that is not `name:<64 hex digits>`
            (the line is named by number, never shown).
    """
    try:
        text = path.read_text()
    except OSError as error:
        raise CredentialsError([f"cannot read {path}: {error.strerror}"]) from None
    found: dict[str, str] = {}
    problems: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, _, digest = line.partition(":")
        name, digest = name.strip(), digest.strip().lower()
        if not _NAME.match(name) or not _DIGEST.match(digest):
            problems.append(f"{path} line {number}: expected name:<sha256 hex of the secret>")
        elif name in found:
            problems.append(f"{path} line {number}: service {name!r} is listed twice")
        else:
            found[name] = digest
    if problems:
        raise CredentialsError(problems)
    return found


def _write_private(path: Path, text: str) -> None:
    scratch = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    descriptor = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w") as out:
            out.write(text)
        os.replace(scratch, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            scratch.unlink()
        raise


def ensure_embedded_credentials(path: Path, services: Iterable[str] = EMBEDDED_SERVICES) -> None:
    """Makes the credentials file and each service's `<name>.secret` beside it, if missing.

    A file that exists is left as it is (an operator's edits stay).
    """
    if path.exists():
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lines = ["# Agent IM service credentials: name:<sha256 hex of the service's secret>"]
    for name in services:
        secret_file = path.parent / f"{name}.secret"
        if secret_file.exists():
            secret = secret_file.read_text().strip()
        else:
            secret = SERVICE_SECRET_PREFIX + secrets.token_urlsafe(32)
            _write_private(secret_file, secret + "\n")
        lines.append(f"{name}:{hashlib.sha256(secret.encode()).hexdigest()}")
    _write_private(path, "\n".join(lines) + "\n")
    logger.info("made service credentials for %s in %s", ", ".join(services), path.parent)
