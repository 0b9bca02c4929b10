"""The shared request rules over the wire: what no service may store or parse is
INVALID_ARGUMENT naming the field, never INTERNAL or UNKNOWN, on the IM and the
runtime, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from services.common.request_rules import MAX_JSON_DEPTH
from tests.conftest import RunningIM, make_world
from tests.edge_support import call_raw, runtime_on
from tests.identities import as_unknown
from tests.integration.test_runtime_grpc import RunningRuntime

__all__ = ["runtime_on"]  # a fixture

NUL = "\x00"


async def refusal(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), caught.value.details() or ""


def invalid(field: str) -> tuple[grpc.StatusCode, str]:
    return grpc.StatusCode.INVALID_ARGUMENT, f"{field} contains a NUL character"


def deep_metadata(levels: int) -> struct_pb2.Struct:
    top = struct_pb2.Struct()
    current = top
    for _ in range(levels - 1):
        current = current.fields["a"].struct_value
    current.fields["leaf"].number_value = 1
    return top


async def test_a_nul_anywhere_in_the_im_is_invalid_argument_naming_the_field(im: RunningIM) -> None:
    stub = im.stub
    world = await make_world(stub, people=2)
    md = world.md(0)
    group = (await stub.CreateGroup(im_pb2.CreateGroupRequest(name="g"), metadata=md)).group
    sent = (
        await stub.SendMessage(im_pb2.SendMessageRequest(group_id=group.id, content="hi"), metadata=md)
    ).message
    cases: list[tuple[Awaitable[Any], str]] = [
        (
            stub.SendMessage(im_pb2.SendMessageRequest(group_id=group.id, content=f"a{NUL}b"), metadata=md),
            "content",
        ),
        (
            stub.SendMessage(
                im_pb2.SendMessageRequest(group_id=group.id, content="x", request_id=f"r{NUL}"), metadata=md
            ),
            "request_id",
        ),
        (
            stub.EditMessage(im_pb2.EditMessageRequest(message_id=sent.id, content=NUL), metadata=md),
            "content",
        ),
        (
            stub.CreateWorkspace(im_pb2.CreateWorkspaceRequest(name=f"w{NUL}", creator_display_name="a")),
            "name",
        ),
        (
            stub.CreateMember(im_pb2.CreateMemberRequest(display_name=f"b{NUL}"), metadata=md),
            "display_name",
        ),
        (stub.CreateGroup(im_pb2.CreateGroupRequest(name=f"g{NUL}"), metadata=md), "name"),
        (
            stub.UpdateGroup(
                im_pb2.UpdateGroupRequest(group=im_pb2.Group(id=group.id, name=NUL)), metadata=md
            ),
            "group.name",
        ),
        (stub.GetGroup(im_pb2.GetGroupRequest(group_id=f"{group.id}{NUL}"), metadata=md), "group_id"),
    ]
    for call, field in cases:
        assert await refusal(call) == invalid(field)


@pytest.mark.parametrize("number", [float("nan"), float("inf"), float("-inf")])
async def test_metadata_numbers_must_be_finite(im: RunningIM, number: float) -> None:
    world = await make_world(im.stub, people=1)
    group = (await im.stub.CreateGroup(im_pb2.CreateGroupRequest(name="g"), metadata=world.md(0))).group
    request = im_pb2.SendMessageRequest(group_id=group.id, content="x")
    request.metadata.fields["score"].number_value = number
    code, details = await refusal(im.stub.SendMessage(request, metadata=world.md(0)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith('metadata["score"] must be a finite number')


async def test_metadata_nesting_is_bounded_both_where_it_parses_and_where_it_does_not(im: RunningIM) -> None:
    world = await make_world(im.stub, people=1)
    md = world.md(0)
    group = (await im.stub.CreateGroup(im_pb2.CreateGroupRequest(name="g"), metadata=md)).group
    at_limit = im_pb2.SendMessageRequest(group_id=group.id, content="x")
    at_limit.metadata.CopyFrom(deep_metadata(MAX_JSON_DEPTH))
    await im.stub.SendMessage(at_limit, metadata=md)
    # One level more still parses: the rules refuse it.
    over = im_pb2.SendMessageRequest(group_id=group.id, content="x")
    over.metadata.CopyFrom(deep_metadata(MAX_JSON_DEPTH + 1))
    assert await refusal(im.stub.SendMessage(over, metadata=md)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"metadata is nested deeper than {MAX_JSON_DEPTH} levels",
    )
    # Deeper, the protobuf parser itself gives up.
    far = im_pb2.SendMessageRequest(group_id=group.id, content="x")
    far.metadata.CopyFrom(deep_metadata(60))
    reply = await call_raw(im.channel, "/agentim.im.v1.IMService/SendMessage", far.SerializeToString(), md)
    assert (reply.code, reply.details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "the request is not a valid SendMessage request: it is nested too deeply",
    )


async def test_undecodable_requests_are_invalid_argument_without_exception_names(im: RunningIM) -> None:
    world = await make_world(im.stub, people=1)
    md = world.md(0)
    bad_utf8 = b"\x1a\x02\xff\xfe"  # field 3 (content): two bytes that are not UTF-8
    surrogate = b"\x1a\x03\xed\xa0\x80"  # U+D800 encoded as if it were a character
    corrupt = b"\xff\xff\xff\xff"
    for method, payload, streaming, problem in [
        ("SendMessage", bad_utf8, False, "a string field is not valid UTF-8"),
        ("SendMessage", surrogate, False, "a string field is not valid UTF-8"),
        ("SendMessage", corrupt, False, "its bytes are malformed"),
        ("GetWorkspace", corrupt, False, "its bytes are malformed"),
        ("WatchEvents", corrupt, True, "its bytes are malformed"),
    ]:
        reply = await call_raw(
            im.channel, f"/agentim.im.v1.IMService/{method}", payload, md, streaming=streaming
        )
        assert reply.code == grpc.StatusCode.INVALID_ARGUMENT, (method, reply)
        assert reply.details == f"the request is not a valid {method} request: {problem}"


async def test_the_runtime_refuses_the_same_inputs(im: RunningIM, runtime_on: RunningRuntime) -> None:
    world = await make_world(im.stub, people=1)
    md = world.md(0)
    stub = runtime_on.stub
    agent = (await stub.CreateAgent(rpb.CreateAgentRequest(name="ada"), metadata=md)).agent
    terminate = rpb.TerminateAgentRequest(agent_id=agent.id)
    terminate.queue_policy = 42  # type: ignore[assignment]
    assert await refusal(stub.TerminateAgent(terminate, metadata=md)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "queue_policy: 42 is not a known QueuePolicy",
    )
    cases: list[tuple[Awaitable[Any], str]] = [
        (stub.CreateAgent(rpb.CreateAgentRequest(name="b", system_prompt=NUL), metadata=md), "system_prompt"),
        (stub.CreateAgent(rpb.CreateAgentRequest(name=f"b{NUL}"), metadata=md), "name"),
        (stub.CreateAgent(rpb.CreateAgentRequest(name="b", request_id=NUL), metadata=md), "request_id"),
        (
            stub.UpdateAgent(rpb.UpdateAgentRequest(agent=rpb.Agent(id=agent.id, role=NUL)), metadata=md),
            "agent.role",
        ),
        (stub.SubmitTask(rpb.SubmitTaskRequest(agent_id=agent.id, input=f"do{NUL}"), metadata=md), "input"),
        (
            stub.CreateCheckpoint(rpb.CreateCheckpointRequest(agent_id=agent.id, name=NUL), metadata=md),
            "name",
        ),
    ]
    for call, field in cases:
        assert await refusal(call) == invalid(field)
    code, details = await refusal(
        stub.CreateAgent(
            rpb.CreateAgentRequest(name="c", model=rpb.ModelSettings(temperature=float("nan"))), metadata=md
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(
        "model.temperature must be a finite number"
    )
    reply = await call_raw(
        runtime_on.channel,
        "/agentim.runtime.v1.RuntimeService/WatchAgent",
        b"\x0a\x01\xff",
        md,
        streaming=True,
    )
    assert (reply.code, reply.details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "the request is not a valid WatchAgent request: a string field is not valid UTF-8",
    )


async def test_an_unknown_member_gets_the_same_answer(im: RunningIM) -> None:
    code, details = await refusal(
        im.stub.SendMessage(im_pb2.SendMessageRequest(content=NUL), metadata=as_unknown())
    )
    assert (code, details) == invalid("content")


# --- what the fuzz (tests/faults/test_fuzz.py) found past the shared rules ------------


async def test_a_cursor_past_64_bits_is_malformed_not_an_overflow(im: RunningIM) -> None:
    world = await make_world(im.stub, people=1)
    for cursor in (str(2**63), "9" * 19):
        watch = im.stub.WatchEvents(im_pb2.WatchEventsRequest(after_cursor=cursor), metadata=world.md(0))
        code, details = await refusal(watch.read())
        assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, f"after_cursor is malformed: {cursor!r}")
    # The largest 64-bit cursor is well-formed, only ahead of the workspace's events.
    watch = im.stub.WatchEvents(im_pb2.WatchEventsRequest(after_cursor=str(2**63 - 1)), metadata=world.md(0))
    code, details = await refusal(watch.read())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "is ahead of this workspace's events" in details


async def test_an_agents_request_id_is_the_runtimes_to_check(
    im: RunningIM, runtime_on: RunningRuntime
) -> None:
    world = await make_world(im.stub, people=1)
    md = world.md(0)
    stub = runtime_on.stub
    # Within the limit, even where the IM member's marked request_id would not be.
    long_enough = "r" * 125
    first = (
        await stub.CreateAgent(rpb.CreateAgentRequest(name="a", request_id=long_enough), metadata=md)
    ).agent
    again = (
        await stub.CreateAgent(rpb.CreateAgentRequest(name="a", request_id=long_enough), metadata=md)
    ).agent
    assert again.id == first.id and again.member_id == first.member_id
    assert await refusal(
        stub.CreateAgent(rpb.CreateAgentRequest(name="a", request_id="r" * 129), metadata=md)
    ) == (grpc.StatusCode.INVALID_ARGUMENT, "request_id is limited to 128 characters")
