"""The HTTP gateway over real HTTP, in front of a real IM service and runtime (offline model).

The gateway holds no state, so one stack on SQLite serves the module; every
test makes its own workspace. The last test fuzzes every route of the
OpenAPI document with schemathesis.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.result import Err

from gateway import healthcheck
from gateway.bootstrap import GatewayApp
from services.im.adapters import migrate
from services.im.adapters.sql import Database
from tests.conftest import RunningIM, start_im, stop_im
from tests.faults.harness import LONG
from tests.gateway_support import WAIT, Api, as_member, new_workspace, sse, start_gateway, write_static
from tests.identities import as_unknown
from tests.integration.test_memory_runtime import start_memory_service
from tests.integration.test_runtime_grpc import RunningRuntime, start_runtime, stop_runtime


@dataclass
class Stack:
    im: RunningIM
    runtime: RunningRuntime
    gateway: GatewayApp
    http: aiohttp.ClientSession
    api: Api
    memory_address: str

    @property
    def base(self) -> str:
        return self.api.base

    @property
    def runtime_address(self) -> str:
        return f"127.0.0.1:{self.runtime.app.server.port}"

    async def gateway_with(self, **overrides: str) -> tuple[GatewayApp, Api]:
        app = await start_gateway(
            self.im.address, self.runtime_address, **{"MEMORY_ADDRESS": self.memory_address, **overrides}
        )
        return app, Api(self.http, f"http://127.0.0.1:{app.port}")


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    directory = tmp_path_factory.mktemp("gateway")
    url = f"sqlite:///{directory / 'im.db'}"
    database = Database(url)
    await migrate.upgrade(database)
    await database.aclose()
    im = await start_im(url)
    memory, memory_address = await start_memory_service(im, directory)
    runtime = await start_runtime(im.address, directory / "runtime.db", MEMORY_ADDRESS=memory_address)
    gateway = await start_gateway(
        im.address, f"127.0.0.1:{runtime.app.server.port}", MEMORY_ADDRESS=memory_address
    )
    http = aiohttp.ClientSession()
    try:
        yield Stack(im, runtime, gateway, http, Api(http, f"http://127.0.0.1:{gateway.port}"), memory_address)
    finally:
        await http.close()
        await gateway.stop()
        await stop_runtime(runtime)
        await memory.stop()
        await stop_im(im)


@dataclass
class People:
    workspace: str
    ids: list[str]


async def people(api: Api, count: int = 3) -> People:
    created = await api.ok(
        "POST", "/v1/workspaces", body={"name": f"ws-{uuid.uuid4().hex[:6]}", "creatorDisplayName": "ada"}
    )
    workspace, ids = created["workspace"]["id"], [created["creator"]["id"]]
    for index in range(1, count):
        member = await api.ok(
            "POST",
            f"/v1/workspaces/{workspace}/members",
            member=ids[0],
            body={"kind": "MEMBER_KIND_HUMAN", "displayName": f"member-{index}"},
        )
        ids.append(member["member"]["id"])
    return People(workspace, ids)


async def test_the_im_routes_answer_in_proto3_json(stack: Stack) -> None:
    api = stack.api
    team = await people(api, 3)
    ada, bea, cy = team.ids
    listed = await api.ok("GET", "/v1/workspaces", member=ada)
    assert [w["id"] for w in listed["workspaces"]] == [team.workspace] and listed["nextPageToken"] == ""
    got = await api.ok("GET", f"/v1/workspaces/{team.workspace}", member=ada)
    assert got["workspace"]["createTime"].endswith("Z")
    members = await api.ok(
        "GET", f"/v1/workspaces/{team.workspace}/members", member=ada, params={"page_size": 2}
    )
    assert len(members["members"]) == 2 and members["nextPageToken"]
    member = await api.ok("GET", f"/v1/members/{bea}", member=ada)
    assert member["member"]["kind"] == "MEMBER_KIND_HUMAN" and member["member"]["avatar"] == ""
    updated = await api.ok(
        "PATCH",
        f"/v1/members/{ada}",
        member=ada,
        body={
            "member": {"displayName": "Ada L", "id": "ignored: the path wins"},
            "updateMask": "displayName",
        },
    )
    assert updated["member"]["displayName"] == "Ada L" and updated["member"]["id"] == ada

    group = (await api.ok("POST", "/v1/groups", member=ada, body={"name": "team", "memberIds": [bea]}))[
        "group"
    ]
    assert group["kind"] == "GROUP_KIND_GROUP" and set(group["memberIds"]) == {ada, bea}
    direct = await api.ok("POST", "/v1/groups:direct", member=ada, body={"peerMemberId": cy})
    assert direct["created"] is True and direct["group"]["kind"] == "GROUP_KIND_DIRECT"
    again = await api.ok("POST", "/v1/groups:direct", member=cy, body={"peer_member_id": ada})
    assert again["created"] is False and again["group"]["id"] == direct["group"]["id"]
    groups = await api.ok("GET", "/v1/groups", member=ada)
    assert {g["id"] for g in groups["groups"]} == {group["id"], direct["group"]["id"]}
    assert (await api.ok("GET", f"/v1/groups/{group['id']}", member=bea))["group"]["name"] == "team"
    renamed = await api.ok(
        "PATCH",
        f"/v1/groups/{group['id']}",
        member=ada,
        body={"group": {"name": "crew"}, "updateMask": "name"},
    )
    assert renamed["group"]["name"] == "crew"
    added = await api.ok(
        "POST", f"/v1/groups/{group['id']}/members:add", member=ada, body={"memberIds": [cy]}
    )
    assert set(added["group"]["memberIds"]) == {ada, bea, cy}
    removed = await api.ok(
        "POST", f"/v1/groups/{group['id']}/members:remove", member=ada, body={"memberIds": [cy]}
    )
    assert set(removed["group"]["memberIds"]) == {ada, bea}

    sent = []
    for text in ("one", "two", "three"):
        reply = await api.ok(
            "POST",
            f"/v1/groups/{group['id']}/messages",
            member=ada,
            body={"content": text, "metadata": {"n": [1, {"x": True}]}, "mentions": [bea]},
        )
        sent.append(reply["message"])
    assert sent[0]["metadata"] == {"n": [1, {"x": True}]} and sent[0]["contentType"] == "CONTENT_TYPE_TEXT"
    page = await api.ok("GET", f"/v1/groups/{group['id']}/messages", member=bea, params={"page_size": "2"})
    assert [m["content"] for m in page["messages"]] == ["two", "three"]
    after = await api.ok(
        "GET", f"/v1/groups/{group['id']}/messages", member=bea, params={"after_message_id": sent[0]["id"]}
    )
    assert [m["content"] for m in after["messages"]] == ["two", "three"]
    message = await api.ok("GET", f"/v1/messages/{sent[1]['id']}", member=bea)
    assert message["message"]["content"] == "two"
    edited = await api.ok("PATCH", f"/v1/messages/{sent[1]['id']}", member=ada, body={"content": "TWO"})
    assert edited["message"]["content"] == "TWO" and edited["message"]["editTime"]

    unread = await api.ok("GET", "/v1/unread", member=bea, params={"page_size": 2})
    assert [m["content"] for m in unread["messages"]] == ["one", "TWO"] and unread["remainingCount"] == "1"
    chats = await api.ok("GET", "/v1/chats", member=bea)
    assert chats["chats"][0]["unreadCount"] == "3"
    read = await api.ok(
        "POST", f"/v1/groups/{group['id']}:markRead", member=bea, body={"upToMessageId": sent[2]["id"]}
    )
    assert read["readState"]["unreadCount"] == "0"
    assert (await api.ok("GET", "/v1/unread", member=bea))["messages"] == []


async def test_errors_carry_the_http_status_and_the_services_message(stack: Stack) -> None:
    api = stack.api
    ada, bea, cy = (await people(api, 3)).ids
    missing = await api.call("GET", f"/v1/members/{uuid.uuid4()}", member=ada)
    assert missing.status == 404 and missing.error["status"] == "NOT_FOUND" and missing.error["message"]
    invalid = await api.call("GET", "/v1/members/not-an-id", member=ada)
    assert invalid.status == 400 and invalid.error["status"] == "INVALID_ARGUMENT"
    assert "member_id" in invalid.error["message"]
    anonymous = await api.call("GET", "/v1/workspaces")
    assert anonymous.status == 401 and anonymous.error["status"] == "UNAUTHENTICATED"
    # The retired X-Member-Id names nobody: without a credential, 401.
    named = await api.call("GET", "/v1/workspaces", headers={"X-Member-Id": ada})
    assert named.status == 401 and named.error["status"] == "UNAUTHENTICATED"
    malformed = await api.call("POST", "/v1/groups", member=ada, data='{"name": ')
    assert malformed.status == 400 and "malformed JSON" in malformed.error["message"]
    not_object = await api.call("POST", "/v1/groups", member=ada, data="[1]")
    assert not_object.status == 400
    typo = await api.call("POST", "/v1/groups", member=ada, body={"nmae": "x"})
    assert typo.status == 400 and "nmae" in typo.error["message"]
    wrong_type = await api.call("POST", "/v1/groups", member=ada, body={"memberIds": "x"})
    assert wrong_type.status == 400
    bad_query = await api.call("GET", "/v1/groups", member=ada, params={"page_size": "ten"})
    assert bad_query.status == 400 and "page_size" in bad_query.error["message"]
    unknown_query = await api.call("GET", "/v1/groups", member=ada, params={"pageSzie": "1"})
    assert unknown_query.status == 400
    query_on_post = await api.call("POST", "/v1/groups", member=ada, body={}, params={"name": "x"})
    assert query_on_post.status == 400

    group = (await api.ok("POST", "/v1/groups", member=ada, body={"name": "pair", "memberIds": [bea]}))[
        "group"
    ]
    forbidden = await api.call("GET", f"/v1/groups/{group['id']}", member=cy)
    assert forbidden.status == 403 and forbidden.error["status"] == "PERMISSION_DENIED"
    direct = (await api.ok("POST", "/v1/groups:direct", member=ada, body={"peerMemberId": bea}))["group"]
    rename = await api.call(
        "PATCH", f"/v1/groups/{direct['id']}", member=ada, body={"group": {"name": "x"}, "updateMask": "name"}
    )
    assert rename.status == 400 and rename.error["status"] == "FAILED_PRECONDITION"
    path = f"/v1/groups/{group['id']}/messages"
    await api.ok("POST", path, member=ada, body={"content": "a", "requestId": "r-1"})
    conflict = await api.call("POST", path, member=ada, body={"content": "b", "requestId": "r-1"})
    assert conflict.status == 409 and conflict.error["status"] == "ALREADY_EXISTS"

    unknown = await api.call("GET", "/v1/nothing-here", member=ada)
    assert unknown.status == 404 and unknown.error["status"] == "NOT_FOUND"
    outside = await api.call("GET", "/nothing-here")
    assert outside.status == 404 and "error" in outside.body
    wrong_method = await api.call("PUT", "/v1/workspaces", member=ada)
    assert wrong_method.status == 405 and set(wrong_method.headers["Allow"].split(", ")) == {"GET", "POST"}


async def test_bodies_over_the_limit_get_413(stack: Stack) -> None:
    app, api = await stack.gateway_with(GATEWAY_MAX_BODY_BYTES="2048")
    try:
        ada = (await people(stack.api, 1)).ids[0]
        big = await api.call("POST", "/v1/groups", member=ada, body={"name": "x" * 4000})
        assert big.status == 413 and big.error["status"] == "RESOURCE_EXHAUSTED"

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"name": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}'

        # Without Content-Length (chunked), the limit holds all the same.
        streamed = await api.call("POST", "/v1/groups", member=ada, data=chunks())  # type: ignore[arg-type]
        assert streamed.status == 413
        small = await api.call("POST", "/v1/groups", member=ada, body={"name": "fits"})
        assert small.status == 200
    finally:
        await app.stop()


async def test_cors_answers_configured_origins_only(stack: Stack) -> None:
    app, api = await stack.gateway_with(GATEWAY_CORS_ORIGINS="https://ui.example, http://localhost:5173")
    try:
        preflight_headers = {
            "Origin": "https://ui.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, x-view-as, content-type",
        }
        preflight = await api.call("OPTIONS", "/v1/groups", headers=preflight_headers)
        assert preflight.status == 204
        assert preflight.headers["Access-Control-Allow-Origin"] == "https://ui.example"
        allowed = {h.strip().lower() for h in preflight.headers["Access-Control-Allow-Headers"].split(",")}
        assert {"authorization", "x-view-as", "content-type", "last-event-id"} <= allowed
        assert "x-member-id" not in allowed
        assert "PATCH" in preflight.headers["Access-Control-Allow-Methods"]
        other = await api.call(
            "OPTIONS", "/v1/groups", headers={**preflight_headers, "Origin": "https://evil.example"}
        )
        assert other.status == 403 and "Access-Control-Allow-Origin" not in other.headers
        ada = (await people(stack.api, 1)).ids[0]
        simple = await api.call(
            "GET", "/v1/workspaces", member=ada, headers={"Origin": "http://localhost:5173"}
        )
        assert (
            simple.status == 200 and simple.headers["Access-Control-Allow-Origin"] == "http://localhost:5173"
        )
        error = await api.call("GET", "/v1/workspaces", headers={"Origin": "http://localhost:5173"})
        assert error.status == 401 and error.headers["Access-Control-Allow-Origin"] == "http://localhost:5173"
        foreign = await api.call(
            "GET", "/v1/workspaces", member=ada, headers={"Origin": "https://evil.example"}
        )
        assert "Access-Control-Allow-Origin" not in foreign.headers
    finally:
        await app.stop()
    # Without GATEWAY_CORS_ORIGINS: same origin only.
    plain = await stack.api.call("OPTIONS", "/v1/groups", headers=preflight_headers)
    assert plain.status == 403 and "Access-Control-Allow-Origin" not in plain.headers


async def test_im_events_stream_and_resume_with_last_event_id(stack: Stack) -> None:
    api = stack.api
    ada, bea = (await people(api, 2)).ids
    group = (await api.ok("POST", "/v1/groups:direct", member=ada, body={"peerMemberId": bea}))["group"]

    async def send(text: str) -> None:
        await api.ok("POST", f"/v1/groups/{group['id']}/messages", member=ada, body={"content": text})

    url = f"{api.base}/v1/events"
    async with sse(stack.http, url, member=bea) as stream:
        for text in ("m1", "m2", "m3"):
            await send(text)
        events = [await stream.next() for _ in range(2)]
        assert stream.retry == 3000
    assert [e.kind for e in events if e] == ["message_created", "message_created"]
    assert [e.json["messageCreated"]["message"]["content"] for e in events if e] == ["m1", "m2"]
    assert all(e is not None and e.id == e.json["cursor"] for e in events)
    resume_from = events[1].id if events[1] else None
    assert resume_from
    for text in ("m4", "m5"):
        await send(text)
    async with sse(stack.http, url, member=bea, headers={"Last-Event-ID": resume_from}) as again:
        resumed = [await again.next() for _ in range(3)]
        nothing_more = asyncio.ensure_future(again.next(0.3))
        with pytest.raises(TimeoutError):
            await nothing_more
    assert [e.json["messageCreated"]["message"]["content"] for e in resumed if e] == ["m3", "m4", "m5"]
    # The same with the query parameter, and the sequence is gap-free.
    async with sse(stack.http, url, member=bea, params={"after_cursor": resume_from}) as by_query:
        replay = [await by_query.next() for _ in range(3)]
    sequences = [int(e.json["sequence"]) for e in replay if e]
    assert sequences == list(range(sequences[0], sequences[0] + 3))


async def test_a_stream_that_breaks_before_any_event_resumes_where_it_began(stack: Stack) -> None:
    api = stack.api
    ada, bea = (await people(api, 2)).ids
    group = (await api.ok("POST", "/v1/groups:direct", member=ada, body={"peerMemberId": bea}))["group"]
    url = f"{api.base}/v1/events"
    async with sse(stack.http, url, member=bea) as stream:
        ping = asyncio.ensure_future(stream.next(0.3))
        with pytest.raises(TimeoutError):
            await ping
        start = stream.last_event_id
    assert start, "the opening carries the start cursor as the event id"
    await api.ok("POST", f"/v1/groups/{group['id']}/messages", member=ada, body={"content": "while away"})
    async with sse(stack.http, url, member=bea, headers={"Last-Event-ID": start}) as again:
        event = await again.next()
    assert event is not None and event.json["messageCreated"]["message"]["content"] == "while away"


async def test_stream_errors_before_opening_are_plain_http_errors(stack: Stack) -> None:
    api = stack.api
    ada = (await people(api, 1)).ids[0]
    unknown = await api.call("GET", f"/v1/agents/{uuid.uuid4()}/events", member=ada)
    assert unknown.status == 404 and unknown.error["status"] == "NOT_FOUND"
    anonymous = await api.call("GET", "/v1/events")
    assert anonymous.status == 401
    bad_cursor = await api.call("GET", "/v1/events", member=ada, headers={"Last-Event-ID": "not a cursor"})
    assert bad_cursor.status == 400
    bad_sequence = await api.call(
        "GET", f"/v1/agents/{uuid.uuid4()}/events", member=ada, headers={"Last-Event-ID": "x"}
    )
    assert bad_sequence.status == 400


async def test_heartbeats_keep_idle_streams_open_and_disconnects_free_them(stack: Stack) -> None:
    app, api = await stack.gateway_with(GATEWAY_SSE_HEARTBEAT_SECONDS="0.05")
    try:
        ada = (await people(stack.api, 1)).ids[0]
        async with sse(stack.http, f"{api.base}/v1/events", headers=as_member(ada)) as stream:
            waiting = asyncio.ensure_future(stream.next(0.4))
            with pytest.raises(TimeoutError):
                await waiting
            assert stream.comments.count("ping") >= 3, stream.comments
            assert app.gateway.open_streams == 1
        await _until(lambda: app.gateway.open_streams == 0)
    finally:
        await app.stop()


async def test_shutdown_ends_open_streams_with_an_unavailable_error_event(stack: Stack) -> None:
    app, api = await stack.gateway_with()
    ada = (await people(stack.api, 1)).ids[0]
    async with sse(stack.http, f"{api.base}/v1/events", headers=as_member(ada)) as stream:
        stopping = asyncio.ensure_future(app.stop())
        # Said, so that the client knows to reconnect, not just dropped.
        ended = await stream.next()
        assert ended is not None and ended.kind == "error", ended
        assert ended.json["error"]["status"] == "UNAVAILABLE" and ended.json["error"]["code"] == 503
        assert "Last-Event-ID" in ended.json["error"]["message"]
        assert await stream.next() is None
        await asyncio.wait_for(stopping, WAIT)


async def test_a_streams_life_can_be_bounded(stack: Stack) -> None:
    app, api = await stack.gateway_with(GATEWAY_SSE_MAX_SECONDS="0.2")
    try:
        ada = (await people(stack.api, 1)).ids[0]
        async with sse(stack.http, f"{api.base}/v1/events", headers=as_member(ada)) as stream:
            assert await stream.next() is None
    finally:
        await app.stop()


async def _until(condition: Any, within: float = WAIT) -> None:
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110 - polling the gateway's counter: no event to wait on
            await asyncio.sleep(0.01)


async def test_agent_routes_and_a_person_watching_an_agent_answer(stack: Stack) -> None:
    api = stack.api
    ada = (await people(api, 1)).ids[0]
    agent = (
        await api.ok(
            "POST",
            "/v1/agents",
            member=ada,
            body={
                "name": "helper",
                "role": "assistant",
                "model": {"temperature": 0.5},
                "tokenBudget": "5000",
            },
        )
    )["agent"]
    assert agent["state"] == "AGENT_STATE_IDLE" and agent["tokenBudget"] == "5000"
    assert (await api.ok("GET", f"/v1/agents/{agent['id']}", member=ada))["agent"]["name"] == "helper"
    listed = await api.ok("GET", "/v1/agents", member=ada)
    assert [a["id"] for a in listed["agents"]] == [agent["id"]]
    updated = await api.ok(
        "PATCH",
        f"/v1/agents/{agent['id']}",
        member=ada,
        body={"agent": {"role": "writer"}, "updateMask": "role"},
    )
    assert updated["agent"]["role"] == "writer"
    chat = (await api.ok("POST", "/v1/groups:direct", member=ada, body={"peerMemberId": agent["memberId"]}))[
        "group"
    ]

    all_agents = sse(stack.http, f"{api.base}/v1/agent-events", member=ada)
    async with (
        sse(
            stack.http,
            f"{api.base}/v1/agents/{agent['id']}/events",
            member=ada,
            params={"live_only": "true"},
        ) as stream,
        all_agents as workspace_stream,
    ):
        await api.ok("POST", f"/v1/groups/{chat['id']}/messages", member=ada, body={"content": "hello there"})
        events = await stream.until("run_ended")
        everything = await workspace_stream.until("run_ended")
    kinds = [e.kind for e in events]
    assert kinds[0] == "run_started" and {"step_started", "step_delta", "step_completed"} <= set(kinds)
    deltas = "".join(
        e.json["event"]["stepDelta"].get("content", "") for e in events if e.kind == "step_delta"
    )
    assert "hello there" in deltas
    completed = [e for e in events if e.kind == "step_completed"]
    assert [int(e.json["event"]["stepCompleted"]["sequence"]) for e in completed] == [1, 2]
    # Each event's id is the last step delivered whole.
    assert [e.id for e in completed] == ["1", "2"] and events[-1].id == "2"
    assert events[-1].json["event"]["runEnded"]["status"] == "RUN_STATUS_COMPLETED"
    # The runtime may merge the deltas of a watcher that lags: compare what they add up to.
    assert [k for k in [e.kind for e in everything] if k != "step_delta"] == [
        k for k in kinds if k != "step_delta"
    ]
    assert all(e.id is None for e in everything)
    assert deltas == "".join(
        e.json["event"]["stepDelta"].get("content", "") for e in everything if e.kind == "step_delta"
    )

    # Resuming after step 1 sends step 2 only (as a snapshot); after 2, nothing.
    url = f"{api.base}/v1/agents/{agent['id']}/events"
    async with sse(stack.http, url, headers=as_member(ada, **{"Last-Event-ID": "1"})) as resumed:
        snapshot = await resumed.next()
        quiet = asyncio.ensure_future(resumed.next(0.3))
        with pytest.raises(TimeoutError):
            await quiet
    assert snapshot is not None and snapshot.kind == "step_completed" and snapshot.id == "2"
    assert snapshot.json["event"]["stepCompleted"]["role"] == "STEP_ROLE_ASSISTANT"

    runs = await api.ok("GET", f"/v1/agents/{agent['id']}/runs", member=ada)
    assert [r["status"] for r in runs["runs"]] == ["RUN_STATUS_COMPLETED"]
    steps = await api.ok("GET", f"/v1/agents/{agent['id']}/steps", member=ada, params={"after_sequence": 1})
    assert [s["sequence"] for s in steps["steps"]] == ["2"] and steps["hasMore"] is False
    woken = await api.ok("POST", f"/v1/agents/{agent['id']}:wake", member=ada)
    assert woken["agent"]["id"] == agent["id"]
    assert await api.ok("DELETE", f"/v1/agents/{agent['id']}", member=ada) == {}
    gone = await api.call("GET", f"/v1/agents/{agent['id']}", member=ada)
    assert gone.status == 404


async def test_health_reflects_both_upstreams(stack: Stack) -> None:
    healthy = await stack.api.call("GET", "/healthz")
    assert healthy.status == 200
    assert healthy.body == {
        "status": "SERVING",
        "upstreams": {"im": "SERVING", "runtime": "SERVING", "memory": "SERVING"},
    }
    app = await start_gateway(stack.im.address, "127.0.0.1:1")
    try:
        api = Api(stack.http, f"http://127.0.0.1:{app.port}")
        down = await api.call("GET", "/healthz")
        assert down.status == 503 and down.body["upstreams"]["im"] == "SERVING"
        assert down.body["upstreams"]["runtime"] == "UNAVAILABLE"
        unavailable = await api.call("GET", "/v1/agents", headers=dict(as_unknown()))
        assert unavailable.status == 503 and unavailable.error["status"] == "UNAVAILABLE"
        # The container probe says the same.
        assert await asyncio.to_thread(healthcheck.main, [f"127.0.0.1:{app.port}"]) == 1
        assert await asyncio.to_thread(healthcheck.main, [f"127.0.0.1:{stack.gateway.port}"]) == 0
    finally:
        await app.stop()


async def test_static_files_are_served(stack: Stack, tmp_path: Path) -> None:
    static = write_static(
        tmp_path / "static",
        {"index.html": "<!doctype html><title>ui</title>", "app.js": "console.log(1)", "css/site.css": "p{}"},
    )
    (tmp_path / "secret.txt").write_text("no")
    app, api = await stack.gateway_with(GATEWAY_STATIC_DIR=str(static))
    try:
        index = await api.call("GET", "/")
        assert index.status == 200 and index.body == "<!doctype html><title>ui</title>"
        assert index.headers["Content-Type"].startswith("text/html")
        script = await api.call("GET", "/static/app.js")
        assert script.status == 200 and "javascript" in script.headers["Content-Type"]
        assert (await api.call("GET", "/static/css/site.css")).body == "p{}"
        assert (await api.call("GET", "/static/nope.js")).status == 404
        assert (await api.call("GET", "/static/%2e%2e/secret.txt")).status == 404
        assert (await api.call("GET", "/static/..%2fsecret.txt")).status == 404
    finally:
        await app.stop()
    placeholder_app, placeholder = await stack.gateway_with(GATEWAY_STATIC_DIR=str(tmp_path / "missing"))
    try:
        page = await placeholder.call("GET", "/")
        assert page.status == 200 and "web UI is not installed" in page.body
    finally:
        await placeholder_app.stop()


async def agent_that_answered(stack: Stack) -> tuple[Api, str, str]:
    """A person and an agent that has answered them once: (api, person, the agent's path)."""
    api = stack.api
    ada = (await people(api, 1)).ids[0]
    agent = (await api.ok("POST", "/v1/agents", member=ada, body={"name": "cora"}))["agent"]
    base = f"/v1/agents/{agent['id']}"
    chat = (await api.ok("POST", "/v1/groups:direct", member=ada, body={"peerMemberId": agent["memberId"]}))[
        "group"
    ]
    await api.ok("POST", f"/v1/groups/{chat['id']}/messages", member=ada, body={"content": "hello"})
    async with sse(stack.http, f"{api.base}{base}/events", member=ada) as stream:
        await stream.until("run_ended")
    return api, ada, base


async def test_agent_lifecycle_intervention_checkpoint_and_task_routes(stack: Stack) -> None:
    api, ada, base = await agent_that_answered(stack)
    paused = await api.ok("POST", f"{base}:pause", member=ada)
    assert paused["agent"]["state"] == "AGENT_STATE_PAUSED"
    refused = await api.call("POST", f"{base}:start", member=ada)
    assert refused.status == 400 and refused.body["error"]["status"] == "FAILED_PRECONDITION"
    assert "cannot start an agent that is PAUSED" in refused.body["error"]["message"]
    edited = await api.ok("PATCH", f"{base}/steps/1", member=ada, body={"content": "hello, edited"})
    assert edited["step"]["content"] == "hello, edited"
    note = await api.ok(
        "POST", f"{base}/notes", member=ada, body={"role": "STEP_ROLE_SYSTEM", "content": "Be brief."}
    )
    assert note["step"]["role"] == "STEP_ROLE_SYSTEM" and note["step"]["sequence"] == "3"
    await api.ok("DELETE", f"{base}/steps/3", member=ada)
    checkpoint = (await api.ok("POST", f"{base}/checkpoints", member=ada, body={"name": "before"}))[
        "checkpoint"
    ]
    listed = await api.ok("GET", f"{base}/checkpoints", member=ada)
    assert [c["id"] for c in listed["checkpoints"]] == [checkpoint["id"]]
    await api.ok("POST", f"{base}/checkpoints/{checkpoint['id']}:restore", member=ada)
    task = (
        await api.ok("POST", f"{base}/tasks", member=ada, body={"input": "sum it up", "requestId": "t-1"})
    )["task"]
    assert task["status"] == "TASK_STATUS_QUEUED" and task["position"] == 0
    again = (
        await api.ok("POST", f"{base}/tasks", member=ada, body={"input": "sum it up", "requestId": "t-1"})
    )["task"]
    assert again["id"] == task["id"], "the same request_id is the same task"
    assert (await api.ok("GET", f"/v1/tasks/{task['id']}", member=ada))["task"]["input"] == "sum it up"
    stats = await api.ok("GET", f"{base}/queue", member=ada)
    assert stats["queued"] == 1 and stats["running"] is False
    cancelled = await api.ok("POST", f"/v1/tasks/{task['id']}:cancel", member=ada)
    assert cancelled["task"]["status"] == "TASK_STATUS_CANCELLED"
    assert [t["id"] for t in (await api.ok("GET", f"{base}/tasks", member=ada))["tasks"]] == [task["id"]]
    resumed = await api.ok("POST", f"{base}:resume", member=ada)
    assert resumed["agent"]["state"] in ("AGENT_STATE_IDLE", "AGENT_STATE_RUNNING")


async def test_agent_fork_session_retry_and_terminate_routes(stack: Stack) -> None:
    api, ada, base = await agent_that_answered(stack)
    async with sse(stack.http, f"{api.base}{base}/events", member=ada, params={"live_only": "true"}) as live:
        forked = await api.ok("POST", f"{base}/steps/1:fork", member=ada, body={})
        await live.until("run_ended")
    sessions = (await api.ok("GET", f"{base}/sessions", member=ada))["sessions"]
    assert [s["main"] for s in sessions] == [False, True] and sessions[1]["id"] == forked["session"]["id"]
    await api.ok("POST", f"{base}:setMainSession", member=ada, body={"sessionId": sessions[0]["id"]})
    steps = await api.ok("GET", f"{base}/steps", member=ada, params={"session_id": sessions[1]["id"]})
    assert steps["steps"][0]["content"].endswith("hello")

    async with sse(stack.http, f"{api.base}{base}/events", member=ada, params={"live_only": "true"}) as live:
        await api.ok("POST", f"{base}/steps/2:retry", member=ada)
        await live.until("run_ended")
    terminated = await api.ok(
        "POST", f"{base}:terminate", member=ada, body={"queuePolicy": "QUEUE_POLICY_CLEAR"}
    )
    assert terminated["agent"]["state"] == "AGENT_STATE_TERMINATED"
    interrupted = await api.call("POST", f"{base}:interrupt", member=ada)
    assert interrupted.status == 400
    started = await api.ok("POST", f"{base}:start", member=ada)
    assert started["agent"]["state"] == "AGENT_STATE_IDLE"


async def test_the_openapi_document_lists_every_route(stack: Stack) -> None:
    document = await stack.api.ok("GET", "/openapi.json")
    operations = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    routes = {(r.method, r.openapi_path) for r in stack.gateway.gateway.table.routes}
    own = {
        ("GET", "/v1/auth/session"),
        ("POST", "/v1/auth/sign-out"),
        ("GET", "/v1/auth/options"),
        ("GET", "/v1/auth/oidc/start"),
        ("GET", "/v1/auth/oidc/callback"),
    }
    assert operations == routes | own and len(routes) == 70


async def test_a_taken_port_is_refused(stack: Stack) -> None:
    app = await start_gateway(stack.im.address, stack.runtime_address)
    try:
        with pytest.raises(OSError, match="cannot listen"):
            await start_gateway(
                stack.im.address, stack.runtime_address, GATEWAY_HTTP_ADDRESS=f"127.0.0.1:{app.port}"
            )
    finally:
        await app.stop()


# --- fuzzing: schemathesis over every route -------------------------------------------

# Derandomized, so every run sends the same requests; `FAULTS_LONG=1` (make faults) sends more.
EXAMPLES_PER_MODE = 40 if LONG else 6
REQUEST_TIMEOUT_S = 10.0


def with_real_ids(known: dict[str, str]) -> Any:
    """Half the cases get ids of real objects in their path, so that calls reach the services' rules."""

    def realize(drawn: tuple[schemathesis.Case[Any], bool]) -> schemathesis.Case[Any]:
        case, real = drawn
        if real and case.path_parameters:
            for name in case.path_parameters:
                if name in known:
                    case.path_parameters[name] = known[name]
        return case

    return realize


def fuzz(
    document: dict[str, Any], base_url: str, known: dict[str, str], headers: dict[str, str]
) -> tuple[int, list[str]]:
    """Runs every operation in both modes, signed in by `headers`; returns the number of
    requests and the failures."""
    schema = schemathesis.openapi.from_dict(document)
    failures: list[str] = []
    calls = 0
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()
        operation = result.ok()
        raw = operation.definition.raw
        # An operation that takes nothing (GET /v1/tools) has no invalid input to make.
        takes_input = bool(raw.get("parameters") or raw.get("requestBody"))
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE][: 2 if takes_input else 1]
        for mode in modes:
            cases = st.tuples(operation.as_strategy(generation_mode=mode), st.booleans()).map(
                with_real_ids(known)
            )

            @given(case=cases)
            @settings(
                max_examples=EXAMPLES_PER_MODE,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def check(case: schemathesis.Case[Any]) -> None:
                nonlocal calls
                calls += 1
                response = case.call(base_url=base_url, headers=headers, timeout=REQUEST_TIMEOUT_S)
                if response.status_code >= 500:
                    failures.append(
                        f"{response.status_code} {response.text[:300]}\n  {case.as_curl_command()}"
                    )

            check()
    return calls, failures


async def real_objects(api: Api) -> tuple[dict[str, str], str]:
    """A workspace with two people, a group, a message, an agent and a spare personal
    token, made by its owner signed in with a password (session cookie + CSRF token);
    their ids by path parameter name, and a personal access token of the owner's."""
    owner, created = await new_workspace(api, login="fuzzer")
    workspace, me = created.body["workspace"]["id"], created.body["creator"]["id"]
    person = {"displayName": "o", "kind": "MEMBER_KIND_HUMAN"}
    other = (await owner.ok("POST", f"/v1/workspaces/{workspace}/members", body=person))["member"]["id"]
    group = (await owner.ok("POST", "/v1/groups", body={"name": "g", "memberIds": [other]}))["group"]["id"]
    sent = await owner.ok("POST", f"/v1/groups/{group}/messages", body={"content": "hi"})
    message = sent["message"]["id"]
    agent = (await owner.ok("POST", "/v1/agents", body={"name": "fuzzy"}))["agent"]["id"]

    async def personal_token(name: str) -> Any:
        body = {"name": name, "scope": "PERSONAL_TOKEN_SCOPE_WRITE"}
        return await owner.ok("POST", "/v1/auth/personal-tokens", body=body)

    fuzzer = await personal_token("fuzzer")
    # Fuzzed revocations may take this one; the fuzzer's own stays.
    spare = await personal_token("spare")
    known = {
        "workspace_id": workspace,
        "member_id": me,
        "group_id": group,
        "message_id": message,
        "agent_id": agent,
        "personal_token_id": spare["personalToken"]["id"],
    }
    return known, fuzzer["secret"]


async def test_no_route_answers_5xx_to_fuzzed_requests(stack: Stack) -> None:
    """Valid and invalid requests, a bounded number per route, as a real member; the
    blocking schemathesis calls run in a worker thread while the services run on this loop."""
    # Streams end by themselves, so that each fuzzed SSE request completes.
    app, api = await stack.gateway_with(GATEWAY_SSE_MAX_SECONDS="0.2")
    try:
        known, secret = await real_objects(api)
        document = await api.ok("GET", "/openapi.json")
        # As a program would: its owner's personal access token (exchanged by the gateway).
        signed_in = {"Authorization": f"Bearer {secret}"}
        calls, failures = await asyncio.to_thread(fuzz, document, api.base, known, signed_in)
    finally:
        await app.stop()
    operations = sum(len(item) for item in document["paths"].values())
    assert calls >= operations * 2, (calls, operations)
    assert not failures, f"{len(failures)} of {calls} requests got 5xx:\n" + "\n".join(failures[:10])
