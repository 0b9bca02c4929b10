"""The command line every service shares: `python -m services.<name> serve|migrate|...`.

A service's `__main__` says only what is its own: how to read its settings,
how to build and start it, what to print once it listens, how to migrate
its schema, and any commands of its own (the IM's key and credential
commands). Reading settings (all problems at once, exit 2), logging,
signals, the graceful stop and the start-up banner are done here, the same
way for each.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from services.common.logs import configure_logging
from services.common.server import GrpcServer, stop_on_signals
from services.common.settings import ConfigError

S = TypeVar("S")
Started = TypeVar("Started")
Started_co = TypeVar("Started_co", covariant=True)


class ServiceApp(Protocol[Started_co]):
    """What `serve` needs of a built service."""

    @property
    def server(self) -> GrpcServer: ...

    async def start(self) -> Started_co: ...

    async def stop(self) -> None: ...


@dataclass(frozen=True)
class Command(Generic[S]):
    """A command of its own a service adds (its settings and the parsed options in)."""

    help: str
    run: Callable[[S, argparse.Namespace], None]


@dataclass(frozen=True)
class Service(Generic[S, Started]):
    """One service's command line.

    Attributes:
        name: as printed ("IM service", "runtime service").
        module: `python -m <module>`.
        description: the parser's description.
        settings: reads the settings from the environment (raises ConfigError).
        log_level: the settings' log level.
        build: wires the service (raises ConfigError for what cannot be used).
        listening: the line printed once it listens, from the settings and
            what `start` returned.
        migrate: applies the service's migrations.
        prepare: called with the built app and the event loop before it
            starts (signal handlers of its own, such as SIGHUP).
        commands: commands of its own besides serve and migrate.
        options: adds the options those commands take.
        start_errors: what `start` raises that means the service cannot
            start (said in one line, exit status 1, no traceback).
    """

    name: str
    module: str
    description: str
    settings: Callable[[], S]
    log_level: Callable[[S], str]
    build: Callable[[S], ServiceApp[Started]]
    listening: Callable[[S, Started], str]
    migrate: Callable[[S], Awaitable[None]]
    prepare: Callable[[Any, asyncio.AbstractEventLoop], None] | None = None
    commands: Mapping[str, Command[S]] = field(default_factory=dict)
    options: Callable[[argparse.ArgumentParser], None] | None = None
    start_errors: tuple[type[Exception], ...] = (OSError,)


def main(service: Service[S, Started], argv: Sequence[str] | None = None) -> None:
    """Parses the command line and runs the command; exits 2 on bad settings."""
    commands = {"serve": "serve the gRPC API", "migrate": "apply migrations"}
    commands.update({name: command.help for name, command in service.commands.items()})
    parser = argparse.ArgumentParser(prog=f"python -m {service.module}", description=service.description)
    parser.add_argument(
        "command", choices=list(commands), help="; ".join(f"{n}: {h}" for n, h in commands.items())
    )
    if service.options is not None:
        service.options(parser)
    options = parser.parse_args(argv)
    try:
        settings = service.settings()
    except ConfigError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(service.log_level(settings))
    if options.command in service.commands:
        service.commands[options.command].run(settings, options)
        return
    if options.command == "migrate":
        asyncio.run(_migrate(service, settings))
        return
    asyncio.run(serve(service, settings))


async def _migrate(service: Service[S, Started], settings: S) -> None:
    await service.migrate(settings)
    logging.getLogger(service.module).info("%s schema is up to date", service.name.removesuffix(" service"))


async def serve(service: Service[S, Started], settings: S) -> None:
    """Builds, starts and serves until SIGTERM or SIGINT, then stops gracefully."""
    try:
        app = service.build(settings)
    except ConfigError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    with stop_on_signals() as stop:
        if service.prepare is not None:
            service.prepare(app, asyncio.get_running_loop())
        try:
            started = await app.start()
        except service.start_errors as error:
            await app.stop()
            raise SystemExit(f"{service.name} cannot start: {error}") from None
        print(f"{service.name} listening on {service.listening(settings, started)}", flush=True)
        # What start-up built lives as long as the process: keep the collector off it.
        gc.collect()
        gc.freeze()
        await app.server.serve_until(stop)
