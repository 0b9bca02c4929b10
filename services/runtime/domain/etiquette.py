"""When an agent speaks up in a chat, and when agents must stop talking to each other."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Set

from services.runtime.domain.llm import ChatMessage, Role


class GroupPolicy(enum.StrEnum):
    """Whether an agent answers a group message that does not @mention it."""

    # Answer unless the message @mentions someone else (the default).
    UNLESS_OTHERS_MENTIONED = "unless_others_mentioned"
    # Answer only when @mentioned.
    MENTIONED_ONLY = "mentioned_only"
    # Answer every message.
    ALWAYS = "always"


def should_answer(
    *,
    agent_member_id: uuid.UUID,
    is_direct: bool,
    mentions: Set[uuid.UUID],
    policy: GroupPolicy,
) -> bool:
    """Direct chats are always answered; groups follow the @mentions and the policy."""
    if is_direct or agent_member_id in mentions:
        return True
    if policy is GroupPolicy.ALWAYS:
        return True
    if policy is GroupPolicy.MENTIONED_ONLY:
        return False
    return not mentions


class ChatterGuard:
    """Counts, per group, messages from agents since the last human message.

    Agents stop answering in a group once `limit` agent messages in a row have
    been sent there, until a human writes again: two agents that keep
    answering each other cannot run forever.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._streak: dict[uuid.UUID, int] = {}

    def observe(self, group_id: uuid.UUID, *, from_agent: bool) -> None:
        if from_agent:
            self._streak[group_id] = self._streak.get(group_id, 0) + 1
        else:
            self._streak.pop(group_id, None)

    def allows(self, group_id: uuid.UUID) -> bool:
        return self._streak.get(group_id, 0) < self.limit


def incoming_message(
    *, group_label: str, group_id: uuid.UUID, sender_name: str, sender_id: uuid.UUID, content: str
) -> ChatMessage:
    """An IM message as the agent reads it: who said it, in which chat."""
    return ChatMessage(
        role=Role.USER,
        content=f"[{group_label} | group_id={group_id}] {sender_name} (member_id={sender_id}): {content}",
    )


def split_reply(content: str, max_bytes: int) -> list[str]:
    """Splits an answer into messages of at most `max_bytes` UTF-8 bytes each.

    Cuts at the last paragraph break, else line break, else space, in the
    second half of a part; a part with none is cut between characters (never
    inside one). Joined back, the parts are the content.
    """
    if max_bytes < 4:
        raise ValueError("max_bytes must leave room for any character (4 bytes)")
    parts: list[str] = []
    rest = content
    while len(rest.encode()) > max_bytes:
        # The longest prefix that fits, counted in whole characters.
        fits = rest.encode()[:max_bytes].decode(errors="ignore")
        cut = len(fits)
        for separator in ("\n\n", "\n", " "):
            at = fits.rfind(separator, len(fits) // 2)
            if at > 0:
                cut = at + len(separator)
                break
        parts.append(rest[:cut])
        rest = rest[cut:]
    if rest or not parts:
        parts.append(rest)
    return parts
