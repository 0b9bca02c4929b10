"""The runtime service's settings, read once from the environment."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common.audit import AuditSettings, read_audit_settings
from services.common.logs import LOG_LEVELS
from services.common.ratelimit import RateLimits, read_rate_limits
from services.common.service_auth import ServiceSecretSettings, read_service_secret
from services.common.settings import EnvReader, default_data_dir
from services.common.tls import TlsSettings, read_tls
from services.runtime.domain.endpoints import AllowedHosts
from services.runtime.domain.etiquette import GroupPolicy
from services.runtime.service_layer.leases import LeaseSettings


@dataclass(frozen=True)
class Settings:
    # Not in the repr: a URL may hold a password.
    database_url: str = field(repr=False)
    db_pool_size: int
    grpc_address: str
    im_address: str
    log_level: str
    reflection: bool
    max_message_bytes: int
    shutdown_grace_seconds: float
    im_call_timeout_seconds: float
    llm_base_url: str
    llm_model: str
    llm_timeout_seconds: float
    llm_max_retries: int
    max_iterations: int
    group_policy: GroupPolicy
    agent_chatter_limit: int
    token_budget: int
    tool_timeout_seconds: float
    ask_human_timeout_seconds: float
    max_reply_bytes: int
    history_cache_steps: int
    # How long an agent's read position waits before it moves in the IM, with
    # the others of its chat meanwhile (service_layer/read_positions.py).
    read_position_delay_seconds: float
    max_task_input_bytes: int
    task_max_attempts: int
    task_retry_base_seconds: float
    task_retry_max_seconds: float
    memory_address: str
    memory_call_timeout_seconds: float
    auto_recall: int
    recall_timeout_seconds: float
    recall_min_score: float
    context_tokens: int | None
    llm_api_key: str | None = field(repr=False)
    # TLS on its gRPC port and to the services it calls (plaintext by default).
    tls: TlsSettings = field(default_factory=TlsSettings)
    # Per-member rates of sending and creating (services.common.ratelimit).
    rate_limits: RateLimits = field(default_factory=RateLimits)
    audit: AuditSettings = field(default_factory=AuditSettings)
    # The runtime's credential, exchanged for its access tokens.
    service_secret: ServiceSecretSettings = field(default_factory=ServiceSecretSettings)
    # The hosts agents' model.base_url may name (RUNTIME_LLM_ALLOWED_HOSTS).
    llm_allowed_hosts: AllowedHosts = field(default_factory=AllowedHosts)
    # Most unread messages a runner takes from the IM at once when it catches up.
    unread_batch: int = 200
    # The first wait before a model's stream that broke off midway is asked
    # for again (it doubles at each try).
    llm_stream_cut_backoff_seconds: float = 0.5
    # Seconds of IM events gathered into one write of a workspace's watch cursor.
    cursor_save_delay_seconds: float = 1.0
    # How long CancelTask waits for the runner to cut a running task short.
    task_cancel_wait_seconds: float = 10.0
    # A run long-term memory could not take is sent again after this wait,
    # doubling up to the most.
    archive_retry_seconds: float = 0.5
    archive_retry_max_seconds: float = 60.0
    # Redis, for wakes and live events between replicas (REDIS_URL).
    redis_url: str = field(default="", repr=False)
    # On PostgreSQL with Redis, where several replicas may run: the leases
    # that decide which replica runs which agents. None: this process runs them all.
    leases: LeaseSettings | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Reads every setting; raises ConfigError listing all bad ones."""
        env = EnvReader(environ)
        data_dir = default_data_dir(env)
        policy = env.text("RUNTIME_GROUP_POLICY", GroupPolicy.UNLESS_OTHERS_MENTIONED.value)
        if policy not in {p.value for p in GroupPolicy}:
            env.problem(
                f"RUNTIME_GROUP_POLICY: expected one of {[p.value for p in GroupPolicy]}, got {policy!r}"
            )
            policy = GroupPolicy.UNLESS_OTHERS_MENTIONED.value
        base_url = env.text("OPENAI_BASE_URL", "")
        if base_url and not base_url.startswith(("http://", "https://")):
            env.problem("OPENAI_BASE_URL: expected an http(s) URL")
        database_url = env.text(
            "RUNTIME_DATABASE_URL", env.text("DATABASE_URL", f"sqlite:///{data_dir / 'runtime.db'}")
        )
        try:
            allowed = AllowedHosts.parse(env.text("RUNTIME_LLM_ALLOWED_HOSTS", ""), trusted_url=base_url)
        except ValueError as malformed:
            env.problem(str(malformed))
            allowed = AllowedHosts(trusted_url=base_url)
        redis_url = env.text("REDIS_URL", "")
        leases = _read_leases(env) if redis_url and not database_url.startswith("sqlite") else None
        settings = cls(
            database_url=database_url,
            db_pool_size=env.integer("RUNTIME_DB_POOL_SIZE", 16, minimum=1),
            grpc_address=env.address("RUNTIME_GRPC_ADDRESS", "127.0.0.1:50052"),
            im_address=env.address("IM_ADDRESS", "127.0.0.1:50051"),
            log_level=env.choice("LOG_LEVEL", "INFO", LOG_LEVELS),
            reflection=env.flag("GRPC_REFLECTION", True),
            max_message_bytes=env.integer("GRPC_MAX_MESSAGE_BYTES", 1024 * 1024, minimum=1024),
            shutdown_grace_seconds=env.number("SHUTDOWN_GRACE_SECONDS", 5.0),
            im_call_timeout_seconds=env.number("IM_CALL_TIMEOUT_SECONDS", 10.0, minimum=0.01),
            llm_base_url=base_url,
            llm_model=env.text("OPENAI_MODEL", "gpt-4o-mini"),
            llm_timeout_seconds=env.number("LLM_TIMEOUT_SECONDS", 120.0, minimum=0.01),
            llm_max_retries=env.integer("LLM_MAX_RETRIES", 4),
            max_iterations=env.integer("RUNTIME_MAX_ITERATIONS", 10, minimum=1),
            group_policy=GroupPolicy(policy),
            agent_chatter_limit=env.integer("RUNTIME_AGENT_CHATTER_LIMIT", 20, minimum=1),
            token_budget=env.integer("RUNTIME_TOKEN_BUDGET", 1_000_000, minimum=1),
            tool_timeout_seconds=env.number("TOOL_TIMEOUT_SECONDS", 60.0, minimum=0.01),
            ask_human_timeout_seconds=env.number("ASK_HUMAN_TIMEOUT_SECONDS", 3600.0, minimum=0.01),
            max_reply_bytes=env.integer("RUNTIME_MAX_REPLY_BYTES", 64 * 1024, minimum=64),
            history_cache_steps=env.integer("RUNTIME_HISTORY_CACHE_STEPS", 20_000, minimum=0),
            read_position_delay_seconds=env.number("RUNTIME_READ_POSITION_DELAY_SECONDS", 1.0, minimum=0.0),
            max_task_input_bytes=env.integer("RUNTIME_MAX_TASK_INPUT_BYTES", 64 * 1024, minimum=1),
            task_max_attempts=env.integer("RUNTIME_TASK_MAX_ATTEMPTS", 3, minimum=1),
            task_retry_base_seconds=env.number("RUNTIME_TASK_RETRY_BASE_SECONDS", 5.0, minimum=0.001),
            task_retry_max_seconds=env.number("RUNTIME_TASK_RETRY_MAX_SECONDS", 300.0, minimum=0.001),
            # The memory service (run_all and the compose file set it); empty:
            # no long-term memory (runs are not archived, nothing is recalled).
            memory_address=env.text("MEMORY_ADDRESS", ""),
            memory_call_timeout_seconds=env.number("MEMORY_CALL_TIMEOUT_SECONDS", 10.0, minimum=0.01),
            auto_recall=env.integer("RUNTIME_AUTO_RECALL", 3, minimum=0),
            recall_timeout_seconds=env.number("RUNTIME_RECALL_TIMEOUT_SECONDS", 3.0, minimum=0.01),
            recall_min_score=env.number("RUNTIME_RECALL_MIN_SCORE", 0.3, minimum=0.0),
            context_tokens=env.integer("OPENAI_CONTEXT_TOKENS", 0, minimum=0) or None,
            llm_api_key=env.optional("OPENAI_API_KEY"),
            tls=read_tls(env),
            rate_limits=read_rate_limits(env),
            audit=read_audit_settings(env),
            service_secret=read_service_secret(
                env,
                prefix="RUNTIME",
                service="runtime",
                data_dir=data_dir,
                embedded=database_url.startswith("sqlite"),
            ),
            llm_allowed_hosts=allowed,
            unread_batch=env.integer("RUNTIME_UNREAD_BATCH", 200, minimum=1),
            llm_stream_cut_backoff_seconds=env.number("LLM_STREAM_CUT_BACKOFF_SECONDS", 0.5, minimum=0.0),
            cursor_save_delay_seconds=env.number("RUNTIME_CURSOR_SAVE_DELAY_SECONDS", 1.0, minimum=0.0),
            task_cancel_wait_seconds=env.number("RUNTIME_TASK_CANCEL_WAIT_SECONDS", 10.0, minimum=0.0),
            archive_retry_seconds=env.number("RUNTIME_ARCHIVE_RETRY_SECONDS", 0.5, minimum=0.001),
            archive_retry_max_seconds=env.number("RUNTIME_ARCHIVE_RETRY_MAX_SECONDS", 60.0, minimum=0.001),
            redis_url=redis_url,
            leases=leases,
        )
        env.finish()
        return settings


def _read_leases(env: EnvReader) -> LeaseSettings | None:
    """The lease settings of a replica among others; None (with the problem
    noted) if they do not fit together."""
    # Unique per process unless set: a restarted replica is a new one (its
    # leases were the old process's, and expire or are released).
    replica = (
        env.text("RUNTIME_REPLICA_ID", "") or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    )
    try:
        return LeaseSettings(
            replica=replica,
            address=env.text("RUNTIME_ADVERTISED_ADDRESS", ""),
            shard_count=env.integer("RUNTIME_SHARDS", 1024, minimum=1),
            ttl_seconds=env.number("RUNTIME_LEASE_TTL_SECONDS", 10.0, minimum=0.1),
            renew_seconds=env.number("RUNTIME_LEASE_RENEW_SECONDS", 2.0, minimum=0.01),
            margin_seconds=env.number("RUNTIME_LEASE_MARGIN_SECONDS", 2.0, minimum=0.0),
            max_moves=env.integer("RUNTIME_SHARD_MOVES_PER_ROUND", 64, minimum=1),
            reconcile_seconds=env.number("RUNTIME_RECONCILE_SECONDS", 5.0, minimum=0.01),
        )
    except ValueError as unfit:
        env.problem(f"RUNTIME_LEASE_*: {unfit}")
        return None
