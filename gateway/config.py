"""The gateway's settings, read once from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gateway.sessions import SessionKeyError, parse_session_key
from services.common.logs import LOG_LEVELS
from services.common.oidc import OidcSettings, read_oidc
from services.common.settings import EnvReader, default_data_dir
from services.common.tls import TlsSettings, read_tls

DEFAULT_STATIC_DIR = Path(__file__).resolve().parent / "static"


@dataclass(frozen=True)
class Settings:
    """Everything the gateway reads from the environment.

    Attributes:
        http_address: host:port to listen on; port 0 picks a free port.
        im_address: host:port of the IM service.
        runtime_address: host:port of the agent runtime.
        memory_address: host:port of the memory service; None: no memory
            routes (they answer 503) and none in the health check.
        cors_origins: origins allowed to call from a browser page served
            elsewhere; `*` allows any; empty: same-origin only.
        max_body_bytes: largest request body.
        upstream_max_message_bytes: largest request the services take (their
            `GRPC_MAX_MESSAGE_BYTES`); a larger one is 413 without a call.
        call_timeout_seconds: deadline of every unary call upstream (and of
            opening a stream).
        heartbeat_seconds: idle time after which an SSE stream gets a `: ping`.
        sse_retry_ms: the reconnection delay sent to SSE clients (`retry:`).
        sse_max_seconds: longest life of one SSE stream; the client then
            reconnects with Last-Event-ID (0: unlimited).
        shutdown_grace_seconds: how long shutdown lets requests finish.
        static_dir: the web UI's files.
        log_level: logging level.
        session_key: the key session cookies are sealed with
            (GATEWAY_SESSION_KEY); None: the embedded default's, made under
            `$AGENTIM_DATA_DIR/secrets/` on first start.
        session_key_file: where the embedded default keeps its key.
        cookie_secure: mark the session cookie Secure even when the request
            did not come over HTTPS (behind a proxy that ends TLS).
        refresh_margin_seconds: a session's access token this close to its
            expiry is refreshed before the request is forwarded.
        oidc: the organisation's OpenID Connect provider people may sign in
            with (the sign-in page shows its button); None: none.
        oidc_redirect_url: the callback URL registered at the provider
            (`.../v1/auth/oidc/callback`); None: made from each request's
            scheme and Host (set it behind a proxy that ends TLS).
    """

    http_address: str
    im_address: str
    runtime_address: str
    memory_address: str | None
    cors_origins: tuple[str, ...]
    max_body_bytes: int
    upstream_max_message_bytes: int
    call_timeout_seconds: float
    heartbeat_seconds: float
    sse_retry_ms: int
    sse_max_seconds: float
    shutdown_grace_seconds: float
    static_dir: Path
    log_level: str
    session_key: bytes | None = field(default=None, repr=False)
    session_key_file: Path = Path("data/secrets/gateway-session.key")
    cookie_secure: bool = False
    refresh_margin_seconds: float = 60.0
    oidc: OidcSettings | None = None
    oidc_redirect_url: str | None = None
    # TLS on its gRPC port and to the services it calls (plaintext by default).
    tls: TlsSettings = field(default_factory=TlsSettings)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Reads every setting; raises ConfigError listing all bad ones."""
        env = EnvReader(environ)
        origins = tuple(
            o.strip().rstrip("/") for o in env.text("GATEWAY_CORS_ORIGINS", "").split(",") if o.strip()
        )
        for origin in origins:
            scheme, sep, rest = origin.partition("://")
            if origin != "*" and (scheme not in {"http", "https"} or not sep or not rest or "/" in rest):
                env.problem(
                    f"GATEWAY_CORS_ORIGINS: expected '*' or origins like https://host:port, got {origin!r}"
                )
        if env.optional("GATEWAY_TOKEN") is not None:
            env.problem(
                "GATEWAY_TOKEN: no longer used; people sign in, and programs send"
                " Authorization: Bearer <personal access token> (see docs/security.md)"
            )
        session_key: bytes | None = None
        raw_key = env.optional("GATEWAY_SESSION_KEY")
        if raw_key is not None:
            try:
                session_key = parse_session_key(raw_key)
            except SessionKeyError as error:
                env.problem(f"GATEWAY_SESSION_KEY: {error} (make one with `python -m gateway keygen`)")
        elif env.optional("DATABASE_URL") or env.optional("REDIS_URL"):
            # Beside a shared database there may be several gateways: each
            # needs the same key, and a generated one would differ.
            env.problem(
                "GATEWAY_SESSION_KEY: required with DATABASE_URL or REDIS_URL"
                " (make one with `python -m gateway keygen`; every replica needs the same)"
            )
        settings = cls(
            http_address=env.address("GATEWAY_HTTP_ADDRESS", "127.0.0.1:8080"),
            im_address=env.address("IM_ADDRESS", "127.0.0.1:50051"),
            runtime_address=env.address("RUNTIME_ADDRESS", "127.0.0.1:50052"),
            memory_address=env.address("MEMORY_ADDRESS", "127.0.0.1:50053")
            if env.text("MEMORY_ADDRESS", "")
            else None,
            cors_origins=origins,
            max_body_bytes=env.integer("GATEWAY_MAX_BODY_BYTES", 1024 * 1024, minimum=1024),
            upstream_max_message_bytes=env.integer("GRPC_MAX_MESSAGE_BYTES", 1024 * 1024, minimum=1024),
            call_timeout_seconds=env.number("GATEWAY_CALL_TIMEOUT_SECONDS", 10.0, minimum=0.01),
            heartbeat_seconds=env.number("GATEWAY_SSE_HEARTBEAT_SECONDS", 15.0, minimum=0.01),
            sse_retry_ms=env.integer("GATEWAY_SSE_RETRY_MS", 3000, minimum=0),
            sse_max_seconds=env.number("GATEWAY_SSE_MAX_SECONDS", 0.0),
            shutdown_grace_seconds=env.number("SHUTDOWN_GRACE_SECONDS", 5.0),
            static_dir=Path(env.text("GATEWAY_STATIC_DIR", str(DEFAULT_STATIC_DIR))).expanduser(),
            log_level=env.choice("LOG_LEVEL", "INFO", LOG_LEVELS),
            session_key=session_key,
            session_key_file=default_data_dir(env) / "secrets" / "gateway-session.key",
            cookie_secure=env.flag("GATEWAY_COOKIE_SECURE", False),
            refresh_margin_seconds=env.number("GATEWAY_REFRESH_MARGIN_SECONDS", 60.0),
            oidc=read_oidc(env, needs_secret=True),
            oidc_redirect_url=env.optional("OIDC_REDIRECT_URL"),
            tls=read_tls(env),
        )
        redirect = settings.oidc_redirect_url
        if redirect is not None:
            scheme, sep, rest = redirect.partition("://")
            if scheme not in {"http", "https"} or not sep or not rest.split("/", 1)[0]:
                env.problem(f"OIDC_REDIRECT_URL: expected an http(s):// URL, got {redirect[:200]!r}")
        env.finish()
        return settings
