"""The composition root: builds the IM service from its settings."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from agentim.im.v1 import auth_pb2, auth_pb2_grpc, im_pb2, im_pb2_grpc
from services.common.audit_boundary import AuditInterceptor, AuditPruner
from services.common.audit_sql import SqlAuditLog
from services.common.authn import AuthenticationInterceptor
from services.common.oidc import ProviderClient
from services.common.ratelimit import RateLimitInterceptor
from services.common.redis_signals import RedisSignal
from services.common.server import GrpcServer
from services.common.settings import ConfigError
from services.common.signals import InProcessSignal
from services.common.tokens import KeyRing, KeyRingError, Verifier, has_signing_key, keyring_source
from services.im.adapters.message_log import open_message_log
from services.im.adapters.oidc_keys import HttpProviderKeys
from services.im.adapters.passwords import Argon2Passwords
from services.im.adapters.read_path import open_read_path
from services.im.adapters.service_credentials import (
    CredentialsError,
    ensure_embedded_credentials,
    read_credentials,
)
from services.im.adapters.sql import Database
from services.im.adapters.tables import audit_events
from services.im.config import Settings
from services.im.domain.oidc import IdTokenRules
from services.im.entrypoints.auth_servicer import AuthServicer
from services.im.entrypoints.grpc_servicer import IMServicer
from services.im.entrypoints.policy import IM_POLICY
from services.im.service_layer.events import EventFeed, EventHub
from services.im.service_layer.handlers import members, workspaces
from services.im.service_layer.handlers.auth import AuthService
from services.im.service_layer.handlers.deps import Deps
from services.im.service_layer.handlers.machine_access import MachineAccess
from services.im.service_layer.handlers.oidc import IdTokenVerifier, OidcAccess
from services.im.service_layer.ports import EventSignal

logger = logging.getLogger(__name__)

SERVICE_NAME = im_pb2.DESCRIPTOR.services_by_name["IMService"].full_name
AUTH_SERVICE_NAME = auth_pb2.DESCRIPTOR.services_by_name["AuthService"].full_name
# The calls each member may make only so often (see services.common.ratelimit).
RATE_LIMITED = {
    **{f"/{SERVICE_NAME}/{m}": "send" for m in ("SendMessage", "EditMessage")},
    **{
        f"/{SERVICE_NAME}/{m}": "create"
        for m in (
            "CreateWorkspace",
            "CreateMember",
            "CreateGroup",
            "GetOrCreateDirectGroup",
            "AddGroupMembers",
        )
    },
}
# Health of the cross-replica event signals: NOT_SERVING while Redis is
# unreachable (delivery then reads the database at intervals); the service stays SERVING.
SIGNALS_HEALTH_NAME = f"{SERVICE_NAME}/signals"


class Identity:
    """The IM's signing keys and the service credentials it accepts, reloadable (SIGHUP)."""

    def __init__(self, keys: KeyRing, credentials_path: Path | None, services: dict[str, str]) -> None:
        self.keys = keys
        self.credentials_path = credentials_path
        self.services = services

    def reload(self) -> None:
        """Reads the key directory and the credentials file again; keeps what it had on a problem."""
        try:
            self.keys.reload()
            logger.info(
                "signing keys reloaded: %s signs, %d published", self.keys.signing_kid, len(self.keys.kids)
            )
        except KeyRingError as error:
            logger.error("signing keys not reloaded (the old ones stay in use): %s", error)
        if self.credentials_path is not None:
            try:
                self.services = read_credentials(self.credentials_path)
            except CredentialsError as error:
                logger.error("service credentials not reloaded (the old ones stay in use): %s", error)


def prepare_identity(settings: Settings) -> Identity:
    """Loads the signing keys and service credentials; the embedded default makes missing ones.

    Raises:
        ConfigError: listing every problem (no signing key on PostgreSQL, a
            malformed key or credentials file...).
    """
    problems: list[str] = []
    directory = settings.signing_keys_dir
    path = settings.credentials_path
    if settings.embedded:
        try:
            if not has_signing_key(directory):
                kid = KeyRing.generate(directory)
                logger.info("made signing key %s in %s", kid, directory)
            if path is not None and settings.service_credentials_file is None:
                ensure_embedded_credentials(path)
        except (OSError, KeyRingError) as error:
            problems.append(
                f"AUTH_SIGNING_KEYS_DIR / AGENTIM_DATA_DIR: cannot make the embedded keys: {error}"
            )
    keys = KeyRing(directory)
    try:
        keys.reload()
    except KeyRingError as error:
        problems.append(f"AUTH_SIGNING_KEYS_DIR: {error} (`python -m services.im keygen` makes a key)")
    services: dict[str, str] = {}
    if path is not None:
        try:
            services = read_credentials(path)
        except CredentialsError as error:
            problems.extend(f"AUTH_SERVICE_CREDENTIALS_FILE: {problem}" for problem in error.problems)
    else:
        logger.warning("AUTH_SERVICE_CREDENTIALS_FILE is not set: no service can get an access token")
    if problems:
        raise ConfigError(problems)
    return Identity(keys, path, services)


@dataclass
class IMApp:
    """Everything the running IM service is made of, wired together."""

    settings: Settings
    database: Database
    signal: EventSignal
    hub: EventHub
    deps: Deps
    server: GrpcServer
    identity: Identity
    audit_pruner: AuditPruner

    async def start(self) -> int:
        """Connects signalling and starts serving; returns the bound port."""
        await self.signal.start()
        port = await self.server.start()
        self.audit_pruner.start()
        return port

    async def stop(self) -> None:
        await self.server.stop()

    def reload_identity(self) -> None:
        """Reads the signing keys and service credentials again (on SIGHUP)."""
        self.identity.reload()


def open_database(settings: Settings) -> Database:
    """The database engine (no connection yet); makes the embedded default's directory."""
    if settings.sqlite_path:
        Path(settings.sqlite_path).parent.mkdir(parents=True, exist_ok=True)
    return Database(settings.database_url, pool_size=settings.db_pool_size)


def build(settings: Settings) -> IMApp:
    """Wires the service; connects nothing until `IMApp.start`.

    Raises:
        ConfigError: the signing keys or service credentials cannot be used.
    """
    identity = prepare_identity(settings)
    database = open_database(settings)
    signal: EventSignal = (
        RedisSignal(
            settings.redis_url,
            reconnect_max_seconds=settings.redis_reconnect_max_seconds,
            fallback_interval_seconds=settings.redis_fallback_poll_seconds,
        )
        if settings.redis_url
        else InProcessSignal()
    )
    read_path = open_read_path(database)
    hub = EventHub(log=read_path, signal=signal)
    message_log = open_message_log(database)
    deps = Deps(
        uow=database.transaction,
        messages=message_log,
        inbox=read_path,
        on_committed=hub.offer,
        signal=signal,
        limits=settings.limits,
        quotas=settings.quotas,
    )
    audit_log = SqlAuditLog(database, audit_events)
    audit_pruner = AuditPruner(audit_log, settings.audit)
    feed = EventFeed(uow=database.transaction, hub=hub)
    passwords = Argon2Passwords(memory_kib=settings.argon2_memory_kib, time_cost=settings.argon2_time_cost)
    accounts = AuthService(
        open_workspace=partial(workspaces.open_workspace, deps),
        uow=database.transaction,
        keys=identity.keys,
        passwords=passwords,
        limits=settings.auth_limits,
        audit_log=audit_log,
        audit_settings=settings.audit,
        member_quota=partial(members.check_member_quota, deps),
        oidc_configured=settings.oidc is not None,
    )
    machines = MachineAccess(
        services=lambda: identity.services,
        uow=database.transaction,
        keys=identity.keys,
        passwords=passwords,
        limits=settings.auth_limits,
        page_limits=settings.limits,
        audit_log=audit_log,
        audit_settings=settings.audit,
    )
    provider: ProviderClient | None = None
    id_tokens: IdTokenVerifier | None = None
    if settings.oidc is not None:
        provider = ProviderClient(settings.oidc)
        id_tokens = IdTokenVerifier(
            HttpProviderKeys(provider),
            IdTokenRules(issuer=settings.oidc.issuer, client_id=settings.oidc.client_id),
        )
    oidc = OidcAccess(
        verifier=id_tokens,
        uow=database.transaction,
        keys=identity.keys,
        passwords=passwords,
        limits=settings.auth_limits,
        audit_log=audit_log,
        audit_settings=settings.audit,
        member_quota=partial(members.check_member_quota, deps),
    )
    # The IM checks its own tokens as every service will: through the JWKS
    # (read from its own key ring, so a reload counts at once).
    verifier = Verifier(keyring_source(identity.keys), refetch_seconds=0, max_age_seconds=5)
    servicer = IMServicer(deps, feed, accounts=accounts)
    auth_servicer = AuthServicer(accounts, machines, oidc)

    async def ready() -> bool:
        return await database.ping()

    server = GrpcServer(
        address=settings.grpc_address,
        registrars=[
            lambda s: im_pb2_grpc.add_IMServiceServicer_to_server(servicer, s),
            lambda s: auth_pb2_grpc.add_AuthServiceServicer_to_server(auth_servicer, s),
        ],
        service_names=[SERVICE_NAME, AUTH_SERVICE_NAME],
        tls=settings.tls.server,
        interceptors=[
            # Outside authentication: it records the refusals made there too.
            AuditInterceptor(IM_POLICY, audit_log, settings=settings.audit),
            AuthenticationInterceptor(
                IM_POLICY,
                verifier,
                honour_view_as=True,
            ),
            RateLimitInterceptor(RATE_LIMITED, settings.rate_limits),
        ],
        readiness=ready,
        components={SIGNALS_HEALTH_NAME: lambda: not signal.degraded},
        reflection=settings.reflection,
        max_message_bytes=settings.max_message_bytes,
        grace_seconds=settings.shutdown_grace_seconds,
        closers=[hub.aclose],
        cleanups=[
            audit_pruner.aclose,
            message_log.aclose,
            read_path.aclose,
            signal.aclose,
            database.aclose,
            passwords.aclose,
            *([provider.aclose] if provider is not None else []),
        ],
    )
    return IMApp(
        settings=settings,
        database=database,
        signal=signal,
        hub=hub,
        deps=deps,
        server=server,
        identity=identity,
        audit_pruner=audit_pruner,
    )
