"""Command line of the IM service: `python -m services.im {serve,migrate,keygen,credentials}`."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys

from services.common.logs import configure_logging
from services.common.server import stop_on_signals
from services.common.settings import ConfigError
from services.common.tokens import KeyRing, KeyRingError, has_signing_key
from services.im import bootstrap
from services.im.adapters import migrate
from services.im.adapters.service_credentials import EMBEDDED_SERVICES, ensure_embedded_credentials
from services.im.config import Settings

logger = logging.getLogger("services.im")


async def _migrate(settings: Settings) -> None:
    database = bootstrap.open_database(settings)
    try:
        await migrate.upgrade(database)
    finally:
        await database.aclose()
    logger.info("IM schema is up to date")


def _keygen(settings: Settings, *, upcoming: bool, if_missing: bool) -> None:
    """Writes a signing key into AUTH_SIGNING_KEYS_DIR (mode 0600); prints its id only."""
    directory = settings.signing_keys_dir
    if if_missing and has_signing_key(directory):
        print(f"{directory} has a signing key already", flush=True)
        return
    try:
        kid = KeyRing.generate(directory, upcoming=upcoming)
    except (OSError, KeyRingError) as error:
        raise SystemExit(f"cannot write a key into {directory}: {error}") from None
    what = "next key (published, not signing until renamed to <kid>.pem)" if upcoming else "signing key"
    print(f"wrote {what} {kid} to {directory}", flush=True)


def _credentials(settings: Settings) -> None:
    """Makes AUTH_SERVICE_CREDENTIALS_FILE and the runtime's and memory's secrets
    beside it (mode 0600), unless it exists; prints no secret."""
    path = settings.credentials_path
    if path is None:
        raise SystemExit("credentials: set AUTH_SERVICE_CREDENTIALS_FILE (where to write them)")
    if path.exists():
        print(f"{path} exists already", flush=True)
        return
    try:
        ensure_embedded_credentials(path)
    except OSError as error:
        raise SystemExit(f"cannot write the service credentials into {path.parent}: {error}") from None
    print(f"wrote the credentials of {', '.join(EMBEDDED_SERVICES)} to {path.parent}", flush=True)


async def _serve(settings: Settings) -> None:
    try:
        app = bootstrap.build(settings)
    except ConfigError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    with stop_on_signals() as stop:
        # SIGHUP reads the signing keys and service credentials again (key rotation).
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, app.reload_identity)
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
        "command",
        choices=["serve", "migrate", "keygen", "credentials"],
        help="serve the gRPC API, apply migrations, write a signing key into AUTH_SIGNING_KEYS_DIR,"
        " or write the services' credentials (AUTH_SERVICE_CREDENTIALS_FILE, if missing)",
    )
    parser.add_argument(
        "--next",
        action="store_true",
        dest="upcoming",
        help="keygen: write <kid>.next.pem, published but not signing (the first step of a rotation)",
    )
    parser.add_argument(
        "--if-missing", action="store_true", help="keygen: do nothing if the directory has a signing key"
    )
    options = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
    except ConfigError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(settings.log_level)
    if options.command == "keygen":
        _keygen(settings, upcoming=options.upcoming, if_missing=options.if_missing)
        return
    if options.command == "credentials":
        _credentials(settings)
        return
    asyncio.run(_migrate(settings) if options.command == "migrate" else _serve(settings))


if __name__ == "__main__":
    main()
