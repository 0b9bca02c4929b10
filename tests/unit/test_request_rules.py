"""The rules every request obeys, walked from the descriptor (services.common.request_rules)."""

from __future__ import annotations

import pytest
from google.protobuf import struct_pb2

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from services.common.errors import InvalidArgument
from services.common.request_rules import MAX_JSON_DEPTH, check_request


def nested(levels: int) -> struct_pb2.Struct:
    """A Struct whose JSON is `levels` objects deep."""
    top = struct_pb2.Struct()
    current = top
    for _ in range(levels - 1):
        current = current.fields["a"].struct_value
    current.fields["leaf"].number_value = 1
    return top


def refusal(message: object) -> str:
    with pytest.raises(InvalidArgument) as raised:
        check_request(message)  # type: ignore[arg-type]
    return raised.value.message


def test_an_ordinary_request_passes() -> None:
    request = im_pb2.SendMessageRequest(group_id="g", content="héllo 👋", mentions=["a", "b"])
    request.metadata.update({"n": 1.5, "list": [1, "two", {"three": None}], "ok": True})
    check_request(request)


def test_a_nul_is_refused_naming_the_field() -> None:
    assert refusal(im_pb2.SendMessageRequest(content="a\x00b")) == "content contains a NUL character"
    assert refusal(im_pb2.CreateGroupRequest(member_ids=["x", "y\x00"])) == (
        "member_ids[1] contains a NUL character"
    )
    nested_field = im_pb2.UpdateMemberRequest(member=im_pb2.Member(display_name="\x00"))
    assert refusal(nested_field) == "member.display_name contains a NUL character"


def test_a_nul_in_json_strings_and_keys_is_refused() -> None:
    value = im_pb2.SendMessageRequest(content="x")
    value.metadata.update({"k": ["fine", "bad\x00"]})
    assert refusal(value) == 'metadata["k"][1] contains a NUL character'
    key = im_pb2.SendMessageRequest(content="x")
    key.metadata.update({"bad\x00key": 1})
    assert refusal(key) == 'key of metadata["bad\\u0000key"] contains a NUL character'


@pytest.mark.parametrize("number", [float("nan"), float("inf"), float("-inf")])
def test_json_numbers_must_be_finite(number: float) -> None:
    request = im_pb2.SendMessageRequest(content="x")
    request.metadata.fields["x"].number_value = number
    assert 'metadata["x"] must be a finite number' in refusal(request)


@pytest.mark.parametrize("number", [float("nan"), float("inf")])
def test_double_fields_must_be_finite(number: float) -> None:
    request = rpb.CreateAgentRequest(name="a", model=rpb.ModelSettings(temperature=number))
    assert refusal(request).startswith("model.temperature must be a finite number")


def test_an_unknown_enum_number_is_refused_naming_the_field() -> None:
    request = rpb.TerminateAgentRequest(agent_id="a")
    request.queue_policy = 42  # type: ignore[assignment]
    assert refusal(request) == "queue_policy: 42 is not a known QueuePolicy"
    check_request(rpb.TerminateAgentRequest(queue_policy=rpb.QUEUE_POLICY_CLEAR))


def test_json_depth_is_bounded() -> None:
    at_limit = im_pb2.SendMessageRequest(content="x")
    at_limit.metadata.CopyFrom(nested(MAX_JSON_DEPTH))
    check_request(at_limit)
    too_deep = im_pb2.SendMessageRequest(content="x")
    too_deep.metadata.CopyFrom(nested(MAX_JSON_DEPTH + 1))
    assert refusal(too_deep) == f"metadata is nested deeper than {MAX_JSON_DEPTH} levels"


def test_lists_count_as_levels_too() -> None:
    request = im_pb2.SendMessageRequest(content="x")
    value = request.metadata.fields["l"]
    for _ in range(MAX_JSON_DEPTH):
        value = value.list_value.values.add()
    value.number_value = 1
    assert refusal(request) == f"metadata is nested deeper than {MAX_JSON_DEPTH} levels"


def test_a_long_path_is_shortened() -> None:
    request = im_pb2.SendMessageRequest(content="x")
    current = request.metadata
    for _ in range(20):
        current = current.fields["k" * 40].struct_value
    current.fields["leaf"].string_value = "\x00"
    message = refusal(request)
    assert message.endswith("contains a NUL character") and len(message) < 300
