"""Long-term memory through the HTTP gateway: a person searches an agent's
memory and the workspace's, expands a hit, and sees only what they could see."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.bootstrap import GatewayApp
from services.im.adapters import migrate
from services.im.adapters.sql import Database
from services.memory.bootstrap import MemoryApp
from tests.conftest import RunningIM, start_im, stop_im
from tests.gateway_support import Api, sse, start_gateway
from tests.integration.test_memory_runtime import start_memory_service
from tests.integration.test_runtime_grpc import RunningRuntime, start_runtime, stop_runtime

WAIT = 15.0


@dataclass
class Stack:
    im: RunningIM
    memory: MemoryApp
    memory_address: str
    runtime: RunningRuntime
    gateway: GatewayApp
    http: aiohttp.ClientSession
    api: Api


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    url = f"sqlite:///{tmp_path / 'im.db'}"
    database = Database(url)
    await migrate.upgrade(database)
    await database.aclose()
    im = await start_im(url)
    memory, memory_address = await start_memory_service(im, tmp_path)
    runtime = await start_runtime(im.address, tmp_path / "runtime.db", MEMORY_ADDRESS=memory_address)
    runtime_address = f"127.0.0.1:{runtime.app.server.port}"
    gateway = await start_gateway(im.address, runtime_address, MEMORY_ADDRESS=memory_address)
    http = aiohttp.ClientSession()
    try:
        yield Stack(
            im, memory, memory_address, runtime, gateway, http, Api(http, f"http://127.0.0.1:{gateway.port}")
        )
    finally:
        await http.close()
        await gateway.stop()
        await stop_runtime(runtime)
        await memory.stop()
        await stop_im(im)


async def told(stack: Stack, text: str) -> tuple[str, str, str, str]:
    """A workspace where ada told an agent `text` in a direct chat, and bob
    (also a member) was not there: (ada, bob, agent id, run id)."""
    api = stack.api
    created = await api.ok(
        "POST", "/v1/workspaces", body={"name": f"ws-{uuid.uuid4().hex[:6]}", "creatorDisplayName": "ada"}
    )
    workspace, ada = created["workspace"]["id"], created["creator"]["id"]
    bob = (
        await api.ok(
            "POST",
            f"/v1/workspaces/{workspace}/members",
            member=ada,
            body={"kind": "MEMBER_KIND_HUMAN", "displayName": "bob"},
        )
    )["member"]["id"]
    agent = (await api.ok("POST", "/v1/agents", member=ada, body={"name": "cora"}))["agent"]
    chat = (await api.ok("POST", "/v1/groups:direct", member=ada, body={"peerMemberId": agent["memberId"]}))[
        "group"
    ]
    async with sse(stack.http, f"{api.base}/v1/agents/{agent['id']}/events", member=ada) as events:
        await api.ok("POST", f"/v1/groups/{chat['id']}/messages", member=ada, body={"content": text})
        seen = await events.until("run_ended")
    run = seen[-1].json["event"]["runEnded"]["id"]

    async def archived() -> None:
        while True:
            stats = await api.ok("GET", f"/v1/agents/{agent['id']}/memory", member=ada)
            if stats.get("runCount") == "1":
                return
            await asyncio.sleep(0.05)

    await asyncio.wait_for(archived(), WAIT)
    return ada, bob, agent["id"], run


async def test_a_person_searches_an_agents_memory_and_expands_a_hit(stack: Stack) -> None:
    api = stack.api
    ada, _, agent, run = await told(stack, "the deploy key rotates every friday at noon")

    found = await api.ok(
        "POST",
        f"/v1/agents/{agent}/memory:search",
        member=ada,
        body={"query": "when does the deploy key rotate?"},
    )
    top = next(
        r["segment"] for r in found["results"][:3] if r["segment"]["type"] == "SEGMENT_TYPE_USER_MESSAGE"
    )
    assert "deploy key rotates" in top["text"]
    assert top["ref"].startswith(f"{run}/") and top["anchor"]["runId"] == run and top["createTime"]
    only_answers = await api.ok(
        "POST",
        f"/v1/agents/{agent}/memory:search",
        member=ada,
        body={"query": "deploy key", "filters": {"types": ["SEGMENT_TYPE_RESPONSE"]}},
    )
    assert {r["segment"]["type"] for r in only_answers["results"]} == {"SEGMENT_TYPE_RESPONSE"}

    expanded = await api.ok(
        "POST", f"/v1/agents/{agent}/memory:expand", member=ada, body={"ref": top["ref"], "after": 2}
    )
    assert expanded["focus"]["ref"] == top["ref"] and expanded["run"]["runId"] == run
    assert [s["type"] for s in expanded["after"]] == ["SEGMENT_TYPE_REASONING", "SEGMENT_TYPE_RESPONSE"]

    workspace = await api.ok(
        "POST", "/v1/memory:search", member=ada, body={"workspace": {}, "query": "deploy key"}
    )
    assert any(r["segment"]["ref"] == top["ref"] for r in workspace["results"])


async def test_nobody_finds_what_they_could_not_see(stack: Stack) -> None:
    api = stack.api
    ada, bob, agent, _ = await told(stack, "my home address is 12 Quince Lane")
    for path, body in (
        (f"/v1/agents/{agent}/memory:search", {"query": "home address Quince Lane"}),
        ("/v1/memory:search", {"workspace": {}, "query": "home address Quince Lane"}),
    ):
        seen_by_bob = await api.ok("POST", path, member=bob, body=body)
        assert seen_by_bob.get("results", []) == [], path
        seen_by_ada = await api.ok("POST", path, member=ada, body=body)
        assert seen_by_ada["results"], path
    outsider = (
        await api.ok("POST", "/v1/workspaces", body={"name": "elsewhere", "creatorDisplayName": "eve"})
    )["creator"]["id"]
    refused = await api.call(
        "POST", f"/v1/agents/{agent}/memory:search", member=outsider, body={"query": "home"}
    )
    assert refused.status == 403 and refused.error["status"] == "PERMISSION_DENIED"


async def test_bad_memory_requests_are_400_and_a_missing_memory_503(stack: Stack) -> None:
    api = stack.api
    ada, _, agent, _ = await told(stack, "hello")
    cases: list[tuple[str, dict[str, Any]]] = [
        (f"/v1/agents/{agent}/memory:search", {"query": ""}),
        (f"/v1/agents/{agent}/memory:search", {"query": "x", "limit": 1000}),
        (f"/v1/agents/{agent}/memory:search", {"query": "x", "filters": {"types": ["NOT_A_TYPE"]}}),
        (f"/v1/agents/{agent}/memory:expand", {"ref": "not-a-ref"}),
    ]
    for path, body in cases:
        reply = await api.call("POST", path, member=ada, body=body)
        assert reply.status == 400 and reply.error["status"] == "INVALID_ARGUMENT", (body, reply.body)
    gone = await api.call(
        "POST", f"/v1/agents/{agent}/memory:expand", member=ada, body={"ref": f"{uuid.uuid4()}/1/0"}
    )
    assert gone.status == 404

    runtime_address = f"127.0.0.1:{stack.runtime.app.server.port}"
    for overrides in ({}, {"MEMORY_ADDRESS": "127.0.0.1:1"}):
        app = await start_gateway(stack.im.address, runtime_address, **overrides)
        try:
            other = Api(stack.http, f"http://127.0.0.1:{app.port}")
            reply = await other.call(
                "POST", f"/v1/agents/{agent}/memory:search", member=ada, body={"query": "x"}
            )
            assert reply.status == 503 and reply.error["status"] == "UNAVAILABLE", overrides
            # Chats go on without memory.
            assert (await other.call("GET", f"/v1/agents/{agent}", member=ada)).status == 200
        finally:
            await app.stop()
