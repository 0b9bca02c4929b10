"""Command line of the IM service: `python -m services.im {serve,migrate,keygen,credentials}`."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence

from services.common import entrypoint
from services.common.tokens import KeyRing, KeyRingError, has_signing_key
from services.im import bootstrap
from services.im.adapters import migrate
from services.im.adapters.service_credentials import EMBEDDED_SERVICES, ensure_embedded_credentials
from services.im.config import Settings


async def _migrate(settings: Settings) -> None:
    database = bootstrap.open_database(settings)
    try:
        await migrate.upgrade(database)
    finally:
        await database.aclose()


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


def _listening(settings: Settings, port: int) -> str:
    host = settings.grpc_address.rpartition(":")[0]
    database = "SQLite" if settings.sqlite_path else "PostgreSQL"
    signals = "Redis" if settings.redis_url else "in-process"
    return f"{host}:{port} ({database}, {signals} event signals, {settings.tls.describe()})"


def _reload_on_sighup(app: bootstrap.IMApp, loop: asyncio.AbstractEventLoop) -> None:
    # SIGHUP reads the signing keys and service credentials again (key rotation).
    loop.add_signal_handler(signal.SIGHUP, app.reload_identity)


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--next",
        action="store_true",
        dest="upcoming",
        help="keygen: write <kid>.next.pem, published but not signing (the first step of a rotation)",
    )
    parser.add_argument(
        "--if-missing", action="store_true", help="keygen: do nothing if the directory has a signing key"
    )


SERVICE = entrypoint.Service(
    name="IM service",
    module="services.im",
    description="The Agent IM messaging service.",
    settings=Settings.from_env,
    log_level=lambda settings: settings.log_level,
    build=bootstrap.build,
    listening=_listening,
    migrate=_migrate,
    prepare=_reload_on_sighup,
    commands={
        "keygen": entrypoint.Command(
            "write a signing key into AUTH_SIGNING_KEYS_DIR",
            lambda settings, options: _keygen(
                settings, upcoming=options.upcoming, if_missing=options.if_missing
            ),
        ),
        "credentials": entrypoint.Command(
            "write the services' credentials (AUTH_SERVICE_CREDENTIALS_FILE, if missing)",
            lambda settings, options: _credentials(settings),
        ),
    },
    options=_options,
)


def main(argv: Sequence[str] | None = None) -> None:
    entrypoint.main(SERVICE, argv)


if __name__ == "__main__":
    main()
