"""Tools agents can call, and the registry that runs them.

A tool failure never crashes a runner: whatever goes wrong comes back to the
model as the tool's result, starting with "error:". Except an unreachable IM
or database: that is nobody's answer to the call, so the call stays
unanswered and the run goes on once the dependency is back, running it again
with the same key (its side effect happens once). Memory is optional: the
model is told it is away and goes on without.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from services.common.errors import ServiceError, Unavailable
from services.runtime.domain.errors import MemoryUnavailable, ToolError
from services.runtime.domain.llm import ToolCall, ToolSpec
from services.runtime.domain.model import Agent
from services.runtime.service_layer.im_port import IMGroup, IMMember, IMMessage, IMPort
from services.runtime.service_layer.memory_port import Memory, MemoryPort, RecallQuery

# (parent, name, role, system prompt, request_id) -> the new agent (the same one for a repeated request_id).
SubAgentFactory = Callable[[Agent, str, str, str, str], Awaitable[Agent]]
# Waits for the first message a person sends to a group after a message.
ReplyWaiter = Callable[[uuid.UUID, uuid.UUID], Awaitable[IMMessage]]


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a tool may act on: the calling agent, the IM, the chat that woke it.

    `request_id` is the idempotency key of this call's side effect (see
    `services.runtime.domain.intents`): a tool passes it with every write it
    makes (a tool making several derives one per write), so that running the
    same call again after a crash does nothing twice.
    """

    agent: Agent
    im: IMPort
    trigger_group_id: uuid.UUID | None
    create_sub_agent: SubAgentFactory
    wait_for_reply: ReplyWaiter | None = None
    request_id: str = ""
    memory: MemoryPort | None = None
    # Who will see the answer: the members of the chat it goes to (empty for a task).
    audience: tuple[uuid.UUID, ...] = ()


ToolFunction = Callable[[ToolContext, dict[str, Any]], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Tool:
    spec: ToolSpec
    run: ToolFunction
    # Longest it may run; None: the registry's limit.
    timeout_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    content: str
    duration_ms: float


class ToolRegistry:
    """The tools the runtime knows; agents use the ones their settings name.

    Args:
        timeout_seconds: longest a tool may run before its call fails.
    """

    def __init__(self, tools: Iterable[Tool] = (), *, timeout_seconds: float = 60.0) -> None:
        self._tools: dict[str, Tool] = {}
        self._timeout = timeout_seconds
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        if tool.spec.name in self._tools:
            raise ValueError(f"a tool named {tool.spec.name!r} is already registered")
        self._tools[tool.spec.name] = tool

    @property
    def names(self) -> list[str]:
        return sorted(self._tools)

    def unknown(self, names: Iterable[str]) -> list[str]:
        return sorted(set(names) - set(self._tools))

    def specs(self, names: Sequence[str]) -> list[ToolSpec]:
        """The specs of the named tools (every tool when names is empty)."""
        chosen = names or self.names
        return [self._tools[name].spec for name in chosen if name in self._tools]

    async def execute(self, context: ToolContext, call: ToolCall) -> ToolOutcome:
        started = time.perf_counter()
        content = await self._run(context, call)
        return ToolOutcome(content=content, duration_ms=(time.perf_counter() - started) * 1000)

    async def _run(self, context: ToolContext, call: ToolCall) -> str:
        tool = self._tools.get(call.name)
        allowed = context.agent.tools or tuple(self._tools)
        if tool is None or call.name not in allowed:
            return f"error: unknown tool {call.name!r}; available: {', '.join(sorted(allowed))}"
        try:
            arguments = json.loads(call.arguments or "{}")
        except json.JSONDecodeError as error:
            return f"error: the arguments are not valid JSON ({error})"
        if not isinstance(arguments, dict):
            return "error: the arguments must be a JSON object"
        timeout = tool.timeout_seconds or self._timeout
        try:
            return await asyncio.wait_for(tool.run(context, arguments), timeout)
        except TimeoutError:
            return f"error: {call.name} did not finish within {timeout:g} s"
        except Unavailable as away:
            if isinstance(away, MemoryUnavailable):
                return f"error: {away}"
            raise
        except (ToolError, ServiceError) as error:
            return f"error: {error}"
        except (KeyError, TypeError, ValueError) as error:
            return f"error: bad arguments for {call.name}: {error}"


# -- built-in tools ---------------------------------------------------------------


async def ask_human(context: ToolContext, arguments: dict[str, Any]) -> str:
    """Posts the question and waits, the agent busy meanwhile, for a person's answer."""
    if context.wait_for_reply is None:
        raise ToolError("nobody can be asked from here")
    group_id = _id(arguments.get("group_id") or context.trigger_group_id, "group_id")
    asked = await context.im.send_message(
        context.agent.member_id, group_id, _text(arguments, "question"), request_id=context.request_id
    )
    reply = await context.wait_for_reply(group_id, asked.id)
    # Read here as the tool's result: it must not wake the agent again.
    await context.im.mark_read(context.agent.member_id, group_id, reply.id)
    return f"answer from member_id={reply.sender_id}: {reply.content}"


def _text(arguments: dict[str, Any], name: str) -> str:
    value = arguments.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ToolError(f"{name!r} must be a non-empty string")
    return value


def _id(value: Any, name: str) -> uuid.UUID:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise ToolError(f"{name!r} is not a valid id: {value!r}") from None


def _describe_message(message: IMMessage, names: dict[uuid.UUID, str]) -> str:
    sender = names.get(message.sender_id, str(message.sender_id))
    return f"{message.sent_at:%Y-%m-%d %H:%M} {sender}: {message.content}"


def _describe_group(group: IMGroup, names: dict[uuid.UUID, str]) -> str:
    members = ", ".join(names.get(m, str(m)) for m in group.member_ids)
    label = group.name or "direct chat"
    return f"{label} (group_id={group.id}, {group.kind}): {members}"


async def _names(context: ToolContext) -> dict[uuid.UUID, str]:
    return {m.id: m.display_name for m in await context.im.list_members(context.agent.member_id)}


async def _find_member(context: ToolContext, who: str) -> IMMember:
    """A member by id, or by display name (with or without a leading @)."""
    members = await context.im.list_members(context.agent.member_id)
    wanted = who.strip().removeprefix("@")
    for member in members:
        if str(member.id) == wanted:
            return member
    matches = [m for m in members if m.display_name.casefold() == wanted.casefold()]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ToolError(f"several members are called {wanted!r}; use a member_id")
    known = ", ".join(f"{m.display_name} ({m.id})" for m in members)
    raise ToolError(f"no member called {wanted!r}; members: {known}")


async def send_message(context: ToolContext, arguments: dict[str, Any]) -> str:
    group_id = _id(arguments.get("group_id") or context.trigger_group_id, "group_id")
    mentions = [_id(m, "mentions") for m in arguments.get("mentions", [])]
    sent = await context.im.send_message(
        context.agent.member_id,
        group_id,
        _text(arguments, "content"),
        mentions=mentions,
        request_id=context.request_id,
    )
    return f"sent message {sent.id} to group {group_id}"


async def send_direct_message(context: ToolContext, arguments: dict[str, Any]) -> str:
    member = await _find_member(context, _text(arguments, "to"))
    if member.id == context.agent.member_id:
        raise ToolError("that is you; name someone else")
    group = await context.im.get_or_create_direct_group(context.agent.member_id, member.id)
    sent = await context.im.send_message(
        context.agent.member_id, group.id, _text(arguments, "content"), request_id=context.request_id
    )
    return f"sent message {sent.id} to {member.display_name} (direct chat {group.id})"


async def read_history(context: ToolContext, arguments: dict[str, Any]) -> str:
    group_id = _id(arguments.get("group_id") or context.trigger_group_id, "group_id")
    limit = max(1, min(int(arguments.get("limit", 20)), 100))
    messages = await context.im.list_messages(context.agent.member_id, group_id, limit=limit)
    if not messages:
        return "no messages yet"
    names = await _names(context)
    return "\n".join(_describe_message(m, names) for m in messages)


async def list_groups(context: ToolContext, arguments: dict[str, Any]) -> str:
    groups = await context.im.list_groups(context.agent.member_id)
    if not groups:
        return "you are in no group"
    names = await _names(context)
    return "\n".join(_describe_group(g, names) for g in groups)


async def list_members(context: ToolContext, arguments: dict[str, Any]) -> str:
    members = await context.im.list_members(context.agent.member_id)
    return "\n".join(f"{m.display_name} (member_id={m.id}, {m.kind})" for m in members)


async def create_group(context: ToolContext, arguments: dict[str, Any]) -> str:
    who = arguments.get("members", [])
    if not isinstance(who, list) or not who:
        raise ToolError("'members' must be a non-empty list of names or member ids")
    members = [await _find_member(context, str(w)) for w in who]
    group = await context.im.create_group(
        context.agent.member_id,
        _text(arguments, "name"),
        [m.id for m in members],
        request_id=context.request_id,
    )
    return f"created group {group.name!r} (group_id={group.id})"


async def create_sub_agent(context: ToolContext, arguments: dict[str, Any]) -> str:
    child = await context.create_sub_agent(
        context.agent,
        _text(arguments, "name"),
        str(arguments.get("role", "")),
        str(arguments.get("system_prompt", "")),
        context.request_id,
    )
    return f"created agent {child.name!r} (agent_id={child.id}, member_id={child.member_id})"


MEMORY_TYPES = ("user_message", "reasoning", "tool_call", "tool_result", "response", "summary")
# A recalled memory's text is cut here in a tool result (expand gives all of it).
_RECALLED_CHARS = 600


def describe_memory(memory: Memory, *, chars: int = _RECALLED_CHARS) -> str:
    text = memory.text if len(memory.text) <= chars else memory.text[:chars] + "…"
    tool = f" {memory.tool_name}" if memory.tool_name else ""
    return f"- ref={memory.ref} ({memory.type}{tool}, {memory.created_at:%Y-%m-%d %H:%M} UTC): {text}"


RECALLED_HEADER = (
    "[memory] Recalled from your earlier runs (cite a ref to point at one; expand(ref) shows more):"
)


def recalled_note(memories: Sequence[Memory]) -> str:
    """The input step that brings memories recalled at the start of a run."""
    return "\n".join([RECALLED_HEADER, *(describe_memory(m) for m in memories)])


def _memory(context: ToolContext) -> MemoryPort:
    if context.memory is None:
        raise ToolError("long-term memory is not available here")
    return context.memory


def _when(arguments: dict[str, Any], name: str) -> datetime | None:
    value = arguments.get(name)
    if value is None or value == "":
        return None
    try:
        at = datetime.fromisoformat(str(value))
    except ValueError:
        raise ToolError(f"{name!r} must be an ISO 8601 date or time, got {value!r}") from None
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def _count(arguments: dict[str, Any], name: str, default: int, most: int) -> int:
    value = arguments.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
        raise ToolError(f"{name!r} must be a whole number from 0 to {most}")
    return value


async def recall(context: ToolContext, arguments: dict[str, Any]) -> str:
    """Searches the agent's long-term memory of earlier runs."""
    types = arguments.get("types") or []
    if not isinstance(types, list) or any(t not in MEMORY_TYPES for t in types):
        raise ToolError(f"'types' must be a list of: {', '.join(MEMORY_TYPES)}")
    query = RecallQuery(
        text=_text(arguments, "query"),
        limit=_count(arguments, "limit", 5, 20) or 5,
        types=tuple(types),
        since=_when(arguments, "since"),
        until=_when(arguments, "until"),
        prefer_recent=bool(arguments.get("prefer_recent", False)),
    )
    found = await _memory(context).recall(context.agent, context.audience, query)
    if not found:
        return "nothing found in memory"
    return "\n".join(describe_memory(m) for m in found)


async def expand(context: ToolContext, arguments: dict[str, Any]) -> str:
    """A memory with what came before and after it in its run."""
    ref = _text(arguments, "ref")
    expanded = await _memory(context).expand(
        context.agent,
        context.audience,
        ref,
        before=_count(arguments, "before", 3, 50),
        after=_count(arguments, "after", 3, 50),
    )
    lines = [f"run {expanded.run_id}:"] if expanded.run_id else []
    lines += [describe_memory(m, chars=4000) for m in expanded.before]
    lines.append(describe_memory(expanded.focus, chars=4000).replace("- ref=", "> ref=", 1))
    lines += [describe_memory(m, chars=4000) for m in expanded.after]
    return "\n".join(lines)


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_STRING = {"type": "string"}

BUILT_IN_TOOLS = (
    Tool(
        ToolSpec(
            "send_message",
            "Send a message to a group you belong to (by default the chat you are answering).",
            _schema(
                {"group_id": _STRING, "content": _STRING, "mentions": {"type": "array", "items": _STRING}},
                ["content"],
            ),
        ),
        send_message,
    ),
    Tool(
        ToolSpec(
            "send_direct_message",
            "Send a direct message to a member, by display name or member_id.",
            _schema({"to": _STRING, "content": _STRING}, ["to", "content"]),
        ),
        send_direct_message,
    ),
    Tool(
        ToolSpec(
            "read_history",
            "Read the latest messages of a group (by default the chat you are answering).",
            _schema({"group_id": _STRING, "limit": {"type": "integer", "minimum": 1, "maximum": 100}}, []),
        ),
        read_history,
    ),
    Tool(ToolSpec("list_groups", "List the groups you belong to.", _schema({}, [])), list_groups),
    Tool(ToolSpec("list_members", "List the members of your workspace.", _schema({}, [])), list_members),
    Tool(
        ToolSpec(
            "create_group",
            "Create a group with you and the given members (names or member ids).",
            _schema({"name": _STRING, "members": {"type": "array", "items": _STRING}}, ["name", "members"]),
        ),
        create_group,
    ),
    Tool(
        ToolSpec(
            "recall",
            "Search your long-term memory of earlier runs (any language). Results carry a ref you can"
            " cite or expand.",
            _schema(
                {
                    "query": _STRING,
                    "types": {"type": "array", "items": {"type": "string", "enum": list(MEMORY_TYPES)}},
                    "since": {**_STRING, "description": "ISO 8601 date or time"},
                    "until": {**_STRING, "description": "ISO 8601 date or time"},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 20},
                    "prefer_recent": {"type": "boolean"},
                },
                ["query"],
            ),
        ),
        recall,
    ),
    Tool(
        ToolSpec(
            "expand",
            "Show a memory (by its ref) with what came before and after it in its run.",
            _schema(
                {
                    "ref": _STRING,
                    "before": {"type": "integer", "minimum": 0, "maximum": 50},
                    "after": {"type": "integer", "minimum": 0, "maximum": 50},
                },
                ["ref"],
            ),
        ),
        expand,
    ),
    Tool(
        ToolSpec(
            "create_sub_agent",
            "Create a new agent that reports to you.",
            _schema({"name": _STRING, "role": _STRING, "system_prompt": _STRING}, ["name"]),
        ),
        create_sub_agent,
    ),
)


def default_registry(
    *, timeout_seconds: float = 60.0, ask_human_timeout_seconds: float = 3600.0
) -> ToolRegistry:
    """The built-in tools; `ask_human` may wait longer than the others."""
    asking = Tool(
        ToolSpec(
            "ask_human",
            "Ask the people of a group a question (by default the chat you are answering) and wait for"
            " the first answer a person sends there.",
            _schema({"question": _STRING, "group_id": _STRING}, ["question"]),
        ),
        ask_human,
        timeout_seconds=ask_human_timeout_seconds,
    )
    return ToolRegistry((*BUILT_IN_TOOLS, asking), timeout_seconds=timeout_seconds)
