"""The HTTP contract: which method and path call which RPC (pure: no I/O).

Nothing here is written by hand: each RPC's HTTP mapping is its
`google.api.http` annotation in the protos (the convention grpc-gateway,
Envoy's transcoder and Google's API tooling read), and whether it needs a
credential is its `agentim.api.v1.public` option. The request and response
messages, and whether the RPC streams, come from the same descriptors, so a
new RPC needs no gateway edit. Path templates use `{field}` for a request
field of that name (dotted names such as `member.id` reach nested fields);
everything else in a template is literal, including the `:verb` suffixes of
custom methods. The body is the whole request (`body: "*"`) or none.
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import unquote

from google.api import annotations_pb2, http_pb2
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from agentim.api.v1 import annotations_pb2 as api_options
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
# The message whose presence in a response opens a browser session.
_TOKENS = "agentim.im.v1.Tokens"


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
    # The OpenAPI operationId (see `operation_ids`); empty: the RPC's name.
    operation: str = ""
    access: Access = Access.SIGNED_IN
    # The response's `tokens` open a browser session: they go into the
    # session cookie, never into the response body.
    opens_session: bool = False
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


class BadAnnotation(ValueError):
    """An RPC's HTTP annotation asks for what the gateway does not do."""


def _bindings(rule: http_pb2.HttpRule) -> Iterator[tuple[str, str, str]]:
    """(method, template, body) of a rule and its additional bindings."""
    for each in (rule, *rule.additional_bindings):
        pattern = each.WhichOneof("pattern")
        if pattern is None or pattern == "custom":
            raise BadAnnotation(f"an HTTP rule needs get, post, patch, put or delete: {each}")
        yield pattern.upper(), getattr(each, pattern), each.body


def _resume(method: MethodDescriptor) -> Resume:
    if not method.server_streaming:
        return Resume.NONE
    fields = method.input_type.fields_by_name
    if "after_cursor" in fields:
        return Resume.CURSOR
    if "after_sequence" in fields:
        return Resume.STEP_SEQUENCE
    return Resume.NONE


def _opens_session(method: MethodDescriptor) -> bool:
    tokens = method.output_type.fields_by_name.get("tokens")
    return tokens is not None and tokens.message_type is not None and tokens.message_type.full_name == _TOKENS


def routes_of(services: Mapping[str, ServiceDescriptor] = SERVICES) -> tuple[Route, ...]:
    """Every HTTP binding of the services' annotated RPCs, in the protos' order.

    Raises:
        BadAnnotation: a binding the gateway cannot serve (a body other than
            the whole request for POST, PATCH and PUT, or any for GET and
            DELETE; a custom method).
    """
    routes: list[Route] = []
    for service, descriptor in services.items():
        for method in descriptor.methods:
            options = method.GetOptions()
            if not options.HasExtension(annotations_pb2.http):
                continue
            public = options.Extensions[api_options.public]
            for verb, template, body in _bindings(options.Extensions[annotations_pb2.http]):
                wanted = "*" if verb in {"POST", "PATCH", "PUT"} else ""
                if body != wanted:
                    raise BadAnnotation(
                        f"{descriptor.name}.{method.name}: {verb} {template} has body {body!r}; "
                        f"the gateway sends {'the whole request' if wanted else 'no body'}"
                    )
                routes.append(
                    Route(
                        verb,
                        template,
                        service,
                        method.name,
                        resume=_resume(method),
                        access=Access.PUBLIC if public else Access.SIGNED_IN,
                        opens_session=_opens_session(method),
                    )
                )
    return operation_ids(routes)


def operation_ids(routes: Sequence[Route]) -> tuple[Route, ...]:
    """The routes with unique OpenAPI operationIds: the RPC's name, or where
    several RPCs share it `<Service>_<RPC>`, and `_2`, `_3`... for an RPC's
    additional bindings (grpc-gateway's OpenAPI generator's convention)."""
    owners: dict[str, set[str]] = {}
    for route in routes:
        owners.setdefault(route.rpc, set()).add(route.service)
    seen: Counter[tuple[str, str]] = Counter()
    named = []
    for route in routes:
        key = (route.service, route.rpc)
        seen[key] += 1
        base = route.rpc if len(owners[route.rpc]) == 1 else f"{SERVICES[route.service].name}_{route.rpc}"
        name = base if seen[key] == 1 else f"{base}_{seen[key]}"
        named.append(replace(route, operation=name))
    return tuple(named)


ROUTES: tuple[Route, ...] = routes_of()

# RPCs the gateway serves with behaviour of its own beside the call: it
# forgets the access tokens it exchanged the caller's personal tokens for.
REVOKES_PERSONAL_TOKEN = frozenset({("auth", "RevokePersonalToken")})

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
