"""Command line of the IM service: `python -m services.im {serve,migrate}`."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys

from services.common.logs import configure_logging
from services.common.server import stop_on_signals
from services.common.settings import ConfigError
from services.im import bootstrap
from services.im.adapters import migrate
from services.im.config import Settings

logger = logging.getLogger("services.im")


async def _migrate(settings: Settings) -> None:
    database = bootstrap.open_database(settings)
    try:
        await migrate.upgrade(database)
    finally:
        await database.aclose()
    logger.info("IM schema is up to date")


async def _serve(settings: Settings) -> None:
    app = bootstrap.build(settings)
    with stop_on_signals() as stop:
        try:
            port = await app.start()
        except OSError as error:
            await app.stop()
            raise SystemExit(f"IM service cannot start: {error}") from None
        host = settings.grpc_address.rpartition(":")[0]
        database = "SQLite" if app.database.is_sqlite else "PostgreSQL"
        signals = "Redis" if settings.redis_url else "in-process"
        tls = settings.tls.describe()
        print(
            f"IM service listening on {host}:{port} ({database}, {signals} event signals, {tls})", flush=True
        )
        # What start-up built lives as long as the process: keep the collector off it.
        gc.collect()
        gc.freeze()
        await app.server.serve_until(stop)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m services.im", description="The Agent IM messaging service."
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
