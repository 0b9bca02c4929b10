"""The token library: key rings, signing, verifying, rotation."""

from __future__ import annotations

import base64
import json
import os
import stat
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from services.common.errors import Unauthenticated, Unavailable
from services.common.tokens import (
    AccessClaims,
    KeyRing,
    KeyRingError,
    PrincipalKind,
    Scope,
    Verifier,
    has_signing_key,
    keyring_source,
    sign,
)


class Clock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC).timestamp()

    def __call__(self) -> float:
        return self.now


class CountingSource:
    """A JWKS source over a key ring that counts its calls and can fail."""

    def __init__(self, ring: KeyRing) -> None:
        self.ring = ring
        self.calls = 0
        self.failing = False

    async def __call__(self) -> Mapping[str, Any]:
        self.calls += 1
        if self.failing:
            raise ConnectionError("the IM is away")
        return self.ring.jwks()


def human(**fields: Any) -> AccessClaims:
    values: dict[str, Any] = {
        "kind": PrincipalKind.HUMAN,
        "member_id": uuid.uuid4(),
        "workspace_id": uuid.uuid4(),
        "roles": ("member",),
    }
    values.update(fields)
    return AccessClaims(**values)


@pytest.fixture
def ring(tmp_path: Path) -> KeyRing:
    KeyRing.generate(tmp_path / "keys")
    return KeyRing.load(tmp_path / "keys")


def segments(token: str) -> list[str]:
    return token.split(".")


def b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


async def test_a_signed_token_verifies_with_its_claims(ring: KeyRing) -> None:
    claims = human(scope=Scope.READ).stamped()
    token = sign(claims, ring)
    verified = await Verifier(keyring_source(ring)).verify(token)
    # Times travel as whole seconds.
    assert verified == AccessClaims(
        kind=claims.kind,
        member_id=claims.member_id,
        workspace_id=claims.workspace_id,
        roles=claims.roles,
        scope=Scope.READ,
        issued_at=claims.issued_at.replace(microsecond=0) if claims.issued_at else None,
        expires_at=claims.expires_at.replace(microsecond=0) if claims.expires_at else None,
        token_id=claims.token_id,
    )
    assert not verified.can_write
    header = jwt.get_unverified_header(token)
    assert header["alg"] == "EdDSA" and header["kid"] == ring.signing_kid
    payload = jwt.decode(token, options={"verify_signature": False})
    assert payload["iss"] == payload["aud"] == "agentim"
    assert payload["sub"] == str(claims.member_id) and payload["ws"] == str(claims.workspace_id)
    assert payload["exp"] - payload["iat"] == 15 * 60


async def test_agent_service_and_personal_token_claims_round_trip(ring: KeyRing) -> None:
    verifier = Verifier(keyring_source(ring))
    agent = human(kind=PrincipalKind.AGENT, host="runtime")
    assert (await verifier.verify(sign(agent, ring))).host == "runtime"
    service = AccessClaims(kind=PrincipalKind.SERVICE, service="memory")
    found = await verifier.verify(sign(service, ring))
    assert (found.kind, found.service, found.member_id, found.workspace_id) == (
        PrincipalKind.SERVICE,
        "memory",
        None,
        None,
    )
    pat = uuid.uuid4()
    assert (await verifier.verify(sign(human(personal_token_id=pat), ring))).personal_token_id == pat


def test_claims_must_name_their_principal() -> None:
    with pytest.raises(ValueError):
        AccessClaims(kind=PrincipalKind.SERVICE)
    with pytest.raises(ValueError):
        AccessClaims(kind=PrincipalKind.HUMAN, member_id=uuid.uuid4())


async def test_the_lifetime_is_configurable_and_an_expired_token_is_refused(ring: KeyRing) -> None:
    clock = Clock()
    verifier = Verifier(keyring_source(ring), clock=clock, leeway_seconds=5)
    issued = datetime.fromtimestamp(clock.now, UTC) - timedelta(minutes=2)
    token = sign(human(), ring, lifetime=timedelta(minutes=1), now=issued)
    with pytest.raises(Unauthenticated, match="expired") as caught:
        await verifier.verify(token)
    assert token not in caught.value.message
    # Within the leeway it still counts.
    fresh = sign(human(), ring, lifetime=timedelta(minutes=2), now=issued + timedelta(seconds=3))
    assert (await verifier.verify(fresh)).member_id is not None


async def test_a_tampered_payload_or_signature_is_refused(ring: KeyRing) -> None:
    verifier = Verifier(keyring_source(ring))
    token = sign(human(roles=("member",)), ring)
    header, payload, signature = segments(token)
    claims = jwt.decode(token, options={"verify_signature": False})
    claims["roles"] = ["owner"]
    forged = f"{header}.{b64(claims)}.{signature}"
    with pytest.raises(Unauthenticated, match="signature") as caught:
        await verifier.verify(forged)
    assert forged not in caught.value.message and signature not in caught.value.message
    flipped = signature[:-2] + ("A" if signature[-2] != "A" else "B") + signature[-1]
    with pytest.raises(Unauthenticated, match="signature"):
        await verifier.verify(f"{header}.{payload}.{flipped}")
    for garbage in ["", "not-a-token", "a.b.c", "x" * 9000, f"{header}.{payload}"]:
        with pytest.raises(Unauthenticated):
            await verifier.verify(garbage)


async def test_a_token_signed_by_another_key_with_the_same_kid_is_refused(
    ring: KeyRing, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    KeyRing.generate(other, kid=ring.signing_kid)
    forged = sign(human(), KeyRing.load(other))
    with pytest.raises(Unauthenticated, match="signature"):
        await Verifier(keyring_source(ring)).verify(forged)


@pytest.mark.parametrize("algorithm", ["HS256", "none", "RS256", "ES256"])
async def test_only_eddsa_is_accepted(ring: KeyRing, algorithm: str) -> None:
    verifier = Verifier(keyring_source(ring))
    claims = jwt.decode(sign(human(), ring), options={"verify_signature": False})
    header = {"alg": algorithm, "kid": ring.signing_kid, "typ": "JWT"}
    # An HMAC "signed" with the public key is the classic confusion attack.
    public_x = ring.jwks()["keys"][0]["x"]
    forged = f"{b64(header)}.{b64(claims)}."
    if algorithm == "HS256":
        secret = public_x.encode() * 2
        forged = jwt.encode(claims, secret, algorithm="HS256", headers={"kid": ring.signing_kid})
    with pytest.raises(Unauthenticated, match="only EdDSA is accepted"):
        await verifier.verify(forged)


async def test_wrong_issuer_audience_or_claims_are_refused(ring: KeyRing) -> None:
    verifier = Verifier(keyring_source(ring))
    kid, key = ring.signing_key()
    good = jwt.decode(sign(human(), ring), options={"verify_signature": False})
    cases = {
        "issuer": {**good, "iss": "someone-else"},
        "audience": {**good, "aud": "another-app"},
        "malformed": {**good, "kind": "wizard"},
    }
    missing = dict(good)
    del missing["jti"]
    cases["malformed "] = missing
    for expected, payload in cases.items():
        token = jwt.encode(payload, key, algorithm="EdDSA", headers={"kid": kid})
        with pytest.raises(Unauthenticated, match=expected.strip()):
            await verifier.verify(token)


async def test_keys_are_cached_and_an_unknown_kid_refetches_at_most_once_per_interval(
    ring: KeyRing, tmp_path: Path
) -> None:
    source = CountingSource(ring)
    clock = Clock()
    verifier = Verifier(source, refetch_seconds=30, max_age_seconds=0, clock=clock)
    token = sign(human(), ring)
    for _ in range(5):
        await verifier.verify(token)
    assert source.calls == 1
    # A key nobody published: one refetch, then refusals without asking again.
    stranger = tmp_path / "stranger"
    KeyRing.generate(stranger, kid="zz-unknown")
    unknown = sign(human(), KeyRing.load(stranger))
    for _ in range(3):
        with pytest.raises(Unauthenticated, match="unknown key"):
            await verifier.verify(unknown)
    assert source.calls == 1  # fetched less than 30 s ago
    clock.now += 31
    with pytest.raises(Unauthenticated, match="unknown key"):
        await verifier.verify(unknown)
    assert source.calls == 2


async def test_a_key_added_after_the_cache_is_found_by_refetching(ring: KeyRing) -> None:
    source = CountingSource(ring)
    clock = Clock()
    verifier = Verifier(source, refetch_seconds=30, clock=clock)
    await verifier.verify(sign(human(), ring))
    KeyRing.generate(ring.directory, kid="zzzz-newer")
    ring.reload()
    assert ring.signing_kid == "zzzz-newer"
    rotated = sign(human(), ring)
    clock.now += 31
    assert (await verifier.verify(rotated)).member_id is not None
    assert source.calls == 2


async def test_rotation_without_downtime(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    old = KeyRing.generate(directory, kid="20260101T000000Z-aaaa")
    ring = KeyRing.load(directory)
    source = CountingSource(ring)
    clock = Clock()
    verifier = Verifier(source, refetch_seconds=30, max_age_seconds=300, clock=clock)
    before = sign(human(), ring)
    await verifier.verify(before)
    # 1. The next key is published but does not sign.
    upcoming = KeyRing.generate(directory, upcoming=True, kid="20260201T000000Z-bbbb")
    ring.reload()
    assert ring.signing_kid == old
    assert {k["kid"] for k in ring.jwks()["keys"]} == {old, upcoming}
    assert jwt.get_unverified_header(sign(human(), ring))["kid"] == old
    # 2. Verifiers pick it up within their max age.
    clock.now += 301
    await verifier.verify(before)
    assert source.calls == 2
    # 3. It signs; tokens of the old key still verify while it is published.
    (directory / f"{upcoming}.next.pem").rename(directory / f"{upcoming}.pem")
    ring.reload()
    assert ring.signing_kid == upcoming
    after = sign(human(), ring)
    calls = source.calls
    assert (await verifier.verify(after)).member_id is not None
    assert (await verifier.verify(before)).member_id is not None
    assert source.calls == calls  # the new key was known already: no fetch
    # 4. The old key goes; its tokens have expired by then anyway.
    (directory / f"{old}.pem").unlink()
    ring.reload()
    clock.now += 301
    with pytest.raises(Unauthenticated, match="unknown key"):
        await verifier.verify(before)
    assert (await verifier.verify(after)).member_id is not None


async def test_a_failing_source_keeps_the_keys_it_had_and_is_unavailable_at_first(ring: KeyRing) -> None:
    source = CountingSource(ring)
    clock = Clock()
    verifier = Verifier(source, max_age_seconds=60, clock=clock)
    token = sign(human(), ring)
    source.failing = True
    with pytest.raises(Unavailable):
        await verifier.verify(token)
    source.failing = False
    await verifier.verify(token)
    source.failing = True
    clock.now += 61
    assert (await verifier.verify(token)).member_id is not None


def test_generate_writes_private_files_and_jwks_holds_no_private_part(tmp_path: Path) -> None:
    directory = tmp_path / "fresh"
    assert not has_signing_key(directory)
    kid = KeyRing.generate(directory)
    assert has_signing_key(directory)
    path = directory / f"{kid}.pem"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    jwks = KeyRing.load(directory).jwks()
    assert jwks["keys"] == [
        {"kty": "OKP", "crv": "Ed25519", "x": jwks["keys"][0]["x"], "kid": kid, "alg": "EdDSA", "use": "sig"}
    ]
    assert "d" not in jwks["keys"][0]
    with pytest.raises(KeyRingError, match="exists"):
        KeyRing.generate(directory, kid=kid)


def test_the_signing_key_is_the_last_by_name_whatever_the_file_times(tmp_path: Path) -> None:
    KeyRing.generate(tmp_path, kid="b-key")
    KeyRing.generate(tmp_path, kid="a-key")
    os.utime(tmp_path / "b-key.pem", (0, 0))
    assert KeyRing.load(tmp_path).signing_kid == "b-key"


def test_a_directory_without_a_signing_key_or_with_junk_is_refused_and_reload_keeps_the_old_keys(
    tmp_path: Path,
) -> None:
    with pytest.raises(KeyRingError, match="not a directory"):
        KeyRing.load(tmp_path / "missing")
    KeyRing.generate(tmp_path, upcoming=True)
    with pytest.raises(KeyRingError, match="no signing key"):
        KeyRing.load(tmp_path)
    kid = KeyRing.generate(tmp_path)
    ring = KeyRing.load(tmp_path)
    (tmp_path / "zzz.pem").write_text("not a key")
    with pytest.raises(KeyRingError, match=r"zzz\.pem"):
        ring.reload()
    assert ring.signing_kid == kid
    (tmp_path / "zzz.pem").unlink()
    (tmp_path / "README").write_text("ignored")
    ring.reload()
    assert ring.signing_kid == kid


def test_a_key_of_another_type_is_refused(tmp_path: Path) -> None:
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (tmp_path / "ec.pem").write_bytes(pem)
    with pytest.raises(KeyRingError, match="not an Ed25519 key"):
        KeyRing.load(tmp_path)


async def test_a_remembered_token_is_still_refused_once_expired_and_a_tampered_copy_is_checked(
    ring: KeyRing,
) -> None:
    clock = Clock()
    verifier = Verifier(keyring_source(ring), clock=clock, leeway_seconds=5)
    token = sign(human(), ring, lifetime=timedelta(minutes=1), now=datetime.fromtimestamp(clock.now, UTC))
    first = await verifier.verify(token)
    assert await verifier.verify(token) == first
    header, payload, signature = segments(token)
    flipped = signature[:-2] + ("A" if signature[-2] != "A" else "B") + signature[-1]
    with pytest.raises(Unauthenticated, match="signature"):
        await verifier.verify(f"{header}.{payload}.{flipped}")
    clock.now += 70
    with pytest.raises(Unauthenticated, match="expired"):
        await verifier.verify(token)
