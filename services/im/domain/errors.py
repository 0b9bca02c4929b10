"""The IM's errors; each maps to one gRPC status (see services.common.errors)."""

from __future__ import annotations

from services.common import errors


class IMError(errors.ServiceError):
    """Base of the IM's expected failures."""


class InvalidRequest(IMError, errors.InvalidArgument):
    pass


class NotFound(IMError, errors.NotFound):
    pass


class NotAMember(IMError, errors.PermissionDenied):
    pass


class NotAllowed(IMError, errors.PermissionDenied):
    pass


class Unauthenticated(IMError, errors.Unauthenticated):
    pass


class RequestIdReused(IMError, errors.AlreadyExists):
    pass


class WrongState(IMError, errors.FailedPrecondition):
    pass


class LimitExceeded(IMError, errors.ResourceExhausted):
    pass


class QuotaExceeded(IMError, errors.ResourceExhausted):
    """The workspace has its quota of something (sent as `google.rpc.QuotaFailure`)."""

    def __init__(self, message: str, *, subject: str, limit: int) -> None:
        super().__init__(message)
        self.quota_violation = errors.QuotaViolation(subject=subject, description=f"at most {limit}")


class TooManyAttempts(IMError, errors.ResourceExhausted):
    """Refused for a while (sign-in throttling); retry_after_seconds says how long."""


class AlreadyTaken(IMError, errors.AlreadyExists):
    pass


class Conflict(IMError, errors.Conflict):
    pass


class ShuttingDown(IMError, errors.Unavailable):
    pass


class ProviderUnavailable(IMError, errors.Unavailable):
    """The OpenID Connect provider cannot be reached (or answers nonsense)."""
