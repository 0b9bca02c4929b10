"""OpenID Connect plumbing the IM and the gateway share: the settings, which
provider URLs are allowed, and a small HTTP client for the provider
(discovery, its keys, the token endpoint), every call with a deadline.

The gateway is the relying party (it runs the authorization code flow);
the IM verifies the ID tokens the gateway hands it, with keys it fetches
itself. Both find the provider's endpoints in its discovery document
(`<issuer>/.well-known/openid-configuration`). A provider is reached over
HTTPS only, except on a loopback address (a provider started by a test).
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp

from services.common.settings import EnvReader

DISCOVERY_PATH = "/.well-known/openid-configuration"
# Larger answers from a provider are refused unread.
MAX_RESPONSE_BYTES = 1024 * 1024
_SHOWN_CHARS = 200


class ProviderError(Exception):
    """The provider could not be reached, or answered something unusable.

    The message is for people and never holds a secret or a token.
    """


@dataclass(frozen=True)
class OidcSettings:
    """The organisation's OpenID Connect provider, as configured.

    Attributes:
        issuer: `OIDC_ISSUER`, exactly as the provider's tokens name it.
        client_id: `OIDC_CLIENT_ID`, this system's client at the provider.
        client_secret: `OIDC_CLIENT_SECRET` (or `_FILE`); only the gateway needs it.
        http_timeout_seconds: deadline of each call to the provider.
    """

    issuer: str
    client_id: str
    client_secret: str | None = field(default=None, repr=False)
    http_timeout_seconds: float = 5.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_problem(url: str, *, what: str) -> str | None:
    """Why a provider URL is not allowed (None if it is): HTTPS, or plain HTTP on loopback."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        parts.port  # noqa: B018 - raises for a malformed port
    except ValueError:
        return f"{what}: not a URL: {url[:_SHOWN_CHARS]!r}"
    if parts.scheme == "https" and host:
        return None
    if parts.scheme == "http" and is_loopback(host):
        return None
    return (
        f"{what}: must be an https:// URL (plain http only on a loopback address), got {url[:_SHOWN_CHARS]!r}"
    )


def read_oidc(env: EnvReader, *, needs_secret: bool) -> OidcSettings | None:
    """`OIDC_*` settings; None when `OIDC_ISSUER` is unset. Problems go to `env`."""
    issuer = env.optional("OIDC_ISSUER")
    client_id = env.optional("OIDC_CLIENT_ID")
    # A service that only verifies ID tokens never holds the secret.
    secret = env.optional("OIDC_CLIENT_SECRET") if needs_secret else None
    secret_file = env.optional("OIDC_CLIENT_SECRET_FILE") if needs_secret else None
    timeout = env.number("OIDC_HTTP_TIMEOUT_SECONDS", 5.0, minimum=0.1)
    if issuer is None:
        return None
    problem = url_problem(issuer, what="OIDC_ISSUER")
    if problem is not None:
        env.problem(problem)
    elif urlsplit(issuer).query or urlsplit(issuer).fragment:
        env.problem("OIDC_ISSUER: an issuer has no query or fragment")
    if client_id is None:
        env.problem("OIDC_CLIENT_ID: required with OIDC_ISSUER")
    if secret is None and secret_file is not None:
        try:
            with open(secret_file, encoding="utf-8") as file:
                secret = file.read().strip() or None
        except OSError as error:
            env.problem(f"OIDC_CLIENT_SECRET_FILE: cannot read it ({error.strerror or error})")
    if needs_secret and secret is None:
        env.problem("OIDC_CLIENT_SECRET (or OIDC_CLIENT_SECRET_FILE): required with OIDC_ISSUER")
    return OidcSettings(
        issuer=issuer, client_id=client_id or "", client_secret=secret, http_timeout_seconds=timeout
    )


@dataclass(frozen=True)
class Discovery:
    """The endpoints of the provider's discovery document this system uses."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str


class ProviderClient:
    """Calls the provider: discovery (kept `discovery_max_age_seconds`), keys, tokens.

    Args:
        settings: the provider and the deadline of each call.
        discovery_max_age_seconds: how long the discovery document is kept.
        clock: monotonic seconds, replaceable in tests.

    The HTTP session is made on first use (inside the running loop);
    `aclose` closes it and is idempotent.
    """

    def __init__(
        self,
        settings: OidcSettings,
        *,
        discovery_max_age_seconds: float = 3600.0,
        clock: Any = time.monotonic,
    ) -> None:
        self.settings = settings
        self._max_age = discovery_max_age_seconds
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._discovery: tuple[float, Discovery] | None = None
        self._lock = asyncio.Lock()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.settings.http_timeout_seconds)
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _json(
        self,
        method: str,
        url: str,
        *,
        data: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """The status and JSON body of a call; ProviderError if there is none."""
        where = urlsplit(url).netloc
        try:
            async with self._http().request(
                method,
                url,
                data=data,
                headers={"Accept": "application/json", **(headers or {})},
                allow_redirects=False,
            ) as response:
                raw = await response.content.read(MAX_RESPONSE_BYTES + 1)
                status = response.status
        except TimeoutError:
            raise ProviderError(
                f"the OpenID provider ({where}) did not answer within {self.settings.http_timeout_seconds} s"
            ) from None
        except aiohttp.ClientError as error:
            raise ProviderError(f"the OpenID provider ({where}) cannot be reached: {error}") from None
        if len(raw) > MAX_RESPONSE_BYTES:
            raise ProviderError(
                f"the OpenID provider ({where}) answered more than {MAX_RESPONSE_BYTES} bytes"
            )
        try:
            return status, json.loads(raw)
        except ValueError:
            raise ProviderError(
                f"the OpenID provider ({where}) answered HTTP {status} without JSON at {urlsplit(url).path}"
            ) from None

    async def discovery(self) -> Discovery:
        """The provider's endpoints, from its discovery document (cached)."""
        cached = self._discovery
        if cached is not None and self._clock() - cached[0] < self._max_age:
            return cached[1]
        async with self._lock:
            if self._discovery is not cached and self._discovery is not None:
                return self._discovery[1]
            issuer = self.settings.issuer
            status, document = await self._json("GET", issuer.rstrip("/") + DISCOVERY_PATH)
            if status != 200 or not isinstance(document, dict):
                raise ProviderError(f"the OpenID provider's discovery document answered HTTP {status}")
            if document.get("issuer") != issuer:
                raise ProviderError(
                    "the OpenID provider's discovery document names another issuer"
                    f" ({str(document.get('issuer'))[:_SHOWN_CHARS]!r}, not OIDC_ISSUER {issuer!r})"
                )
            endpoints = {}
            for name in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
                value = document.get(name)
                if not isinstance(value, str) or not value:
                    raise ProviderError(f"the OpenID provider's discovery document has no {name}")
                problem = url_problem(value, what=name)
                if problem is not None:
                    raise ProviderError(f"the OpenID provider's {problem}")
                endpoints[name] = value
            found = Discovery(issuer=issuer, **endpoints)
            self._discovery = (self._clock(), found)
            return found

    async def jwks(self) -> dict[str, Any]:
        """The provider's published keys (a JWKS), fetched now."""
        discovery = await self.discovery()
        status, document = await self._json("GET", discovery.jwks_uri)
        if status != 200 or not isinstance(document, dict) or not isinstance(document.get("keys"), list):
            raise ProviderError(
                f"the OpenID provider's keys (jwks_uri) answered HTTP {status} without a JWKS"
            )
        return document

    async def exchange_code(self, *, code: str, redirect_uri: str, code_verifier: str) -> dict[str, Any]:
        """The token endpoint's answer for an authorization code (client_secret_basic).

        Raises:
            ProviderError: unreachable, or the provider refused (its `error`
                and `error_description` are in the message).
        """
        secret = self.settings.client_secret or ""
        discovery = await self.discovery()
        # RFC 6749, 2.3.1: both parts form-encoded before Basic's base64.
        pair = f"{quote(self.settings.client_id, safe='')}:{quote(secret, safe='')}"
        basic = "Basic " + base64.b64encode(pair.encode()).decode()
        status, body = await self._json(
            "POST",
            discovery.token_endpoint,
            data={
                "grant_type": "authorization_code",
                "code": code,
                "redirect_uri": redirect_uri,
                "code_verifier": code_verifier,
            },
            headers={"Authorization": basic},
        )
        if not isinstance(body, dict):
            raise ProviderError(
                f"the OpenID provider's token endpoint answered HTTP {status} without an object"
            )
        if status != 200:
            error = str(body.get("error", f"HTTP {status}"))[:_SHOWN_CHARS]
            description = str(body.get("error_description", ""))[:_SHOWN_CHARS]
            raise ProviderError(
                f"the OpenID provider refused the sign-in: {error}"
                + (f" ({description})" if description else "")
            )
        return body
