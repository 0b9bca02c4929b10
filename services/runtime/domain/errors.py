"""Every error the runtime raises, in one tree.

Each class subclasses a category of `services.common.errors`; the status a
client sees is chosen by the category at the boundary
(`services.common.status`), never here. Nothing in this module imports I/O.

The few classes that are not `ServiceError`s never reach a client: a port's
signal to its caller (`DuplicateStep`, `DuplicateAgentRequest`) or a tool's
refusal, which the model reads (`ToolError`).
"""

from __future__ import annotations

from services.common.errors import (
    AlreadyExists,
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
    Unavailable,
)

# --- Requests -----------------------------------------------------------------


class InvalidAgentRequest(InvalidArgument):
    pass


class InvalidHistoryRequest(InvalidArgument):
    pass


class InvalidTaskRequest(InvalidArgument):
    pass


class NotAuthenticated(Unauthenticated):
    pass


class NotAllowed(PermissionDenied):
    pass


class RequestReused(AlreadyExists):
    """An agent's request_id was used before for a different request."""


class TaskRequestReused(AlreadyExists):
    """A task's request_id was used before for a different task."""


# --- What a request names -----------------------------------------------------


class AgentNotFound(NotFound):
    pass


class AgentGone(NotFound):
    """The agent was deleted while the request was on its way."""


class SessionNotFound(NotFound):
    pass


class StepNotFound(NotFound):
    pass


class CheckpointNotFound(NotFound):
    pass


class TaskNotFound(NotFound):
    pass


# --- State --------------------------------------------------------------------


class InvalidTransition(FailedPrecondition):
    """The agent's state does not allow that control."""


class WrongAgentState(FailedPrecondition):
    """The agent's state does not allow the change now."""


class BrokenToolCall(FailedPrecondition):
    """The change would leave a tool call without its result, or a result without its call."""


class TaskAlreadyEnded(FailedPrecondition):
    pass


class StepTaken(Conflict):
    """The agent wrote a step at the same moment."""


# --- Model endpoints ----------------------------------------------------------


class EndpointRefused(InvalidArgument, ValueError):
    """The URL may not be an agent's model endpoint; the message says why.

    Also a `ValueError`, since settings parsing reports it as a malformed value.
    """


class EndpointNotAllowed(InvalidArgument):
    """An agent's model.base_url names a host it may not."""


# --- Dependencies -------------------------------------------------------------


class LLMError(ServiceError):
    """A completion failed."""


class LLMUnavailable(LLMError, Unavailable):
    """The endpoint failed even after retries (rate limits, server errors, cut connections)."""


class LLMRejected(LLMError, FailedPrecondition):
    """The endpoint refused the request itself (bad model, bad key, bad input): retrying will not help."""


class ContextTooLong(LLMRejected):
    """The endpoint refused the request as longer than the model's context
    window; `window` and `requested` are its numbers when it said them."""

    def __init__(self, message: str, *, window: int | None = None, requested: int | None = None) -> None:
        super().__init__(message)
        self.window = window
        self.requested = requested


class IMError(ServiceError):
    """The IM refused a call; `code` is the IM's status, `message` its readable reason."""


class IMUnavailable(IMError, Unavailable):
    """The IM could not be reached (after the call's deadline)."""


class MemoryRefused(ServiceError):
    """The memory service refused a call (bad query, unknown anchor)."""


class MemoryUnavailable(MemoryRefused, Unavailable):
    """The memory service could not be reached."""


# --- Event streams ------------------------------------------------------------


class WatcherFellBehind(ResourceExhausted):
    """A watcher's backlog overflowed: its stream ends with this error, never
    silently, so that the client knows to resume from its last step."""


class HubClosed(Unavailable):
    """The runtime is shutting down: every watch ends with this error (which
    clients retry), never silently, so that the client knows to watch again."""


# --- Signals that never reach a client ----------------------------------------


class DuplicateStep(Exception):
    """A step with that (session, sequence) exists: another writer got there first."""


class DuplicateAgentRequest(Exception):
    """The request_id was recorded first by a concurrent call."""


class ToolError(Exception):
    """A tool's own refusal, shown to the model as is."""
