"""Command line of the runtime service: `python -m services.runtime {serve,migrate}`."""

from __future__ import annotations

from collections.abc import Sequence

from services.common import entrypoint
from services.runtime import bootstrap
from services.runtime.adapters import migrate
from services.runtime.config import Settings


async def _migrate(settings: Settings) -> None:
    database = bootstrap.open_database(settings)
    try:
        await migrate.upgrade(database)
    finally:
        await database.aclose()


def _listening(settings: Settings, started: tuple[int, int]) -> str:
    port, agents = started
    host = settings.grpc_address.rpartition(":")[0]
    model = (
        f"LLM endpoint {settings.llm_base_url}"
        if settings.llm_base_url
        else "the built-in offline model (set OPENAI_BASE_URL to use a real LLM)"
    )
    memory = f"memory at {settings.memory_address}" if settings.memory_address else "no long-term memory"
    return (
        f"{host}:{port} ({agents} agents, IM at {settings.im_address}, {memory}, {model},"
        f" {settings.tls.describe()})"
    )


SERVICE = entrypoint.Service(
    name="runtime service",
    module="services.runtime",
    description="The Agent IM agent runtime.",
    settings=Settings.from_env,
    log_level=lambda settings: settings.log_level,
    build=bootstrap.build,
    listening=_listening,
    migrate=_migrate,
    start_errors=(OSError, bootstrap.BesideReplicas),
)


def main(argv: Sequence[str] | None = None) -> None:
    entrypoint.main(SERVICE, argv)


if __name__ == "__main__":
    main()
