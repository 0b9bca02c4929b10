"""The composition root: builds the IM service from its settings."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from agentim.im.v1 import auth_pb2, auth_pb2_grpc, im_pb2, im_pb2_grpc
from services.common.audit import AuditLog
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
from services.im.adapters.id_tokens import IdTokenVerifier
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
from services.im.domain import commands
from services.im.domain.oidc import IdTokenRules
from services.im.entrypoints.auth_servicer import AuthServicer
from services.im.entrypoints.grpc_servicer import IMServicer
from services.im.entrypoints.policy import IM_POLICY
from services.im.service_layer.auth_ports import Passwords, ProviderKeys
from services.im.service_layer.events import EventFeed, EventHub
from services.im.service_layer.handlers import (
    groups,
    invites,
    machine_access,
    members,
    messages,
    oidc,
    read_state,
    roles,
    sessions,
    workspaces,
)
from services.im.service_layer.handlers.auth_deps import AuthDeps
from services.im.service_layer.handlers.deps import Clock, Deps, utc_now
from services.im.service_layer.messagebus import MessageBus
from services.im.service_layer.ports import (
    EventLog,
    EventSignal,
    Inbox,
    MessageLog,
    Store,
    TransactionalEventLog,
    TransactionalInbox,
    TransactionalMessageLog,
)

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
    """Everything the running IM service is made of, wired together.

    An async context manager: leaving it stops serving (if it started) and
    closes what `build` opened, as `stop` does.
    """

    settings: Settings
    store: Store
    signal: EventSignal
    hub: EventHub
    feed: EventFeed
    deps: Deps
    auth: AuthDeps
    bus: MessageBus
    server: GrpcServer
    identity: Identity
    audit_log: AuditLog
    audit_pruner: AuditPruner

    @property
    def database(self) -> Database:
        """The SQL database the state lives in (not there when a fake store was passed)."""
        if not isinstance(self.store, Database):
            raise TypeError("this IM was built on a store that is not the SQL database")
        return self.store

    async def start(self) -> int:
        """Connects signalling and starts serving; returns the bound port."""
        await self.signal.start()
        port = await self.server.start()
        self.audit_pruner.start()
        return port

    async def stop(self) -> None:
        """Stops serving gracefully and closes everything. Idempotent."""
        await self.server.stop()

    async def __aenter__(self) -> IMApp:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def reload_identity(self) -> None:
        """Reads the signing keys and service credentials again (on SIGHUP)."""
        self.identity.reload()


def open_database(settings: Settings) -> Database:
    """The database engine (no connection yet); makes the embedded default's directory."""
    if settings.sqlite_path:
        Path(settings.sqlite_path).parent.mkdir(parents=True, exist_ok=True)
    return Database(settings.database_url, pool_size=settings.db_pool_size)


def build(
    settings: Settings,
    *,
    store: Store | None = None,
    audit_log: AuditLog | None = None,
    signal: EventSignal | None = None,
    passwords: Passwords | None = None,
    provider_keys: ProviderKeys | None = None,
    clock: Clock | None = None,
) -> IMApp:
    """Wires the service; connects nothing until `IMApp.start`.

    Every keyword replaces a real adapter (None: the real one), so that tests
    wire the service exactly as it runs, on fakes.

    Args:
        settings: the configuration.
        store: replaces the database; the message log, inbox and event log
            are then plain transactions of it.
        audit_log: replaces the SQL audit log (required beside a `store`).
        signal: replaces the event signals (Redis, or in-process without it).
        passwords: replaces argon2.
        provider_keys: replaces the OpenID provider's published keys (used
            when `settings.oidc` is set).
        clock: replaces the wall clock.

    Raises:
        ConfigError: the signing keys or service credentials cannot be used.
    """
    identity = prepare_identity(settings)
    now = clock or utc_now
    closers: list[Callable[[], Awaitable[None]]] = []
    message_log: MessageLog
    inbox: Inbox
    event_log: EventLog
    if store is None:
        database = open_database(settings)
        store = database
        read_path = open_read_path(database)
        message_log, inbox, event_log = open_message_log(database), read_path, read_path
        audit_log = audit_log or SqlAuditLog(database, audit_events)
        closers += [message_log.aclose, read_path.aclose]
    else:
        if audit_log is None:
            raise TypeError("build: a store passed in needs its audit log beside it (audit_log=)")
        message_log = TransactionalMessageLog(store.transaction)
        inbox = TransactionalInbox(store.transaction)
        event_log = TransactionalEventLog(store.transaction)
    if signal is None:
        signal = (
            RedisSignal(
                settings.redis_url,
                reconnect_max_seconds=settings.redis_reconnect_max_seconds,
                fallback_interval_seconds=settings.redis_fallback_poll_seconds,
            )
            if settings.redis_url
            else InProcessSignal()
        )
    hub = EventHub(log=event_log, signal=signal)
    deps = Deps(
        uow=store.transaction,
        messages=message_log,
        inbox=inbox,
        on_committed=hub.offer,
        signal=signal,
        limits=settings.limits,
        quotas=settings.quotas,
        clock=now,
    )
    audit_pruner = AuditPruner(audit_log, settings.audit, clock=now)
    feed = EventFeed(uow=store.transaction, hub=hub)
    argon2: Argon2Passwords | None = None
    if passwords is None:
        argon2 = Argon2Passwords(memory_kib=settings.argon2_memory_kib, time_cost=settings.argon2_time_cost)
        passwords = argon2
    provider: ProviderClient | None = None
    id_tokens: IdTokenVerifier | None = None
    if settings.oidc is not None:
        if provider_keys is None:
            provider = ProviderClient(settings.oidc)
            provider_keys = HttpProviderKeys(provider)
        id_tokens = IdTokenVerifier(
            provider_keys,
            IdTokenRules(issuer=settings.oidc.issuer, client_id=settings.oidc.client_id),
            clock=now,
        )
    auth = AuthDeps(
        im=deps,
        keys=identity.keys,
        passwords=passwords,
        limits=settings.auth_limits,
        audit_log=audit_log,
        audit_settings=settings.audit,
        services=lambda: identity.services,
        id_tokens=id_tokens,
    )
    # The IM checks its own tokens as every service will: through the JWKS
    # (read from its own key ring, so a reload counts at once).
    verifier = Verifier(keyring_source(identity.keys), refetch_seconds=0, max_age_seconds=5)
    bus = MessageBus(
        {
            commands.CreateWorkspace: partial(workspaces.create_workspace, auth),
            commands.CreateMember: partial(members.create_member, deps),
            commands.UpdateMember: partial(members.update_member, deps),
            commands.SetAgentOwners: partial(members.set_agent_owners, deps),
            commands.CreateGroup: partial(groups.create_group, deps),
            commands.GetOrCreateDirectGroup: partial(groups.get_or_create_direct_group, deps),
            commands.RenameGroup: partial(groups.rename_group, deps),
            commands.AddGroupMembers: partial(groups.add_group_members, deps),
            commands.RemoveGroupMembers: partial(groups.remove_group_members, deps),
            commands.SendMessage: partial(messages.send_message, deps),
            commands.EditMessage: partial(messages.edit_message, deps),
            commands.MarkRead: partial(read_state.mark_read, deps),
            commands.SignIn: partial(sessions.sign_in, auth),
            commands.RefreshTokens: partial(sessions.refresh_tokens, auth),
            commands.SignOut: partial(sessions.sign_out, auth),
            commands.ChangePassword: partial(sessions.change_password, auth),
            commands.CreateInvite: partial(invites.create_invite, auth),
            commands.AcceptInvite: partial(invites.accept_invite, auth),
            commands.SetMemberRole: partial(roles.set_member_role, auth),
            commands.CreatePersonalToken: partial(machine_access.create_personal_token, auth),
            commands.RevokePersonalToken: partial(machine_access.revoke_personal_token, auth),
            commands.ExchangePersonalToken: partial(machine_access.exchange_personal_token, auth),
            commands.IssueServiceToken: partial(machine_access.issue_service_token, auth),
            commands.IssueAgentTokens: partial(machine_access.issue_agent_tokens, auth),
            commands.SignInWithOidc: partial(oidc.sign_in_with_oidc, auth),
            commands.LinkOidcAccount: partial(oidc.link_oidc_account, auth),
        }
    )
    servicer = IMServicer(bus, deps, feed)
    auth_servicer = AuthServicer(bus, auth)

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
        readiness=store.ping,
        components={SIGNALS_HEALTH_NAME: lambda: not signal.degraded},
        reflection=settings.reflection,
        max_message_bytes=settings.max_message_bytes,
        grace_seconds=settings.shutdown_grace_seconds,
        closers=[hub.aclose],
        cleanups=[
            audit_pruner.aclose,
            *closers,
            signal.aclose,
            store.aclose,
            *([argon2.aclose] if argon2 is not None else []),
            *([provider.aclose] if provider is not None else []),
        ],
    )
    return IMApp(
        settings=settings,
        store=store,
        signal=signal,
        hub=hub,
        feed=feed,
        deps=deps,
        auth=auth,
        bus=bus,
        server=server,
        identity=identity,
        audit_log=audit_log,
        audit_pruner=audit_pruner,
    )
