"""The IM service's settings, read once from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from services.common.audit import AuditSettings, read_audit_settings
from services.common.logs import LOG_LEVELS
from services.common.oidc import OidcSettings, read_oidc
from services.common.ratelimit import RateLimits, read_rate_limits
from services.common.settings import EnvReader, default_data_dir
from services.common.tls import TlsSettings, read_tls
from services.im.domain.access import AuthLimits
from services.im.domain.rules import Limits, Quotas


@dataclass(frozen=True)
class Settings:
    # Not in the repr: a URL may hold a password.
    database_url: str = field(repr=False)
    redis_url: str | None = field(repr=False)
    redis_fallback_poll_seconds: float
    redis_reconnect_max_seconds: float
    grpc_address: str
    log_level: str
    reflection: bool
    max_message_bytes: int
    shutdown_grace_seconds: float
    db_pool_size: int
    limits: Limits
    data_dir: Path
    # Identity: where the signing keys are, which services may get tokens.
    signing_keys_dir: Path
    service_credentials_file: Path | None
    auth_limits: AuthLimits
    argon2_memory_kib: int
    argon2_time_cost: int
    # TLS on its gRPC port and to the services it calls (plaintext by default).
    tls: TlsSettings = field(default_factory=TlsSettings)
    # Per-member rates of sending and creating (services.common.ratelimit).
    rate_limits: RateLimits = field(default_factory=RateLimits)
    quotas: Quotas = field(default_factory=Quotas)
    audit: AuditSettings = field(default_factory=AuditSettings)

    # The organisation's OpenID Connect provider, whose ID tokens sign people in (None: none).
    oidc: OidcSettings | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Reads every setting; raises ConfigError listing all bad ones."""
        env = EnvReader(environ)
        data_dir = default_data_dir(env)
        defaults = Limits()
        auth = AuthLimits()
        credentials = env.optional("AUTH_SERVICE_CREDENTIALS_FILE")
        settings = cls(
            database_url=env.text("DATABASE_URL", f"sqlite:///{data_dir / 'im.db'}"),
            redis_url=env.optional("REDIS_URL"),
            redis_fallback_poll_seconds=env.number("IM_REDIS_FALLBACK_POLL_SECONDS", 0.25, minimum=0.01),
            redis_reconnect_max_seconds=env.number("IM_REDIS_RECONNECT_MAX_SECONDS", 1.0, minimum=0.05),
            grpc_address=env.address("IM_GRPC_ADDRESS", "127.0.0.1:50051"),
            log_level=env.choice("LOG_LEVEL", "INFO", LOG_LEVELS),
            reflection=env.flag("GRPC_REFLECTION", True),
            max_message_bytes=env.integer("GRPC_MAX_MESSAGE_BYTES", 1024 * 1024, minimum=1024),
            shutdown_grace_seconds=env.number("SHUTDOWN_GRACE_SECONDS", 5.0),
            db_pool_size=env.integer("IM_DB_POOL_SIZE", 16, minimum=1),
            tls=read_tls(env),
            rate_limits=read_rate_limits(env),
            quotas=Quotas(
                members=env.integer("QUOTA_MEMBERS_PER_WORKSPACE", Quotas().members, minimum=0),
                agents=env.integer("QUOTA_AGENTS_PER_WORKSPACE", Quotas().agents, minimum=0),
                groups=env.integer("QUOTA_GROUPS_PER_WORKSPACE", Quotas().groups, minimum=0),
            ),
            audit=read_audit_settings(env),
            limits=Limits(
                max_content_bytes=env.integer("IM_MAX_CONTENT_BYTES", defaults.max_content_bytes, minimum=1),
                max_metadata_bytes=env.integer(
                    "IM_MAX_METADATA_BYTES", defaults.max_metadata_bytes, minimum=2
                ),
                max_mentions=env.integer("IM_MAX_MENTIONS", defaults.max_mentions),
                max_group_members=env.integer("IM_MAX_GROUP_MEMBERS", defaults.max_group_members, minimum=2),
                max_page_size=env.integer("IM_MAX_PAGE_SIZE", defaults.max_page_size, minimum=1),
                default_page_size=min(
                    defaults.default_page_size, env.integer("IM_MAX_PAGE_SIZE", 200, minimum=1)
                ),
                max_unread_page_size=env.integer(
                    "IM_MAX_UNREAD_PAGE_SIZE", defaults.max_unread_page_size, minimum=1
                ),
            ),
            data_dir=data_dir,
            signing_keys_dir=Path(env.text("AUTH_SIGNING_KEYS_DIR", str(data_dir / "keys"))).expanduser(),
            service_credentials_file=Path(credentials).expanduser() if credentials else None,
            auth_limits=AuthLimits(
                password_min_length=env.integer(
                    "AUTH_PASSWORD_MIN_LENGTH", auth.password_min_length, minimum=8
                ),
                access_token_lifetime=timedelta(
                    minutes=env.integer("AUTH_ACCESS_TOKEN_MINUTES", 15, minimum=1)
                ),
                refresh_token_lifetime=timedelta(days=env.integer("AUTH_REFRESH_TOKEN_DAYS", 30, minimum=1)),
                sign_in_max_failures=env.integer(
                    "AUTH_SIGN_IN_MAX_FAILURES", auth.sign_in_max_failures, minimum=1
                ),
                sign_in_window=timedelta(minutes=env.integer("AUTH_SIGN_IN_WINDOW_MINUTES", 15, minimum=1)),
                sign_in_max_workspaces=env.integer(
                    "AUTH_SIGN_IN_MAX_WORKSPACES", auth.sign_in_max_workspaces, minimum=1
                ),
            ),
            argon2_memory_kib=env.integer("AUTH_ARGON2_MEMORY_KIB", 65536, minimum=1024),
            argon2_time_cost=env.integer("AUTH_ARGON2_TIME_COST", 3, minimum=1),
            # The IM only verifies ID tokens: it needs no client secret.
            oidc=read_oidc(env, needs_secret=False),
        )
        if settings.database_url.split(":", 1)[0].split("+", 1)[0] not in {
            "sqlite",
            "postgresql",
            "postgres",
        }:
            env.problem("DATABASE_URL: expected a sqlite:// or postgresql:// URL")
        if settings.redis_url is not None and not settings.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            env.problem("REDIS_URL: expected a redis:// URL")
        env.finish()
        return settings

    @property
    def sqlite_path(self) -> str | None:
        """The SQLite file of the embedded default, if that is the database."""
        if not self.database_url.startswith("sqlite"):
            return None
        return self.database_url.split("///", 1)[1] if "///" in self.database_url else None

    @property
    def embedded(self) -> bool:
        """The embedded default (SQLite): it makes its own keys and service credentials."""
        return self.database_url.startswith("sqlite")

    @property
    def credentials_path(self) -> Path | None:
        """The service credentials file: the configured one, or the embedded default's."""
        if self.service_credentials_file is not None:
            return self.service_credentials_file
        return self.data_dir / "secrets" / "service-credentials" if self.embedded else None
