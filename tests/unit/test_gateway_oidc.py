"""The gateway as OpenID Connect relying party: its settings, PKCE, and the
sealed flow cookie (pure parts; the whole flow is tests/e2e/test_oidc.py)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from gateway.config import Settings
from gateway.oidc import FLOW_MAX_AGE_S, Flow, FlowError, RelyingParty, pkce_challenge
from gateway.sessions import Session, SessionSealer
from services.common.oidc import Discovery, OidcSettings, ProviderClient
from services.common.settings import ConfigError
from services.im.config import Settings as ImSettings

OIDC = {"OIDC_ISSUER": "https://id.example.test", "OIDC_CLIENT_ID": "agentim"}


def test_the_pkce_challenge_is_rfc_7636_s256() -> None:
    # RFC 7636, appendix B.
    assert (
        pkce_challenge("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk")
        == "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
    )


def test_the_gateway_needs_the_client_secret_and_the_im_never_reads_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        Settings.from_env({"OIDC_ISSUER": "https://id.example.test"})
    problems = "\n".join(raised.value.problems)
    assert (
        "OIDC_CLIENT_ID: required" in problems
        and "OIDC_CLIENT_SECRET (or OIDC_CLIENT_SECRET_FILE)" in problems
    )
    secret_file = tmp_path / "secret"
    secret_file.write_text("s3cret-value\n")
    settings = Settings.from_env({**OIDC, "OIDC_CLIENT_SECRET_FILE": str(secret_file)})
    assert settings.oidc is not None and settings.oidc.client_secret == "s3cret-value"
    assert "s3cret-value" not in repr(settings)
    im = ImSettings.from_env({**OIDC, "OIDC_CLIENT_SECRET": "s3cret-value"})
    assert im.oidc == OidcSettings(issuer="https://id.example.test", client_id="agentim")
    assert im.oidc.client_secret is None
    assert Settings.from_env({}).oidc is None and ImSettings.from_env({}).oidc is None


@pytest.mark.parametrize(
    ("issuer", "allowed"),
    [
        ("https://id.example.test", True),
        ("https://id.example.test/realms/acme", True),
        ("http://127.0.0.1:8080", True),
        ("http://localhost:9000", True),
        ("http://[::1]:9000", True),
        ("http://id.example.test", False),
        ("http://10.0.0.5", False),
        ("ftp://id.example.test", False),
        ("https://id.example.test/?x=1", False),
        ("id.example.test", False),
    ],
)
def test_a_provider_is_reached_over_https_or_on_loopback(issuer: str, allowed: bool) -> None:
    environ = {**OIDC, "OIDC_ISSUER": issuer, "OIDC_CLIENT_SECRET": "s"}
    if allowed:
        assert Settings.from_env(environ).oidc is not None
        return
    with pytest.raises(ConfigError) as raised:
        Settings.from_env(environ)
    assert any(p.startswith("OIDC_ISSUER:") for p in raised.value.problems), raised.value.problems


def test_the_redirect_url_must_be_a_url() -> None:
    environ = {**OIDC, "OIDC_CLIENT_SECRET": "s"}
    assert (
        Settings.from_env(
            {**environ, "OIDC_REDIRECT_URL": "https://im.example/v1/auth/oidc/callback"}
        ).oidc_redirect_url
        == "https://im.example/v1/auth/oidc/callback"
    )
    with pytest.raises(ConfigError, match="OIDC_REDIRECT_URL"):
        Settings.from_env({**environ, "OIDC_REDIRECT_URL": "im.example/callback"})


class KnownProvider(ProviderClient):
    """A provider whose discovery document is known (no HTTP)."""

    async def discovery(self) -> Discovery:
        return Discovery(
            issuer=self.settings.issuer,
            authorization_endpoint="https://id.example.test/auth?tenant=acme",
            token_endpoint="https://id.example.test/token",
            jwks_uri="https://id.example.test/jwks",
        )


def party(clock: list[float], key: bytes = b"k" * 32) -> RelyingParty:
    settings = OidcSettings(issuer="https://id.example.test", client_id="agentim", client_secret="s")
    return RelyingParty(KnownProvider(settings), SessionSealer(key), clock=lambda: clock[0])


async def test_start_sends_a_pkce_request_and_seals_its_secrets() -> None:
    clock = [1_000_000.0]
    rp = party(clock)
    url, cookie = await rp.start(redirect_uri="https://im.example/v1/auth/oidc/callback", invite="aim_inv_x")
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    assert parts.path == "/auth" and query["tenant"] == "acme"
    assert query["response_type"] == "code" and query["client_id"] == "agentim"
    assert query["scope"] == "openid email profile" and query["code_challenge_method"] == "S256"
    flow = rp.open(cookie)
    assert (flow.state, flow.nonce) == (query["state"], query["nonce"])
    assert query["code_challenge"] == pkce_challenge(flow.verifier) and flow.verifier not in url
    assert flow.invite == "aim_inv_x" and flow.verifier not in cookie and flow.nonce not in cookie
    # Each start has secrets of its own.
    _, second = await rp.start(redirect_uri="https://im.example/v1/auth/oidc/callback")
    assert rp.open(second).state != flow.state


async def test_a_flow_cookie_opens_only_as_itself_fresh_and_unaltered() -> None:
    clock = [1_000_000.0]
    rp = party(clock)
    _, cookie = await rp.start(redirect_uri="https://im.example/cb")
    sealer = SessionSealer(b"k" * 32)
    session = Session("sid", "m", "w", access_token="at", access_expires_at=1.0, refresh_token="rt")
    # Altered, or a session cookie offered as a flow cookie.
    for wrong in (None, "", cookie[:-3] + "AAA", sealer.seal(session)):
        with pytest.raises(FlowError, match="no sign-in"):
            rp.open(wrong)
    # A flow cookie is no session cookie either.
    assert sealer.open(cookie) is None
    # Another gateway key cannot open it.
    with pytest.raises(FlowError):
        party(clock, b"o" * 32).open(cookie)
    clock[0] += FLOW_MAX_AGE_S + 1
    with pytest.raises(FlowError, match="took too long"):
        rp.open(cookie)


async def test_the_callback_must_carry_this_flow_s_state_and_issuer() -> None:
    clock = [1_000_000.0]
    rp = party(clock)
    flow = Flow(
        state="s" * 43,
        nonce="n",
        verifier="v" * 43,
        redirect_uri="https://im.example/cb",
        started_at=clock[0],
    )
    for query, words in (
        ({"state": "t" * 43, "code": "c"}, "state does not match"),
        ({"code": "c"}, "state does not match"),
        ({"state": "s" * 43}, "no authorization code"),
        ({"state": "s" * 43, "code": "c", "iss": "https://evil.example"}, "another provider"),
        ({"error": "access_denied"}, "did not complete: access_denied"),
    ):
        with pytest.raises(FlowError, match=words):
            await rp.finish(flow, query)
    assert (
        "verifier" not in repr(flow) and "v" * 43 not in repr(flow) and asdict(flow)["verifier"] == "v" * 43
    )
