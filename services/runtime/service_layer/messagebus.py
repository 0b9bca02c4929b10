"""The message bus: each command goes to the one handler of its type."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar, cast

from services.runtime.domain.commands import Command

R = TypeVar("R")

# A command's handler, its dependencies bound (see `bootstrap`).
Handler = Callable[[Any], Awaitable[Any]]


class MessageBus:
    """Dispatches commands to their handlers (one per command type).

    Args:
        handlers: the handler of each command type.
    """

    def __init__(self, handlers: Mapping[type[Command[Any]], Handler]) -> None:
        self._handlers = dict(handlers)

    @property
    def commands(self) -> frozenset[type[Command[Any]]]:
        """The command types this bus has a handler for."""
        return frozenset(self._handlers)

    async def handle(self, command: Command[R]) -> R:
        """Handles `command`; returns what its handler returns.

        Raises:
            LookupError: no handler takes commands of its type (a wiring mistake).
        """
        handler = self._handlers.get(type(command))
        if handler is None:
            raise LookupError(f"no handler for {type(command).__name__}")
        return cast(R, await handler(command))
