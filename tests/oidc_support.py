"""ID tokens for tests: a key pair of a test issuer, and that issuer over real HTTP.

`TestIssuer` signs ID tokens as an OpenID provider would (any claim may be
made wrong, to see it refused) and serves its discovery document and JWKS
on a loopback port, so that an IM configured with it fetches its keys as
from any provider. The whole authorization code flow is tested against a
real provider (`oidc-provider`, tests/e2e/oidc/provider.mjs); this one is
for what the IM decides about tokens, where a real provider would not sign
the wrong tokens these tests need.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import jwt
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec, rsa

CLIENT_ID = "agentim-test-client"


class TestIssuer:
    """An ID token issuer with an RSA key (RS256) and an EC key (ES256).

    Args:
        issuer: the `iss` it signs with; set by `start` to its URL when empty.
        client_id: the `aud` it signs for by default.
    """

    __test__ = False  # not a test class, whatever pytest thinks of the name

    def __init__(self, issuer: str = "", client_id: str = CLIENT_ID) -> None:
        self.issuer = issuer
        self.client_id = client_id
        self.rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.ec = ec.generate_private_key(ec.SECP256R1())
        self.rsa_kid = f"rsa-{secrets.token_hex(4)}"
        self.ec_kid = f"ec-{secrets.token_hex(4)}"
        self._runner: web.AppRunner | None = None
        self.jwks_fetches = 0
        self.published: list[dict[str, Any]] | None = None

    # -- keys and tokens ----------------------------------------------------------------

    def jwks(self) -> dict[str, Any]:
        if self.published is not None:
            return {"keys": self.published}
        rsa_jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.rsa.public_key()))
        ec_jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(self.ec.public_key()))
        return {
            "keys": [
                {**rsa_jwk, "kid": self.rsa_kid, "use": "sig", "alg": "RS256"},
                {**ec_jwk, "kid": self.ec_kid, "use": "sig"},
            ]
        }

    def claims(self, *, email: str, nonce: str, **overrides: Any) -> dict[str, Any]:
        """Valid claims for `email`; an override of None removes the claim."""
        now = int(time.time())
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "aud": self.client_id,
            "sub": f"sub-{email}",
            "iat": now,
            "exp": now + 300,
            "nonce": nonce,
            "email": email,
            "email_verified": True,
            "name": email.split("@", 1)[0].title(),
        }
        claims.update(overrides)
        return {name: value for name, value in claims.items() if value is not None}

    def sign(self, claims: dict[str, Any], *, algorithm: str = "RS256", kid: str | None = None) -> str:
        if algorithm.startswith("ES"):
            return jwt.encode(claims, self.ec, algorithm=algorithm, headers={"kid": kid or self.ec_kid})
        return jwt.encode(claims, self.rsa, algorithm=algorithm, headers={"kid": kid or self.rsa_kid})

    def id_token(self, *, email: str, nonce: str, algorithm: str = "RS256", **overrides: Any) -> str:
        return self.sign(self.claims(email=email, nonce=nonce, **overrides), algorithm=algorithm)

    def rotate(self) -> None:
        """A new RSA key under a new kid (the old one is no longer published)."""
        self.rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.rsa_kid = f"rsa-{secrets.token_hex(4)}"

    # -- over HTTP ----------------------------------------------------------------------

    async def start(self) -> str:
        """Serves discovery and the JWKS on a free loopback port; returns the issuer URL."""
        app = web.Application()
        app.router.add_get("/.well-known/openid-configuration", self._discovery)
        app.router.add_get("/jwks", self._jwks)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.issuer = self.issuer or f"http://127.0.0.1:{port}"
        self._base = f"http://127.0.0.1:{port}"
        return self.issuer

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def environment(self) -> dict[str, str]:
        """The IM's settings naming this issuer."""
        return {"OIDC_ISSUER": self.issuer, "OIDC_CLIENT_ID": self.client_id}

    async def _discovery(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "issuer": self.issuer,
                "authorization_endpoint": f"{self._base}/auth",
                "token_endpoint": f"{self._base}/token",
                "jwks_uri": f"{self._base}/jwks",
            }
        )

    async def _jwks(self, request: web.Request) -> web.Response:
        self.jwks_fetches += 1
        return web.json_response(self.jwks())
