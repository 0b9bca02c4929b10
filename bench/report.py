"""How the benchmarks report: markdown cells and tables, and their section of docs/benchmarks.md.

Each benchmark renders one `## ...` section; `update_section` puts it in
place of the section of the same title (or at the end), keeping the other
sections of the file, and `run_and_record` runs a benchmark, prints its
section and writes it. A figure that was not measured is `nan` and shows as
`n/a`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import os
import platform
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc

from bench.harness import ROOT, BenchError, code_version

DOC = ROOT / "docs" / "benchmarks.md"
NEW_DOC = (
    "# Benchmarks\n\nMeasured performance of the Agent IM services. Each section is written by its "
    "benchmark script and regenerated when the script runs again.\n"
)

R = TypeVar("R")
Opts = TypeVar("Opts", bound="Recordable")

_NEXT_SECTION = re.compile(r"^## ", re.MULTILINE)


# --- cells -------------------------------------------------------------------------


def fixed(value: float, digits: int = 2) -> str:
    """A number with `digits` decimals, no thousands separator (`n/a` for nan)."""
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def grouped(value: float, digits: int = 0) -> str:
    """A number with thousands separators (`n/a` for nan)."""
    return "n/a" if math.isnan(value) else f"{value:,.{digits}f}"


def percent(cores: float) -> str:
    """A share (CPU in cores, 1.0 = one core) as a whole percentage (`n/a` for nan)."""
    return "n/a" if math.isnan(cores) else f"{100 * cores:.0f}%"


def status(met: bool) -> str:
    """A target's status cell."""
    return "met" if met else "**not met**"


def tally(counts: Counter[str]) -> str:
    """`3 idle, 1 error`: counts by key, in key order (`none` if empty)."""
    return ", ".join(f"{n:,} {key}" for key, n in sorted(counts.items())) or "none"


def errors_note(errors: Counter[str]) -> str:
    """`; errors: UNAVAILABLE 2` to append to a cell, or nothing when there was none."""
    return f"; errors: {', '.join(f'{k} {v}' for k, v in sorted(errors.items()))}" if errors else ""


# --- tables and sections -------------------------------------------------------------


def row(*cells: object) -> str:
    """A markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table_head(*columns: str, align: str = "") -> list[str]:
    """A markdown table's header and alignment rows. `align` has an `l` (left)
    or `r` (right) per column; by default the first column (labels) is left
    and the others (figures) right."""
    align = align or "l" + "r" * (len(columns) - 1)
    if len(align) != len(columns) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r} does not fit {len(columns)} columns")
    return [row(*columns), "|" + "".join("---|" if a == "l" else "---:|" for a in align)]


def preamble(title: str, command: str, versions: tuple[str, str], seconds: float) -> list[str]:
    """The opening of a section of the benchmarks that run the services from a snapshot:
    the command, the code measured (and whether HEAD moved meanwhile), the date and the machine."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    moved = versions[0].split()[0] != versions[1].split()[0]
    return [
        title,
        "",
        f"Command: `{command}` (took {seconds / 60:.1f} min)",
        "",
        f"Code: {versions[0]}" + (f"; HEAD was {versions[1]} at the end" if moved else "") + ". The servers "
        "run from a copy of that code taken at the start, so edits made meanwhile do not affect them.",
        "",
        f"Date: {now}. Machine: {os.cpu_count()} cores, {platform.platform()}, Python "
        f"{platform.python_version()}, grpcio {grpc.__version__}; load average at the end {load[0]:.2f}. "
        "The machine is shared and noisy, and its 2 cores run the benchmark client, the IM, the runtime, "
        "the fake LLM server, PostgreSQL and Redis together: read the figures as orders of magnitude.",
        "",
    ]


def problems_section(problems: Iterable[tuple[str, Counter[str]]]) -> list[str]:
    """What the services logged at WARNING and above, by service (see `Service.problems`)."""
    found = [(name, counts) for name, counts in problems if counts]
    if not found:
        return ["No service logged a warning or an error.", ""]
    lines = ["### Logged warnings and errors", "", "Counted by message (ids replaced by `<id>`):", ""]
    for name, counts in found:
        lines += [f"{name}: {sum(counts.values()):,} lines", ""]
        lines += [f"    {n:>6,} x {message}" for message, n in counts.most_common(8)]
        lines.append("")
    return lines


def update_section(path: Path, section: str, title: str) -> None:
    """Replaces the section headed `title` (up to the next `## `) with `section`,
    or appends it; the file's other sections are kept."""
    text = path.read_text() if path.exists() else NEW_DOC
    start = text.find(title)
    if start < 0:
        text = text.rstrip() + "\n\n" + section
    else:
        following = _NEXT_SECTION.search(text, start + len(title))
        rest = text[following.start() :] if following else ""
        text = text[:start] + section + ("\n" + rest if rest else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --- running and recording -------------------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    """How a benchmark was run, for its section: the command, the code
    (what the servers ran from, and HEAD at the end), and how long it took."""

    command: str
    versions: tuple[str, str]
    seconds: float


class Recordable(Protocol):
    """A benchmark's options, which say whether to write docs/benchmarks.md."""

    @property
    def write_doc(self) -> bool: ...


def add_doc_option(parser: argparse.ArgumentParser) -> None:
    """--no-doc: print the section without writing it to docs/benchmarks.md."""
    parser.add_argument("--no-doc", action="store_true", help=f"do not update {DOC.relative_to(ROOT)}")


def run_and_record(
    module: str,
    argv: Sequence[str] | None,
    options: Opts,
    *,
    run: Callable[[Opts], Coroutine[Any, Any, tuple[R, str]]],
    render: Callable[[R, Opts, Recorded], str],
    title: str,
    python: str = ".venv/bin/python",
) -> None:
    """Runs a benchmark (`run` returns its results and the code it measured),
    prints its section and, unless `--no-doc`, writes it to docs/benchmarks.md under `title`."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    command = " ".join([f"{python} -m {module}", *arguments])
    started = time.perf_counter()
    try:
        results, version = asyncio.run(run(options))
    except BenchError as error:
        raise SystemExit(f"benchmark failed: {error}") from None
    elapsed = time.perf_counter() - started
    # Other people may commit while this runs: say so if HEAD moved.
    section = render(results, options, Recorded(command, (version, code_version()), elapsed))
    print()
    print(section)
    if options.write_doc:
        update_section(DOC, section, title)
        print(f"updated {DOC.relative_to(ROOT)}")
    print(f"total time {elapsed:.0f} s")
