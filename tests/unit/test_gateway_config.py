"""The gateway's settings."""

from __future__ import annotations

import pytest

from gateway.config import DEFAULT_STATIC_DIR, Settings
from services.common.settings import ConfigError


def test_defaults() -> None:
    settings = Settings.from_env({})
    assert settings.http_address == "127.0.0.1:8080"
    assert (settings.im_address, settings.runtime_address) == ("127.0.0.1:50051", "127.0.0.1:50052")
    assert settings.session_key is None and settings.cors_origins == ()
    assert settings.session_key_file.name == "gateway-session.key" and not settings.cookie_secure
    assert settings.max_body_bytes == 1024 * 1024 and settings.heartbeat_seconds == 15.0
    assert settings.static_dir == DEFAULT_STATIC_DIR and settings.sse_max_seconds == 0


def test_every_problem_is_reported_at_once_and_the_token_never() -> None:
    with pytest.raises(ConfigError) as raised:
        Settings.from_env(
            {
                "GATEWAY_HTTP_ADDRESS": "nowhere",
                "RUNTIME_ADDRESS": "x:99999",
                "GATEWAY_MAX_BODY_BYTES": "lots",
                "GATEWAY_CORS_ORIGINS": "https://ok.example, ftp://bad, https://x.example/path",
                "GATEWAY_CALL_TIMEOUT_SECONDS": "0",
                "GATEWAY_SESSION_KEY": "secret-but-short",
                "LOG_LEVEL": "LOUD",
            }
        )
    problems = "\n".join(raised.value.problems)
    assert len(raised.value.problems) == 8, problems
    for name in ("GATEWAY_HTTP_ADDRESS", "RUNTIME_ADDRESS", "GATEWAY_MAX_BODY_BYTES", "LOG_LEVEL"):
        assert name in problems
    assert "ftp://bad" in problems and "x.example/path" in problems
    assert "secret" not in problems


def test_origins_and_session_key() -> None:
    key = "ab" * 32
    settings = Settings.from_env(
        {"GATEWAY_CORS_ORIGINS": "https://a.example/, *", "GATEWAY_SESSION_KEY": key}
    )
    assert settings.cors_origins == ("https://a.example", "*")
    assert settings.session_key == bytes.fromhex(key) and key not in repr(settings)


def test_a_shared_database_needs_a_session_key_and_gateway_token_is_gone() -> None:
    with pytest.raises(ConfigError) as raised:
        Settings.from_env({"DATABASE_URL": "postgresql://db/x", "GATEWAY_TOKEN": "t0k"})
    problems = "\n".join(raised.value.problems)
    assert "GATEWAY_SESSION_KEY: required" in problems and "GATEWAY_TOKEN: no longer used" in problems
    assert "t0k" not in problems
