"""The IM's ID token verification: signatures with test keys, and each claim that fails."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import jwt
import pytest

from services.common.errors import ServiceError
from services.im.adapters.id_tokens import IdTokenVerifier
from services.im.domain.errors import NotAllowed, ProviderUnavailable, Unauthenticated
from services.im.domain.oidc import IdTokenRules
from services.im.service_layer.auth_ports import ProviderKeys
from tests.oidc_support import TestIssuer

ISSUER = "https://id.example.test"
NONCE = "n-0S6_WzA2Mj"
EMAIL = "ada@example.test"


class FakeKeys(ProviderKeys):
    """The test issuer's JWKS, or an outage; counts fetches."""

    def __init__(self, issuer: TestIssuer) -> None:
        self.issuer = issuer
        self.fetches = 0
        self.down = False

    async def fetch(self) -> Mapping[str, Any]:
        self.fetches += 1
        if self.down:
            raise ProviderUnavailable("the provider cannot be reached")
        return self.issuer.jwks()


@pytest.fixture(scope="module")
def issuer() -> TestIssuer:
    return TestIssuer(issuer=ISSUER)


def verifier_for(issuer: TestIssuer, **options: Any) -> tuple[IdTokenVerifier, FakeKeys]:
    keys = FakeKeys(issuer)
    rules = IdTokenRules(issuer=ISSUER, client_id=issuer.client_id)
    return IdTokenVerifier(keys, rules, **options), keys


async def refusal(issuer: TestIssuer, token: str, nonce: str = NONCE) -> ServiceError:
    verifier, _ = verifier_for(issuer)
    with pytest.raises(ServiceError) as caught:
        await verifier.verify(token, nonce)
    return caught.value


@pytest.mark.parametrize("algorithm", ["RS256", "ES256"])
async def test_a_genuine_token_gives_its_verified_email(issuer: TestIssuer, algorithm: str) -> None:
    verifier, _ = verifier_for(issuer)
    token = issuer.id_token(email="Ada@Example.TEST", nonce=NONCE, algorithm=algorithm, name="Ada L.")
    identity = await verifier.verify(token, NONCE)
    assert (identity.email, identity.name, identity.subject) == (EMAIL, "Ada L.", "sub-Ada@Example.TEST")
    # Remembered until the token could no longer be used: its iat + 10 minutes at most, plus leeway.
    assert identity.usable_until <= datetime.now(UTC) + timedelta(minutes=11)


async def test_some_providers_send_email_verified_as_a_string(issuer: TestIssuer) -> None:
    verifier, _ = verifier_for(issuer)
    token = issuer.id_token(email=EMAIL, nonce=NONCE, email_verified="true")
    assert (await verifier.verify(token, NONCE)).email == EMAIL


def _tampered(token: str) -> str:
    head, body, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims["email"] = "mallory@example.test"
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return ".".join([head, forged, signature])


async def test_a_changed_token_fails_its_signature(issuer: TestIssuer) -> None:
    error = await refusal(issuer, _tampered(issuer.id_token(email=EMAIL, nonce=NONCE)))
    assert isinstance(error, Unauthenticated) and "signature is invalid" in error.message


async def test_symmetric_and_unsigned_tokens_are_refused(issuer: TestIssuer) -> None:
    claims = issuer.claims(email=EMAIL, nonce=NONCE)
    # HS256 keyed with the public key's JWK: the classic confusion attack.
    hs = jwt.encode(
        claims,
        "a shared secret of thirty-two bytes or more",
        algorithm="HS256",
        headers={"kid": issuer.rsa_kid},
    )
    unsigned = jwt.encode(claims, None, algorithm="none")  # type: ignore[arg-type]
    for token in (hs, unsigned):
        error = await refusal(issuer, token)
        assert isinstance(error, Unauthenticated) and "only" in error.message and "RS256" in error.message


async def test_an_algorithm_other_than_the_key_s_is_refused(issuer: TestIssuer) -> None:
    token = issuer.sign(issuer.claims(email=EMAIL, nonce=NONCE), algorithm="RS384")
    error = await refusal(issuer, token)
    assert "not the one its key is published for" in error.message
    # The EC key is published without `alg`: an RSA algorithm cannot use it.
    error = await refusal(issuer, issuer.sign(issuer.claims(email=EMAIL, nonce=NONCE), kid=issuer.ec_kid))
    assert "cannot verify RS256" in error.message or "signature" in error.message


async def test_an_unknown_key_is_fetched_again_once_then_refused(issuer: TestIssuer) -> None:
    now = [datetime.now(UTC)]
    verifier, keys = verifier_for(issuer, refetch_seconds=10, clock=lambda: now[0])
    assert (await verifier.verify(issuer.id_token(email=EMAIL, nonce=NONCE), NONCE)).email == EMAIL
    assert keys.fetches == 1
    # The provider rotated its key: the new kid makes the verifier fetch again.
    rotated = TestIssuer(issuer=ISSUER)
    keys.issuer = rotated
    now[0] += timedelta(seconds=11)
    assert (await verifier.verify(rotated.id_token(email=EMAIL, nonce=NONCE), NONCE)).email == EMAIL
    assert keys.fetches == 2
    # A kid nobody publishes: one fetch at most per interval, then refused.
    stranger = TestIssuer(issuer=ISSUER)
    for _ in range(3):
        with pytest.raises(Unauthenticated, match="key the provider does not publish"):
            await verifier.verify(stranger.id_token(email=EMAIL, nonce=NONCE), NONCE)
    assert keys.fetches == 2


async def test_an_unreachable_provider_is_unavailable_until_its_keys_are_known(issuer: TestIssuer) -> None:
    now = [datetime.now(UTC)]
    verifier, keys = verifier_for(issuer, max_age_seconds=60, clock=lambda: now[0])
    keys.down = True
    with pytest.raises(ProviderUnavailable):
        await verifier.verify(issuer.id_token(email=EMAIL, nonce=NONCE), NONCE)
    keys.down = False
    await verifier.verify(issuer.id_token(email=EMAIL, nonce=NONCE), NONCE)
    # Known keys outlive an outage.
    keys.down = True
    now[0] += timedelta(seconds=61)
    assert (await verifier.verify(issuer.id_token(email=EMAIL, nonce=NONCE), NONCE)).email == EMAIL


@dataclass(frozen=True)
class Ago:
    """A time this many seconds before the test runs (negative: after), in epoch seconds."""

    seconds: int

    def at(self, now: int) -> int:
        return now - self.seconds


CLAIM_FAILURES = [
    (
        "another issuer",
        {"iss": "https://evil.example.test"},
        Unauthenticated,
        "not by the configured provider",
    ),
    ("no issuer", {"iss": None}, Unauthenticated, "not by the configured provider"),
    ("another audience", {"aud": "another-client"}, Unauthenticated, "audience"),
    ("no audience", {"aud": None}, Unauthenticated, "audience"),
    (
        "several audiences without azp",
        {"aud": ["agentim-test-client", "other"]},
        Unauthenticated,
        "another client (azp)",
    ),
    (
        "azp of another client",
        {"aud": ["agentim-test-client", "other"], "azp": "other"},
        Unauthenticated,
        "another client (azp)",
    ),
    ("expired", {"exp": Ago(120)}, Unauthenticated, "has expired"),
    ("no expiry", {"exp": None}, Unauthenticated, "'exp' claim is missing"),
    ("issued in the future", {"iat": Ago(-300)}, Unauthenticated, "not valid yet"),
    ("not before later", {"nbf": Ago(-300)}, Unauthenticated, "not valid yet"),
    (
        "issued long ago",
        {"iat": Ago(3600), "exp": Ago(-3600)},
        Unauthenticated,
        "too long ago",
    ),
    ("another nonce", {"nonce": "someone else's"}, Unauthenticated, "nonce does not match"),
    ("no nonce", {"nonce": None}, Unauthenticated, "nonce does not match"),
    ("no subject", {"sub": None}, Unauthenticated, "no subject"),
    ("no email", {"email": None}, NotAllowed, "gave no email address"),
    ("not an email", {"email": "not an address"}, NotAllowed, "is not an email address"),
    ("unverified email", {"email_verified": False}, NotAllowed, "has not verified the email address"),
    ("email_verified missing", {"email_verified": None}, NotAllowed, "has not verified"),
    ("email_verified 'false'", {"email_verified": "false"}, NotAllowed, "has not verified"),
]


@pytest.mark.parametrize(
    ("overrides", "kind", "words"),
    [pytest.param(o, k, w, id=name) for name, o, k, w in CLAIM_FAILURES],
)
async def test_each_claim_that_fails_is_refused_with_its_reason(
    issuer: TestIssuer, overrides: dict[str, Any], kind: type[ServiceError], words: str
) -> None:
    now = int(time.time())
    resolved = {name: value.at(now) if isinstance(value, Ago) else value for name, value in overrides.items()}
    claims = {**issuer.claims(email=EMAIL, nonce=NONCE), **resolved}
    token = issuer.sign({name: value for name, value in claims.items() if value is not None})
    error = await refusal(issuer, token)
    assert isinstance(error, kind), error
    assert words in error.message
    assert "eyJ" not in error.message  # never the token


async def test_malformed_input_is_refused_clearly(issuer: TestIssuer) -> None:
    verifier, _ = verifier_for(issuer)
    for token, words in (("not a token", "malformed"), ("x" * 20000, "too long")):
        with pytest.raises(Unauthenticated, match=words):
            await verifier.verify(token, NONCE)
    with pytest.raises(ServiceError, match="id_token is required"):
        await verifier.verify("", NONCE)
    with pytest.raises(ServiceError, match="nonce is required"):
        await verifier.verify(issuer.id_token(email=EMAIL, nonce=NONCE), "")
