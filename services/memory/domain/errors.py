"""The memory service's errors; each maps to one gRPC status (see services.common.errors)."""

from __future__ import annotations

from services.common import errors


class MemoryServiceError(errors.ServiceError):
    """Base of the memory service's expected failures."""


class InvalidRequest(MemoryServiceError, errors.InvalidArgument):
    pass


class NotFound(MemoryServiceError, errors.NotFound):
    pass


class NotAllowed(MemoryServiceError, errors.PermissionDenied):
    pass


class Unauthenticated(MemoryServiceError, errors.Unauthenticated):
    pass


class DirectoryUnavailable(MemoryServiceError, errors.Unavailable):
    """The IM, which says who a caller is, cannot be reached."""
