"""Which conversation each step belongs to, and what a run may see of them.

An agent answers many chats. What it saw in one reaches its answer in
another only if everyone there could see it; the live context of a run is
therefore made of the runs of the conversation it answers (a chat, or the
agent's tasks), and the rest comes in only through recall, which applies
the same rule per memory.

A run's conversation is named by its input: a chat message reads
`[<chat> | group_id=<id>] ...` (see `etiquette.incoming_message`), a task
`[task <id>] ...`. Steps of no run of either kind (notes a person added)
belong to every conversation.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from services.runtime.domain.llm import ChatMessage, Role
from services.runtime.domain.model import Step


class _Tasks:
    """The conversation of the agent's tasks (they belong to no chat)."""

    def __repr__(self) -> str:
        return "TASKS"


TASKS: Final = _Tasks()
Conversation = uuid.UUID | _Tasks

_CHAT_INPUT = re.compile(r"\[[^\]\n]*\| group_id=([0-9a-fA-F-]{36})\]")
_TASK_INPUT = re.compile(r"\[task [0-9a-fA-F-]{36}\]")


def conversation_of_input(message: ChatMessage) -> Conversation | None:
    """The chat (or TASKS) an input step came from; None for anything else."""
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
        conversation = conversation_of_input(step.message)
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
        named = conversation_of_input(step.message)
        if isinstance(named, uuid.UUID):
            paired.append((step, named))
            current = current if run_chat is not None else named
            continue
        paired.append((step, current if not isinstance(named, _Tasks) else None))
    return paired
