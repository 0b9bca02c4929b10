"""The HTTP contract: which method and path call which RPC (pure: no I/O).

Each route names an RPC of one upstream service; the request and response
messages, and whether the RPC streams, come from the protobuf descriptors.
Path templates use `{field}` for a request field of that name (dotted names
such as `member.id` reach nested fields); everything else in a template is
literal, including the `:verb` suffixes of custom methods.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import unquote

from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from agentim.im.v1 import auth_pb2, im_pb2
from agentim.memory.v1 import memory_pb2
from agentim.runtime.v1 import runtime_pb2

SERVICES: Mapping[str, ServiceDescriptor] = {
    "im": im_pb2.DESCRIPTOR.services_by_name["IMService"],
    # Served by the IM process, beside IMService.
    "auth": auth_pb2.DESCRIPTOR.services_by_name["AuthService"],
    "runtime": runtime_pb2.DESCRIPTOR.services_by_name["RuntimeService"],
    "memory": memory_pb2.DESCRIPTOR.services_by_name["MemoryService"],
}

_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_.]*)\}")
# A path parameter is one segment, and stops before a `:verb` suffix.
_SEGMENT = r"([^/:]+)"


class Access(enum.Enum):
    """What credentials a route needs."""

    # A signed-in caller (session cookie, or Authorization: Bearer).
    SIGNED_IN = "signed_in"
    # Anyone: the call proves who it is by itself (a password, an invite).
    PUBLIC = "public"


class Resume(enum.Enum):
    """How an SSE stream's events are numbered for `Last-Event-ID`."""

    NONE = "none"
    # The IM event cursor (WatchEventsRequest.after_cursor).
    CURSOR = "cursor"
    # The last fully delivered step sequence (WatchAgentRequest.after_sequence).
    STEP_SEQUENCE = "step_sequence"


@dataclass(frozen=True)
class Route:
    """One HTTP method and path template bound to one RPC."""

    method: str
    template: str
    service: str
    rpc: str
    resume: Resume = Resume.NONE
    # The OpenAPI operationId when one RPC serves several routes; else the RPC's name.
    operation: str = ""
    access: Access = Access.SIGNED_IN
    # The response's `tokens` open a browser session: they go into the
    # session cookie, never into the response body.
    opens_session: bool = False
    # A POST that only reads (a search): allowed with a read-only token.
    reads_only: bool = False
    # Revokes a personal token of the caller's: the gateway forgets the
    # access tokens it exchanged the caller's personal tokens for.
    revokes_personal_token: bool = False
    params: tuple[str, ...] = field(init=False)
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        params = tuple(_PARAM.findall(self.template))
        regex, last = "", 0
        for found in _PARAM.finditer(self.template):
            regex += re.escape(self.template[last : found.start()]) + _SEGMENT
            last = found.end()
        regex += re.escape(self.template[last:])
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "pattern", re.compile(f"^{regex}$"))

    @property
    def openapi_path(self) -> str:
        """The template with `_` for `.` in parameter names.

        OpenAPI tools want plain names, and take templates that differ only
        in parameter names for the same path: `/v1/members/{member.id}` and
        `/v1/members/{member_id}` are one path to them, so they must agree.
        """
        return _PARAM.sub(lambda found: "{" + found[1].replace(".", "_") + "}", self.template)

    @property
    def descriptor(self) -> MethodDescriptor:
        return SERVICES[self.service].methods_by_name[self.rpc]

    @property
    def streaming(self) -> bool:
        """Server streaming: served as Server-Sent Events."""
        return bool(self.descriptor.server_streaming)

    @property
    def has_body(self) -> bool:
        return self.method in {"POST", "PATCH", "PUT"}

    @property
    def writes(self) -> bool:
        """Changes something: refused to a read-only token."""
        return self.method != "GET" and not self.reads_only


IM, AUTH, RT, MEM = "im", "auth", "runtime", "memory"

ROUTES: tuple[Route, ...] = (
    # With creator_login and creator_password, creating a workspace signs its creator in.
    Route("POST", "/v1/workspaces", IM, "CreateWorkspace", access=Access.PUBLIC, opens_session=True),
    Route("GET", "/v1/workspaces", IM, "ListWorkspaces"),
    Route("GET", "/v1/workspaces/{workspace_id}", IM, "GetWorkspace"),
    Route("POST", "/v1/workspaces/{workspace_id}/members", IM, "CreateMember"),
    Route("GET", "/v1/workspaces/{workspace_id}/members", IM, "ListMembers"),
    Route("GET", "/v1/members/{member_id}", IM, "GetMember"),
    Route("POST", "/v1/members/{member_id}:setRole", AUTH, "SetMemberRole"),
    Route("PATCH", "/v1/members/{member.id}", IM, "UpdateMember"),
    Route("POST", "/v1/groups", IM, "CreateGroup"),
    Route("POST", "/v1/groups:direct", IM, "GetOrCreateDirectGroup"),
    Route("GET", "/v1/groups", IM, "ListGroups"),
    Route("GET", "/v1/groups/{group_id}", IM, "GetGroup"),
    Route("PATCH", "/v1/groups/{group.id}", IM, "UpdateGroup"),
    Route("POST", "/v1/groups/{group_id}/members:add", IM, "AddGroupMembers"),
    Route("POST", "/v1/groups/{group_id}/members:remove", IM, "RemoveGroupMembers"),
    Route("POST", "/v1/groups/{group_id}/messages", IM, "SendMessage"),
    Route("GET", "/v1/groups/{group_id}/messages", IM, "ListMessages"),
    Route("POST", "/v1/groups/{group_id}:markRead", IM, "MarkRead"),
    Route("GET", "/v1/messages/{message_id}", IM, "GetMessage"),
    Route("PATCH", "/v1/messages/{message_id}", IM, "EditMessage"),
    Route("GET", "/v1/unread", IM, "GetAllUnread"),
    Route("GET", "/v1/chats", IM, "ListChats"),
    Route("GET", "/v1/events", IM, "WatchEvents", Resume.CURSOR),
    Route("POST", "/v1/agents", RT, "CreateAgent"),
    Route("GET", "/v1/agents", RT, "ListAgents"),
    Route("GET", "/v1/agents/{agent_id}", RT, "GetAgent"),
    Route("PATCH", "/v1/agents/{agent.id}", RT, "UpdateAgent"),
    Route("DELETE", "/v1/agents/{agent_id}", RT, "DeleteAgent"),
    Route("POST", "/v1/agents/{agent_id}:wake", RT, "WakeAgent"),
    Route("GET", "/v1/agents/{agent_id}/runs", RT, "ListRuns"),
    Route("GET", "/v1/agents/{agent_id}/steps", RT, "ListSteps"),
    Route("GET", "/v1/agents/{agent_id}/events", RT, "WatchAgent", Resume.STEP_SEQUENCE),
    Route("GET", "/v1/agent-events", RT, "WatchAgents"),
    Route("GET", "/v1/tools", RT, "ListTools"),
    # Agent control (lifecycle, intervention, checkpoints, sessions, retry
    # and fork, the task queue).
    Route("POST", "/v1/agents/{agent_id}:start", RT, "StartAgent"),
    Route("POST", "/v1/agents/{agent_id}:pause", RT, "PauseAgent"),
    Route("POST", "/v1/agents/{agent_id}:resume", RT, "ResumeAgent"),
    Route("POST", "/v1/agents/{agent_id}:interrupt", RT, "InterruptAgent"),
    Route("POST", "/v1/agents/{agent_id}:terminate", RT, "TerminateAgent"),
    Route("PATCH", "/v1/agents/{agent_id}/steps/{sequence}", RT, "UpdateStep"),
    Route("DELETE", "/v1/agents/{agent_id}/steps/{sequence}", RT, "DeleteStep"),
    Route("POST", "/v1/agents/{agent_id}/notes", RT, "AddNote"),
    Route("POST", "/v1/agents/{agent_id}/checkpoints", RT, "CreateCheckpoint"),
    Route("GET", "/v1/agents/{agent_id}/checkpoints", RT, "ListCheckpoints"),
    Route("POST", "/v1/agents/{agent_id}/checkpoints/{checkpoint_id}:restore", RT, "RestoreCheckpoint"),
    Route("GET", "/v1/agents/{agent_id}/sessions", RT, "ListSessions"),
    Route("POST", "/v1/agents/{agent_id}:setMainSession", RT, "SetMainSession"),
    Route("POST", "/v1/agents/{agent_id}/steps/{sequence}:retry", RT, "RetryFromStep"),
    Route("POST", "/v1/agents/{agent_id}/steps/{sequence}:fork", RT, "ForkFromStep"),
    Route("POST", "/v1/agents/{agent_id}/tasks", RT, "SubmitTask"),
    Route("GET", "/v1/agents/{agent_id}/tasks", RT, "ListTasks"),
    Route("GET", "/v1/agents/{agent_id}/queue", RT, "GetQueueStats"),
    Route("GET", "/v1/tasks/{task_id}", RT, "GetTask"),
    Route("POST", "/v1/tasks/{task_id}:cancel", RT, "CancelTask"),
    # Long-term memory: an agent's (what its audience may see, the caller
    # included) and a workspace's, for the people searching it.
    Route(
        "POST",
        "/v1/agents/{agent.agent_id}/memory:search",
        MEM,
        "Retrieve",
        operation="SearchAgentMemory",
        reads_only=True,
    ),
    Route(
        "POST",
        "/v1/agents/{agent.agent_id}/memory:expand",
        MEM,
        "Expand",
        operation="ExpandAgentMemory",
        reads_only=True,
    ),
    Route("GET", "/v1/agents/{agent_id}/memory", MEM, "GetMemoryStats"),
    Route("POST", "/v1/agents/{agent_id}/memory:forget", MEM, "Forget"),
    Route("POST", "/v1/memory:search", MEM, "Retrieve", operation="SearchWorkspaceMemory", reads_only=True),
    Route("POST", "/v1/memory:expand", MEM, "Expand", operation="ExpandWorkspaceMemory", reads_only=True),
    # Accounts and sessions (sign-out and who-am-I are the gateway's own: see gateway.http).
    Route("POST", "/v1/auth/sign-in", AUTH, "SignIn", access=Access.PUBLIC, opens_session=True),
    Route("POST", "/v1/auth/accept-invite", AUTH, "AcceptInvite", access=Access.PUBLIC, opens_session=True),
    Route("POST", "/v1/auth/password", AUTH, "ChangePassword", opens_session=True),
    Route("POST", "/v1/auth/invites", AUTH, "CreateInvite"),
    Route("POST", "/v1/auth/personal-tokens", AUTH, "CreatePersonalToken"),
    Route("GET", "/v1/auth/personal-tokens", AUTH, "ListPersonalTokens"),
    Route(
        "POST",
        "/v1/auth/personal-tokens/{personal_token_id}:revoke",
        AUTH,
        "RevokePersonalToken",
        revokes_personal_token=True,
    ),
    # The audit logs (admins): the IM's (accounts, tokens, roles, members) and the runtime's (agents).
    Route("GET", "/v1/audit-events", AUTH, "ListAuditEvents"),
    Route("GET", "/v1/agent-audit-events", RT, "ListAuditEvents", operation="ListAgentAuditEvents"),
)

# RPCs given no HTTP route: the runtime archives its agents' runs (acting as
# each agent), and no browser has a run to archive; the gateway itself
# refreshes, signs out and exchanges tokens (a refresh token never leaves the
# session cookie); only services get service and agent tokens; the
# gateway's OpenID Connect callback (gateway.http) hands ID tokens to the IM
# itself: no browser ever holds one.
INTERNAL_RPCS = frozenset(
    {
        ("auth", "SignInWithOidc"),
        ("auth", "LinkOidcAccount"),
        ("memory", "ArchiveRun"),
        ("auth", "GetSigningKeys"),
        ("auth", "RefreshTokens"),
        ("auth", "SignOut"),
        ("auth", "ExchangePersonalToken"),
        ("auth", "IssueServiceToken"),
        ("auth", "IssueAgentTokens"),
        ("im", "SetAgentOwners"),
    }
)

# The query parameter SSE routes accept besides request fields: the member
# whose view to stream (browsers' EventSource can set no header). It is no
# credential: the caller is the session's (or the Authorization header's).
SSE_MEMBER_PARAM = "member_id"


@dataclass(frozen=True)
class Matched:
    """A route and the decoded values of its path parameters."""

    route: Route
    path_params: Mapping[str, str]


@dataclass(frozen=True)
class MethodNotAllowed:
    """The path exists, but not with this method."""

    allowed: tuple[str, ...]


class RouteTable:
    """Finds the route of a request path."""

    def __init__(self, routes: Iterable[Route] = ROUTES) -> None:
        self.routes: Sequence[Route] = tuple(routes)
        seen: set[tuple[str, str]] = set()
        for route in self.routes:
            key = (route.method, route.template)
            if key in seen:
                raise ValueError(f"duplicate route {route.method} {route.template}")
            seen.add(key)
            route.descriptor  # noqa: B018 - fails here for an unknown service or RPC

    def match(self, method: str, raw_path: str) -> Matched | MethodNotAllowed | None:
        """The route for `method` and the still percent-encoded `raw_path`.

        Returns:
            The match; MethodNotAllowed if only other methods serve the path;
            None if no route has that path.
        """
        allowed: list[str] = []
        for route in self.routes:
            found = route.pattern.match(raw_path)
            if found is None:
                continue
            if route.method != method:
                allowed.append(route.method)
                continue
            values = {name: unquote(value) for name, value in zip(route.params, found.groups(), strict=True)}
            return Matched(route, values)
        if allowed:
            return MethodNotAllowed(tuple(sorted(set(allowed))))
        return None
