"""Checking the OpenID Connect provider's ID tokens (`IdTokens`): the
signature against the provider's published keys, fetched through
`ProviderKeys` (over HTTP: `oidc_keys`) and kept for a while, then every
claim (`domain.oidc.check_claims`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import jwt

from services.im.domain.errors import InvalidRequest, ProviderUnavailable, Unauthenticated
from services.im.domain.oidc import IdTokenRules, VerifiedIdentity, check_claims, check_nonce_format
from services.im.service_layer.auth_ports import IdTokens, ProviderKeys

logger = logging.getLogger(__name__)


def utc_now() -> datetime:
    return datetime.now(UTC)


# Asymmetric algorithms only: with HS256 the client secret (which the
# gateway holds) would sign tokens, and "none" signs nothing.
ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
MAX_ID_TOKEN_CHARS = 16384


class IdTokenVerifier(IdTokens):
    """Checks ID tokens of one provider: signature, then claims.

    Args:
        keys: the provider's JWKS.
        rules: the issuer, client id and times a token must match.
        refetch_seconds: a key id it does not know makes it fetch the keys
            again, at most this often (the provider may have rotated them).
        max_age_seconds: keys older than this are fetched again first.
        clock: current time, replaceable in tests.
    """

    def __init__(
        self,
        keys: ProviderKeys,
        rules: IdTokenRules,
        *,
        refetch_seconds: float = 10.0,
        max_age_seconds: float = 3600.0,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self._source = keys
        self.rules = rules
        self._refetch = timedelta(seconds=refetch_seconds)
        self._max_age = timedelta(seconds=max_age_seconds)
        self._clock = clock
        self._keys: list[Mapping[str, Any]] = []
        self._fetched_at: datetime | None = None
        self._lock = asyncio.Lock()
        self.fetches = 0

    async def verify(self, id_token: str, nonce: str) -> VerifiedIdentity:
        """Who the token proves signed in, for the sign-in that sent `nonce`.

        Raises:
            InvalidRequest: no token or no nonce.
            Unauthenticated: malformed, a refused algorithm, an unknown key,
                a bad signature, or a claim that fails (domain.oidc).
            NotAllowed: genuine, but without a verified email.
            ProviderUnavailable: the keys were never fetched and cannot be now.
        """
        if not id_token:
            raise InvalidRequest("id_token is required")
        check_nonce_format(nonce)
        if len(id_token) > MAX_ID_TOKEN_CHARS:
            raise Unauthenticated("the ID token is malformed (too long)")
        try:
            header = jwt.get_unverified_header(id_token)
        except jwt.PyJWTError:
            raise Unauthenticated("the ID token is malformed") from None
        algorithm = header.get("alg")
        if algorithm not in ALGORITHMS:
            shown = algorithm if isinstance(algorithm, str) and len(algorithm) <= 16 else "another algorithm"
            raise Unauthenticated(
                f"the ID token is signed with {shown!r}; only {', '.join(sorted(ALGORITHMS))} are accepted"
            )
        kid = header.get("kid")
        jwk = await self._key(kid if isinstance(kid, str) and kid else None)
        if jwk.get("alg") not in (None, algorithm):
            raise Unauthenticated("the ID token's algorithm is not the one its key is published for")
        try:
            key = jwt.PyJWK(dict(jwk), algorithm=algorithm)
        except jwt.PyJWTError:
            raise Unauthenticated(f"the provider's key for this ID token cannot verify {algorithm}") from None
        try:
            # Only the signature here: domain.oidc checks every claim, with its own messages.
            payload = jwt.decode(
                id_token,
                key,
                algorithms=[algorithm],
                options={
                    "verify_signature": True,
                    "verify_exp": False,
                    "verify_iat": False,
                    "verify_nbf": False,
                    "verify_aud": False,
                    "verify_iss": False,
                    "require": [],
                },
            )
        except jwt.InvalidSignatureError:
            raise Unauthenticated("the ID token's signature is invalid") from None
        except jwt.PyJWTError:
            raise Unauthenticated("the ID token is malformed") from None
        return check_claims(payload, nonce=nonce, rules=self.rules, now=self._clock())

    async def _key(self, kid: str | None) -> Mapping[str, Any]:
        now = self._clock()
        fetched = self._fetched_at
        if (
            fetched is None
            or now - fetched >= self._max_age
            or (self._find(kid) is None and now - fetched >= self._refetch)
        ):
            await self._fetch(required=fetched is None)
        found = self._find(kid)
        if found is None:
            if kid is None:
                raise Unauthenticated("the ID token names no key (kid) and the provider publishes several")
            raise Unauthenticated("the ID token is signed with a key the provider does not publish")
        return found

    def _find(self, kid: str | None) -> Mapping[str, Any] | None:
        if kid is None:
            return self._keys[0] if len(self._keys) == 1 else None
        return next((k for k in self._keys if k.get("kid") == kid), None)

    async def _fetch(self, *, required: bool) -> None:
        started = self._fetched_at
        async with self._lock:
            if self._fetched_at != started:
                return  # fetched by another sign-in meanwhile
            try:
                jwks = await self._source.fetch()
            except ProviderUnavailable:
                if required:
                    raise
                logger.warning("could not refresh the OpenID provider's keys; keeping the old ones")
                self._fetched_at = self._clock()
                return
            keys = jwks.get("keys")
            if not isinstance(keys, list):
                keys = []
            # Keys for encryption, or of no known type, verify nothing.
            self._keys = [
                k for k in keys if isinstance(k, dict) and k.get("use", "sig") == "sig" and "kty" in k
            ]
            self._fetched_at = self._clock()
            self.fetches += 1
