"""Domain objects to protobuf messages and back; nothing else."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from google.protobuf import json_format, struct_pb2, timestamp_pb2

from agentim.im.v1 import im_pb2
from services.im.domain import model
from services.im.domain.errors import InvalidRequest
from services.im.service_layer.events import Delivery

MEMBER_KINDS = {
    im_pb2.MEMBER_KIND_HUMAN: model.MemberKind.HUMAN,
    im_pb2.MEMBER_KIND_AGENT: model.MemberKind.AGENT,
}
MEMBER_KINDS_OUT = {v: k for k, v in MEMBER_KINDS.items()}
CONTENT_TYPES = {
    im_pb2.CONTENT_TYPE_TEXT: model.ContentType.TEXT,
    im_pb2.CONTENT_TYPE_IMAGE: model.ContentType.IMAGE,
    im_pb2.CONTENT_TYPE_FILE: model.ContentType.FILE,
    im_pb2.CONTENT_TYPE_CODE: model.ContentType.CODE,
    im_pb2.CONTENT_TYPE_TASK: model.ContentType.TASK,
    im_pb2.CONTENT_TYPE_SYSTEM: model.ContentType.SYSTEM,
}
CONTENT_TYPES_OUT = {v: k for k, v in CONTENT_TYPES.items()}
ROLES = {
    im_pb2.MEMBER_ROLE_OWNER: model.Role.OWNER,
    im_pb2.MEMBER_ROLE_ADMIN: model.Role.ADMIN,
    im_pb2.MEMBER_ROLE_MEMBER: model.Role.MEMBER,
}
ROLES_OUT = {v: k for k, v in ROLES.items()}
GROUP_KINDS_OUT = {
    model.GroupKind.GROUP: im_pb2.GROUP_KIND_GROUP,
    model.GroupKind.DIRECT: im_pb2.GROUP_KIND_DIRECT,
}


def member_kind(value: int) -> model.MemberKind | None:
    if value == im_pb2.MEMBER_KIND_UNSPECIFIED:
        return None
    if value not in MEMBER_KINDS:
        raise InvalidRequest(f"kind {value} is not a known member kind")
    return MEMBER_KINDS[value]  # type: ignore[index]


def role(value: int) -> model.Role | None:
    if value == im_pb2.MEMBER_ROLE_UNSPECIFIED:
        return None
    if value not in ROLES:
        raise InvalidRequest(f"role {value} is not a known role")
    return ROLES[value]  # type: ignore[index]


def content_type(value: int) -> model.ContentType | None:
    if value == im_pb2.CONTENT_TYPE_UNSPECIFIED:
        return None
    if value not in CONTENT_TYPES:
        raise InvalidRequest(f"content_type {value} is not a known content type")
    return CONTENT_TYPES[value]  # type: ignore[index]


def metadata(value: struct_pb2.Struct) -> dict[str, Any]:
    return json_format.MessageToDict(value) if value.fields else {}


def timestamp(value: datetime) -> timestamp_pb2.Timestamp:
    out = timestamp_pb2.Timestamp()
    out.FromDatetime(value)
    return out


def workspace(w: model.Workspace) -> im_pb2.Workspace:
    return im_pb2.Workspace(id=str(w.id), name=w.name, create_time=timestamp(w.created_at))


def member(m: model.Member) -> im_pb2.Member:
    return im_pb2.Member(
        id=str(m.id),
        workspace_id=str(m.workspace_id),
        kind=MEMBER_KINDS_OUT[m.kind],
        display_name=m.display_name,
        avatar=m.avatar,
        create_time=timestamp(m.created_at),
        role=ROLES_OUT[m.role],
        owner_id=str(m.owner_id) if m.owner_id is not None else "",
    )


def group(g: model.Group) -> im_pb2.Group:
    return im_pb2.Group(
        id=str(g.id),
        workspace_id=str(g.workspace_id),
        name=g.name,
        kind=GROUP_KINDS_OUT[g.kind],
        member_ids=[str(m) for m in g.member_ids],
        creator_id=str(g.creator_id),
        create_time=timestamp(g.created_at),
    )


def message(m: model.Message) -> im_pb2.Message:
    out = im_pb2.Message(
        id=str(m.id),
        workspace_id=str(m.workspace_id),
        group_id=str(m.group_id),
        sender_id=str(m.sender_id),
        content_type=CONTENT_TYPES_OUT[m.content_type],
        content=m.content,
        mentions=[str(x) for x in m.mentions],
        reply_to_message_id=str(m.reply_to) if m.reply_to else "",
        send_time=timestamp(m.sent_at),
    )
    if m.metadata:
        out.metadata.update(m.metadata)
    if m.edited_at is not None:
        out.edit_time.CopyFrom(timestamp(m.edited_at))
    return out


def read_state(r: model.ReadState) -> im_pb2.ReadState:
    last = "" if r.last_read_message_id == model.NIL_ID else str(r.last_read_message_id)
    return im_pb2.ReadState(
        group_id=str(r.group_id),
        member_id=str(r.member_id),
        last_read_message_id=last,
        unread_count=r.unread_count,
    )


def chat(c: model.Chat) -> im_pb2.Chat:
    out = im_pb2.Chat(
        group=group(c.group), unread_count=c.unread_count, last_activity_time=timestamp(c.last_activity_at)
    )
    if c.last_message is not None:
        out.last_message.CopyFrom(message(c.last_message))
    return out


def delivery(d: Delivery) -> im_pb2.WatchEventsResponse:
    recorded = d.recorded
    out = im_pb2.WatchEventsResponse(
        cursor=str(recorded.sequence),
        sequence=recorded.sequence,
        event_time=timestamp(recorded.recorded_at),
        member_ids=[str(m) for m in d.member_ids],
        previous_sequence=d.previous_sequence,
    )
    match recorded.event:
        case model.MessageCreated(message=m):
            out.message_created.message.CopyFrom(message(m))
        case model.MessageEdited(message=m):
            out.message_edited.message.CopyFrom(message(m))
        case model.GroupChanged(group=g, added_member_ids=added, removed_member_ids=removed):
            out.group_changed.group.CopyFrom(group(g))
            out.group_changed.added_member_ids.extend(str(x) for x in added)
            out.group_changed.removed_member_ids.extend(str(x) for x in removed)
        case model.ReadUpdated(read_state=r):
            out.read_updated.read_state.CopyFrom(read_state(r))
    return out
