"""A real OpenID Connect provider in a process of its own, and a browser that
goes through its sign-in as a person would.

`ProviderProcess` runs tests/e2e/oidc/provider.mjs (npm's oidc-provider).
`FlowBrowser` keeps cookies (the gateway's and the provider's), follows
redirects by hand so that a test can stop at any step, and fills in the
provider's login and consent forms. `code_flow` is a relying party of the
test's own, for tests that need an ID token in hand.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import aiohttp

from tests.conftest import unavailable

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).resolve().parent / "provider.mjs"
CLIENT_ID = "agentim-test-client"
CLIENT_SECRET = f"test-secret-{secrets.token_hex(8)}"
OTHER_CLIENT = "other-client"
WAIT = 10.0


class ProviderProcess:
    """oidc-provider on a free loopback port; `start`, `configure`, then `stop`."""

    def __init__(self) -> None:
        self._process: asyncio.subprocess.Process | None = None
        self.issuer = ""

    async def start(self) -> str:
        node = shutil.which("node")
        if node is None or not (ROOT / "node_modules" / "oidc-provider").is_dir():
            unavailable("node and node_modules/oidc-provider are needed (make install)")
        assert node is not None
        self._process = await asyncio.create_subprocess_exec(
            node,
            str(SCRIPT),
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "OIDC_TEST_CLIENT_ID": CLIENT_ID, "OIDC_TEST_CLIENT_SECRET": CLIENT_SECRET},
        )
        self.issuer = (await self._read())["issuer"]
        return self.issuer

    async def _read(self) -> dict[str, Any]:
        assert self._process is not None and self._process.stdout is not None
        line = await asyncio.wait_for(self._process.stdout.readline(), WAIT)
        assert line, "the OpenID provider exited"
        found: dict[str, Any] = json.loads(line)
        return found

    async def configure(self, redirect_uris: list[str]) -> None:
        """Registers the clients with these callback URLs (the provider answers only then)."""
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write((json.dumps({"redirect_uris": redirect_uris}) + "\n").encode())
        await self._process.stdin.drain()
        assert (await self._read()) == {"ready": True}

    async def stop(self) -> None:
        process = self._process
        if process is None:
            return
        self._process = None
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 5)
        except TimeoutError:
            process.kill()
            await process.wait()


class _Forms(HTMLParser):
    """The first form of a page: its action and its inputs' names and values."""

    def __init__(self) -> None:
        super().__init__()
        self.action: str | None = None
        self.fields: dict[str, str] = {}
        self._in_form = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        if tag == "form" and self.action is None:
            self.action = values.get("action", "")
            self._in_form = True
        elif tag == "input" and self._in_form and "name" in values:
            self.fields[values["name"]] = values.get("value", "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._in_form = False


@dataclass
class Landing:
    """Where the gateway sent the browser back to: the web UI's URL and its fragment."""

    location: str

    @property
    def fragment(self) -> dict[str, str]:
        return {k: v[0] for k, v in parse_qs(urlsplit(self.location).fragment).items()}

    @property
    def error(self) -> str:
        return self.fragment.get("signin_error", "")

    @property
    def status(self) -> str:
        return self.fragment.get("signin_status", "")


class FlowBrowser:
    """One browser (one cookie jar) against one gateway and the provider.

    Args:
        base: the gateway's URL.
        replicas: other gateways' URLs (a callback may come back to one of them).
    """

    def __init__(self, base: str, *replicas: str) -> None:
        self.base = base
        self.gateways = (base, *replicas)
        # unsafe: keep cookies of IP-address hosts (127.0.0.1), as browsers do.
        self.http = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))
        self.csrf = ""

    async def aclose(self) -> None:
        await self.http.close()

    async def _step(self, method: str, url: str, data: dict[str, str] | None = None) -> tuple[int, str, str]:
        async with self.http.request(
            method, url, data=data, allow_redirects=False, timeout=aiohttp.ClientTimeout(WAIT)
        ) as response:
            return response.status, response.headers.get("Location", ""), await response.text()

    async def go(self, url: str, *, login: str, stop_at_callback: bool = False) -> str:
        """Follows `url` through the provider (logging in as `login`, consenting)
        back to the gateway: the callback URL if `stop_at_callback`, else where
        the gateway sent the browser after it."""
        callbacks = tuple(f"{base}/v1/auth/oidc/callback" for base in self.gateways)
        for _ in range(20):
            status, location, text = await self._step("GET", url)
            if status in (302, 303):
                target = urljoin(url, location)
                if target.startswith(callbacks) and stop_at_callback:
                    return target
                if target.startswith(self.gateways) and not target.startswith(callbacks):
                    return target
                url = target
                continue
            assert status == 200, (status, url, text[:500])
            forms = _Forms()
            forms.feed(text)
            assert forms.action is not None, f"no form at {url}: {text[:500]}"
            fields = dict(forms.fields)
            if "login" in fields:
                fields.update(login=login, password="any password")
            status, location, text = await self._step("POST", urljoin(url, forms.action), fields)
            assert status in (302, 303), (status, text[:500])
            url = urljoin(url, location)
        raise AssertionError("the sign-in did not come back to the gateway in 20 steps")

    async def sign_in(self, login: str, **query: str) -> Landing:
        """The whole sign-in, from the gateway's start route; where it lands."""
        start = f"{self.base}/v1/auth/oidc/start" + (f"?{urlencode(query)}" if query else "")
        return Landing(await self.go(start, login=login))

    async def finish(self, callback_url: str) -> Landing:
        """Hands a callback URL (possibly altered) to the gateway."""
        status, location, text = await self._step("GET", callback_url)
        assert status == 303, (status, text[:500])
        return Landing(urljoin(callback_url, location))

    async def session(self) -> tuple[int, Any]:
        async with self.http.get(f"{self.base}/v1/auth/session", timeout=aiohttp.ClientTimeout(WAIT)) as r:
            body = await r.json()
        if r.status == 200:
            self.csrf = body["csrfToken"]
        return r.status, body

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.http.request(
            method,
            f"{self.base}{path}",
            json=body,
            headers={"X-CSRF-Token": self.csrf} if self.csrf else {},
            timeout=aiohttp.ClientTimeout(WAIT),
        ) as r:
            return r.status, await r.json()

    def cookie(self, name: str) -> str | None:
        for cookie in self.http.cookie_jar:
            if cookie.key == name:
                return cookie.value
        return None


def _pkce() -> tuple[str, str]:
    verifier = secrets.token_urlsafe(32)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
    return verifier, challenge


async def code_flow(
    issuer: str, redirect_uri: str, *, login: str, client_id: str = CLIENT_ID
) -> tuple[str, str]:
    """An ID token and its nonce, from an authorization code flow of the test's own."""
    browser = FlowBrowser(redirect_uri.split("/v1/", 1)[0])
    try:
        async with browser.http.get(f"{issuer}/.well-known/openid-configuration") as response:
            discovery = await response.json()
        verifier, challenge = _pkce()
        state, nonce = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
        query = urlencode(
            {
                "response_type": "code",
                "client_id": client_id,
                "redirect_uri": redirect_uri,
                "scope": "openid email profile",
                "state": state,
                "nonce": nonce,
                "code_challenge": challenge,
                "code_challenge_method": "S256",
            }
        )
        callback = await browser.go(
            f"{discovery['authorization_endpoint']}?{query}", login=login, stop_at_callback=True
        )
        answer = {k: v[0] for k, v in parse_qs(urlsplit(callback).query).items()}
        assert answer["state"] == state, answer
        async with browser.http.post(
            discovery["token_endpoint"],
            data={
                "grant_type": "authorization_code",
                "code": answer["code"],
                "redirect_uri": redirect_uri,
                "code_verifier": verifier,
            },
            headers={
                "Authorization": "Basic " + base64.b64encode(f"{client_id}:{CLIENT_SECRET}".encode()).decode()
            },
        ) as response:
            tokens = await response.json()
            assert response.status == 200, tokens
        return tokens["id_token"], nonce
    finally:
        with contextlib.suppress(Exception):
            await browser.aclose()
