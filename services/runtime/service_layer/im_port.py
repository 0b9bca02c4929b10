"""The runtime's view of the IM service: what agents do there, as a port.

The adapter (`services.runtime.adapters.im_client`) calls the IM's gRPC API
as a trusted service acting for the agent; tests use an in-memory fake.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class IMMember:
    id: uuid.UUID
    workspace_id: uuid.UUID
    kind: str  # "human" or "agent"
    display_name: str


@dataclass(frozen=True, slots=True)
class IMGroup:
    id: uuid.UUID
    name: str
    kind: str  # "group" or "direct"
    member_ids: tuple[uuid.UUID, ...]


@dataclass(frozen=True, slots=True)
class IMMessage:
    id: uuid.UUID
    group_id: uuid.UUID
    sender_id: uuid.UUID
    content_type: str  # "text", "code", "task", ...
    content: str
    mentions: tuple[uuid.UUID, ...]
    sent_at: datetime
    # The message this one replies to, if any.
    reply_to: uuid.UUID | None = None
    # Structured data for clients and agents (a notice says what it is about).
    metadata: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class IMEvent:
    """A message-created event (other events are not passed on).

    `member_ids` are the watched members in the message's group.
    `sequence` is the event's number in its workspace, and
    `previous_sequence` the number of the message event the watch delivered
    before it (or the one it started after); -1 when the watch cannot vouch
    that nothing came in between. A consumer whose last event is another has
    missed some (see `Supervisor`).
    """

    cursor: str
    message: IMMessage
    member_ids: tuple[uuid.UUID, ...] = ()
    sequence: int = 0
    previous_sequence: int = 0


class IMPort(abc.ABC):
    """IM calls made for an agent (`as_member`) or by the runtime itself.

    Every call has a deadline. Refusals raise `IMError` with the IM's status
    code (for example NOT_FOUND or PERMISSION_DENIED) and message, so that a
    tool can hand them back to the model.
    """

    @abc.abstractmethod
    async def create_agent_member(
        self,
        workspace_id: uuid.UUID,
        display_name: str,
        *,
        avatar: str = "",
        request_id: str = "",
        owner_id: uuid.UUID | None = None,
    ) -> IMMember:
        """Registers an agent as an AGENT member of the workspace, owned by `owner_id`."""

    @abc.abstractmethod
    async def set_agent_owners(self, owners: dict[uuid.UUID, uuid.UUID]) -> int:
        """Tells the IM who owns which of the agents this runtime hosts
        (agent member id -> owner); returns how many the IM changed."""

    @abc.abstractmethod
    async def rename_member(self, member_id: uuid.UUID, display_name: str) -> IMMember: ...

    @abc.abstractmethod
    async def get_member(self, as_member: uuid.UUID, member_id: uuid.UUID) -> IMMember: ...

    @abc.abstractmethod
    async def list_members(self, as_member: uuid.UUID) -> list[IMMember]:
        """Every member of the agent's workspace."""

    @abc.abstractmethod
    async def get_all_unread(self, as_member: uuid.UUID, *, limit: int = 200) -> list[IMMessage]:
        """The member's unread messages across its groups, oldest first."""

    @abc.abstractmethod
    async def mark_read(self, as_member: uuid.UUID, group_id: uuid.UUID, up_to: uuid.UUID) -> None: ...

    @abc.abstractmethod
    async def send_message(
        self,
        as_member: uuid.UUID,
        group_id: uuid.UUID,
        content: str,
        *,
        mentions: Sequence[uuid.UUID] = (),
        reply_to: uuid.UUID | None = None,
        request_id: str = "",
        content_type: str = "text",
        metadata: Mapping[str, Any] | None = None,
    ) -> IMMessage:
        """Sends a message; `content_type` is one of the IM's ("text", "system", ...)."""

    @abc.abstractmethod
    async def get_message(self, as_member: uuid.UUID, message_id: uuid.UUID) -> IMMessage: ...

    @abc.abstractmethod
    async def get_or_create_direct_group(self, as_member: uuid.UUID, peer_id: uuid.UUID) -> IMGroup: ...

    @abc.abstractmethod
    async def get_group(self, as_member: uuid.UUID, group_id: uuid.UUID) -> IMGroup: ...

    @abc.abstractmethod
    async def list_groups(self, as_member: uuid.UUID) -> list[IMGroup]: ...

    @abc.abstractmethod
    async def create_group(
        self, as_member: uuid.UUID, name: str, member_ids: Sequence[uuid.UUID], *, request_id: str = ""
    ) -> IMGroup:
        """Creates a group of the agent and the members; a repeated request_id returns the same group."""

    @abc.abstractmethod
    async def list_messages(
        self, as_member: uuid.UUID, group_id: uuid.UUID, *, limit: int = 50, before: uuid.UUID | None = None
    ) -> list[IMMessage]:
        """A group's newest messages (before a message, if given), oldest first."""

    @abc.abstractmethod
    def watch(
        self,
        workspace_id: uuid.UUID,
        *,
        member_ids: Sequence[uuid.UUID] = (),
        after_cursor: str = "",
        on_subscribed: Callable[[str], object] | None = None,
    ) -> AsyncIterator[IMEvent]:
        """Message-created events of a workspace (or of the named members), resuming after a cursor.

        With member_ids, only the messages of those members' groups come, each
        with the members it concerns (`IMEvent.member_ids`).

        `on_subscribed(cursor)` is called each time the IM confirms the
        subscription (at the start and after every reconnection) with the
        cursor the stream starts after: from then on no event is missed, so it
        is the moment to catch up on anything earlier, and the cursor to keep
        for a later watch if no event comes.

        The stream reconnects by itself (with backoff, from the last cursor it
        delivered) when the IM goes away, so it never loses or repeats an
        event; it ends only when the consumer stops.
        """

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Closes channels. Idempotent."""
