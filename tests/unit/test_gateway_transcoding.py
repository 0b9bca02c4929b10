"""JSON bodies, query and path parameters into request messages; responses into JSON."""

from __future__ import annotations

import pytest

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from gateway.errors import HttpError
from gateway.transcoding import build_request, message_json, to_json


def build(
    message: object,
    *,
    body: bytes | None = None,
    query: list[tuple[str, str]] | None = None,
    path: dict[str, str] | None = None,
) -> object:
    return build_request(message, body=body, query=query or [], path_params=path or {})  # type: ignore[arg-type]


def test_the_body_is_the_request_in_proto3_json_and_path_parameters_win() -> None:
    request = build(
        im_pb2.UpdateMemberRequest(),
        body=b'{"member": {"id": "from-body", "displayName": "Ada"}, "updateMask": "displayName,avatar"}',
        path={"member.id": "from-path"},
    )
    assert isinstance(request, im_pb2.UpdateMemberRequest)
    assert request.member.id == "from-path" and request.member.display_name == "Ada"
    assert list(request.update_mask.paths) == ["display_name", "avatar"]


def test_original_field_names_are_accepted_too() -> None:
    request = build(im_pb2.GetOrCreateDirectGroupRequest(), body=b'{"peer_member_id": "p"}')
    assert isinstance(request, im_pb2.GetOrCreateDirectGroupRequest) and request.peer_member_id == "p"


def test_an_empty_body_is_an_empty_message() -> None:
    assert build(rpb.WakeAgentRequest(), body=b"", path={"agent_id": "a"}) == rpb.WakeAgentRequest(
        agent_id="a"
    )


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b'{"name": ', "malformed JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"nmae": "x"}', "nmae"),
        (b'{"memberIds": "x"}', "memberIds"),
        (b'{"name": NaN}', "NaN"),
        (b"\xff\xfe", "malformed JSON"),
        (b'{"requestId": 5}', "requestId"),
    ],
)
def test_bad_bodies_are_400_with_the_parsers_message(body: bytes, fragment: str) -> None:
    with pytest.raises(HttpError) as raised:
        build(im_pb2.CreateGroupRequest(), body=body)
    assert raised.value.code == 400 and raised.value.status == "INVALID_ARGUMENT"
    assert fragment in raised.value.message


def test_deep_nesting_is_a_400_not_a_crash() -> None:
    deep = b'{"content": "x", "metadata": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    with pytest.raises(HttpError) as raised:
        build(im_pb2.SendMessageRequest(), body=deep)
    assert raised.value.code == 400


def test_query_parameters_fill_scalars_by_either_name_with_types_checked() -> None:
    request = build(
        rpb.ListStepsRequest(),
        query=[("after_sequence", "7"), ("pageSize", "20"), ("run_id", "r")],
        path={"agent_id": "a"},
    )
    assert request == rpb.ListStepsRequest(agent_id="a", after_sequence=7, page_size=20, run_id="r")
    watch = build(rpb.WatchAgentRequest(), query=[("live_only", "true")])
    assert isinstance(watch, rpb.WatchAgentRequest) and watch.live_only is True


def test_repeated_query_parameters_repeat() -> None:
    request = build(rpb.WatchAgentsRequest(), query=[("agent_ids", "a"), ("agent_ids", "b")])
    assert isinstance(request, rpb.WatchAgentsRequest) and list(request.agent_ids) == ["a", "b"]


def test_enums_by_name_or_number() -> None:
    by_name = build(im_pb2.CreateMemberRequest(), query=[("kind", "MEMBER_KIND_AGENT")])
    by_number = build(im_pb2.CreateMemberRequest(), query=[("kind", "2")])
    assert by_name == by_number == im_pb2.CreateMemberRequest(kind=im_pb2.MEMBER_KIND_AGENT)


@pytest.mark.parametrize(
    ("query", "fragment"),
    [
        ([("page_size", "ten")], "expected a number"),
        ([("page_size", "99999999999")], "page_size"),
        ([("page_size", "1"), ("page_size", "2")], "more than once"),
        ([("pageSzie", "1")], "unknown parameter"),
        ([("after_sequence", "1.5")], "expected a number"),
    ],
)
def test_bad_query_parameters_are_400(query: list[tuple[str, str]], fragment: str) -> None:
    with pytest.raises(HttpError) as raised:
        build(rpb.ListStepsRequest(), query=query)
    assert raised.value.code == 400 and fragment in raised.value.message


def test_booleans_are_true_or_false() -> None:
    with pytest.raises(HttpError, match="true or false"):
        build(rpb.WatchAgentRequest(), query=[("live_only", "maybe")])


def test_query_parameters_cannot_name_message_fields() -> None:
    with pytest.raises(HttpError, match="scalar"):
        build(im_pb2.UpdateMemberRequest(), query=[("member", "x")])
    nested = build(im_pb2.UpdateMemberRequest(), query=[("member.display_name", "Ada")])
    assert isinstance(nested, im_pb2.UpdateMemberRequest) and nested.member.display_name == "Ada"


def test_responses_print_defaults_int64_as_strings_and_enums_by_name() -> None:
    state = im_pb2.MarkReadResponse(read_state=im_pb2.ReadState(group_id="g", unread_count=3))
    assert to_json(state) == {
        "readState": {"groupId": "g", "memberId": "", "lastReadMessageId": "", "unreadCount": "3"}
    }
    member = im_pb2.GetMemberResponse(member=im_pb2.Member(id="m", kind=im_pb2.MEMBER_KIND_AGENT))
    assert to_json(member)["member"]["kind"] == "MEMBER_KIND_AGENT"
    assert message_json(rpb.DeleteAgentResponse()) == "{}"
    assert message_json(im_pb2.Member(display_name="é")).count("é") == 1
