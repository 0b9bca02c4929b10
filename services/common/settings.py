"""Reading settings from the environment, reporting every problem at once."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


class ConfigError(Exception):
    """Raised with the full list of missing or malformed settings."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))
        self.problems = problems


class EnvReader:
    """Reads typed values from an environment mapping, collecting errors.

    Call `finish()` once all values are read: it raises `ConfigError` naming
    every bad variable. Values of variables named in `secret` never appear in
    a message.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = os.environ if environ is None else environ
        self._problems: list[str] = []
        self.names_read: set[str] = set()

    def text(self, name: str, default: str) -> str:
        self.names_read.add(name)
        return self._environ.get(name, default).strip() or default

    def optional(self, name: str) -> str | None:
        self.names_read.add(name)
        value = self._environ.get(name, "").strip()
        return value or None

    def integer(self, name: str, default: int, *, minimum: int = 0) -> int:
        self.names_read.add(name)
        raw = self._environ.get(name, "").strip()
        if not raw:
            return default
        try:
            value = int(raw)
        except ValueError:
            self._problems.append(f"{name}: expected an integer, got {raw!r}")
            return default
        if value < minimum:
            self._problems.append(f"{name}: must be at least {minimum}, got {value}")
            return default
        return value

    def number(self, name: str, default: float, *, minimum: float = 0.0) -> float:
        self.names_read.add(name)
        raw = self._environ.get(name, "").strip()
        if not raw:
            return default
        try:
            value = float(raw)
        except ValueError:
            self._problems.append(f"{name}: expected a number, got {raw!r}")
            return default
        if value < minimum:
            self._problems.append(f"{name}: must be at least {minimum}, got {value}")
            return default
        return value

    def flag(self, name: str, default: bool) -> bool:
        self.names_read.add(name)
        raw = self._environ.get(name, "").strip().lower()
        if not raw:
            return default
        if raw in {"1", "true", "yes", "on"}:
            return True
        if raw in {"0", "false", "no", "off"}:
            return False
        self._problems.append(f"{name}: expected true or false, got {raw!r}")
        return default

    def choice(self, name: str, default: str, choices: set[str]) -> str:
        value = self.text(name, default)
        if value.upper() not in {c.upper() for c in choices}:
            self._problems.append(f"{name}: expected one of {sorted(choices)}, got {value!r}")
            return default
        return value.upper()

    def address(self, name: str, default: str) -> str:
        value = self.text(name, default)
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            self._problems.append(f"{name}: expected host:port, got {value!r}")
            return default
        return value

    def problem(self, message: str) -> None:
        self._problems.append(message)

    def finish(self) -> None:
        if self._problems:
            raise ConfigError(self._problems)


def default_data_dir(reader: EnvReader) -> Path:
    """`AGENTIM_DATA_DIR`: where the embedded default keeps its files."""
    return Path(reader.text("AGENTIM_DATA_DIR", "./data")).expanduser()
