"""The categories of failure every service reports.

Each bounded context defines its own error classes as subclasses of these.
Nothing here knows about gRPC: the status a category is reported with is
chosen at the boundary, by the table in `services.common.status`, and one
server interceptor (`services.common.interceptors`) turns an error into that
status with the error's message. Anything else becomes INTERNAL with a generic
message, and its traceback goes to the log.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QuotaViolation:
    """Which quota a refusal ran into (`google.rpc.QuotaFailure.Violation`)."""

    subject: str
    description: str


class ServiceError(Exception):
    """Base of every expected failure.

    `retry_after_seconds`, when set, goes to the client as
    `google.rpc.RetryInfo` (how long to wait before trying again), and
    `quota_violation` as `google.rpc.QuotaFailure`. `relayed_status` is set
    only on a refusal relayed from another service: the status name
    (`google.rpc.Code`, e.g. "NOT_FOUND") that service chose, kept as it was.
    """

    relayed_status: str | None = None
    retry_after_seconds: float | None = None
    quota_violation: QuotaViolation | None = None

    def __init__(self, message: str, *, retry_after_seconds: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retry_after_seconds is not None:
            self.retry_after_seconds = retry_after_seconds


class InvalidArgument(ServiceError):
    """The request itself is wrong; retrying it unchanged cannot succeed."""


class NotFound(ServiceError):
    """What the request names does not exist (or the caller may not know it does)."""


class AlreadyExists(ServiceError):
    """What the request would create exists already."""


class PermissionDenied(ServiceError):
    """The caller is known and may not do this."""


class Unauthenticated(ServiceError):
    """The caller could not be identified."""


class FailedPrecondition(ServiceError):
    """The system is not in a state where this can be done."""


class Conflict(ServiceError):
    """A concurrent change won; the caller may read again and retry."""


class ResourceExhausted(ServiceError):
    """A limit or quota was reached."""


class Unavailable(ServiceError):
    """A dependency could not be reached; retrying later may succeed."""
