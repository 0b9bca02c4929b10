"""The runtime's message bus as `bootstrap.build` wires it: every command of
`domain.commands` reaches a handler."""

from __future__ import annotations

import inspect

from services.runtime.domain import commands
from tests.unit.runtime_support import fake_runtime


async def test_every_command_has_a_handler_in_the_built_app() -> None:
    declared = {
        value
        for value in vars(commands).values()
        if inspect.isclass(value) and issubclass(value, commands.Command) and value is not commands.Command
    }
    app = fake_runtime()
    try:
        assert declared == app.bus.commands
    finally:
        await app.stop()
