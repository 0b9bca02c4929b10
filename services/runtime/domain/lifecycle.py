"""An agent's lifecycle under human control, and what a cut-short history needs.

Pure rules: which controls each state allows, where a run resumes from, and
how the steps of an interrupted run stay a valid conversation for any
OpenAI-compatible model (every tool call answered by a result).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence

from services.runtime.domain.errors import InvalidTransition
from services.runtime.domain.llm import ChatMessage, Role, ToolCall
from services.runtime.domain.model import AgentState, Step, shown_to_model


class Control(enum.StrEnum):
    START = "start"
    PAUSE = "pause"
    RESUME = "resume"
    INTERRUPT = "interrupt"
    TERMINATE = "terminate"


# The states each control may be applied in.
_ALLOWED: dict[Control, frozenset[AgentState]] = {
    Control.START: frozenset({AgentState.TERMINATED}),
    Control.PAUSE: frozenset({AgentState.IDLE, AgentState.RUNNING, AgentState.ERROR}),
    Control.RESUME: frozenset({AgentState.PAUSED}),
    Control.INTERRUPT: frozenset({AgentState.RUNNING}),
    Control.TERMINATE: frozenset({AgentState.IDLE, AgentState.RUNNING, AgentState.ERROR, AgentState.PAUSED}),
}


def check_control(control: Control, state: AgentState) -> None:
    """Raises `InvalidTransition` unless `control` may be applied in `state`."""
    allowed = _ALLOWED[control]
    if state not in allowed:
        names = ", ".join(sorted(s.value.upper() for s in allowed))
        raise InvalidTransition(
            f"cannot {control.value} an agent that is {state.value.upper()} (only when {names})"
        )


# The result recorded for a tool call that never ran to its end.
CANCELLED_RESULT = "cancelled: the run was interrupted before this tool call finished"


def unanswered_calls(steps: Sequence[Step]) -> tuple[ToolCall, ...]:
    """The tool calls of the last assistant step that have no result after it."""
    answered: set[str] = set()
    for step in reversed(shown_to_model(steps)):
        if step.role is Role.TOOL and step.message.tool_call_id:
            answered.add(step.message.tool_call_id)
        elif step.role is Role.ASSISTANT:
            return tuple(c for c in step.message.tool_calls if c.id not in answered)
        else:
            return ()
    return ()


class Next(enum.Enum):
    """What a run resumed from a history does first."""

    CALL_MODEL = "call_model"  # the last step is input (user, system note, tool result)
    RUN_TOOLS = "run_tools"  # the last assistant step has calls without results
    NOTHING = "nothing"  # the last step is an answer: nothing is pending


def resume_point(steps: Sequence[Step]) -> Next:
    steps = shown_to_model(steps)  # a broken-off stream is asked for again
    if not steps:
        return Next.NOTHING
    last = steps[-1]
    if last.role is Role.ASSISTANT:
        return Next.RUN_TOOLS if unanswered_calls(steps) else Next.NOTHING
    if last.role is Role.TOOL and unanswered_calls(steps):
        return Next.RUN_TOOLS
    return Next.CALL_MODEL


def interrupted_message(partial: ChatMessage) -> ChatMessage:
    """What an assistant step cut mid-stream keeps: its text, and only the tool
    calls whose arguments arrived whole (valid JSON), which will be answered
    with a cancelled result."""
    whole = tuple(call for call in partial.tool_calls if call.name and _is_json(call.arguments))
    return ChatMessage(
        role=Role.ASSISTANT,
        content=partial.content,
        reasoning=partial.reasoning,
        tool_calls=whole,
    )


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
