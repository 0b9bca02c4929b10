"""The harness's reading of a server's log and banner, and its option lists."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import pytest

from bench.harness import Service, listed

LOG = """\
listening on 127.0.0.1:4242 (3 agents)
2026-11-26 09:00:00 WARNING services.runtime slow step for agent 0b0e8a9e-1c2d-4e5f-8a9b-0c1d2e3f4a5b
2026-11-26 09:00:01 WARNING services.runtime slow step for agent 7c3f1e2d-5a6b-4c7d-9e8f-1a2b3c4d5e6f
2026-11-26 09:00:02 INFO services.runtime all fine
2026-11-26 09:00:03 ERROR services.im handler failed
Traceback (most recent call last):
  File "x.py", line 1, in <module>
ValueError: bad input
"""


def service(log: Path, banner: str = "listening on 127.0.0.1:4242 (3 agents)") -> Service:
    return Service("runtime", 1, "127.0.0.1:4242", banner, log, 0.0, 0.1)


def test_problems_are_counted_by_message_with_ids_folded_and_the_exception_named(tmp_path: Path) -> None:
    log = tmp_path / "runtime.log"
    log.write_text(LOG)
    assert service(log).problems() == Counter(
        {
            "WARNING services.runtime slow step for agent <id>": 2,
            "ERROR services.im handler failed -> ValueError: bad input": 1,
        }
    )
    assert len(service(log).problem_lines()) == 4  # three levels and the traceback's first line


def test_a_missing_log_has_no_problems(tmp_path: Path) -> None:
    gone = service(tmp_path / "never-written.log")
    assert gone.problems() == Counter()
    assert gone.problem_lines() == []


def test_the_banner_says_how_many_agents_the_runtime_started_with(tmp_path: Path) -> None:
    assert service(tmp_path / "log").banner_agents() == 3
    assert service(tmp_path / "log", banner="listening on 127.0.0.1:4242").banner_agents() == -1


def test_listed_names_must_be_among_the_allowed() -> None:
    parser = argparse.ArgumentParser()
    assert listed(parser, "--parts", " queue, recovery ", ("queue", "recovery")) == ["queue", "recovery"]
    with pytest.raises(SystemExit):
        listed(parser, "--parts", "queue,oops", ("queue", "recovery"))
    with pytest.raises(SystemExit):
        listed(parser, "--parts", ",", ("queue", "recovery"))
