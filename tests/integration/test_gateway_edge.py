"""The gateway at the edge: hostile input is 400 (never 500), a request too large
for the services is 413 (never 429), and every response carries the security
headers."""

from __future__ import annotations

import re
import uuid

from gateway.config import DEFAULT_STATIC_DIR
from tests.gateway_support import Api, as_member
from tests.integration.test_gateway_http import Stack, people, stack

__all__ = ["stack"]  # a fixture

SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


async def a_group(api: Api) -> tuple[str, str]:
    ada = (await people(api, 1)).ids[0]
    group = (await api.ok("POST", "/v1/groups", member=ada, body={"name": "edge"}))["group"]["id"]
    return ada, group


async def test_hostile_bodies_are_400(stack: Stack) -> None:
    api = stack.api
    ada, group = await a_group(api)
    messages = f"/v1/groups/{group}/messages"
    cases = {
        # JSON text as a client sends it (escapes kept as escapes).
        '{"content": "a\\u0000b"}': "content contains a NUL character",
        '{"content": "lone \\ud800 surrogate"}': "surrogate",
        '{"content": "x", "metadata": {"n": 1e999}}': 'metadata["n"] must be a finite number',
        '{"content": "x", "metadata": {"n": NaN}}': "malformed JSON",
        '{"content": "x", "metadata": {"k\\u0000": 1}}': "contains a NUL character",
        '{"content": "x", "contentType": 42}': "content_type: 42 is not a known ContentType",
        '{"content": "x", "requestId": "\\udc80"}': "surrogate",
        '{"content": "x", "metadata": {"k": "\\ud800"}}': "surrogate",
        '{"content": "x", "metadata": {"\\ud800": 1}}': "surrogate",
    }
    for body, said in cases.items():
        reply = await api.call(
            "POST", messages, member=ada, data=body, headers={"Content-Type": "application/json"}
        )
        assert reply.status == 400, (body, reply.status, reply.body)
        assert reply.error["status"] == "INVALID_ARGUMENT" and said in reply.error["message"], (
            body,
            reply.body,
        )
    deep = '{"content": "x", "metadata": ' + '{"a": ' * 40 + "1" + "}" * 40 + "}"
    reply = await api.call(
        "POST", messages, member=ada, data=deep, headers={"Content-Type": "application/json"}
    )
    assert reply.status == 400 and "nested deeper than 32 levels" in reply.error["message"], reply.body


async def test_hostile_paths_and_queries_are_400(stack: Stack) -> None:
    api = stack.api
    ada, group = await a_group(api)
    for path in [
        f"/v1/groups/{group}%00",
        f"/v1/groups/{group}/messages?page_token=%00",
        f"/v1/groups/{group}/messages?page_token=%ED%A0%80",
        f"/v1/groups/{group}/messages?before_message_id=%FF",
        f"/v1/agents?page_size={2**40}",
    ]:
        async with api.http.get(api.base + path, headers=as_member(ada)) as response:
            body = await response.json()
            assert response.status == 400, (path, response.status, body)
            assert body["error"]["status"] == "INVALID_ARGUMENT", (path, body)


async def test_a_request_too_large_for_the_services_is_413(stack: Stack) -> None:
    # The gateway takes bodies of 4 MiB; the services' requests stop at 1 MiB.
    app, api = await stack.gateway_with(GATEWAY_MAX_BODY_BYTES=str(4 << 20))
    try:
        ada, group = await a_group(api)
        big = {"content": "x" * (2 << 20), "requestId": uuid.uuid4().hex}
        reply = await api.call("POST", f"/v1/groups/{group}/messages", member=ada, body=big)
        assert reply.status == 413, (reply.status, reply.body)
        assert reply.error["status"] == "RESOURCE_EXHAUSTED"
        assert (
            reply.error["message"]
            == (f"the request is {2 * 1024 * 1024 + 50} bytes as protobuf; the services take at most 1048576")
            or "at most 1048576" in reply.error["message"]
        )
    finally:
        await app.stop()
    # Told a larger limit than the services have, the gateway learns it from their answer.
    app, api = await stack.gateway_with(
        GATEWAY_MAX_BODY_BYTES=str(4 << 20), GRPC_MAX_MESSAGE_BYTES=str(8 << 20)
    )
    try:
        ada, group = await a_group(api)
        reply = await api.call(
            "POST", f"/v1/groups/{group}/messages", member=ada, body={"content": "y" * (2 << 20)}
        )
        assert reply.status == 413, (reply.status, reply.body)
        assert reply.error["status"] == "RESOURCE_EXHAUSTED"
    finally:
        await app.stop()
    # A full group is still 429: only size is 413.
    app, api = await stack.gateway_with()
    try:
        ada, group = await a_group(api)
        fits = await api.call("POST", f"/v1/groups/{group}/messages", member=ada, body={"content": "fits"})
        assert fits.status == 200
    finally:
        await app.stop()


def meta_policy() -> str:
    page = (DEFAULT_STATIC_DIR / "index.html").read_text()
    found = re.search(r'http-equiv="Content-Security-Policy"\s+content="([^"]+)"', page)
    assert found is not None
    return found.group(1)


async def test_every_response_carries_the_security_headers(stack: Stack) -> None:
    api = stack.api
    ada = (await people(api, 1)).ids[0]
    policy = f"{meta_policy()}; frame-ancestors 'none'"
    for method, path, member in [
        ("GET", "/", None),
        ("GET", "/static/app.js", None),
        ("GET", "/healthz", None),
        ("GET", "/openapi.json", None),
        ("GET", "/v1/chats", ada),
        ("GET", "/v1/chats", None),
        ("GET", "/nowhere", None),
        ("POST", "/v1/groups", ada),
    ]:
        headers = as_member(member) if member else {}
        async with api.http.request(
            method, api.base + path, headers=headers, data=b"{" if method == "POST" else None
        ) as response:
            assert response.headers.get("Content-Security-Policy") == policy, (path, response.status)
            for name, value in SECURITY_HEADERS.items():
                assert response.headers.get(name) == value, (path, name)
    async with api.http.get(f"{api.base}/v1/events", headers=as_member(ada)) as stream:
        assert stream.status == 200 and stream.headers.get("X-Frame-Options") == "DENY"
        assert stream.headers.get("Content-Security-Policy") == policy
