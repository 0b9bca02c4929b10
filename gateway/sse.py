"""Server-Sent Events framing and resume ids (pure).

Each streamed response becomes one event:

    id: <resume id>
    event: <kind>
    data: <the response message as JSON, on one line>

The kind is the name of the event's `oneof` case (`message_created`,
`step_delta`...). The resume id depends on the stream (see `Resume`):

- /v1/events: the IM event cursor; a reconnect with `Last-Event-ID`
  continues right after that event (WatchEventsRequest.after_cursor). The
  opening of the stream carries the cursor it starts after (the IM's
  `x-agentim-start-cursor` response header), so even a stream broken before
  its first event resumes with nothing lost.
- /v1/agents/{id}/events: the sequence of the last step delivered whole
  (the starting `after_sequence` before any; also sent in the opening).
  WatchAgent with that `after_sequence` sends the steps after it as
  `step_completed` snapshots, then the step in flight from its
  `step_started` with every delta so far, then live events: so a reconnect
  loses nothing; it may repeat the deltas of the step that was in flight,
  which a client rebuilds from its `step_started`. Run and state events are
  live only.
- /v1/agent-events: no id (WatchAgents has no resume point).
"""

from __future__ import annotations

from google.protobuf.message import Message

from gateway.errors import HttpError, bad_request
from gateway.routes import Resume
from gateway.transcoding import dumps, message_json

PING = b": ping\n\n"
ERROR_EVENT = "error"


def frame(kind: str, data: str, event_id: str | None = None) -> bytes:
    """One event. `data` must be one line (compact JSON is)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {data}\n\n".encode()


def opening(retry_ms: int, event_id: str | None = None) -> bytes:
    """The first bytes of every stream: the reconnection delay, and the id it starts after.

    An id with no data dispatches no event but sets the client's last event
    id, so that a stream broken before its first event resumes where it began.
    """
    head = f"id: {event_id}\n" if event_id else ""
    return f"retry: {retry_ms}\n{head}: open\n\n".encode()


def error_frame(error: HttpError) -> bytes:
    return frame(ERROR_EVENT, dumps(error.body()))


def event_kind(response: Message) -> str:
    """The oneof case of a streamed response (WatchEventsResponse, or the AgentEvent it wraps)."""
    holder = getattr(response, "event") if "event" in response.DESCRIPTOR.fields_by_name else response  # noqa: B009
    kind = holder.WhichOneof("event") if "event" in holder.DESCRIPTOR.oneofs_by_name else None
    return kind or "message"


class ResumeIds:
    """Gives each event of one stream its `id:` (None: no id line)."""

    def __init__(self, resume: Resume, *, after_sequence: int = 0) -> None:
        self._resume = resume
        self._sequence = after_sequence

    def next_id(self, response: Message) -> str | None:
        if self._resume is Resume.CURSOR:
            return str(getattr(response, "cursor"))  # noqa: B009
        if self._resume is Resume.STEP_SEQUENCE:
            event = getattr(response, "event")  # noqa: B009
            if event.WhichOneof("event") == "step_completed":
                self._sequence = max(self._sequence, int(event.step_completed.sequence))
            return str(self._sequence)
        return None

    def encode(self, response: Message) -> bytes:
        return frame(event_kind(response), message_json(response), self.next_id(response))


def apply_last_event_id(resume: Resume, request: Message, last_event_id: str) -> int:
    """Sets the request's resume field from `Last-Event-ID`; returns the starting sequence.

    Raises:
        HttpError: 400 when the id cannot be a resume point of this stream.
    """
    if resume is Resume.CURSOR:
        setattr(request, "after_cursor", last_event_id)  # noqa: B010
        return 0
    if resume is Resume.STEP_SEQUENCE:
        if not last_event_id.isdigit():
            raise bad_request(f"Last-Event-ID: expected a step sequence, got {last_event_id[:64]!r}")
        sequence = int(last_event_id)
        setattr(request, "after_sequence", sequence)  # noqa: B010
        # Resuming needs the snapshots of the steps missed meanwhile.
        setattr(request, "live_only", False)  # noqa: B010
        return sequence
    return 0
