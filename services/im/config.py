"""The IM service's settings, read once from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common.logs import LOG_LEVELS
from services.common.ratelimit import RateLimits, read_rate_limits
from services.common.settings import EnvReader, default_data_dir
from services.common.tls import TlsSettings, read_tls
from services.im.domain.rules import Limits


@dataclass(frozen=True)
class Settings:
    database_url: str
    redis_url: str | None
    redis_fallback_poll_seconds: float
    redis_reconnect_max_seconds: float
    grpc_address: str
    log_level: str
    reflection: bool
    max_message_bytes: int
    shutdown_grace_seconds: float
    db_pool_size: int
    service_token: str | None = field(repr=False)
    limits: Limits
    # TLS on its gRPC port and to the services it calls (plaintext by default).
    tls: TlsSettings = field(default_factory=TlsSettings)
    # Per-member rates of sending and creating (services.common.ratelimit).
    rate_limits: RateLimits = field(default_factory=RateLimits)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Reads every setting; raises ConfigError listing all bad ones."""
        env = EnvReader(environ)
        data_dir = default_data_dir(env)
        defaults = Limits()
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
            service_token=env.optional("AGENTIM_SERVICE_TOKEN"),
            tls=read_tls(env),
            rate_limits=read_rate_limits(env),
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
