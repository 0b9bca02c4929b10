"""Which conversation each step belongs to, and what a run may see of them.

An agent answers many chats. What it saw in one reaches its answer in
another only if everyone there could see it; the live context of a run is
therefore made of the runs of the conversation it answers (a chat, or the
agent's tasks), and the rest comes in only through recall, which applies
the same rule per memory.

A run's conversation is named by its input: the `origin` of an input step
(a chat message or a task; steps stored before origins existed name theirs
in their text: `[<chat> | group_id=<id>] ...` or `[task <id>] ...`). Steps
of no run of either kind (notes a person added) belong to every conversation.

The model reads an input step as it was written, after its sender's name in
a group (`Ada: ...`); the system prompt names the conversation
(`conversation_line`); the ids stay with the step (`as_sent`).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Final

from services.runtime.domain.llm import ChatMessage, Role
from services.runtime.domain.model import Origin, Step


class _Tasks:
    """The conversation of the agent's tasks (they belong to no chat)."""

    def __repr__(self) -> str:
        return "TASKS"


TASKS: Final = _Tasks()
Conversation = uuid.UUID | _Tasks

_CHAT_INPUT = re.compile(r"\[[^\]\n]*\| group_id=([0-9a-fA-F-]{36})\]")
_TASK_INPUT = re.compile(r"\[task [0-9a-fA-F-]{36}\]")


def conversation_of_input(step: Step) -> Conversation | None:
    """The chat (or TASKS) an input step came from; None for anything else."""
    origin, message = step.origin, step.message
    if origin is not None:
        if origin.task_id is not None:
            return TASKS
        return origin.group_id
    if message.role is not Role.USER or not message.content:
        return None
    head = message.content[:200]
    if (chat := _CHAT_INPUT.match(head)) is not None:
        return uuid.UUID(chat.group(1))
    if _TASK_INPUT.match(head):
        return TASKS
    return None


def run_conversations(steps: Iterable[Step]) -> dict[uuid.UUID, Conversation]:
    """Each run's conversation: the one its first chat or task input names.

    Runs with neither (a person's notes) are absent: they belong to all.
    """
    found: dict[uuid.UUID, Conversation] = {}
    for step in steps:
        if step.run_id in found:
            continue
        conversation = conversation_of_input(step)
        if conversation is not None:
            found[step.run_id] = conversation
    return found


def in_conversation(
    steps: Sequence[Step], conversation: Conversation | None, runs: Mapping[uuid.UUID, Conversation]
) -> list[Step]:
    """The steps a run answering `conversation` sees live: those of its runs and the shared ones.

    With no conversation (not known), every step.
    """
    if conversation is None:
        return list(steps)
    return [step for step in steps if runs.get(step.run_id, conversation) == conversation]


def step_chats(steps: Sequence[Step], run_chat: uuid.UUID | None) -> list[tuple[Step, uuid.UUID | None]]:
    """Each step of one run with the chat it came from, for memory: an input
    step names its own; the others belong to the chat the run answers (or,
    for runs stored before runs knew it, to the last chat read)."""
    paired: list[tuple[Step, uuid.UUID | None]] = []
    current = run_chat
    for step in steps:
        named = conversation_of_input(step)
        if isinstance(named, uuid.UUID):
            paired.append((step, named))
            current = current if run_chat is not None else named
            continue
        paired.append((step, current if not isinstance(named, _Tasks) else None))
    return paired


# OpenAI's `name` of a message: a sender whose name fits goes there too.
_NAME_FIELD = re.compile(r"[A-Za-z0-9_-]{1,64}")


def sender_prefix(origin: Origin) -> str:
    """What the model reads before an input's text: in a group, who said it
    (`Ada: `); nothing in a direct chat or a task, where the system prompt
    says whose they are (see `conversation_line`). Small models copy such
    prefixes into their answers: they go only where they are needed."""
    if origin.task_id is not None or origin.direct:
        return ""
    return f"{origin.sender_name or 'someone'}: "


def conversation_line(origin: Origin | None) -> str:
    """The system prompt's word on the conversation a run answers (`origin`:
    its first input's), or nothing when it is not known."""
    if origin is None:
        return ""
    if origin.task_id is not None:
        return "You are working on a task a person gave you; your final answer is its result."
    if origin.direct:
        return f"This is your direct chat with {origin.sender_name or 'a member'}."
    return f'This is the group chat "{origin.group_name}"; each message starts with its sender\'s name.'


def origin_of_run(steps: Sequence[Step], run_id: uuid.UUID) -> Origin | None:
    """The origin of a run's first input step (its conversation), if it has one."""
    return next((s.origin for s in steps if s.run_id == run_id and s.origin is not None), None)


def as_sent(step: Step) -> ChatMessage:
    """The step's message as the model receives it: an input with who sent
    it where (and the sender's name in `name`, which endpoints that read it
    show the model; see `ChatMessage.to_openai`)."""
    origin, message = step.origin, step.message
    if origin is None or message.role is not Role.USER:
        return message
    name = (
        origin.sender_name if origin.task_id is None and _NAME_FIELD.fullmatch(origin.sender_name) else None
    )
    return replace(message, prefix=sender_prefix(origin), name=name)
