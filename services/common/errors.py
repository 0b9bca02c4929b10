"""The categories of failure every service reports, and their gRPC status.

Each bounded context defines its own error classes as subclasses of these;
one server interceptor (`services.common.interceptors`) turns them into a
gRPC status with the error's message. Anything else becomes INTERNAL with a
generic message, and its traceback goes to the log.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc


@dataclass(frozen=True, slots=True)
class QuotaViolation:
    """Which quota a refusal ran into (`google.rpc.QuotaFailure.Violation`)."""

    subject: str
    description: str


class ServiceError(Exception):
    """Base of every expected failure; `code` is the gRPC status it maps to.

    `retry_after_seconds`, when set, goes to the client as
    `google.rpc.RetryInfo` (how long to wait before trying again), and
    `quota_violation` as `google.rpc.QuotaFailure`.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    retry_after_seconds: float | None = None
    quota_violation: QuotaViolation | None = None

    def __init__(self, message: str, *, retry_after_seconds: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retry_after_seconds is not None:
            self.retry_after_seconds = retry_after_seconds


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Conflict(ServiceError):
    code = grpc.StatusCode.ABORTED


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE
