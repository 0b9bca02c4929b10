"""The IM's pure rules: validation, limits, fingerprints and page tokens."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import pytest

from services.im.domain import rules
from services.im.domain.errors import InvalidRequest, LimitExceeded
from services.im.domain.model import ContentType

LIMITS = rules.Limits()


# -- ids ------------------------------------------------------------------


def test_parse_id_accepts_a_uuid() -> None:
    value = uuid.uuid4()
    assert rules.parse_id(str(value), "group_id") == value


@pytest.mark.parametrize("raw", ["", "nope", "1234", "0e25b00a-04a2-4059-ae28-a2dc1ea22ed", "x" * 500])
def test_parse_id_refuses_empty_and_malformed_ids(raw: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        rules.parse_id(raw, "group_id")
    assert "group_id" in caught.value.message
    # A long bad value is quoted only in part.
    assert len(caught.value.message) < 200


def test_parse_optional_id_treats_empty_as_absent() -> None:
    assert rules.parse_optional_id("", "reply_to") is None
    value = uuid.uuid4()
    assert rules.parse_optional_id(str(value), "reply_to") == value
    with pytest.raises(InvalidRequest):
        rules.parse_optional_id("bad", "reply_to")


def test_parse_ids_keeps_first_seen_order_and_drops_repeats() -> None:
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    assert rules.parse_ids([str(b), str(a), str(b), str(c), str(a)], "member_ids") == (b, a, c)
    assert rules.parse_ids([], "member_ids") == ()
    with pytest.raises(InvalidRequest):
        rules.parse_ids([str(a), ""], "member_ids")


# -- names, avatars, request ids --------------------------------------------


def test_check_name_strips_and_enforces_the_limit() -> None:
    assert rules.check_name("  team  ", "name", required=True) == "team"
    assert rules.check_name("x" * rules.MAX_NAME_CHARS, "name", required=True) == "x" * rules.MAX_NAME_CHARS
    with pytest.raises(InvalidRequest):
        rules.check_name("x" * (rules.MAX_NAME_CHARS + 1), "name", required=True)
    # Surrounding blanks do not count against the limit.
    assert len(rules.check_name(" " + "x" * rules.MAX_NAME_CHARS + " ", "name", required=False)) == (
        rules.MAX_NAME_CHARS
    )


def test_check_name_required_refuses_blank() -> None:
    with pytest.raises(InvalidRequest):
        rules.check_name("   ", "name", required=True)
    assert rules.check_name("   ", "name", required=False) == ""


def test_check_avatar_limit() -> None:
    assert rules.check_avatar("a" * rules.MAX_AVATAR_CHARS) == "a" * rules.MAX_AVATAR_CHARS
    with pytest.raises(InvalidRequest):
        rules.check_avatar("a" * (rules.MAX_AVATAR_CHARS + 1))


def test_check_request_id() -> None:
    assert rules.check_request_id("") is None
    assert rules.check_request_id("r-1") == "r-1"
    assert rules.check_request_id("r" * rules.MAX_REQUEST_ID_CHARS) == "r" * rules.MAX_REQUEST_ID_CHARS
    with pytest.raises(InvalidRequest):
        rules.check_request_id("r" * (rules.MAX_REQUEST_ID_CHARS + 1))


# -- messages ---------------------------------------------------------------


def check(content: str = "hi", mentions: int = 0, metadata: dict[str, Any] | None = None) -> None:
    limits = rules.Limits(max_content_bytes=10, max_mentions=2, max_metadata_bytes=20)
    rules.check_message(
        content=content,
        mentions=[uuid.uuid4() for _ in range(mentions)],
        metadata=metadata or {},
        limits=limits,
    )


def test_check_message_accepts_content_at_the_limits() -> None:
    check(content="x" * 10, mentions=2, metadata={"k": "v" * 12})  # {"k":"vvvvvvvvvvvv"} is 20 bytes


@pytest.mark.parametrize("content", ["", "   ", "\n\t"])
def test_check_message_refuses_empty_content(content: str) -> None:
    with pytest.raises(InvalidRequest):
        check(content=content)


def test_check_message_counts_content_in_utf8_bytes() -> None:
    check(content="é" * 5)  # 10 bytes
    with pytest.raises(InvalidRequest):
        check(content="é" * 6)  # 6 characters, 12 bytes


def test_check_message_refuses_too_many_mentions() -> None:
    with pytest.raises(InvalidRequest):
        check(mentions=3)


def test_check_message_refuses_large_metadata() -> None:
    with pytest.raises(InvalidRequest):
        check(metadata={"k": "v" * 13})


def test_check_content_alone() -> None:
    limits = rules.Limits(max_content_bytes=3)
    rules.check_content("abc", limits)
    with pytest.raises(InvalidRequest):
        rules.check_content("abcd", limits)


def test_group_size_over_the_limit_is_limit_exceeded() -> None:
    limits = rules.Limits(max_group_members=3)
    rules.check_group_size(3, limits)
    with pytest.raises(LimitExceeded):
        rules.check_group_size(4, limits)


# -- fingerprints and keys --------------------------------------------------


def fingerprint(**changes: Any) -> str:
    fields: dict[str, Any] = {
        "group_id": uuid.UUID(int=1),
        "content_type": ContentType.TEXT,
        "content": "hello",
        "mentions": (uuid.UUID(int=2),),
        "reply_to": None,
        "metadata": {"a": 1, "b": [1, 2]},
    }
    fields.update(changes)
    return rules.message_fingerprint(**fields)


def test_message_fingerprint_is_equal_for_equal_payloads() -> None:
    assert fingerprint() == fingerprint()
    # Key order in metadata does not matter: the JSON is canonical.
    assert fingerprint(metadata={"b": [1, 2], "a": 1}) == fingerprint()


@pytest.mark.parametrize(
    "changes",
    [
        {"group_id": uuid.UUID(int=9)},
        {"content_type": ContentType.CODE},
        {"content": "hello!"},
        {"mentions": ()},
        {"mentions": (uuid.UUID(int=3),)},
        {"reply_to": uuid.UUID(int=4)},
        {"metadata": {"a": 1, "b": [2, 1]}},
        {"metadata": {}},
    ],
)
def test_message_fingerprint_differs_for_any_other_payload(changes: dict[str, Any]) -> None:
    assert fingerprint(**changes) != fingerprint()


def test_request_fingerprint() -> None:
    assert rules.request_fingerprint(op="x", name="a") == rules.request_fingerprint(name="a", op="x")
    assert rules.request_fingerprint(op="x", name="a") != rules.request_fingerprint(op="x", name="b")
    assert rules.request_fingerprint(op="x", name="a") != rules.request_fingerprint(op="y", name="a")


def test_direct_key_is_symmetric_and_distinct_per_pair() -> None:
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    assert rules.direct_key(a, b) == rules.direct_key(b, a)
    assert rules.direct_key(a, b) != rules.direct_key(a, c)
    low, high = sorted((a, b))
    assert rules.direct_key(a, b) == f"{low}:{high}"


# -- paging -------------------------------------------------------------------


def test_page_size_defaults_and_clamps() -> None:
    limits = rules.Limits(default_page_size=10, max_page_size=50)
    assert rules.page_size(0, limits) == 10
    assert rules.page_size(1, limits) == 1
    assert rules.page_size(50, limits) == 50
    assert rules.page_size(51, limits) == 50
    assert rules.page_size(10**9, limits) == 50


def test_page_size_with_an_explicit_maximum() -> None:
    limits = rules.Limits(default_page_size=10, max_page_size=50)
    assert rules.page_size(0, limits, maximum=5) == 5
    assert rules.page_size(100, limits, maximum=80) == 80
    assert rules.page_size(3, limits, maximum=80) == 3


@pytest.mark.parametrize("requested", [-1, -100])
def test_page_size_refuses_negatives(requested: int) -> None:
    with pytest.raises(InvalidRequest):
        rules.page_size(requested, LIMITS)


def test_page_token_round_trip() -> None:
    fields = {"group": str(uuid.uuid4()), "direction": "before", "cursor": "é/+=?"}
    token = rules.encode_page_token(fields)
    assert "=" not in token
    assert token.isascii()
    assert rules.decode_page_token(token, set(fields)) == fields


def raw_token(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    "token",
    [
        "a",  # impossible base64 length
        "!!!!",
        raw_token("not json"),
        raw_token('["after", "x"]'),
        raw_token('{"after": 5}'),
        raw_token('{"after": "x", "extra": "y"}'),
        raw_token("{}"),
        base64.urlsafe_b64encode(b"\xff\xfe\xfd").decode(),  # not UTF-8
        raw_token("[" * 100_000),  # nesting too deep for the JSON parser
    ],
)
def test_decode_page_token_refuses_malformed_tokens(token: str) -> None:
    with pytest.raises(InvalidRequest):
        rules.decode_page_token(token, {"after"})


def test_decode_page_token_refuses_a_token_of_another_kind() -> None:
    token = rules.encode_page_token({"activity": "2026", "group": "g"})
    with pytest.raises(InvalidRequest):
        rules.decode_page_token(token, {"after"})
