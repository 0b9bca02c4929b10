"""Command line of the runtime service: `python -m services.runtime {serve,migrate}`."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys

from services.common.logs import configure_logging
from services.common.server import stop_on_signals
from services.common.settings import ConfigError
from services.runtime import bootstrap
from services.runtime.adapters import migrate
from services.runtime.config import Settings

logger = logging.getLogger("services.runtime")


async def _migrate(settings: Settings) -> None:
    database = bootstrap.open_database(settings)
    try:
        await migrate.upgrade(database)
    finally:
        await database.aclose()
    logger.info("runtime schema is up to date")


async def _serve(settings: Settings) -> None:
    app = bootstrap.build(settings)
    with stop_on_signals() as stop:
        try:
            port, agents = await app.start()
        except OSError as error:
            await app.stop()
            raise SystemExit(f"runtime service cannot start: {error}") from None
        host = settings.grpc_address.rpartition(":")[0]
        model = (
            f"LLM endpoint {settings.llm_base_url}"
            if settings.llm_base_url
            else "the built-in offline model (set OPENAI_BASE_URL to use a real LLM)"
        )
        memory = f"memory at {settings.memory_address}" if settings.memory_address else "no long-term memory"
        where = f"{agents} agents, IM at {settings.im_address}, {memory}, {model}, {settings.tls.describe()}"
        print(f"runtime service listening on {host}:{port} ({where})", flush=True)
        gc.collect()
        gc.freeze()
        await app.server.serve_until(stop)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m services.runtime", description="The Agent IM agent runtime."
    )
    parser.add_argument(
        "command", choices=["serve", "migrate"], help="serve the gRPC API, or apply migrations"
    )
    options = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
    except ConfigError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(settings.log_level)
    asyncio.run(_migrate(settings) if options.command == "migrate" else _serve(settings))


if __name__ == "__main__":
    main()
