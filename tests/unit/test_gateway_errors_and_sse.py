"""gRPC status to HTTP status, and SSE framing and resume ids."""

from __future__ import annotations

import json

import grpc
import pytest

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from gateway import sse
from gateway.errors import HttpError, http_status
from gateway.routes import Resume


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.OUT_OF_RANGE, 400),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.ALREADY_EXISTS, 409),
        (grpc.StatusCode.ABORTED, 409),
        (grpc.StatusCode.PERMISSION_DENIED, 403),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.UNIMPLEMENTED, 501),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
        (grpc.StatusCode.DATA_LOSS, 500),
        (grpc.StatusCode.CANCELLED, 500),
    ],
)
def test_grpc_codes_map_to_http_statuses(code: grpc.StatusCode, status: int) -> None:
    assert http_status(code) == status
    error = HttpError.from_grpc(code, "what happened")
    assert error.body() == {"error": {"code": status, "status": code.name, "message": "what happened"}}


@pytest.mark.parametrize(
    "details",
    [
        "Received message larger than max (2097229 vs. 1048576)",
        "SERVER: Received message larger than max (5 vs. 4)",
        "Sent message larger than max (9 vs. 8)",
    ],
)
def test_a_message_over_grpcs_size_limit_is_413_not_429(details: str) -> None:
    error = HttpError.from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, details)
    assert (error.code, error.status) == (413, "RESOURCE_EXHAUSTED")
    full = HttpError.from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "a group may have at most 500 members")
    assert full.code == 429


def test_an_error_without_details_still_says_something() -> None:
    assert HttpError.from_grpc(grpc.StatusCode.NOT_FOUND, "").message == "not found"


def message_event(cursor: str) -> im_pb2.WatchEventsResponse:
    return im_pb2.WatchEventsResponse(
        cursor=cursor,
        sequence=int(cursor),
        message_created=im_pb2.MessageCreated(message=im_pb2.Message(id="m", content="line1\nline2")),
    )


def test_im_events_are_named_by_their_case_and_numbered_by_their_cursor() -> None:
    frame = sse.ResumeIds(Resume.CURSOR).encode(message_event("41"))
    text = frame.decode()
    assert text.endswith("\n\n") and text.count("\n\n") == 1
    head, event, data = text.rstrip("\n").split("\n")
    assert head == "id: 41" and event == "event: message_created"
    payload = json.loads(data.removeprefix("data: "))
    assert payload["cursor"] == "41" and payload["sequence"] == "41"
    assert payload["messageCreated"]["message"]["content"] == "line1\nline2"


def agent_event(**event: object) -> rpb.WatchAgentResponse:
    return rpb.WatchAgentResponse(event=rpb.AgentEvent(agent_id="a", **event))  # type: ignore[arg-type]


def test_agent_event_ids_are_the_last_step_delivered_whole() -> None:
    ids = sse.ResumeIds(Resume.STEP_SEQUENCE, after_sequence=4)
    stream = [
        agent_event(run_started=rpb.Run(id="r")),
        agent_event(step_completed=rpb.Step(sequence=5)),
        agent_event(step_started=rpb.StepStarted(sequence=6)),
        agent_event(step_delta=rpb.StepDelta(sequence=6, content="hi")),
        agent_event(step_completed=rpb.Step(sequence=6)),
        agent_event(run_ended=rpb.Run(id="r")),
    ]
    assert [ids.next_id(e) for e in stream] == ["4", "5", "5", "5", "6", "6"]
    assert [sse.event_kind(e) for e in stream] == [
        "run_started",
        "step_completed",
        "step_started",
        "step_delta",
        "step_completed",
        "run_ended",
    ]


def test_watch_agents_events_have_no_id() -> None:
    frame = sse.ResumeIds(Resume.NONE).encode(
        rpb.WatchAgentsResponse(event=rpb.AgentEvent(state_changed=rpb.AgentStateChanged()))
    )
    assert frame.startswith(b"event: state_changed\ndata: {")


def test_last_event_id_sets_the_resume_field() -> None:
    events = im_pb2.WatchEventsRequest()
    assert sse.apply_last_event_id(Resume.CURSOR, events, "c-9") == 0 and events.after_cursor == "c-9"
    watch = rpb.WatchAgentRequest(live_only=True)
    assert sse.apply_last_event_id(Resume.STEP_SEQUENCE, watch, "12") == 12
    assert watch.after_sequence == 12 and watch.live_only is False
    with pytest.raises(HttpError) as raised:
        sse.apply_last_event_id(Resume.STEP_SEQUENCE, rpb.WatchAgentRequest(), "-1")
    assert raised.value.code == 400


def test_the_opening_and_the_error_event() -> None:
    assert sse.opening(2500) == b"retry: 2500\n: open\n\n"
    assert sse.opening(2500, "c-3") == b"retry: 2500\nid: c-3\n: open\n\n"
    error = sse.error_frame(HttpError.from_grpc(grpc.StatusCode.UNAVAILABLE, "gone"))
    assert error.startswith(b"event: error\ndata: ")
    assert json.loads(error.split(b"data: ")[1]) == {
        "error": {"code": 503, "status": "UNAVAILABLE", "message": "gone"}
    }
