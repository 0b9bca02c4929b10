"""Errors of the HTTP API: gRPC status to HTTP status, and the JSON error body.

Every error the gateway answers has the body
`{"error": {"code": <http status>, "status": "<gRPC status name>", "message": "..."}}`,
whether it comes from an upstream service or from the gateway itself (bad
JSON, unknown path, missing token...). The mapping follows grpc-gateway's,
with FAILED_PRECONDITION as 400 (the request cannot succeed in the current
state; retrying it as is will not help), CANCELLED folded into 500, and
RESOURCE_EXHAUSTED for a message over gRPC's size limit as 413 (quotas and
full groups stay 429).
"""

from __future__ import annotations

import math
import re
from typing import Any

import grpc

from services.common.ratelimit import retry_after_seconds

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


# What gRPC (C core) says when a message exceeds a size limit, on either side.
_OVER_SIZE = re.compile(r"^(?:SERVER: )?(?:Received|Sent) message larger than max")


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status for a gRPC status code (500 for any other)."""
    return HTTP_STATUS.get(code, 500)


class HttpError(Exception):
    """A failed request: its HTTP status, gRPC status name and readable message."""

    def __init__(
        self, code: int, status: str, message: str, *, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        self.message = message
        self.headers = headers or {}

    @classmethod
    def from_grpc(
        cls, code: grpc.StatusCode, details: str | None, trailing_metadata: Any = None
    ) -> HttpError:
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and _OVER_SIZE.search(details or ""):
            # gRPC's own size limit (the service's, or this channel's): the
            # request is too large, not a quota to wait for.
            return cls(413, code.name, "the request is larger than the services accept")
        headers = {}
        # A rate limit says when to come back (google.rpc.RetryInfo).
        wait = retry_after_seconds(trailing_metadata) if trailing_metadata else None
        if wait is not None:
            headers["Retry-After"] = str(max(1, math.ceil(wait)))
        return cls(
            http_status(code), code.name, details or code.name.replace("_", " ").lower(), headers=headers
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "status": self.status, "message": self.message}}


def bad_request(message: str) -> HttpError:
    return HttpError(400, "INVALID_ARGUMENT", message)


def unauthenticated(message: str) -> HttpError:
    return HttpError(401, "UNAUTHENTICATED", message, headers={"WWW-Authenticate": "Bearer"})


def not_found(message: str) -> HttpError:
    return HttpError(404, "NOT_FOUND", message)


def method_not_allowed(allowed: tuple[str, ...]) -> HttpError:
    return HttpError(
        405,
        "UNIMPLEMENTED",
        f"method not allowed here; allowed: {', '.join(allowed)}",
        headers={"Allow": ", ".join(allowed)},
    )


def too_large(limit: int) -> HttpError:
    return HttpError(413, "RESOURCE_EXHAUSTED", f"request body larger than {limit} bytes")


def too_large_upstream(size: int, limit: int) -> HttpError:
    return HttpError(
        413,
        "RESOURCE_EXHAUSTED",
        f"the request is {size} bytes as protobuf; the services take at most {limit}",
    )


def not_configured(service: str) -> HttpError:
    return HttpError(
        503,
        "UNAVAILABLE",
        f"the {service} service is not configured on this gateway (set {service.upper()}_ADDRESS)",
    )
