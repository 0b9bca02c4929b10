"""JSON form of the IM's domain events, as stored in the events table."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

from services.im.domain.model import (
    ContentType,
    Event,
    Group,
    GroupChanged,
    GroupKind,
    Message,
    MessageCreated,
    MessageEdited,
    ReadState,
    ReadUpdated,
)

KINDS: dict[type[Any], str] = {
    MessageCreated: "message_created",
    MessageEdited: "message_edited",
    GroupChanged: "group_changed",
    ReadUpdated: "read_updated",
}


def _message(m: Message) -> dict[str, Any]:
    return {
        "id": str(m.id),
        "workspace_id": str(m.workspace_id),
        "group_id": str(m.group_id),
        "sender_id": str(m.sender_id),
        "content_type": m.content_type.value,
        "content": m.content,
        "mentions": [str(x) for x in m.mentions],
        "reply_to": str(m.reply_to) if m.reply_to else None,
        "metadata": m.metadata,
        "sent_at": m.sent_at.isoformat(),
        "edited_at": m.edited_at.isoformat() if m.edited_at else None,
    }


def _message_from(d: dict[str, Any]) -> Message:
    return Message(
        id=uuid.UUID(d["id"]),
        workspace_id=uuid.UUID(d["workspace_id"]),
        group_id=uuid.UUID(d["group_id"]),
        sender_id=uuid.UUID(d["sender_id"]),
        content_type=ContentType(d["content_type"]),
        content=d["content"],
        mentions=tuple(uuid.UUID(x) for x in d["mentions"]),
        reply_to=uuid.UUID(d["reply_to"]) if d["reply_to"] else None,
        metadata=d["metadata"],
        sent_at=datetime.fromisoformat(d["sent_at"]),
        edited_at=datetime.fromisoformat(d["edited_at"]) if d["edited_at"] else None,
    )


def _group(g: Group) -> dict[str, Any]:
    return {
        "id": str(g.id),
        "workspace_id": str(g.workspace_id),
        "name": g.name,
        "kind": g.kind.value,
        "creator_id": str(g.creator_id),
        "created_at": g.created_at.isoformat(),
        "member_ids": [str(x) for x in g.member_ids],
    }


def _group_from(d: dict[str, Any]) -> Group:
    return Group(
        id=uuid.UUID(d["id"]),
        workspace_id=uuid.UUID(d["workspace_id"]),
        name=d["name"],
        kind=GroupKind(d["kind"]),
        creator_id=uuid.UUID(d["creator_id"]),
        created_at=datetime.fromisoformat(d["created_at"]),
        member_ids=tuple(uuid.UUID(x) for x in d["member_ids"]),
    )


def encode_event(event: Event) -> tuple[str, str]:
    """Returns (kind, JSON payload)."""
    body: dict[str, Any]
    match event:
        case MessageCreated(message=m) | MessageEdited(message=m):
            body = {"message": _message(m)}
        case GroupChanged(group=g, added_member_ids=added, removed_member_ids=removed):
            body = {
                "group": _group(g),
                "added": [str(x) for x in added],
                "removed": [str(x) for x in removed],
            }
        case ReadUpdated(read_state=r):
            body = {
                "group_id": str(r.group_id),
                "member_id": str(r.member_id),
                "last_read_message_id": str(r.last_read_message_id),
                "unread_count": r.unread_count,
            }
    return KINDS[type(event)], json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def decode_event(kind: str, payload: str) -> Event:
    body = json.loads(payload)
    if kind == "message_created":
        return MessageCreated(message=_message_from(body["message"]))
    if kind == "message_edited":
        return MessageEdited(message=_message_from(body["message"]))
    if kind == "group_changed":
        return GroupChanged(
            group=_group_from(body["group"]),
            added_member_ids=tuple(uuid.UUID(x) for x in body["added"]),
            removed_member_ids=tuple(uuid.UUID(x) for x in body["removed"]),
        )
    if kind == "read_updated":
        return ReadUpdated(
            read_state=ReadState(
                group_id=uuid.UUID(body["group_id"]),
                member_id=uuid.UUID(body["member_id"]),
                last_read_message_id=uuid.UUID(body["last_read_message_id"]),
                unread_count=int(body["unread_count"]),
            )
        )
    raise ValueError(f"unknown event kind {kind!r}")
