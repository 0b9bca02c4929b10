"""The status each category of failure is reported with.

The one table that maps the categories of `services.common.errors` to
`google.rpc.Code` names: the gRPC boundary reports an error with
`grpc.StatusCode[status_name(error)]`, the audit log records the same name,
and the gateway maps the status to HTTP. Domain code raises categories and
never chooses a status itself.
"""

from __future__ import annotations

from services.common import errors

STATUS_OF_CATEGORY: dict[type[errors.ServiceError], str] = {
    errors.InvalidArgument: "INVALID_ARGUMENT",
    errors.NotFound: "NOT_FOUND",
    errors.AlreadyExists: "ALREADY_EXISTS",
    errors.PermissionDenied: "PERMISSION_DENIED",
    errors.Unauthenticated: "UNAUTHENTICATED",
    errors.FailedPrecondition: "FAILED_PRECONDITION",
    errors.Conflict: "ABORTED",
    errors.ResourceExhausted: "RESOURCE_EXHAUSTED",
    errors.Unavailable: "UNAVAILABLE",
}


def status_name(error: errors.ServiceError) -> str:
    """The status name `error` is reported with: the one another service chose
    for a relayed refusal, else its category's (the nearest in its class's
    method resolution order), else UNKNOWN."""
    if error.relayed_status is not None:
        return error.relayed_status
    for category in type(error).__mro__:
        status = STATUS_OF_CATEGORY.get(category)
        if status is not None:
            return status
    return "UNKNOWN"
