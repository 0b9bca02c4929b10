"""The audit logs and the quotas through the gateway: 429 with the IM's words
over a quota; both logs for admins (403 for others), with their filters in
the query string."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from gateway.bootstrap import GatewayApp
from tests.conftest import RunningIM, start_im, stop_im
from tests.gateway_support import PASSWORD, Api, Browser, new_workspace, start_gateway
from tests.integration.test_runtime_grpc import RunningRuntime, start_runtime, stop_runtime


@dataclass
class Small:
    im: RunningIM
    runtime: RunningRuntime
    gateway: GatewayApp
    api: Api


@pytest.fixture
async def small(tmp_path: Path, database_url: str) -> AsyncIterator[Small]:
    im = await start_im(database_url, QUOTA_GROUPS_PER_WORKSPACE="1")
    runtime = await start_runtime(im.address, tmp_path / "runtime.db")
    gateway = await start_gateway(im.address, f"127.0.0.1:{runtime.app.server.port}", MEMORY_ADDRESS="")
    http = aiohttp.ClientSession()
    try:
        yield Small(im, runtime, gateway, Api(http, f"http://127.0.0.1:{gateway.port}"))
    finally:
        await http.close()
        await gateway.stop()
        await stop_runtime(runtime)
        await stop_im(im)


async def joined(ada: Browser, api: Api, name: str) -> Browser:
    invite = await ada.ok("POST", "/v1/auth/invites", body={})
    person = Browser(api)
    reply = await person.call(
        "POST",
        "/v1/auth/accept-invite",
        body={"invite": invite["secret"], "displayName": name, "login": name.lower(), "password": PASSWORD},
    )
    assert reply.status == 200, reply.body
    await person.who()
    return person


async def test_a_quota_is_429_and_admins_read_both_logs(small: Small) -> None:
    ada, _ = await new_workspace(small.api)
    await ada.ok("POST", "/v1/groups", body={"name": "first"})
    over = await ada.call("POST", "/v1/groups", body={"name": "second"})
    assert over.status == 429
    assert over.error["status"] == "RESOURCE_EXHAUSTED"
    assert over.error["message"] == "this workspace has reached its quota of 1 groups; ask its administrator"
    agent = (await ada.ok("POST", "/v1/agents", body={"name": "helper"}))["agent"]

    im_log = await ada.ok("GET", "/v1/audit-events", params={"page_size": "50"})
    actions = [e["action"] for e in im_log["auditEvents"]]
    assert "CreateWorkspace" in actions and "CreateMember" in actions
    runtime_log = await ada.ok("GET", "/v1/agent-audit-events")
    created = [e for e in runtime_log["auditEvents"] if e["action"] == "CreateAgent"]
    assert [e["target"]["id"] for e in created] == [agent["id"]]
    assert created[0]["service"] == "runtime" and created[0]["outcome"]["code"] == "OK"

    # Filters in the query string, a time as RFC 3339.
    start = created[0]["time"]
    since = await ada.ok("GET", "/v1/agent-audit-events", params={"query.start_time": start})
    assert [e["id"] for e in since["auditEvents"]] == [created[0]["id"]]
    refused = await ada.ok(
        "GET", "/v1/audit-events", params={"query.outcome": "AUDIT_OUTCOME_FILTER_REFUSED"}
    )
    assert refused.get("auditEvents", []) == []
    bad = await ada.call("GET", "/v1/audit-events", params={"query.start_time": "yesterday"})
    assert bad.status == 400 and "RFC 3339" in bad.error["message"]

    bob = await joined(ada, small.api, "Bobby")
    for path in ("/v1/audit-events", "/v1/agent-audit-events"):
        denied = await bob.call("GET", path)
        assert denied.status == 403, denied.body
