"""The benchmarks' report: cells and the replacement of one section of docs/benchmarks.md."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from bench.report import (
    NEW_DOC,
    errors_note,
    fixed,
    grouped,
    percent,
    problems_section,
    row,
    status,
    table_head,
    tally,
    update_section,
)

DOC = """# Benchmarks

Intro.

## IM service (issue 2)

old IM figures

### Targets (issue 2)

old IM targets

## Agent runtime (issue 3)

runtime figures

## Gateway (issue 4)

gateway figures
"""


def test_a_section_is_replaced_up_to_the_next_one_and_the_others_are_kept(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    update_section(doc, "## Agent runtime (issue 3)\n\nnew runtime figures\n", "## Agent runtime (issue 3)")
    assert doc.read_text() == DOC.replace("runtime figures", "new runtime figures")


def test_a_section_keeps_its_subsections_together(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    update_section(doc, "## IM service (issue 2)\n\nnew IM figures\n", "## IM service (issue 2)")
    text = doc.read_text()
    assert "old IM" not in text
    assert text.index("new IM figures") < text.index("## Agent runtime (issue 3)")
    assert text.endswith("## Gateway (issue 4)\n\ngateway figures\n")


def test_the_last_section_is_replaced_to_the_end(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    update_section(doc, "## Gateway (issue 4)\n\nnew gateway figures\n", "## Gateway (issue 4)")
    assert doc.read_text() == DOC.replace("gateway figures", "new gateway figures")


def test_a_new_section_is_appended(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    update_section(doc, "## Agent control (issue 5)\n\ncontrol figures\n", "## Agent control (issue 5)")
    assert doc.read_text() == DOC + "\n## Agent control (issue 5)\n\ncontrol figures\n"


def test_a_missing_document_is_started(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "benchmarks.md"
    update_section(doc, "## IM service (issue 2)\n\nfigures\n", "## IM service (issue 2)")
    assert doc.read_text() == NEW_DOC + "\n## IM service (issue 2)\n\nfigures\n"


def test_cells_show_what_was_not_measured_as_n_a() -> None:
    assert (fixed(1.23456), fixed(1.23456, 3), fixed(math.nan)) == ("1.23", "1.235", "n/a")
    assert (grouped(12345.6), grouped(1234.5, 1), grouped(math.nan)) == ("12,346", "1,234.5", "n/a")
    assert (percent(0.256), percent(math.nan)) == ("26%", "n/a")
    assert (status(True), status(False)) == ("met", "**not met**")


def test_counts_read_in_key_order() -> None:
    assert tally(Counter({"idle": 1200, "error": 2})) == "2 error, 1,200 idle"
    assert tally(Counter()) == "none"
    assert errors_note(Counter({"UNAVAILABLE": 2, "ABORTED": 1})) == "; errors: ABORTED 1, UNAVAILABLE 2"
    assert errors_note(Counter()) == ""


def test_tables() -> None:
    assert table_head("Backend", "p50 ms", "p99 ms") == ["| Backend | p50 ms | p99 ms |", "|---|---:|---:|"]
    assert table_head("Target", "Measured", "Status", align="lrl")[1] == "|---|---:|---|"
    with pytest.raises(ValueError, match="does not fit"):
        table_head("a", "b", align="l")
    assert row("a", 1, "2.0") == "| a | 1 | 2.0 |"


def test_problems_are_listed_by_service_most_common_first() -> None:
    lines = problems_section(
        [("IM service", Counter({"WARNING slow": 1, "ERROR broken": 3})), ("runtime", Counter())]
    )
    assert lines[:4] == [
        "### Logged warnings and errors",
        "",
        "Counted by message (ids replaced by `<id>`):",
        "",
    ]
    assert lines[4:8] == ["IM service: 4 lines", "", "         3 x ERROR broken", "         1 x WARNING slow"]
    assert not any("runtime" in line for line in lines)
    assert problems_section([("runtime", Counter())]) == ["No service logged a warning or an error.", ""]
