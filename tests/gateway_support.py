"""Helpers for the gateway tests: a whole stack on loopback, an HTTP client, an SSE reader.

Tests act as a member by sending an access token for it (`as_member`),
signed with the key the test IMs sign with (tests.identities): the gateway
verifies it like any other. Tests of sign-in itself use real
accounts and the session cookie.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import aiohttp

from agentim.runtime.v1 import runtime_pb2
from gateway import bootstrap
from gateway.config import Settings
from gateway.sessions import COOKIE_NAME, new_session_key
from tests.identities import learn_agent, learn_json_member, member_token

WAIT = 10.0
SESSION_KEY = new_session_key()


def _learn_members(body: Any) -> None:
    """Records every member a gateway answer shows (see `Api.call`), so that
    a token made for a member names its workspace, kind and role."""
    if isinstance(body, dict):
        if str(body.get("kind", "")).startswith("MEMBER_KIND_"):
            learn_json_member(body)
        elif isinstance(body.get("memberId"), str) and isinstance(body.get("workspaceId"), str):
            learn_agent(runtime_pb2.Agent(member_id=body["memberId"], workspace_id=body["workspaceId"]))
        for value in body.values():
            _learn_members(value)
    elif isinstance(body, list):
        for value in body:
            _learn_members(value)


def as_member(member: str, **extra: str) -> dict[str, str]:
    """Headers that make a request the member's: its access token (tests.identities)."""
    return {"Authorization": f"Bearer {member_token(member)}", **extra}


def gateway_settings(im_address: str, runtime_address: str, **overrides: str) -> Settings:
    environ = {
        "GATEWAY_HTTP_ADDRESS": "127.0.0.1:0",
        "IM_ADDRESS": im_address,
        "RUNTIME_ADDRESS": runtime_address,
        "LOG_LEVEL": "WARNING",
        "SHUTDOWN_GRACE_SECONDS": "1",
        "GATEWAY_SESSION_KEY": SESSION_KEY,
        **overrides,
    }
    return Settings.from_env(environ)


async def start_gateway(im_address: str, runtime_address: str, **overrides: str) -> bootstrap.GatewayApp:
    app = bootstrap.build(gateway_settings(im_address, runtime_address, **overrides))
    try:
        await app.start()
    except BaseException:
        await app.stop()
        raise
    return app


@dataclass
class Reply:
    status: int
    body: Any
    headers: Any

    @property
    def error(self) -> dict[str, Any]:
        assert isinstance(self.body, dict) and "error" in self.body, self.body
        error: dict[str, Any] = self.body["error"]
        return error


class Api:
    """A small JSON client of one gateway."""

    def __init__(self, http: aiohttp.ClientSession, base: str) -> None:
        self.http = http
        self.base = base

    async def call(
        self,
        method: str,
        path: str,
        *,
        member: str | None = None,
        body: Any = None,
        data: bytes | str | None = None,
        params: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        sent = as_member(member) if member else {}
        sent.update(headers or {})
        if body is not None:
            data = json.dumps(body)
            sent.setdefault("Content-Type", "application/json")
        async with self.http.request(
            method,
            self.base + path,
            data=data,
            params=params,
            headers=sent,
            timeout=aiohttp.ClientTimeout(WAIT),
        ) as response:
            text = await response.text()
            try:
                parsed: Any = json.loads(text)
            except ValueError:
                parsed = text
            _learn_members(parsed)
            return Reply(response.status, parsed, response.headers)

    async def ok(self, method: str, path: str, **kwargs: Any) -> Any:
        reply = await self.call(method, path, **kwargs)
        assert reply.status == 200, (method, path, reply.status, reply.body)
        return reply.body


# The password of the accounts the tests make.
PASSWORD = "correct horse battery"


class Browser:
    """A browser's view of one gateway: it keeps the session cookie and sends the CSRF token."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.cookie: str | None = None
        self.csrf: str | None = None

    def keep(self, reply: Reply) -> None:
        raw = reply.headers.getall("Set-Cookie", [])
        for header in raw:
            parsed = SimpleCookie()
            parsed.load(header)
            if COOKIE_NAME in parsed:
                self.cookie = parsed[COOKIE_NAME].value or None

    async def call(self, method: str, path: str, *, csrf: bool = True, **kwargs: Any) -> Reply:
        headers = dict(kwargs.pop("headers", {}) or {})
        if self.cookie:
            headers["Cookie"] = f"{COOKIE_NAME}={self.cookie}"
        if csrf and self.csrf:
            headers["X-CSRF-Token"] = self.csrf
        reply = await self.api.call(method, path, headers=headers, **kwargs)
        self.keep(reply)
        return reply

    async def ok(self, method: str, path: str, **kwargs: Any) -> Any:
        reply = await self.call(method, path, **kwargs)
        assert reply.status == 200, (method, path, reply.status, reply.body)
        return reply.body

    async def who(self) -> Any:
        session = await self.ok("GET", "/v1/auth/session")
        self.csrf = session["csrfToken"]
        return session


async def new_workspace(api: Api, login: str = "ada") -> tuple[Browser, Reply]:
    browser = Browser(api)
    reply = await browser.call(
        "POST",
        "/v1/workspaces",
        body={
            "name": f"ws-{uuid.uuid4().hex[:6]}",
            "creatorDisplayName": "Ada",
            "creatorLogin": login,
            "creatorPassword": PASSWORD,
        },
    )
    assert reply.status == 200, reply.body
    await browser.who()
    return browser, reply


@dataclass
class Event:
    """One SSE event as a browser's EventSource sees it."""

    kind: str
    data: str
    id: str | None

    @property
    def json(self) -> Any:
        return json.loads(self.data)


@dataclass
class SseStream:
    """Reads events from an open `text/event-stream` response, like EventSource does."""

    response: aiohttp.ClientResponse
    last_event_id: str | None = None
    retry: int | None = None
    comments: list[str] = field(default_factory=list)

    async def next(self, within: float = WAIT) -> Event | None:
        """The next event (None when the stream ends)."""
        return await asyncio.wait_for(self._next(), within)

    async def _next(self) -> Event | None:
        kind, event_id, seen_id = "message", None, False
        data: list[str] = []
        while True:
            raw = await self.response.content.readline()
            if not raw:
                return None
            line = raw.decode().rstrip("\n")
            if not line:
                if seen_id:
                    self.last_event_id = event_id
                if data:
                    return Event(kind, "\n".join(data), self.last_event_id)
                kind, data, seen_id = "message", [], False
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if not name:
                self.comments.append(value)
            elif name == "event":
                kind = value
            elif name == "data":
                data.append(value)
            elif name == "id":
                event_id, seen_id = value, True
            elif name == "retry":
                self.retry = int(value)

    async def until(self, kind: str, within: float = WAIT) -> list[Event]:
        """Events up to and including the first of `kind`."""
        seen: list[Event] = []
        while True:
            event = await self.next(within)
            assert event is not None, f"the stream ended before {kind}; got {[e.kind for e in seen]}"
            seen.append(event)
            if event.kind == kind:
                return seen


class sse:
    """Opens an SSE stream; the response must be 200 `text/event-stream`."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        url: str,
        *,
        params: Any = None,
        headers: dict[str, str] | None = None,
        member: str | None = None,
    ) -> None:
        if member:
            headers = {**as_member(member), **(headers or {})}
        self._request = http.get(
            url, params=params, headers=headers, timeout=aiohttp.ClientTimeout(total=None, sock_connect=WAIT)
        )
        self._response: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> SseStream:
        self._response = await asyncio.wait_for(self._request.__aenter__(), WAIT)
        assert self._response.status == 200, (self._response.status, await self._response.text())
        assert self._response.headers["Content-Type"].startswith("text/event-stream")
        return SseStream(self._response)

    async def __aexit__(self, *exc: object) -> None:
        await self._request.__aexit__(None, None, None)


def write_static(directory: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        target = directory / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return directory
