"""When an agent speaks up in a chat, and when agents must stop talking to each other."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping, Set


class GroupPolicy(enum.StrEnum):
    """Whether an agent answers a person's group message that does not
    @mention it or reply to it (another agent's, never: see `should_answer`)."""

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
    from_person: bool = True,
    replies_to_agent: bool = False,
) -> bool:
    """Direct chats are always answered, and so is a message that @mentions
    the agent or replies to one of its messages. Otherwise, in a group, a
    person's message is answered as `policy` says and another agent's never:
    two agents in a group do not talk to each other unless one asks the other.
    """
    if is_direct or agent_member_id in mentions or replies_to_agent:
        return True
    if not from_person:
        return False
    if policy is GroupPolicy.ALWAYS:
        return True
    if policy is GroupPolicy.MENTIONED_ONLY:
        return False
    return not mentions


# An answer that is only this posts nothing: the agent has nothing to add.
NO_REPLY = "NO_REPLY"


def is_silence(answer: str) -> bool:
    """Whether an answer means "nothing to say" (`NO_REPLY`, any case, maybe
    with a full stop), or is empty."""
    return answer.strip().rstrip(".").strip().upper() in ("", NO_REPLY)


def mentioned(content: str, names: Mapping[uuid.UUID, str], *, author: uuid.UUID) -> list[uuid.UUID]:
    """The members that `content` @names ("@" and the display name, any case,
    as a word of its own), but not its author; longer names are tried first
    so that "@Bea Smith" is not "@Bea"."""
    text = content.casefold()
    found: list[uuid.UUID] = []
    taken: list[tuple[int, int]] = []
    for member_id, name in sorted(names.items(), key=lambda item: -len(item[1])):
        token = "@" + name.casefold()
        if member_id == author or not name.strip():
            continue
        start = 0
        while (at := text.find(token, start)) >= 0:
            end = at + len(token)
            alone = (at == 0 or not text[at - 1].isalnum()) and (end == len(text) or not text[end].isalnum())
            if alone and not any(a <= at < b for a, b in taken):
                found.append(member_id)
                taken.append((at, end))
                break
            start = at + 1
    return found


class Trouble(enum.StrEnum):
    """Why an agent could not answer, as the people it owes an answer are told."""

    BUDGET = "budget"
    CONTEXT = "context"
    MODEL_DOWN = "model_down"
    MODEL_REFUSED = "model_refused"
    TERMINATED = "terminated"
    OTHER = "other"


# The model's own words are quoted up to this many characters.
_QUOTED = 400


def failure_notice(trouble: Trouble, error: str) -> str:
    """What an agent that could not answer says in the chat: what happened,
    in plain words, the endpoint's own reason, and how to retry."""
    reason = error.strip()
    if len(reason) > _QUOTED:
        reason = reason[: _QUOTED - 1] + "…"
    said = {
        Trouble.BUDGET: "I stopped before answering: I have used up my token budget."
        " Raise it in my settings, then retry.",
        Trouble.CONTEXT: "I could not answer: this conversation no longer fits my model's context"
        f" window, even shortened. The model said: {reason}. Retry, or start me on a new session.",
        Trouble.MODEL_DOWN: f"I could not answer: my model did not respond ({reason})."
        " Retry once it is back.",
        Trouble.MODEL_REFUSED: f"I could not answer: my model refused the request ({reason}). Retry once"
        " my settings are fixed.",
        Trouble.TERMINATED: "I stopped before answering: a person terminated me. Start me again, then"
        " ask once more.",
        Trouble.OTHER: f"I could not answer: {reason}. Retry to have me try again.",
    }
    return said[trouble]


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
