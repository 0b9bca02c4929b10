"""What the runtime needs to know about LLMs: native chat messages, streamed
deltas and their assembly, as plain data. No I/O.

Messages are the OpenAI chat format ("native"): a step of an agent is one of
these, and the context of a completion is the ordered steps, unconverted.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any


class Role(enum.StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call requested by the model; `arguments` is JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One native chat message. `reasoning` is the model's thinking
    (`reasoning_content`); it is kept and shown but not sent back."""

    role: Role
    content: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    # Sent before `content` (never stored with it): who said an input, and where.
    prefix: str = ""

    def to_openai(self, *, user_names: bool = False) -> dict[str, Any]:
        """The message as the chat completions API takes it. A user message's
        `name` (its sender) is sent only with `user_names`: OpenAI's own API
        shows it to the model, where other servers may ignore it or refuse it
        (the sender's name is in the text anyway)."""
        content = self.prefix + self.content if self.prefix and self.content is not None else self.content
        out: dict[str, Any] = {"role": self.role.value, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if (
            self.name is not None
            and self.role is not Role.TOOL
            and (user_names or self.role is not Role.USER)
        ):
            out["name"] = self.name
        return out


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool as the model sees it: a name, what it does, a JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """Which model to call and how. An empty base_url means the default endpoint
    (from the environment), or the built-in offline model when there is none."""

    model: str = ""
    base_url: str = ""
    temperature: float | None = None
    max_tokens: int | None = None
    # The model's context window in tokens; None: known by the model's name,
    # else the runtime's OPENAI_CONTEXT_TOKENS.
    context_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    messages: Sequence[ChatMessage]
    tools: Sequence[ToolSpec] = ()
    settings: ModelSettings = field(default_factory=ModelSettings)


# Streamed pieces of a completion, in the order the model produced them.


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A fragment of tool call `index`: id and name come once, arguments in pieces."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


Delta = ContentDelta | ReasoningDelta | ToolCallDelta


class FinishReason(enum.StrEnum):
    STOP = "stop"
    TOOL_CALLS = "tool_calls"
    LENGTH = "length"
    CONTENT_FILTER = "content_filter"
    OTHER = "other"

    @classmethod
    def parse(cls, value: str | None) -> FinishReason:
        if value == "function_call":
            return cls.TOOL_CALLS
        try:
            return cls(value or "stop")
        except ValueError:
            return cls.OTHER


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    # Counted by the runtime: the endpoint reported none.
    estimated: bool = False


@dataclass(frozen=True, slots=True)
class Completion:
    """The end of a stream: the assembled assistant message and how it ended."""

    message: ChatMessage
    finish_reason: FinishReason
    usage: Usage | None = None
    model: str = ""


class CompletionAssembler:
    """Joins streamed deltas into the assistant message (tool calls by index)."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}

    def add(self, delta: Delta) -> None:
        match delta:
            case ContentDelta(text=text):
                self._content.append(text)
            case ReasoningDelta(text=text):
                self._reasoning.append(text)
            case ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments):
                call = self._calls.setdefault(index, {"id": None, "name": None, "arguments": []})
                if call_id:
                    call["id"] = call_id
                if name:
                    call["name"] = name
                call["arguments"].append(arguments)

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    def message(self) -> ChatMessage:
        calls = tuple(
            ToolCall(
                id=call["id"] or f"call_{index}",
                name=call["name"] or "",
                arguments="".join(call["arguments"]) or "{}",
            )
            for index, call in sorted(self._calls.items())
        )
        return ChatMessage(
            role=Role.ASSISTANT,
            content=self.content or None,
            reasoning=self.reasoning or None,
            tool_calls=calls,
        )


# Text no database stores: NUL (PostgreSQL's text refuses it) and UTF-16
# surrogates (not UTF-8). A model may emit either, as "\u0000" or "\ud800"
# in its JSON, and a tool may return either.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
REPLACEMENT_CHARACTER = "\ufffd"


def storable_text(text: str) -> str:
    """`text` as any database stores it: NUL and lone surrogates become U+FFFD.

    A high and a low surrogate side by side (a character split where a
    stream was cut into pieces) become the character they encode.
    """
    if _UNSTORABLE.search(text) is None:
        return text
    paired = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return paired.replace("\x00", REPLACEMENT_CHARACTER)


def _storable_or_none(text: str | None) -> str | None:
    return None if text is None else storable_text(text)


def storable_message(message: ChatMessage) -> ChatMessage:
    """The message with every text field made storable (`storable_text`)."""
    texts = (message.content, message.reasoning, message.tool_call_id, message.name)
    calls = message.tool_calls
    if not any(t is not None and _UNSTORABLE.search(t) for t in texts) and not any(
        _UNSTORABLE.search(c.id + c.name + c.arguments) for c in calls
    ):
        return message
    return replace(
        message,
        content=_storable_or_none(message.content),
        reasoning=_storable_or_none(message.reasoning),
        tool_calls=tuple(
            ToolCall(storable_text(c.id), storable_text(c.name), storable_text(c.arguments)) for c in calls
        ),
        tool_call_id=_storable_or_none(message.tool_call_id),
        name=_storable_or_none(message.name),
    )


def storable_delta(delta: Delta) -> Delta:
    """A streamed piece with its text made storable, as the step it builds will be."""
    match delta:
        case ContentDelta(text=text):
            return delta if _UNSTORABLE.search(text) is None else ContentDelta(storable_text(text))
        case ReasoningDelta(text=text):
            return delta if _UNSTORABLE.search(text) is None else ReasoningDelta(storable_text(text))
        case ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments):
            return ToolCallDelta(
                index, _storable_or_none(call_id), _storable_or_none(name), storable_text(arguments)
            )
    return delta
