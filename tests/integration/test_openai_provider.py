"""OpenAIProvider through the real `openai` client, against a fake OpenAI-compatible server.

The fake (`tests.fake_openai`) speaks HTTP/1.1 on 127.0.0.1 with the
standard library only: each request takes the next scripted `Reply` (a
status, SSE chunks, an optional cut or stall) and is recorded, headers and
JSON body included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import traceback
import uuid
from collections.abc import AsyncIterator

import pytest

from services.runtime.adapters.llm.openai_provider import OpenAIProvider
from services.runtime.domain.errors import ContextTooLong, LLMRejected, LLMUnavailable
from services.runtime.domain.llm import (
    ChatMessage,
    Completion,
    CompletionRequest,
    ContentDelta,
    Delta,
    FinishReason,
    ModelSettings,
    ReasoningDelta,
    Role,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    Usage,
)
from tests.fake_openai import (
    FakeOpenAI,
    Reply,
    call_fragment,
    chunk,
    error_body,
    pieces,
    text_reply,
    usage_chunk,
)

SECRET = f"sk-test-{uuid.uuid4().hex}"
MAX_RETRIES = 3
TIMEOUT = 5.0


def user(text: str) -> CompletionRequest:
    return CompletionRequest(messages=[ChatMessage(role=Role.USER, content=text)])


async def collect(provider: OpenAIProvider, request: CompletionRequest) -> tuple[list[Delta], Completion]:
    """Every delta, then the one completion that must end the stream."""
    deltas: list[Delta] = []
    completions: list[Completion] = []
    async with asyncio.timeout(TIMEOUT):
        async for item in provider.stream(request):
            assert not completions, "nothing may follow the completion"
            if isinstance(item, Completion):
                completions.append(item)
            else:
                deltas.append(item)
    assert len(completions) == 1
    return deltas, completions[0]


async def deltas_until_error(
    provider: OpenAIProvider, request: CompletionRequest
) -> tuple[list[Delta | Completion], BaseException]:
    seen: list[Delta | Completion] = []
    async with asyncio.timeout(TIMEOUT):
        try:
            async for item in provider.stream(request):
                seen.append(item)
        except Exception as exc:
            return seen, exc
    raise AssertionError(f"no error; got {seen}")


@pytest.fixture
async def provider(fake: FakeOpenAI) -> AsyncIterator[OpenAIProvider]:
    llm = OpenAIProvider(
        base_url=fake.url,
        api_key=SECRET,
        model="fake-model",
        request_timeout=TIMEOUT,
        max_retries=MAX_RETRIES,
        backoff_base=0.001,
        backoff_cap=0.005,
    )
    yield llm
    await llm.aclose()


# Streaming and assembly


async def test_content_streams_delta_by_delta(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    text = "Hello from the fake server; this answer arrives three characters at a time."
    fake.script(text_reply(text))

    deltas, completion = await collect(provider, user("hi"))

    assert deltas == [ContentDelta(p) for p in pieces(text)]
    assert completion.message == ChatMessage(role=Role.ASSISTANT, content=text)
    assert completion.finish_reason is FinishReason.STOP
    assert completion.model == "fake-model-2025"
    assert completion.usage == Usage(input_tokens=10, output_tokens=5, cached_tokens=0)


@pytest.mark.parametrize("reasoning_field", ["reasoning_content", "reasoning"])
async def test_reasoning_becomes_reasoning_deltas(
    fake: FakeOpenAI, provider: OpenAIProvider, reasoning_field: str
) -> None:
    fake.script(
        Reply(
            chunks=[
                chunk(role="assistant", reasoning="Let me ", reasoning_field=reasoning_field),
                chunk(reasoning="think.", reasoning_field=reasoning_field),
                chunk(content="42"),
                chunk(finish="stop"),
            ]
        )
    )

    deltas, completion = await collect(provider, user("meaning?"))

    assert deltas == [ReasoningDelta("Let me "), ReasoningDelta("think."), ContentDelta("42")]
    assert completion.message.reasoning == "Let me think."
    assert completion.message.content == "42"


async def test_parallel_tool_calls_assemble_from_fragments(
    fake: FakeOpenAI, provider: OpenAIProvider
) -> None:
    first = json.dumps({"to": "bob", "content": "the build is green"})
    second = json.dumps({"query": "release notes", "limit": 5})
    fragments = [call_fragment(0, call_id="call_a", name="send_direct_message")]
    fragments += [call_fragment(0, arguments=p) for p in pieces(first, 4)]
    fragments += [call_fragment(1, call_id="call_b", name="search_messages")]
    fragments += [call_fragment(1, arguments=p) for p in pieces(second, 4)]
    fake.script(
        Reply(
            chunks=[
                chunk(role="assistant"),
                *(chunk(tool_calls=[f]) for f in fragments),
                chunk(finish="tool_calls"),
                usage_chunk(30, 20),
            ]
        )
    )

    deltas, completion = await collect(provider, user("tell bob and search"))

    assert all(isinstance(d, ToolCallDelta) for d in deltas)
    assert len(deltas) == len(fragments)
    assert completion.finish_reason is FinishReason.TOOL_CALLS
    assert completion.message.content is None
    assert completion.message.tool_calls == (
        ToolCall(id="call_a", name="send_direct_message", arguments=first),
        ToolCall(id="call_b", name="search_messages", arguments=second),
    )


async def test_tool_calls_interleaved_in_one_chunk(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake.script(
        Reply(
            chunks=[
                chunk(
                    tool_calls=[
                        call_fragment(0, call_id="c0", name="a"),
                        call_fragment(1, call_id="c1", name="b"),
                    ]
                ),
                chunk(tool_calls=[call_fragment(1, arguments='{"y"'), call_fragment(0, arguments='{"x"')]),
                chunk(tool_calls=[call_fragment(0, arguments=": 1}"), call_fragment(1, arguments=": 2}")]),
                chunk(finish="tool_calls"),
            ]
        )
    )

    _, completion = await collect(provider, user("two"))

    assert completion.message.tool_calls == (
        ToolCall(id="c0", name="a", arguments='{"x": 1}'),
        ToolCall(id="c1", name="b", arguments='{"y": 2}'),
    )


async def test_usage_includes_cached_tokens(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake.script(Reply(chunks=[chunk(content="ok"), chunk(finish="stop"), usage_chunk(1200, 7, cached=1024)]))

    _, completion = await collect(provider, user("hi"))

    assert completion.usage == Usage(input_tokens=1200, output_tokens=7, cached_tokens=1024)


async def test_usage_is_none_when_the_server_sends_none(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake.script(Reply(chunks=[chunk(content="ok", finish="stop")]))

    _, completion = await collect(provider, user("hi"))

    assert completion.usage is None
    assert completion.message.content == "ok"


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        ("stop", FinishReason.STOP),
        ("tool_calls", FinishReason.TOOL_CALLS),
        ("length", FinishReason.LENGTH),
        ("content_filter", FinishReason.CONTENT_FILTER),
        ("function_call", FinishReason.TOOL_CALLS),
        ("insufficient_system_resource", FinishReason.OTHER),
    ],
)
async def test_finish_reasons(
    fake: FakeOpenAI, provider: OpenAIProvider, wire: str, expected: FinishReason
) -> None:
    fake.script(Reply(chunks=[chunk(content="partial"), chunk(finish=wire), usage_chunk(3, 1)]))

    _, completion = await collect(provider, user("hi"))

    assert completion.finish_reason is expected


# What is sent


async def test_request_body_is_native_openai(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake.script(text_reply("done"))
    tool = ToolSpec(
        name="send_direct_message",
        description="Sends a direct message.",
        parameters={"type": "object", "properties": {"to": {"type": "string"}}, "required": ["to"]},
    )
    request = CompletionRequest(
        messages=[
            ChatMessage(role=Role.SYSTEM, content="You are Ada."),
            ChatMessage(role=Role.USER, content="tell bob hi", name="alice"),
            ChatMessage(
                role=Role.ASSISTANT,
                reasoning="not sent back",
                tool_calls=(ToolCall(id="call_1", name="send_direct_message", arguments='{"to": "bob"}'),),
            ),
            ChatMessage(role=Role.TOOL, content='{"ok": true}', tool_call_id="call_1"),
        ],
        tools=[tool],
        settings=ModelSettings(model="other-model", temperature=0.2, max_tokens=256),
    )

    await collect(provider, request)

    [received] = fake.requests
    assert received.path == "/v1/chat/completions"
    assert received.headers["authorization"] == f"Bearer {SECRET}"
    body = received.body
    assert body["model"] == "other-model"
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.2
    assert body["max_tokens"] == 256
    assert body["tools"] == [tool.to_openai()]
    assert body["messages"] == [
        {"role": "system", "content": "You are Ada."},
        # A sender's `name` goes only to OpenAI's own API: other servers may refuse it.
        {"role": "user", "content": "tell bob hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "send_direct_message", "arguments": '{"to": "bob"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"ok": true}', "tool_call_id": "call_1"},
    ]


async def test_unset_options_are_not_sent(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake.script(text_reply("done"))

    await collect(provider, user("hi"))

    body = fake.requests[0].body
    assert body["model"] == "fake-model"
    for absent in ("tools", "temperature", "max_tokens"):
        assert absent not in body


async def test_the_key_goes_only_to_the_default_endpoint(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    other = FakeOpenAI()
    await other.start()
    try:
        other.script(text_reply("from elsewhere"))
        request = CompletionRequest(
            messages=[ChatMessage(role=Role.USER, content="hi")],
            settings=ModelSettings(model="local", base_url=other.url + "/"),
        )

        _, completion = await collect(provider, request)
    finally:
        await other.stop()

    assert completion.message.content == "from elsewhere"
    assert fake.requests == []
    [received] = other.requests
    assert received.body["model"] == "local"
    assert SECRET not in received.headers["authorization"]


async def test_a_request_without_any_model_is_rejected_before_sending(fake: FakeOpenAI) -> None:
    llm = OpenAIProvider(base_url=fake.url, api_key=SECRET)
    try:
        with pytest.raises(LLMRejected, match="no model"):
            await collect(llm, user("hi"))
    finally:
        await llm.aclose()
    assert fake.requests == []


# Retries


async def test_429_is_retried(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake.script(
        Reply(429, body=error_body("slow down"), headers={"Retry-After": "0"}), text_reply("after the wait")
    )

    deltas, completion = await collect(provider, user("hi"))

    assert len(fake.requests) == 2
    assert completion.message.content == "after the wait"
    assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == "after the wait"


async def test_500_is_retried(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake.script(Reply(500), Reply(503), text_reply("recovered"))

    _, completion = await collect(provider, user("hi"))

    assert len(fake.requests) == 3
    assert completion.message.content == "recovered"


async def test_a_cut_before_any_delta_is_retried(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    # The role-only first chunk carries no delta, so nothing has been yielded.
    fake.script(
        Reply(chunks=[chunk(role="assistant", content=""), chunk(content="lost")], cut_after=1),
        text_reply("second try"),
    )

    deltas, completion = await collect(provider, user("hi"))

    assert len(fake.requests) == 2
    assert completion.message.content == "second try"
    assert ContentDelta("lost") not in deltas


async def test_a_stream_ending_early_without_deltas_is_retried(
    fake: FakeOpenAI, provider: OpenAIProvider
) -> None:
    fake.script(Reply(chunks=[chunk(role="assistant")]), text_reply("complete"))

    _, completion = await collect(provider, user("hi"))

    assert len(fake.requests) == 2
    assert completion.message.content == "complete"


async def test_an_error_event_before_deltas_is_retried(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    overloaded = {"error": {"message": "overloaded", "type": "server_error", "code": None}}
    fake.script(Reply(chunks=[overloaded]), text_reply("fine now"))

    _, completion = await collect(provider, user("hi"))

    assert len(fake.requests) == 2
    assert completion.message.content == "fine now"


@pytest.mark.parametrize(
    "error",
    [
        {"message": "tools[0].function.parameters is not a valid schema", "type": "invalid_request_error"},
        {"message": "the model 'x' does not exist", "code": 404},
    ],
)
async def test_an_error_event_that_blames_the_request_is_not_retried_and_says_why(
    fake: FakeOpenAI, provider: OpenAIProvider, error: dict[str, object]
) -> None:
    fake.script(Reply(chunks=[chunk(role="assistant"), {"error": error}]), text_reply("never"))

    _, failure = await deltas_until_error(provider, user("hi"))

    assert isinstance(failure, LLMRejected) and not isinstance(failure, ContextTooLong)
    assert str(error["message"]) in str(failure)
    assert len(fake.requests) == 1


async def test_llama_cpp_error_lines_in_the_stream_say_the_context_is_too_long(
    fake: FakeOpenAI, provider: OpenAIProvider
) -> None:
    # llama.cpp's server, over its window mid-stream: an `error:` line, not `data:`.
    line = {
        "code": 400,
        "message": "the request exceeds the available context size, try increasing it",
        "type": "exceed_context_size_error",
        "n_prompt_tokens": 4624,
        "n_ctx": 4096,
    }
    fake.script(
        Reply(chunks=[chunk(role="assistant")], raw=f"error: {json.dumps(line)}\n\n".encode(), done=False),
        text_reply("never"),
    )

    _, failure = await deltas_until_error(provider, user("hi"))

    assert isinstance(failure, ContextTooLong)
    assert (failure.window, failure.requested) == (4096, 4624)
    assert "exceeds the available context size" in str(failure)
    assert len(fake.requests) == 1


async def test_a_stalled_stream_times_out_and_is_retried(fake: FakeOpenAI) -> None:
    fake.script(Reply(chunks=[chunk(content="late", finish="stop")], delay=0.5), text_reply("prompt"))
    llm = OpenAIProvider(
        base_url=fake.url, model="m", request_timeout=0.05, backoff_base=0.001, backoff_cap=0.001
    )
    try:
        _, completion = await collect(llm, user("hi"))
    finally:
        await llm.aclose()

    assert len(fake.requests) == 2
    assert completion.message.content == "prompt"


async def test_a_cut_after_deltas_is_not_retried(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake.script(
        Reply(chunks=[chunk(content="one "), chunk(content="two "), chunk(content="three")], cut_after=2),
        text_reply("never asked for"),
    )

    seen, error = await deltas_until_error(provider, user("hi"))

    assert isinstance(error, LLMUnavailable)
    assert "stream cut after 2 deltas" in str(error)
    assert seen == [ContentDelta("one "), ContentDelta("two ")]
    assert len(fake.requests) == 1


async def test_an_end_without_finish_reason_after_deltas_is_unavailable(
    fake: FakeOpenAI, provider: OpenAIProvider
) -> None:
    fake.script(Reply(chunks=[chunk(content="half an ans")]))

    seen, error = await deltas_until_error(provider, user("hi"))

    assert isinstance(error, LLMUnavailable)
    assert "without a finish reason" in str(error)
    assert seen == [ContentDelta("half an ans")]


async def test_a_cut_after_the_finish_reason_keeps_the_completion(
    fake: FakeOpenAI, provider: OpenAIProvider
) -> None:
    fake.script(
        Reply(chunks=[chunk(content="all of it"), chunk(finish="stop"), usage_chunk(1, 1)], cut_after=2)
    )

    _, completion = await collect(provider, user("hi"))

    assert completion.message.content == "all of it"
    assert completion.usage is None
    assert len(fake.requests) == 1


async def test_repeated_500s_are_unavailable_after_the_retries(
    fake: FakeOpenAI, provider: OpenAIProvider
) -> None:
    down = Reply(500, body={"error": {"message": "the GPU is on fire", "type": "server_error"}})
    fake.script(*(down for _ in range(MAX_RETRIES + 1)), text_reply("too late"))

    seen, error = await deltas_until_error(provider, user("hi"))

    assert isinstance(error, LLMUnavailable)
    assert f"after {MAX_RETRIES + 1} attempts" in str(error)
    assert "HTTP 500: the GPU is on fire" in str(error)  # the endpoint's own reason
    assert seen == []
    assert len(fake.requests) == MAX_RETRIES + 1


async def test_an_unreachable_endpoint_is_unavailable() -> None:
    gone = FakeOpenAI()
    await gone.start()
    url = gone.url
    await gone.stop()
    llm = OpenAIProvider(base_url=url, model="m", max_retries=1, backoff_base=0.001, backoff_cap=0.001)
    try:
        with pytest.raises(LLMUnavailable, match="after 2 attempts: connection failed"):
            await collect(llm, user("hi"))
    finally:
        await llm.aclose()


# Rejections and the secret


async def test_401_is_rejected_at_once_without_revealing_the_key(
    fake: FakeOpenAI, provider: OpenAIProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fake.script(
        Reply(401, body=error_body(f"Incorrect API key provided: {SECRET}.")), text_reply("unreachable")
    )

    seen, error = await deltas_until_error(provider, user("hi"))

    assert isinstance(error, LLMRejected)
    assert seen == []
    assert len(fake.requests) == 1
    assert "HTTP 401" in str(error)
    assert "Incorrect API key provided: ***" in str(error)
    assert "fake-model" in str(error)
    rendered = "".join(traceback.format_exception(error))
    for text in (str(error), repr(error), rendered, caplog.text, repr(provider), str(provider)):
        assert SECRET not in text


@pytest.mark.parametrize("status", [400, 403, 404, 422])
async def test_client_errors_are_rejected_at_once(
    fake: FakeOpenAI, provider: OpenAIProvider, status: int
) -> None:
    fake.script(Reply(status, body=error_body("The model `nope` does not exist")), text_reply("unreachable"))

    with pytest.raises(LLMRejected, match=f"HTTP {status}: The model `nope` does not exist"):
        await collect(provider, user("hi"))

    assert len(fake.requests) == 1


async def test_retry_logs_do_not_reveal_the_key(
    fake: FakeOpenAI, provider: OpenAIProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fake.script(Reply(503, body=error_body(f"key {SECRET} overloaded")), text_reply("ok"))

    await collect(provider, user("hi"))

    assert "retrying" in caplog.text
    assert SECRET not in caplog.text


# Cancellation and lifecycle


async def test_cancelling_the_consumer_closes_the_request(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake.script(Reply(chunks=[chunk(role="assistant", content="first"), chunk(content=" second")], hold=True))
    received = asyncio.Event()

    async def consume() -> None:
        async for _ in provider.stream(user("a long answer please")):
            received.set()

    task = asyncio.create_task(consume())
    async with asyncio.timeout(TIMEOUT):
        await received.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await fake.client_left.wait()


async def test_breaking_out_of_the_stream_closes_the_request(
    fake: FakeOpenAI, provider: OpenAIProvider
) -> None:
    fake.script(Reply(chunks=[chunk(content="first")], hold=True))

    async with asyncio.timeout(TIMEOUT):
        items = provider.stream(user("hi"))
        assert await anext(items) == ContentDelta("first")
        await items.aclose()  # type: ignore[attr-defined]
        await fake.client_left.wait()


async def test_aclose_is_idempotent_and_clients_come_back(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake.script(text_reply("one"), text_reply("two"))

    await collect(provider, user("hi"))
    await provider.aclose()
    await provider.aclose()
    _, completion = await collect(provider, user("again"))

    assert completion.message.content == "two"


# Context too long


@pytest.mark.parametrize(
    ("body", "window", "requested"),
    [
        (  # OpenAI
            {
                "error": {
                    "message": "This model's maximum context length is 4096 tokens. However, your messages"
                    " resulted in 5210 tokens. Please reduce the length of the messages.",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            },
            4096,
            5210,
        ),
        (  # llama.cpp's server
            {
                "error": {
                    "code": 400,
                    "message": "the request exceeds the available context size, try increasing it",
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": 5000,
                    "n_ctx": 4096,
                }
            },
            4096,
            5000,
        ),
        ({"error": {"message": "prompt is too long: 210000 tokens > 200000 maximum"}}, None, None),
        (  # llama-cpp-python's server
            {"error": {"message": "Requested tokens (4624) exceed context window of 4096"}},
            4096,
            4624,
        ),
    ],
)
async def test_a_request_over_the_context_window_is_context_too_long_with_its_numbers(
    fake: FakeOpenAI,
    provider: OpenAIProvider,
    body: dict[str, object],
    window: int | None,
    requested: int | None,
) -> None:
    fake.script(Reply(400, body=body))

    _, error = await deltas_until_error(provider, user("hi"))

    assert isinstance(error, ContextTooLong)
    assert (error.window, error.requested) == (window, requested)
    assert len(fake.requests) == 1  # not retried by the adapter: the runtime shrinks first


async def test_another_400_is_not_context_too_long(fake: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake.script(Reply(400, body=error_body("unknown parameter: temperature_x")))
    _, error = await deltas_until_error(provider, user("hi"))
    assert isinstance(error, LLMRejected) and not isinstance(error, ContextTooLong)
