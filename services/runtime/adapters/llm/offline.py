"""The built-in offline model: used when no LLM endpoint is configured.

`OfflineModel` needs no network and has no randomness: the same request
always streams the same deltas. It is enough to watch an agent work end to
end (think, call a tool, read the result, answer) without an API key, and
for tests. What it does with a `CompletionRequest`:

1. It first streams a short thought (`ReasoningDelta`s) saying what it will do.
2. If the conversation ends with tool results (one or more `tool` messages),
   it answers `Done: <result>` (one line per result, each cut to 200
   characters) and finishes with `stop`.
3. Otherwise it reads the latest user message:

   * `tell @<name> <text>`, `message @<name> <text>` or `ask @<name> <text>`
     (any case; a `:` or `,` may follow the name), when the request offers a
     `send_direct_message` tool: it calls that tool with the JSON arguments
     `{"to": "<name>", "content": "<text>"}` and finishes with `tool_calls`;
   * a text containing `list groups` or `what groups`, when the request
     offers a `list_groups` tool: it calls `list_groups` with `{}` and
     finishes with `tool_calls`;
   * anything else: it answers `(offline model) You said: <text>` (the
     text cut to 200 characters) and finishes with `stop`.

   Who sent an input and where (`ChatMessage.prefix`, `Ada: `) is
   not part of the text, nor the envelope of inputs stored before prefixes
   (`[chat | group_id=...] sender (member_id=...): `).

Text is streamed a few characters per delta and tool arguments in several
fragments, as a real model would. Tool call ids are `call_<n>`, where n
counts the tool calls already in the conversation, so they do not repeat
within one. Usage counts words (input: every message; output: the thought,
the answer and the arguments), never zero. The model is named `offline`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

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
    ToolCallDelta,
    Usage,
)
from services.runtime.service_layer.llm_port import LLM

MODEL_NAME = "offline"
_ECHO = "(offline model) You said: "
SEND_DIRECT_MESSAGE = "send_direct_message"
LIST_GROUPS = "list_groups"

_ENVELOPE = re.compile(r"^\[[^\]\n]*\][^\n]*?\(member_id=[0-9a-fA-F-]+\): ")
_INSTRUCTION = re.compile(
    r"\b(?:tell|message|ask)\s+@(?P<name>[^\s,:;]+)[\s,:;]+(?P<text>\S.*)",
    re.IGNORECASE | re.DOTALL,
)
_LIST_GROUPS = re.compile(r"\b(?:list\s+(?:my\s+|your\s+|the\s+)?|what\s+)groups\b", re.IGNORECASE)
_PREVIEW = 200


@dataclass(frozen=True, slots=True)
class _Call:
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class _Plan:
    """What the model will say: a thought, then an answer or a tool call."""

    thought: str
    content: str = ""
    call: _Call | None = None


class OfflineModel(LLM):
    """A deterministic stand-in model; see the module docstring for what it says.

    Args:
        chunk_size: Characters per streamed text delta.
        yield_between_chunks: Let other tasks run between deltas, so that a
            stream interleaves with the rest of the program as a real one does.
    """

    def __init__(self, *, chunk_size: int = 4, yield_between_chunks: bool = True) -> None:
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        self._chunk_size = chunk_size
        self._yield = yield_between_chunks

    def __repr__(self) -> str:
        return f"OfflineModel(chunk_size={self._chunk_size})"

    async def stream(self, request: CompletionRequest) -> AsyncIterator[Delta | Completion]:
        plan = _plan(request)
        assembler = CompletionAssembler()
        for delta in self._deltas(plan, request.messages):
            assembler.add(delta)
            yield delta
            if self._yield:
                await asyncio.sleep(0)
        output = " ".join([plan.thought, plan.content, plan.call.arguments if plan.call else ""])
        yield Completion(
            message=assembler.message(),
            finish_reason=FinishReason.TOOL_CALLS if plan.call else FinishReason.STOP,
            usage=Usage(input_tokens=max(1, _input_words(request.messages)), output_tokens=_words(output)),
            model=MODEL_NAME,
        )

    def _deltas(self, plan: _Plan, messages: Sequence[ChatMessage]) -> Iterator[Delta]:
        for piece in self._pieces(plan.thought):
            yield ReasoningDelta(piece)
        for piece in self._pieces(plan.content):
            yield ContentDelta(piece)
        if plan.call is not None:
            call_id = f"call_{1 + sum(len(m.tool_calls) for m in messages)}"
            yield ToolCallDelta(index=0, id=call_id, name=plan.call.name)
            # Arguments come in larger fragments than text, as real models send them.
            size = self._chunk_size * 2
            for start in range(0, len(plan.call.arguments), size):
                yield ToolCallDelta(index=0, arguments=plan.call.arguments[start : start + size])

    def _pieces(self, text: str) -> Iterator[str]:
        for start in range(0, len(text), self._chunk_size):
            yield text[start : start + self._chunk_size]


def _plan(request: CompletionRequest) -> _Plan:
    messages = request.messages
    results: list[str] = []
    for message in reversed(messages):
        if message.role is not Role.TOOL:
            break
        results.append(message.content or "")
    if results:
        lines = [f"Done: {result[:_PREVIEW]}" for result in reversed(results)]
        return _Plan(thought="The tool has run; I will report its result.", content="\n".join(lines))

    text = next((m.content or "" for m in reversed(messages) if m.role is Role.USER), "").strip()
    # Inputs stored before prefixes read "[chat | group_id=...] sender (member_id=...): text".
    text = _ENVELOPE.sub("", text, count=1)
    tools = {tool.name for tool in request.tools}
    instruction = _INSTRUCTION.search(text)
    if instruction and SEND_DIRECT_MESSAGE in tools:
        name, content = instruction["name"], instruction["text"].strip()
        arguments = json.dumps({"to": name, "content": content}, ensure_ascii=False)
        return _Plan(
            thought=f"I am asked to message {name}; I will call {SEND_DIRECT_MESSAGE}.",
            call=_Call(SEND_DIRECT_MESSAGE, arguments),
        )
    if _LIST_GROUPS.search(text) and LIST_GROUPS in tools:
        return _Plan(
            thought=f"I am asked about my groups; I will call {LIST_GROUPS}.", call=_Call(LIST_GROUPS, "{}")
        )
    # Another offline agent's echo is echoed as what it echoed, not nested in
    # it: two agents that answer each other keep saying the same thing (and
    # the names they mention) instead of pushing them past the preview.
    while text.startswith(_ECHO):
        text = text[len(_ECHO) :]
    return _Plan(
        thought="Nothing to do but answer; I will echo the message.",
        content=f"{_ECHO}{text[:_PREVIEW]}",
    )


def _words(text: str) -> int:
    return len(text.split())


def _input_words(messages: Sequence[ChatMessage]) -> int:
    return sum(_words(m.content or "") + sum(_words(c.arguments) + 1 for c in m.tool_calls) for m in messages)
