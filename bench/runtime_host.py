"""The runtime service with timestamps where a wake passes, for bench.runtime_bench.

Run as `python -m bench.runtime_host` with the runtime's usual environment
plus `BENCH_TRACE_FILE`: it serves exactly as `python -m services.runtime
serve` does (same settings, banner, logging and shutdown), except that right
after `bootstrap.build` it wraps a few methods of the built app's IM client
and LLM. They are instance attributes of the very objects the runners hold,
so every runner calls the wrappers; nothing else changes.

Each wrapper appends one line `<ns> <point> <tag>` to the trace file, where
ns is `time.monotonic_ns()` (CLOCK_MONOTONIC, system-wide on Linux, so it
compares with the benchmark's own clock) and tag is the number in the first
`bench-<n>` found in the message concerned, or `-`:

- `event`: the IM watch delivered a message to the runtime;
- `unread` / `unread-done`: GetAllUnread called / answered (the tag of the
  unread messages);
- `markread` / `markread-done`: MarkRead called / answered;
- `llm`: the LLM's `stream()` called (the tag of the last user message),
  that is, the completion request is being sent.

Between `unread-done` and `markread` the runner stores the run, the agent's
state and the step of the message read (three database transactions).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import IO, Any

from services.common import entrypoint
from services.runtime import bootstrap
from services.runtime.__main__ import SERVICE
from services.runtime.config import Settings
from services.runtime.domain.llm import CompletionRequest, Role

TRACE_ENV = "BENCH_TRACE_FILE"
_TAG = re.compile(r"bench-(\d+)")


def _tag(text: str | None) -> str:
    found = _TAG.search(text or "")
    return found[1] if found else "-"


def instrument(app: bootstrap.RuntimeApp, trace: IO[str]) -> None:
    """Wraps the app's IM client and LLM methods so that they write trace lines."""

    def mark(point: str, tag: str = "-") -> None:
        trace.write(f"{time.monotonic_ns()} {point} {tag}\n")

    im: Any = app.im
    llm: Any = app.llm
    watch, get_all_unread, mark_read, stream = im.watch, im.get_all_unread, im.mark_read, llm.stream

    def traced_watch(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async def events() -> AsyncIterator[Any]:
            async for event in watch(*args, **kwargs):
                mark("event", _tag(event.message.content))
                yield event

        return events()

    async def traced_unread(*args: Any, **kwargs: Any) -> Any:
        mark("unread")
        messages = await get_all_unread(*args, **kwargs)
        mark("unread-done", next((t for m in messages if (t := _tag(m.content)) != "-"), "-"))
        return messages

    async def traced_mark_read(*args: Any, **kwargs: Any) -> Any:
        mark("markread")
        result = await mark_read(*args, **kwargs)
        mark("markread-done")
        return result

    def traced_stream(request: CompletionRequest) -> Any:
        last_user = next((m.content for m in reversed(request.messages) if m.role is Role.USER), None)
        mark("llm", _tag(last_user))
        return stream(request)

    im.watch = traced_watch
    im.get_all_unread = traced_unread
    im.mark_read = traced_mark_read
    llm.stream = traced_stream


def main() -> None:
    path = os.environ.get(TRACE_ENV)
    if not path:
        raise SystemExit(f"{TRACE_ENV} must name the trace file")
    # Line-buffered: each line is one write(2) of a few dozen bytes, a few microseconds.
    trace = open(path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process
    build: Callable[[Settings], bootstrap.RuntimeApp] = bootstrap.build

    def traced_build(settings: Settings) -> bootstrap.RuntimeApp:
        app = build(settings)
        instrument(app, trace)
        return app

    try:
        entrypoint.main(replace(SERVICE, build=traced_build), ["serve"])
    finally:
        trace.close()


if __name__ == "__main__":
    main()
