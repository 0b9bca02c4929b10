"""Command line of the gateway: `python -m gateway [serve]`."""

from __future__ import annotations

import argparse
import asyncio
import sys

from gateway import bootstrap
from gateway.config import Settings
from gateway.sessions import new_session_key
from services.common.logs import configure_logging
from services.common.server import stop_on_signals
from services.common.settings import ConfigError


async def _serve(settings: Settings) -> None:
    app = bootstrap.build(settings)
    with stop_on_signals() as stop:
        try:
            port = await app.start()
        except OSError as error:
            await app.stop()
            raise SystemExit(f"gateway cannot start: {error}") from None
        host = settings.http_address.rpartition(":")[0]
        key = "session key from GATEWAY_SESSION_KEY" if settings.session_key else "embedded session key"
        where = f"IM at {settings.im_address}, runtime at {settings.runtime_address}, {key}"
        print(f"HTTP gateway listening on {host}:{port} ({where})", flush=True)
        await app.serve_until(stop)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gateway", description="The Agent IM HTTP gateway (JSON, Server-Sent Events, web UI)."
    )
    parser.add_argument(
        "command",
        nargs="?",
        default="serve",
        choices=["serve", "keygen"],
        help="serve HTTP (default), or print a new GATEWAY_SESSION_KEY",
    )
    if parser.parse_args(argv).command == "keygen":
        print(new_session_key())
        return
    try:
        settings = Settings.from_env()
    except ConfigError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(settings.log_level)
    asyncio.run(_serve(settings))


if __name__ == "__main__":
    main()
