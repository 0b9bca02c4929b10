"""The gateway's route table: matching, 404/405, path parameters."""

from __future__ import annotations

import pytest

from gateway.routes import (
    INTERNAL_RPCS,
    ROUTES,
    SERVICES,
    Matched,
    MethodNotAllowed,
    Resume,
    Route,
    RouteTable,
)

TABLE = RouteTable()


def matched(method: str, path: str) -> Matched:
    found = TABLE.match(method, path)
    assert isinstance(found, Matched), found
    return found


@pytest.mark.parametrize(
    ("method", "path", "rpc", "params"),
    [
        ("POST", "/v1/workspaces", "CreateWorkspace", {}),
        ("GET", "/v1/workspaces/w1", "GetWorkspace", {"workspace_id": "w1"}),
        ("PATCH", "/v1/members/m1", "UpdateMember", {"member.id": "m1"}),
        ("GET", "/v1/members/m1", "GetMember", {"member_id": "m1"}),
        ("POST", "/v1/groups:direct", "GetOrCreateDirectGroup", {}),
        ("GET", "/v1/groups/g1", "GetGroup", {"group_id": "g1"}),
        ("POST", "/v1/groups/g1/members:add", "AddGroupMembers", {"group_id": "g1"}),
        ("POST", "/v1/groups/g1/members:remove", "RemoveGroupMembers", {"group_id": "g1"}),
        ("POST", "/v1/groups/g1:markRead", "MarkRead", {"group_id": "g1"}),
        ("POST", "/v1/agents/a1:wake", "WakeAgent", {"agent_id": "a1"}),
        ("DELETE", "/v1/agents/a1", "DeleteAgent", {"agent_id": "a1"}),
        ("GET", "/v1/agent-events", "WatchAgents", {}),
    ],
)
def test_paths_find_their_rpc_and_parameters(
    method: str, path: str, rpc: str, params: dict[str, str]
) -> None:
    found = matched(method, path)
    assert found.route.rpc == rpc and dict(found.path_params) == params


def test_parameters_are_one_segment_decoded_and_stop_at_a_verb() -> None:
    assert matched("GET", "/v1/members/a%2Fb%20c").path_params == {"member_id": "a/b c"}
    assert TABLE.match("GET", "/v1/members/a/b") is None
    assert TABLE.match("POST", "/v1/groups/g1:unknownVerb") is None
    assert TABLE.match("GET", "/v1/members/") is None
    assert TABLE.match("GET", "/v1/workspaces/") is None


def test_an_existing_path_with_another_method_is_405_with_the_allowed_ones() -> None:
    assert TABLE.match("PUT", "/v1/workspaces") == MethodNotAllowed(("GET", "POST"))
    assert TABLE.match("DELETE", "/v1/members/m1") == MethodNotAllowed(("GET", "PATCH"))
    assert TABLE.match("GET", "/v1/nothing") is None


def test_the_contract_has_every_route_once_and_streams_where_the_rpc_streams() -> None:
    assert len(ROUTES) == 69
    assert {r.rpc for r in ROUTES if r.streaming} == {"WatchEvents", "WatchAgent", "WatchAgents"}
    assert {r.rpc: r.resume for r in ROUTES if r.resume is not Resume.NONE} == {
        "WatchEvents": Resume.CURSOR,
        "WatchAgent": Resume.STEP_SEQUENCE,
    }
    assert all(r.method in {"GET", "DELETE"} for r in ROUTES if r.streaming or not r.has_body)
    # Every RPC of every service has a route, but those only services call.
    rpcs = {(name, m.name) for name, service in SERVICES.items() for m in service.methods}
    assert {(r.service, r.rpc) for r in ROUTES} == rpcs - INTERNAL_RPCS
    assert rpcs >= INTERNAL_RPCS


def test_a_table_refuses_duplicates_and_unknown_rpcs() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        RouteTable([Route("GET", "/v1/x", "im", "GetGroup"), Route("GET", "/v1/x", "im", "GetMember")])
    with pytest.raises(KeyError):
        RouteTable([Route("GET", "/v1/x", "im", "NoSuchRpc")])


def test_openapi_paths_use_plain_parameter_names() -> None:
    route = Route("PATCH", "/v1/members/{member.id}", "im", "UpdateMember")
    assert route.openapi_path == "/v1/members/{member_id}" and route.params == ("member.id",)
