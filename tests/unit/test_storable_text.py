"""Text the runtime stores that no client sent (model output, tool results) is made storable."""

from __future__ import annotations

from services.runtime.domain.llm import (
    ChatMessage,
    ContentDelta,
    Role,
    ToolCall,
    ToolCallDelta,
    storable_delta,
    storable_message,
    storable_text,
)

FFFD = "\ufffd"


def test_ordinary_text_is_returned_as_it_is() -> None:
    text = "héllo 👋 世界"
    assert storable_text(text) is text


def test_nul_and_lone_surrogates_become_replacement_characters() -> None:
    assert storable_text("a\x00b") == f"a{FFFD}b"
    assert storable_text("\ud800 and \udfff") == f"{FFFD} and {FFFD}"
    assert storable_text("\udc00\ud800") == FFFD * 2
    assert storable_text("\x00").encode() == FFFD.encode()


def test_a_split_surrogate_pair_becomes_its_character() -> None:
    assert storable_text("\ud83d\ude00") == "😀"


def test_every_text_field_of_a_message_is_made_storable() -> None:
    message = ChatMessage(
        role=Role.ASSISTANT,
        content="c\x00",
        reasoning="r\ud800",
        tool_calls=(ToolCall(id="i\x00", name="n\x00", arguments='{"a": "\x00"}'),),
        tool_call_id=None,
        name="x\x00",
    )
    clean = storable_message(message)
    assert clean.content == f"c{FFFD}" and clean.reasoning == f"r{FFFD}" and clean.name == f"x{FFFD}"
    assert clean.tool_calls == (ToolCall(id=f"i{FFFD}", name=f"n{FFFD}", arguments=f'{{"a": "{FFFD}"}}'),)
    assert clean.tool_call_id is None
    ordinary = ChatMessage(role=Role.USER, content="fine")
    assert storable_message(ordinary) is ordinary


def test_deltas_are_made_storable_as_their_step_will_be() -> None:
    assert storable_delta(ContentDelta("a\x00")) == ContentDelta(f"a{FFFD}")
    assert storable_delta(ToolCallDelta(0, id=None, name="n\ud800", arguments="\x00")) == ToolCallDelta(
        0, id=None, name=f"n{FFFD}", arguments=FFFD
    )
