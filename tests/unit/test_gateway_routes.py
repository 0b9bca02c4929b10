"""The gateway's route table: matching, 404/405, path parameters."""

from __future__ import annotations

import pytest
from google.api import annotations_pb2, http_pb2
from google.protobuf import descriptor_pb2, descriptor_pool

from agentim.api.v1 import annotations_pb2 as api_options
from gateway.routes import (
    ROUTES,
    SERVICES,
    Access,
    BadAnnotation,
    Matched,
    MethodNotAllowed,
    Resume,
    Route,
    RouteTable,
    operation_ids,
    routes_of,
)

# The HTTP contract as it was written by hand before the routes came from the
# protos' annotations (issue 12): the paths must not change.
CONTRACT = {
    ("POST", "/v1/workspaces", "im", "CreateWorkspace"),
    ("GET", "/v1/workspaces", "im", "ListWorkspaces"),
    ("GET", "/v1/workspaces/{workspace_id}", "im", "GetWorkspace"),
    ("POST", "/v1/workspaces/{workspace_id}/members", "im", "CreateMember"),
    ("GET", "/v1/workspaces/{workspace_id}/members", "im", "ListMembers"),
    ("GET", "/v1/members/{member_id}", "im", "GetMember"),
    ("POST", "/v1/members/{member_id}:setRole", "auth", "SetMemberRole"),
    ("PATCH", "/v1/members/{member.id}", "im", "UpdateMember"),
    ("POST", "/v1/groups", "im", "CreateGroup"),
    ("POST", "/v1/groups:direct", "im", "GetOrCreateDirectGroup"),
    ("GET", "/v1/groups", "im", "ListGroups"),
    ("GET", "/v1/groups/{group_id}", "im", "GetGroup"),
    ("PATCH", "/v1/groups/{group.id}", "im", "UpdateGroup"),
    ("POST", "/v1/groups/{group_id}/members:add", "im", "AddGroupMembers"),
    ("POST", "/v1/groups/{group_id}/members:remove", "im", "RemoveGroupMembers"),
    ("POST", "/v1/groups/{group_id}/messages", "im", "SendMessage"),
    ("GET", "/v1/groups/{group_id}/messages", "im", "ListMessages"),
    ("POST", "/v1/groups/{group_id}:markRead", "im", "MarkRead"),
    ("GET", "/v1/messages/{message_id}", "im", "GetMessage"),
    ("PATCH", "/v1/messages/{message_id}", "im", "EditMessage"),
    ("GET", "/v1/unread", "im", "GetAllUnread"),
    ("GET", "/v1/chats", "im", "ListChats"),
    ("GET", "/v1/events", "im", "WatchEvents"),
    ("POST", "/v1/agents", "runtime", "CreateAgent"),
    ("GET", "/v1/agents", "runtime", "ListAgents"),
    ("GET", "/v1/agents/{agent_id}", "runtime", "GetAgent"),
    ("PATCH", "/v1/agents/{agent.id}", "runtime", "UpdateAgent"),
    ("DELETE", "/v1/agents/{agent_id}", "runtime", "DeleteAgent"),
    ("POST", "/v1/agents/{agent_id}:wake", "runtime", "WakeAgent"),
    ("GET", "/v1/agents/{agent_id}/runs", "runtime", "ListRuns"),
    ("GET", "/v1/agents/{agent_id}/steps", "runtime", "ListSteps"),
    ("GET", "/v1/agents/{agent_id}/events", "runtime", "WatchAgent"),
    ("GET", "/v1/agent-events", "runtime", "WatchAgents"),
    ("GET", "/v1/tools", "runtime", "ListTools"),
    ("POST", "/v1/agents/{agent_id}:start", "runtime", "StartAgent"),
    ("POST", "/v1/agents/{agent_id}:pause", "runtime", "PauseAgent"),
    ("POST", "/v1/agents/{agent_id}:resume", "runtime", "ResumeAgent"),
    ("POST", "/v1/agents/{agent_id}:interrupt", "runtime", "InterruptAgent"),
    ("POST", "/v1/agents/{agent_id}:terminate", "runtime", "TerminateAgent"),
    ("PATCH", "/v1/agents/{agent_id}/steps/{sequence}", "runtime", "UpdateStep"),
    ("DELETE", "/v1/agents/{agent_id}/steps/{sequence}", "runtime", "DeleteStep"),
    ("POST", "/v1/agents/{agent_id}/notes", "runtime", "AddNote"),
    ("POST", "/v1/agents/{agent_id}/checkpoints", "runtime", "CreateCheckpoint"),
    ("GET", "/v1/agents/{agent_id}/checkpoints", "runtime", "ListCheckpoints"),
    ("POST", "/v1/agents/{agent_id}/checkpoints/{checkpoint_id}:restore", "runtime", "RestoreCheckpoint"),
    ("GET", "/v1/agents/{agent_id}/sessions", "runtime", "ListSessions"),
    ("POST", "/v1/agents/{agent_id}:setMainSession", "runtime", "SetMainSession"),
    ("POST", "/v1/agents/{agent_id}/steps/{sequence}:retry", "runtime", "RetryFromStep"),
    ("POST", "/v1/agents/{agent_id}/steps/{sequence}:fork", "runtime", "ForkFromStep"),
    ("POST", "/v1/agents/{agent_id}/tasks", "runtime", "SubmitTask"),
    ("GET", "/v1/agents/{agent_id}/tasks", "runtime", "ListTasks"),
    ("GET", "/v1/agents/{agent_id}/queue", "runtime", "GetQueueStats"),
    ("GET", "/v1/tasks/{task_id}", "runtime", "GetTask"),
    ("POST", "/v1/tasks/{task_id}:cancel", "runtime", "CancelTask"),
    ("POST", "/v1/agents/{agent.agent_id}/memory:search", "memory", "Retrieve"),
    ("POST", "/v1/agents/{agent.agent_id}/memory:expand", "memory", "Expand"),
    ("GET", "/v1/agents/{agent_id}/memory", "memory", "GetMemoryStats"),
    ("POST", "/v1/agents/{agent_id}/memory:forget", "memory", "Forget"),
    ("POST", "/v1/memory:search", "memory", "Retrieve"),
    ("POST", "/v1/memory:expand", "memory", "Expand"),
    ("POST", "/v1/auth/sign-in", "auth", "SignIn"),
    ("POST", "/v1/auth/accept-invite", "auth", "AcceptInvite"),
    ("POST", "/v1/auth/password", "auth", "ChangePassword"),
    ("POST", "/v1/auth/invites", "auth", "CreateInvite"),
    ("POST", "/v1/auth/personal-tokens", "auth", "CreatePersonalToken"),
    ("GET", "/v1/auth/personal-tokens", "auth", "ListPersonalTokens"),
    ("POST", "/v1/auth/personal-tokens/{personal_token_id}:revoke", "auth", "RevokePersonalToken"),
    ("GET", "/v1/audit-events", "auth", "ListAuditEvents"),
    ("GET", "/v1/agent-audit-events", "runtime", "ListAuditEvents"),
    ("GET", "/v1/runtime-replicas", "runtime", "ListReplicas"),
}
# The RPCs no browser calls, which therefore have no HTTP mapping: the
# runtime archives runs as its agents; the gateway itself refreshes, signs
# out, exchanges personal tokens and hands OpenID Connect ID tokens to the
# IM; only services get service and agent tokens, and set agents' owners.
WITHOUT_HTTP = {
    ("auth", "ExchangePersonalToken"),
    ("auth", "GetSigningKeys"),
    ("auth", "IssueAgentTokens"),
    ("auth", "IssueServiceToken"),
    ("auth", "LinkOidcAccount"),
    ("auth", "RefreshTokens"),
    ("auth", "SignInWithOidc"),
    ("auth", "SignOut"),
    ("im", "SetAgentOwners"),
    ("memory", "ArchiveRun"),
}

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
    assert {(r.method, r.template, r.service, r.rpc) for r in ROUTES} == CONTRACT
    assert len(ROUTES) == len(CONTRACT)
    assert {r.rpc for r in ROUTES if r.streaming} == {"WatchEvents", "WatchAgent", "WatchAgents"}
    assert {r.rpc: r.resume for r in ROUTES if r.resume is not Resume.NONE} == {
        "WatchEvents": Resume.CURSOR,
        "WatchAgent": Resume.STEP_SEQUENCE,
    }
    assert all(r.method in {"GET", "DELETE"} for r in ROUTES if r.streaming or not r.has_body)
    rpcs = {(name, m.name) for name, service in SERVICES.items() for m in service.methods}
    assert rpcs - {(r.service, r.rpc) for r in ROUTES} == WITHOUT_HTTP


def test_what_a_route_needs_comes_from_the_protos() -> None:
    by_rpc = {(r.service, r.rpc): r for r in ROUTES}
    public = {key for key, r in by_rpc.items() if r.access is Access.PUBLIC}
    assert public == {("im", "CreateWorkspace"), ("auth", "SignIn"), ("auth", "AcceptInvite")}
    sessions = {key for key, r in by_rpc.items() if r.opens_session}
    assert sessions == public | {("auth", "ChangePassword")}
    operations = [r.operation for r in ROUTES]
    assert len(set(operations)) == len(operations)
    assert {r.operation for r in ROUTES if r.rpc in {"Retrieve", "ListAuditEvents", "SendMessage"}} == {
        "Retrieve",
        "Retrieve_2",
        "AuthService_ListAuditEvents",
        "RuntimeService_ListAuditEvents",
        "SendMessage",
    }


def _service(*methods: tuple[str, str, str, str]) -> descriptor_pool.DescriptorPool:
    """A pool with a service `test.v1.T` whose methods are (name, verb, path, body)."""
    pool = descriptor_pool.DescriptorPool()
    for dependency in (descriptor_pb2.DESCRIPTOR, http_pb2.DESCRIPTOR, annotations_pb2.DESCRIPTOR):
        proto = descriptor_pb2.FileDescriptorProto()
        dependency.CopyToProto(proto)
        pool.Add(proto)
    file = descriptor_pb2.FileDescriptorProto(
        name="test/v1/t.proto",
        package="test.v1",
        syntax="proto3",
        dependency=["google/api/annotations.proto"],
    )
    file.message_type.add(name="Request").field.add(
        name="id", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING
    )
    service = file.service.add(name="T")
    for name, verb, path, body in methods:
        method = service.method.add(name=name, input_type=".test.v1.Request", output_type=".test.v1.Request")
        rule = method.options.Extensions[annotations_pb2.http]
        setattr(rule, verb, path)
        rule.body = body
    pool.Add(file)
    return pool


def test_an_annotation_the_gateway_cannot_serve_is_refused_at_start() -> None:
    good = _service(("Get", "get", "/v1/t/{id}", ""), ("Make", "post", "/v1/t", "*"))
    routes = routes_of({"t": good.FindServiceByName("test.v1.T")})
    assert [(r.method, r.template, r.params, r.has_body) for r in routes] == [
        ("GET", "/v1/t/{id}", ("id",), False),
        ("POST", "/v1/t", (), True),
    ]
    for bad in (("Get", "get", "/v1/t", "*"), ("Make", "post", "/v1/t", "id")):
        with pytest.raises(BadAnnotation):
            routes_of({"t": _service(bad).FindServiceByName("test.v1.T")})
    assert api_options.public.number == 50100


def test_operation_ids_are_unique_as_grpc_gateway_names_them() -> None:
    routes = [
        Route("GET", "/v1/a", "im", "ListAuditEvents"),
        Route("GET", "/v1/b", "runtime", "ListAuditEvents"),
        Route("POST", "/v1/c", "memory", "Retrieve"),
        Route("POST", "/v1/d", "memory", "Retrieve"),
    ]
    assert [r.operation for r in operation_ids(routes)] == [
        "IMService_ListAuditEvents",
        "RuntimeService_ListAuditEvents",
        "Retrieve",
        "Retrieve_2",
    ]


def test_a_table_refuses_duplicates_and_unknown_rpcs() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        RouteTable([Route("GET", "/v1/x", "im", "GetGroup"), Route("GET", "/v1/x", "im", "GetMember")])
    with pytest.raises(KeyError):
        RouteTable([Route("GET", "/v1/x", "im", "NoSuchRpc")])


def test_openapi_paths_use_plain_parameter_names() -> None:
    route = Route("PATCH", "/v1/members/{member.id}", "im", "UpdateMember")
    assert route.openapi_path == "/v1/members/{member_id}" and route.params == ("member.id",)
