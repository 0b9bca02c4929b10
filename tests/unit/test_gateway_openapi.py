"""The OpenAPI document, built from the route table and the descriptors."""

from __future__ import annotations

import json
from typing import Any

import schemathesis

from gateway import openapi
from gateway.routes import ROUTES

DOCUMENT: dict[str, Any] = json.loads(json.dumps(openapi.build(ROUTES)))
SCHEMAS: dict[str, Any] = DOCUMENT["components"]["schemas"]


def operation(method: str, path: str) -> dict[str, Any]:
    found: dict[str, Any] = DOCUMENT["paths"][path][method]
    return found


def test_every_route_is_an_operation_with_a_unique_id() -> None:
    operations = [op for item in DOCUMENT["paths"].values() for op in item.values()]
    assert len(operations) == len(ROUTES) + 5  # and the gateway's own session and OIDC routes
    assert len({op["operationId"] for op in operations}) == len(ROUTES) + 5
    assert DOCUMENT["openapi"].startswith("3.1")


def test_schemathesis_loads_every_operation() -> None:
    schema = schemathesis.openapi.from_dict(DOCUMENT)
    results = list(schema.get_all_operations())
    assert len(results) == len(ROUTES) + 5
    assert all(hasattr(result, "ok") for result in results), [
        getattr(r, "err", lambda: None)() for r in results
    ]


def test_message_schemas_follow_the_proto3_json_mapping() -> None:
    member = SCHEMAS["agentim.im.v1.Member"]
    assert member["additionalProperties"] is False
    props = member["properties"]
    assert props["displayName"] == {"type": "string"}
    assert props["kind"]["enum"][0] == "MEMBER_KIND_UNSPECIFIED" and props["kind"]["type"] == "string"
    assert props["createTime"] == {"type": "string", "format": "date-time"}
    assert SCHEMAS["agentim.im.v1.ReadState"]["properties"]["unreadCount"]["type"] == "string"
    assert SCHEMAS["agentim.im.v1.Group"]["properties"]["memberIds"] == {
        "type": "array",
        "items": {"type": "string"},
    }
    assert SCHEMAS["agentim.im.v1.Message"]["properties"]["metadata"] == {"type": "object"}
    assert SCHEMAS["agentim.im.v1.UpdateMemberRequest"]["properties"]["updateMask"]["type"] == "string"
    assert SCHEMAS["agentim.runtime.v1.ModelSettings"]["properties"]["temperature"] == {"type": "number"}
    assert SCHEMAS["agentim.runtime.v1.Run"]["properties"]["iterations"]["format"] == "int32"
    chat = SCHEMAS["agentim.im.v1.Chat"]["properties"]
    assert chat["lastMessage"] == {"$ref": "#/components/schemas/agentim.im.v1.Message"}


def test_parameters_bodies_and_streams() -> None:
    steps = operation("get", "/v1/agents/{agent_id}/steps")
    names = {p["name"]: p for p in steps["parameters"]}
    assert names["agent_id"]["in"] == "path" and names["agent_id"]["required"] is True
    assert names["after_sequence"]["schema"] == {"type": "integer", "format": "int64"}
    assert "requestBody" not in steps
    update = operation("patch", "/v1/members/{member_id}")
    assert [p["name"] for p in update["parameters"]] == ["member_id"]
    assert update["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/agentim.im.v1.UpdateMemberRequest"
    }
    watch = operation("get", "/v1/agent-events")
    watch_params = {p["name"]: p for p in watch["parameters"]}
    assert watch_params["agent_ids"]["schema"]["type"] == "array" and watch_params["agent_ids"]["explode"]
    assert "member_id" in watch_params and "access_token" not in watch_params
    assert "text/event-stream" in watch["responses"]["200"]["content"]
    events = {p["name"] for p in operation("get", "/v1/events")["parameters"]}
    assert {"after_cursor", "Last-Event-ID"} <= events
    assert operation("get", "/v1/chats")["responses"]["default"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"
    }
