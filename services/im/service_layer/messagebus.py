"""The message bus: hands each command to its one handler.

Only commands (`services.im.domain.commands`) go through it. Queries (get,
list, the unread messages, the event watch) change nothing and are called
directly, as plain functions of `services.im.service_layer.handlers`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from services.im.domain.commands import Command

R = TypeVar("R")

# A handler with its dependencies bound (see `services.im.bootstrap`).
Handler = Callable[[Any], Awaitable[Any]]


class MessageBus:
    """Dispatches a command by its type.

    Args:
        handlers: command type -> the handler of that command.
    """

    def __init__(self, handlers: Mapping[type[Command[Any]], Handler]) -> None:
        self._handlers = dict(handlers)

    @property
    def commands(self) -> frozenset[type[Command[Any]]]:
        """The command types this bus has a handler for."""
        return frozenset(self._handlers)

    async def handle(self, command: Command[R]) -> R:
        """Runs the command's handler and returns what it returns.

        Raises:
            LookupError: no handler is registered for the command's type (a
                wiring mistake, never a client's).
        """
        handler = self._handlers.get(type(command))
        if handler is None:
            raise LookupError(f"no handler for the command {type(command).__name__}")
        result: R = await handler(command)
        return result
