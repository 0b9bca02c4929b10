"""The IM's domain objects: plain data, no I/O."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

NIL_ID = uuid.UUID(int=0)


class MemberKind(enum.StrEnum):
    HUMAN = "human"
    AGENT = "agent"


class Role(enum.StrEnum):
    """A member's role in its workspace (see `services.im.domain.access`)."""

    OWNER = "owner"
    ADMIN = "admin"
    MEMBER = "member"


class GroupKind(enum.StrEnum):
    GROUP = "group"
    DIRECT = "direct"


class ContentType(enum.StrEnum):
    TEXT = "text"
    IMAGE = "image"
    FILE = "file"
    CODE = "code"
    TASK = "task"
    SYSTEM = "system"


@dataclass(frozen=True, slots=True)
class Workspace:
    id: uuid.UUID
    name: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Member:
    id: uuid.UUID
    workspace_id: uuid.UUID
    kind: MemberKind
    display_name: str
    avatar: str
    created_at: datetime
    role: Role = Role.MEMBER
    # For an agent: the service that hosts it (the only one that may get
    # tokens for it); None for people and for agents no service created.
    host: str | None = None
    # For an agent: the person who owns it, as its host says (they may view
    # the IM through its eyes); None for people and for agents of no known owner.
    owner_id: uuid.UUID | None = None


@dataclass(frozen=True, slots=True)
class Group:
    id: uuid.UUID
    workspace_id: uuid.UUID
    name: str
    kind: GroupKind
    creator_id: uuid.UUID
    created_at: datetime
    member_ids: tuple[uuid.UUID, ...] = ()
    # For direct groups: the pair, smaller id first, so one pair has one group.
    direct_key: str | None = None


@dataclass(frozen=True, slots=True)
class Message:
    id: uuid.UUID
    workspace_id: uuid.UUID
    group_id: uuid.UUID
    sender_id: uuid.UUID
    content_type: ContentType
    content: str
    mentions: tuple[uuid.UUID, ...]
    reply_to: uuid.UUID | None
    metadata: dict[str, Any]
    sent_at: datetime
    edited_at: datetime | None = None
    request_id: str | None = None
    # Fingerprint of the sent payload, to tell a retry from a reused request_id.
    request_hash: str | None = None


@dataclass(frozen=True, slots=True)
class Membership:
    group_id: uuid.UUID
    member_id: uuid.UUID
    last_read_message_id: uuid.UUID = NIL_ID
    joined_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class ReadState:
    group_id: uuid.UUID
    member_id: uuid.UUID
    last_read_message_id: uuid.UUID
    unread_count: int


@dataclass(frozen=True, slots=True)
class Chat:
    group: Group
    last_message: Message | None
    unread_count: int
    last_activity_at: datetime


# Events: what changed, recorded in the same transaction as the change.


@dataclass(frozen=True, slots=True)
class MessageCreated:
    message: Message


@dataclass(frozen=True, slots=True)
class MessageEdited:
    message: Message


@dataclass(frozen=True, slots=True)
class GroupChanged:
    group: Group
    added_member_ids: tuple[uuid.UUID, ...] = ()
    removed_member_ids: tuple[uuid.UUID, ...] = ()


@dataclass(frozen=True, slots=True)
class ReadUpdated:
    read_state: ReadState


Event = MessageCreated | MessageEdited | GroupChanged | ReadUpdated


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    """An event with its place in the workspace's gap-free sequence."""

    workspace_id: uuid.UUID
    sequence: int
    recorded_at: datetime
    event: Event
    group_id: uuid.UUID | None = field(default=None)


def event_group_id(event: Event) -> uuid.UUID:
    match event:
        case MessageCreated(message=m) | MessageEdited(message=m):
            return m.group_id
        case GroupChanged(group=g):
            return g.id
        case ReadUpdated(read_state=r):
            return r.group_id


def as_recorded(event: Event) -> Event:
    """The event as the event log gives it back: without what only its writer needs.

    A recorded message keeps no request_id (nor its fingerprint) and a
    recorded group no direct_key; an event handed out without a round trip
    through the log must look exactly like one read from it.
    """
    match event:
        case MessageCreated(message=m) if m.request_id is not None or m.request_hash is not None:
            return MessageCreated(message=replace(m, request_id=None, request_hash=None))
        case MessageEdited(message=m) if m.request_id is not None or m.request_hash is not None:
            return MessageEdited(message=replace(m, request_id=None, request_hash=None))
        case GroupChanged(group=g) if g.direct_key is not None:
            return replace(event, group=replace(g, direct_key=None))
    return event
