"""The OpenAPI 3.1 document of the HTTP API, built from the route table and the
protobuf descriptors (pure): JSON Schemas of the messages in the proto3 JSON
mapping, so that the document cannot drift from the protos.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from agentim.im.v1 import im_pb2
from gateway.routes import SSE_MEMBER_PARAM, Access, Resume, Route
from gateway.sessions import COOKIE_NAME, CSRF_HEADER

_INT32 = {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32}
_UINT32 = {FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32}
_INT64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_SFIXED64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_FIXED64,
}
# Well-known types have their own JSON form in the proto3 mapping.
_WELL_KNOWN: dict[str, dict[str, Any]] = {
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
    "google.protobuf.Duration": {"type": "string", "pattern": r"^-?[0-9]+(\.[0-9]{1,9})?s$"},
    "google.protobuf.FieldMask": {
        "type": "string",
        "description": "Comma-separated field paths in lowerCamelCase, e.g. `displayName`.",
    },
    "google.protobuf.Struct": {"type": "object"},
    "google.protobuf.Value": {},
    "google.protobuf.ListValue": {"type": "array"},
    "google.protobuf.Empty": {"type": "object", "additionalProperties": False},
}
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "status", "message"],
            "properties": {
                "code": {"type": "integer", "description": "The HTTP status."},
                "status": {"type": "string", "description": "The gRPC status name, e.g. NOT_FOUND."},
                "message": {"type": "string", "description": "What went wrong, readably."},
            },
        }
    },
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


class SchemaBuilder:
    """Collects the JSON Schemas of messages (and of the messages they use)."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}

    def message(self, descriptor: Descriptor) -> dict[str, Any]:
        """A schema reference for a message, adding its schema (and its fields') if new."""
        if descriptor.full_name in _WELL_KNOWN:
            return dict(_WELL_KNOWN[descriptor.full_name])
        name = descriptor.full_name
        if name not in self.schemas:
            self.schemas[name] = {}  # placeholder: recursive messages end here
            properties = {f.json_name: self.field(f) for f in descriptor.fields}
            self.schemas[name] = {"type": "object", "properties": properties, "additionalProperties": False}
        return _ref(name)

    def field(self, field: FieldDescriptor) -> dict[str, Any]:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value = field.message_type.fields_by_name["value"]
            return {"type": "object", "additionalProperties": self.scalar(value)}
        schema = self.scalar(field)
        if field.is_repeated:
            return {"type": "array", "items": schema}
        return schema

    def scalar(self, field: FieldDescriptor) -> dict[str, Any]:
        """The schema of one value of the field (ignoring `repeated`)."""
        kind = field.type
        if field.message_type is not None:
            return self.message(field.message_type)
        if field.enum_type is not None:
            return _enum(field)
        if kind == FieldDescriptor.TYPE_BOOL:
            return {"type": "boolean"}
        if kind == FieldDescriptor.TYPE_STRING:
            return {"type": "string"}
        if kind == FieldDescriptor.TYPE_BYTES:
            return {"type": "string", "contentEncoding": "base64"}
        if kind in _INT32:
            return {"type": "integer", "format": "int32", "minimum": -(2**31), "maximum": 2**31 - 1}
        if kind in _UINT32:
            return {"type": "integer", "format": "int32", "minimum": 0, "maximum": 2**32 - 1}
        if kind in _INT64:
            return {"type": "string", "format": "int64", "pattern": "^-?[0-9]{1,18}$"}
        return {"type": "number"}

    def parameter(self, field: FieldDescriptor) -> dict[str, Any]:
        """The schema of a path or query parameter: like a field, but 64-bit integers as integers."""
        if field.type in _INT64:
            schema: dict[str, Any] = {"type": "integer", "format": "int64"}
        elif field.enum_type is not None:
            schema = _enum(field)
        else:
            schema = self.scalar(field)
        if field.is_repeated:
            return {"type": "array", "items": schema}
        return schema


def _enum(field: FieldDescriptor) -> dict[str, Any]:
    assert field.enum_type is not None
    return {"type": "string", "enum": [v.name for v in field.enum_type.values]}


def _path_field(descriptor: Descriptor, dotted: str) -> FieldDescriptor:
    current: Descriptor | None = descriptor
    parts = dotted.split(".")
    for part in parts[:-1]:
        assert current is not None
        current = current.fields_by_name[part].message_type
    assert current is not None
    return current.fields_by_name[parts[-1]]


def _query_fields(descriptor: Descriptor, bound: set[str]) -> list[FieldDescriptor]:
    return [f for f in descriptor.fields if f.name not in bound and f.type != FieldDescriptor.TYPE_MESSAGE]


def _operation(route: Route, builder: SchemaBuilder) -> dict[str, Any]:
    method = route.descriptor
    request, response = method.input_type, method.output_type
    parameters: list[dict[str, Any]] = [
        {
            "name": name.replace(".", "_"),
            "in": "path",
            "required": True,
            "description": f"Sets `{name}` of the request.",
            "schema": {
                **builder.parameter(_path_field(request, name)),
                "minLength": 1,
                "pattern": "^[^/:]+$",
            },
        }
        for name in route.params
    ]
    operation: dict[str, Any] = {
        "operationId": route.operation or route.rpc,
        "tags": [method.containing_service.name],
        "summary": f"{method.containing_service.full_name}.{route.rpc}",
    }
    if not route.has_body:
        for field in _query_fields(request, set(route.params)):
            parameter: dict[str, Any] = {
                "name": field.name,
                "in": "query",
                "schema": builder.parameter(field),
            }
            if field.is_repeated:
                parameter.update(style="form", explode=True)
            parameters.append(parameter)
    else:
        operation["requestBody"] = {
            "required": False,
            "content": {"application/json": {"schema": builder.message(request)}},
        }
    if route.streaming:
        parameters += [
            {
                "name": SSE_MEMBER_PARAM,
                "in": "query",
                "description": "Whose view to stream, for clients that cannot set X-View-As (EventSource).",
                "schema": {"type": "string"},
            },
        ]
        if route.resume is not Resume.NONE:
            parameters.append(
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "description": "Resume after this event id.",
                    "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"}
                    if route.resume is Resume.STEP_SEQUENCE
                    else {"type": "string"},
                }
            )
        ok: dict[str, Any] = {
            "description": f"Server-Sent Events; each `data:` is one {response.full_name} as JSON.",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    else:
        ok = {"description": "OK", "content": {"application/json": {"schema": builder.message(response)}}}
        if route.opens_session:
            ok["description"] = (
                "OK. The `tokens` are not in the body: they open the browser session"
                f" (the `{COOKIE_NAME}` cookie); GET /v1/auth/session tells its CSRF token."
            )
            ok["headers"] = {"Set-Cookie": {"schema": {"type": "string"}}}
    operation["parameters"] = parameters
    operation["responses"] = {
        "200": ok,
        "default": {
            "description": "An error.",
            "content": {"application/json": {"schema": _ref("Error")}},
        },
    }
    operation["security"] = [] if route.access is Access.PUBLIC else SIGNED_IN
    return operation


# A program sends a bearer token; a browser its session cookie and, on
# state-changing requests, the session's CSRF token.
SIGNED_IN: list[dict[str, list[str]]] = [
    {"bearerToken": []},
    {"session": [], "csrfToken": []},
    {"session": []},
]

SESSION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["member", "workspace", "csrfToken"],
    "properties": {
        "member": {"$ref": "#/components/schemas/agentim.im.v1.Member"},
        "workspace": {"$ref": "#/components/schemas/agentim.im.v1.Workspace"},
        "csrfToken": {
            "type": "string",
            "description": f"Send it in {CSRF_HEADER} on state-changing requests.",
        },
    },
}


def _session_operations() -> dict[str, dict[str, Any]]:
    """The gateway's own routes (no RPC of their own)."""
    error = {"description": "An error.", "content": {"application/json": {"schema": _ref("Error")}}}
    return {
        "/v1/auth/session": {
            "get": {
                "operationId": "GetSession",
                "tags": ["Gateway"],
                "summary": "Who is signed in: the member, the workspace, and the session's CSRF token.",
                "parameters": [],
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {"application/json": {"schema": _ref("Session")}},
                    },
                    "default": error,
                },
                "security": SIGNED_IN,
            }
        },
        "/v1/auth/sign-out": {
            "post": {
                "operationId": "SignOut",
                "tags": ["Gateway"],
                "summary": "Ends the browser session: its refresh token is revoked and the cookie cleared.",
                "parameters": [],
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    "default": error,
                },
                "security": [{"session": [], "csrfToken": []}, {}],
            }
        },
        "/v1/auth/options": {
            "get": {
                "operationId": "GetSignInOptions",
                "tags": ["Gateway"],
                "summary": "How people may sign in here (for the sign-in page).",
                "parameters": [],
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["oidc"],
                                    "properties": {
                                        "oidc": {
                                            "type": "boolean",
                                            "description": "OpenID Connect sign-in is configured.",
                                        }
                                    },
                                }
                            }
                        },
                    },
                    "default": error,
                },
                "security": [],
            }
        },
        "/v1/auth/oidc/start": {
            "get": {
                "operationId": "StartOidcSignIn",
                "tags": ["Gateway"],
                "summary": (
                    "Sends the browser to the organisation's OpenID Connect provider (a 303), with the"
                    " sign-in's state, nonce and PKCE verifier in a sealed cookie; 404 when OIDC_ISSUER"
                    " is unset."
                ),
                "parameters": [
                    _query("invite", "An invite's secret: join its workspace."),
                    _query("workspace", "The workspace to sign in to (when the email is in several)."),
                    _query("name", "A new member's name (with an invite)."),
                    _query("link", "`1`: link the signed-in person's account instead of signing in."),
                ],
                "responses": {
                    "303": {"description": "To the provider, or back to the web UI"},
                    "default": error,
                },
                "security": [],
            }
        },
        "/v1/auth/oidc/callback": {
            "get": {
                "operationId": "FinishOidcSignIn",
                "tags": ["Gateway"],
                "summary": (
                    "The provider's answer: checked against the sign-in's cookie, the code exchanged, the"
                    " person signed in by the IM; then back to the web UI (`/`, or"
                    " `/#signin_error=...&signin_status=...`)."
                ),
                "parameters": [
                    _query("code", "The authorization code."),
                    _query("state", "The state the sign-in started with."),
                    _query("iss", "The provider (RFC 9207)."),
                    _query("error", "The provider's refusal."),
                    _query("error_description", "Its reason."),
                ],
                "responses": {"303": {"description": "Back to the web UI"}, "default": error},
                "security": [],
            }
        },
    }


def _query(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "schema": {"type": "string"},
        "description": description,
    }


def build(routes: tuple[Route, ...] | list[Route], *, title: str = "Agent IM HTTP API") -> dict[str, Any]:
    """The OpenAPI 3.1 document of the routes."""
    builder = SchemaBuilder()
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.openapi_path, {})[route.method.lower()] = _operation(route, builder)
    # The session's schema refers to these.
    builder.message(im_pb2.Member.DESCRIPTOR)
    builder.message(im_pb2.Workspace.DESCRIPTOR)
    paths.update(_session_operations())
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": "v1",
            "description": (
                "The IM and agent runtime gRPC APIs over HTTP/JSON (proto3 JSON mapping) "
                "and Server-Sent Events. Programs authenticate with `Authorization: Bearer <access token"
                " or personal access token>`; browsers sign in (POST /v1/auth/sign-in) and then send the"
                " session cookie, and the session's CSRF token in `X-CSRF-Token` on state-changing requests."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": {
                "Error": ERROR_SCHEMA,
                "Session": SESSION_SCHEMA,
                **dict(sorted(builder.schemas.items())),
            },
            "securitySchemes": {
                "bearerToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "An access token, or a personal access token (`aim_pat_...`).",
                },
                "session": {"type": "apiKey", "in": "cookie", "name": COOKIE_NAME},
                "csrfToken": {"type": "apiKey", "in": "header", "name": CSRF_HEADER},
            },
        },
    }
