"""The built-in offline model: what it answers, that it streams, that it repeats itself."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence

import pytest

from services.runtime.adapters.llm.offline import OfflineModel
from services.runtime.domain.llm import (
    ChatMessage,
    Completion,
    CompletionAssembler,
    CompletionRequest,
    ContentDelta,
    Delta,
    FinishReason,
    ReasoningDelta,
    Role,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
)

ANY_ARGS = {"type": "object", "properties": {}}
SEND = ToolSpec(name="send_direct_message", description="Sends a direct message.", parameters=ANY_ARGS)
LIST = ToolSpec(name="list_groups", description="Lists my groups.", parameters=ANY_ARGS)
TOOLS = (SEND, LIST)


def request(*messages: ChatMessage, tools: Sequence[ToolSpec] = TOOLS) -> CompletionRequest:
    return CompletionRequest(messages=messages, tools=tools)


def user(text: str) -> ChatMessage:
    return ChatMessage(role=Role.USER, content=text)


async def run(req: CompletionRequest, model: OfflineModel | None = None) -> tuple[list[Delta], Completion]:
    deltas: list[Delta] = []
    completions: list[Completion] = []
    async with asyncio.timeout(5):
        async for item in (model or OfflineModel()).stream(req):
            assert not completions, "nothing may follow the completion"
            if isinstance(item, Completion):
                completions.append(item)
            else:
                deltas.append(item)
    [completion] = completions
    return deltas, completion


def text_of(deltas: Sequence[Delta], kind: type[ContentDelta] | type[ReasoningDelta]) -> str:
    return "".join(d.text for d in deltas if isinstance(d, kind))


async def test_plain_text_is_echoed() -> None:
    deltas, completion = await run(request(user("What is the weather like?")))

    assert completion.message.content == "(offline model) You said: What is the weather like?"
    assert completion.message.tool_calls == ()
    assert completion.finish_reason is FinishReason.STOP
    assert completion.model == "offline"
    assert text_of(deltas, ContentDelta) == completion.message.content


async def test_a_long_text_is_echoed_in_part() -> None:
    text = "word " * 100

    _, completion = await run(request(user(text)))

    assert completion.message.content == f"(offline model) You said: {text.strip()[:200]}"


async def test_another_offline_agents_echo_is_echoed_without_nesting() -> None:
    said = "(offline model) You said: (offline model) You said: @ada @bea hello"

    _, completion = await run(request(user(said)))

    assert completion.message.content == "(offline model) You said: @ada @bea hello"


async def test_it_thinks_first() -> None:
    deltas, completion = await run(request(user("hello")))

    first_content = next(i for i, d in enumerate(deltas) if isinstance(d, ContentDelta))
    assert all(isinstance(d, ReasoningDelta) for d in deltas[:first_content])
    assert completion.message.reasoning
    assert "echo" in completion.message.reasoning


async def test_text_streams_in_small_pieces() -> None:
    deltas, _ = await run(
        request(user("a fairly long message to be streamed back")), OfflineModel(chunk_size=3)
    )

    contents = [d for d in deltas if isinstance(d, ContentDelta)]
    assert len(contents) > 10
    assert all(len(d.text) <= 3 for d in contents)


async def test_the_latest_user_message_is_the_one_answered() -> None:
    _, completion = await run(
        request(
            ChatMessage(role=Role.SYSTEM, content="You are Ada."),
            user("first"),
            ChatMessage(role=Role.ASSISTANT, content="(offline model) You said: first"),
            user("second"),
        )
    )

    assert completion.message.content == "(offline model) You said: second"


@pytest.mark.parametrize(
    ("text", "to", "content"),
    [
        ("tell @bob the build is green", "bob", "the build is green"),
        ("Please MESSAGE @carol: lunch at noon?", "carol", "lunch at noon?"),
        ("ask @dave, can you review PR 12", "dave", "can you review PR 12"),
        ("tell @李雷 你好", "李雷", "你好"),
    ],
)
async def test_an_instruction_to_message_someone_calls_send_direct_message(
    text: str, to: str, content: str
) -> None:
    deltas, completion = await run(request(user(text)))

    assert completion.finish_reason is FinishReason.TOOL_CALLS
    assert completion.message.content is None
    [call] = completion.message.tool_calls
    assert call.name == "send_direct_message"
    assert call.id == "call_1"
    assert json.loads(call.arguments) == {"to": to, "content": content}
    fragments = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert len([f for f in fragments if f.arguments]) >= 3
    assert all(f.index == 0 for f in fragments)


async def test_without_the_tool_an_instruction_is_only_echoed() -> None:
    _, completion = await run(request(user("tell @bob hi"), tools=[LIST]))

    assert completion.finish_reason is FinishReason.STOP
    assert completion.message.content == "(offline model) You said: tell @bob hi"


@pytest.mark.parametrize("text", ["list groups", "What groups am I in?", "please list my groups"])
async def test_asking_about_groups_calls_list_groups(text: str) -> None:
    _, completion = await run(request(user(text)))

    assert completion.finish_reason is FinishReason.TOOL_CALLS
    assert completion.message.tool_calls == (ToolCall(id="call_1", name="list_groups", arguments="{}"),)


async def test_without_list_groups_the_question_is_echoed() -> None:
    _, completion = await run(request(user("list groups"), tools=[SEND]))

    assert completion.finish_reason is FinishReason.STOP


async def test_tool_results_are_reported() -> None:
    call = ToolCall(id="call_1", name="send_direct_message", arguments='{"to": "bob", "content": "hi"}')
    result = json.dumps({"message_id": "m-1", "status": "sent"}) + "x" * 300
    deltas, completion = await run(
        request(
            user("tell @bob hi"),
            ChatMessage(role=Role.ASSISTANT, tool_calls=(call,)),
            ChatMessage(role=Role.TOOL, content=result, tool_call_id="call_1"),
        )
    )

    assert completion.finish_reason is FinishReason.STOP
    assert completion.message.content == f"Done: {result[:200]}"
    assert completion.message.tool_calls == ()
    assert text_of(deltas, ContentDelta) == completion.message.content


async def test_several_tool_results_are_reported_in_order() -> None:
    calls = (ToolCall(id="call_1", name="a", arguments="{}"), ToolCall(id="call_2", name="b", arguments="{}"))
    _, completion = await run(
        request(
            user("do both"),
            ChatMessage(role=Role.ASSISTANT, tool_calls=calls),
            ChatMessage(role=Role.TOOL, content="first result", tool_call_id="call_1"),
            ChatMessage(role=Role.TOOL, content="second result", tool_call_id="call_2"),
        )
    )

    assert completion.message.content == "Done: first result\nDone: second result"


async def test_tool_call_ids_do_not_repeat_within_a_conversation() -> None:
    earlier = ToolCall(id="call_1", name="list_groups", arguments="{}")
    _, completion = await run(
        request(
            user("list groups"),
            ChatMessage(role=Role.ASSISTANT, tool_calls=(earlier,)),
            ChatMessage(role=Role.TOOL, content="[]", tool_call_id="call_1"),
            ChatMessage(role=Role.ASSISTANT, content="Done: []"),
            user("tell @bob hello"),
        )
    )

    [call] = completion.message.tool_calls
    assert call.id == "call_2"


async def test_the_same_request_streams_the_same_deltas() -> None:
    for req in (request(user("hello there")), request(user("tell @bob hi")), request(user("list groups"))):
        first = await run(req)
        second = await run(req)
        assert first == second


async def test_the_completion_is_the_assembly_of_the_deltas() -> None:
    for req in (request(user("hello there")), request(user("tell @bob hi"))):
        deltas, completion = await run(req)
        assembler = CompletionAssembler()
        for delta in deltas:
            assembler.add(delta)
        assert completion.message == assembler.message()


async def test_usage_counts_words() -> None:
    _, completion = await run(request(user("one two three four")))

    assert completion.usage is not None
    assert completion.usage.input_tokens == 4
    assert completion.usage.output_tokens > 4
    assert completion.usage.cached_tokens == 0


async def test_an_empty_conversation_still_completes() -> None:
    _, completion = await run(request())

    assert completion.finish_reason is FinishReason.STOP
    assert completion.usage is not None
    assert completion.usage.input_tokens >= 1


async def test_streams_interleave_with_other_tasks() -> None:
    order: list[str] = []

    async def consume(name: str) -> None:
        async for item in OfflineModel().stream(request(user(f"message from {name}"))):
            if not isinstance(item, Completion):
                order.append(name)

    async with asyncio.timeout(5):
        await asyncio.gather(consume("a"), consume("b"))

    first_b = order.index("b")
    assert "a" in order[first_b:], "the two streams should have interleaved"


async def test_who_sent_an_input_and_where_is_not_echoed() -> None:
    said = ChatMessage(role=Role.USER, content="hi there", prefix="Ada: ")
    stored_before_prefixes = ChatMessage(
        role=Role.USER,
        content=f"[direct chat | group_id={uuid.uuid4()}] Ada (member_id={uuid.uuid4()}): hi there",
    )
    for message in (said, stored_before_prefixes):
        items = [item async for item in OfflineModel().stream(CompletionRequest(messages=[message]))]
        completion = items[-1]
        assert isinstance(completion, Completion)
        assert completion.message.content == "(offline model) You said: hi there"
