"""Summarises a py-spy speedscope profile: where did the process spend its CPU?

py-spy (`py-spy record --format speedscope`) writes one sampled profile per
thread; this adds them up and reports, as shares of all samples, the time
spent in each library (by the file of the innermost frame, and inclusively)
and the hottest functions.

Run as `python -m bench.speedscope PROFILE.json [--top 15]`.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Checked in order: the first fragment found in a frame's file names its library.
_LIBRARIES: tuple[tuple[str, str], ...] = (
    ("/sqlalchemy/", "SQLAlchemy"),
    ("/greenlet", "greenlet (SQLAlchemy's async bridge)"),
    ("/asyncpg/", "asyncpg"),
    ("/aiosqlite/", "aiosqlite"),
    ("/sqlite3/", "sqlite3"),
    ("/google/", "protobuf"),
    ("grpc", "grpc"),
    # The entry point is the root of every main-thread stack, not where time goes.
    ("/__main__.py", _ENTRY := "entry point (__main__)"),
    ("/services/", "our code (services/)"),
    ("/uuid_utils/", "uuid_utils"),
    ("/asyncio/", "asyncio"),
    ("_asynciomodule", "asyncio"),
    ("libc.so", _LIBC := "libc (system calls)"),
    ("Modules/", _RUNTIME := "CPython runtime"),
    ("Include/", _RUNTIME),
    ("include/python3", _RUNTIME),
    ("Objects/", _RUNTIME),
    ("Python/", _RUNTIME),
    ("libpython3", _RUNTIME),
    ("<frozen", _STDLIB := "other stdlib"),
    ("/python3.", _STDLIB),
)
# Frames that do work on behalf of their caller: "attributed" time goes to the
# innermost frame of any other library (a send() under asyncpg is asyncpg's).
_ON_BEHALF = frozenset({_LIBC, _RUNTIME, _STDLIB, _ENTRY, "asyncio", "other"})


def library(file: str) -> str:
    """The library a source file belongs to, by its path."""
    for fragment, name in _LIBRARIES:
        if fragment in file:
            return name
    return "other"


@dataclass(frozen=True)
class Function:
    name: str
    file: str

    def label(self) -> str:
        parts = Path(self.file).parts
        short = "/".join(parts[-2:]) if parts else self.file
        return f"{self.name} ({short})"


@dataclass
class Summary:
    samples: float
    seconds_by_thread: Counter[str]
    self_by_library: Counter[str]
    attributed_by_library: Counter[str]
    inclusive_by_library: Counter[str]
    self_by_function: Counter[Function]
    inclusive_by_function: Counter[Function]

    def share(self, value: float) -> str:
        return f"{100 * value / self.samples:.1f}%" if self.samples else "n/a"


def summarise(path: Path) -> Summary:
    """Adds up every thread's samples of a speedscope file written by py-spy."""
    document: dict[str, Any] = json.loads(path.read_text())
    frames: list[dict[str, Any]] = document["shared"]["frames"]
    functions = [Function(str(f.get("name", "?")), str(f.get("file", "?"))) for f in frames]
    libraries = [library(f.file) for f in functions]
    summary = Summary(0.0, Counter(), Counter(), Counter(), Counter(), Counter(), Counter())
    for profile in document.get("profiles", []):
        if profile.get("type") != "sampled":
            continue
        thread = str(profile.get("name", "?"))
        for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
            if not stack:
                continue
            # py-spy weighs each sample by its interval in seconds.
            summary.samples += weight
            summary.seconds_by_thread[thread] += weight
            leaf = stack[-1]
            summary.self_by_library[libraries[leaf]] += weight
            owner = next((libraries[i] for i in reversed(stack) if libraries[i] not in _ON_BEHALF), None)
            summary.attributed_by_library[owner or libraries[leaf]] += weight
            summary.self_by_function[functions[leaf]] += weight
            for name in {libraries[i] for i in stack}:
                summary.inclusive_by_library[name] += weight
            for function in {functions[i] for i in stack}:
                summary.inclusive_by_function[function] += weight
    return summary


def render(summary: Summary, *, top: int = 15) -> str:
    """A Markdown report of a summary."""
    threads = ", ".join(
        f"{name} {seconds:.2f} s" for name, seconds in summary.seconds_by_thread.most_common()
    )
    lines = [
        f"{summary.samples:.2f} s of active samples: {threads}. Shares are of all active samples.",
        "",
        "Self: the innermost frame's library. Attributed: system calls, interpreter and stdlib "
        "frames charged to the innermost library that called them. Inclusive: anywhere on the stack.",
        "",
        "| Library | Self | Attributed | Inclusive |",
        "|---|---:|---:|---:|",
    ]
    for name, weight in summary.attributed_by_library.most_common():
        lines.append(
            f"| {name} | {summary.share(summary.self_by_library[name])} | {summary.share(weight)} "
            f"| {summary.share(summary.inclusive_by_library[name])} |"
        )
    for name, weight in summary.self_by_library.most_common():
        if name not in summary.attributed_by_library:
            lines.append(
                f"| {name} | {summary.share(weight)} | 0.0% "
                f"| {summary.share(summary.inclusive_by_library[name])} |"
            )
    lines += ["", "| Hottest functions (self) | Self |", "|---|---:|"]
    for function, weight in summary.self_by_function.most_common(top):
        lines.append(f"| `{function.label()}` | {summary.share(weight)} |")
    lines += ["", "| Hottest functions (inclusive) | Inclusive |", "|---|---:|"]
    for function, weight in summary.inclusive_by_function.most_common(top):
        lines.append(f"| `{function.label()}` | {summary.share(weight)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.speedscope", description=__doc__)
    parser.add_argument("profile", type=Path, help="speedscope JSON written by py-spy")
    parser.add_argument("--top", type=int, default=15, help="functions to list")
    options = parser.parse_args(argv)
    print(render(summarise(options.profile), top=options.top))


if __name__ == "__main__":
    main()
