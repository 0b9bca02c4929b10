"""Messages: sending (the hot path), editing, reading a group's history."""

from __future__ import annotations

import uuid
from dataclasses import replace

from uuid_utils.compat import uuid7

from services.common.identity import Caller
from services.im.domain import rules
from services.im.domain.commands import EditMessage, SendMessage
from services.im.domain.errors import (
    Conflict,
    InvalidRequest,
    NotAllowed,
    NotAMember,
    NotFound,
    RequestIdReused,
)
from services.im.domain.model import ContentType, Member, Message, MessageCreated, MessageEdited
from services.im.service_layer.handlers.deps import Deps, Page, recorded
from services.im.service_layer.ports import Transaction


async def send_message(deps: Deps, command: SendMessage) -> Message:
    content, metadata = command.content, dict(command.metadata)
    target = rules.parse_id(command.group_id, "group_id")
    kind = command.content_type or ContentType.TEXT
    mentioned = rules.parse_ids(command.mentions, "mentions")
    reply_to = rules.parse_optional_id(command.reply_to_message_id, "reply_to_message_id")
    rid = rules.check_request_id(command.request_id)
    rules.check_message(content=content, mentions=mentioned, metadata=metadata, limits=deps.limits)
    # Only a request_id needs the payload's fingerprint (to tell a retry from a reuse).
    fingerprint = (
        rules.message_fingerprint(
            group_id=target,
            content_type=kind,
            content=content,
            mentions=mentioned,
            reply_to=reply_to,
            metadata=metadata,
        )
        if rid is not None
        else ""
    )
    # The hot path is one atomic append that stores the message only if
    # the request is valid; only when it stores nothing do we look closer
    # to say why.
    actor = await deps.caller_member(command.caller)
    message = Message(
        id=uuid7(),
        workspace_id=actor.workspace_id,
        group_id=target,
        sender_id=actor.id,
        content_type=kind,
        content=content,
        mentions=mentioned,
        reply_to=reply_to,
        metadata=metadata,
        sent_at=deps.clock(),
        request_id=rid,
        request_hash=fingerprint if rid is not None else None,
    )
    at = deps.clock()
    sequence = await deps.messages.append(message, at)
    if sequence is not None:
        await deps.signal_committed(
            [recorded(message.workspace_id, sequence, at, MessageCreated(message=message))]
        )
        return message
    access = await deps.messages.access(target, [actor.id, *mentioned], reply_to)
    if access is None or access.workspace_id != actor.workspace_id:
        raise NotFound(f"group {target} not found")
    if actor.id not in access.members:
        raise NotAMember(f"member {actor.id} is not in group {target}")
    outsiders = [m for m in mentioned if m not in access.members]
    if outsiders:
        raise InvalidRequest(f"mentioned members are not in the group: {[str(m) for m in outsiders]}")
    if reply_to is not None and access.reply_to_group != target:
        raise InvalidRequest(f"reply_to_message_id {reply_to} is not a message of this group")
    # A valid request that stored nothing: its request_id was used before.
    async with deps.uow(write=False) as tx:
        earlier = await tx.find_message_by_request(actor.id, rid) if rid is not None else None
    if earlier is not None:
        return _retried(earlier, fingerprint, rid or "")
    raise Conflict(f"group {target} changed while the message was sent; send it again")


def _retried(earlier: Message, fingerprint: str, request_id: str) -> Message:
    if earlier.request_hash != fingerprint:
        raise RequestIdReused(f"request_id {request_id!r} was already used for a different message")
    return earlier


async def edit_message(deps: Deps, command: EditMessage) -> Message:
    caller, content = command.caller, command.content
    wanted = rules.parse_id(command.message_id, "message_id")
    if not content.strip():
        raise InvalidRequest("content is empty")
    rules.check_content(content, deps.limits)
    async with deps.uow() as tx:
        actor = await deps.acting_member(tx, caller)
        message = await _visible_message(deps, tx, actor, wanted)
        if message.sender_id != actor.id:
            raise NotAllowed("only the sender may edit a message")
        edited = replace(message, content=content, edited_at=deps.clock())
        await tx.edit_message(edited.id, content, edited.edited_at or deps.clock())
        await deps.commit(tx, edited.workspace_id, [MessageEdited(message=edited)])
        return edited


async def _visible_message(deps: Deps, tx: Transaction, member: Member, message_id: uuid.UUID) -> Message:
    message = await tx.get_message(message_id)
    if message is None or message.workspace_id != member.workspace_id:
        raise NotFound(f"message {message_id} not found")
    await deps.visible_group(tx, member, message.group_id)
    return message


async def get_message(deps: Deps, caller: Caller | None, message_id: str) -> Message:
    wanted = rules.parse_id(message_id, "message_id")
    async with deps.uow(write=False) as tx:
        actor = await deps.acting_member(tx, caller)
        return await _visible_message(deps, tx, actor, wanted)


async def list_messages(
    deps: Deps,
    caller: Caller | None,
    *,
    group_id: str,
    page_size: int,
    page_token: str,
    before_message_id: str,
    after_message_id: str,
) -> Page[Message]:
    target = rules.parse_id(group_id, "group_id")
    limit = rules.page_size(page_size, deps.limits)
    before = rules.parse_optional_id(before_message_id, "before_message_id")
    after = rules.parse_optional_id(after_message_id, "after_message_id")
    if page_token:
        token = rules.decode_page_token(page_token, {"group", "direction", "cursor"})
        if token["group"] != str(target):
            raise InvalidRequest("page_token belongs to another group")
        cursor = rules.parse_id(token["cursor"], "page_token")
        if token["direction"] not in ("before", "after"):
            raise InvalidRequest("page_token is malformed")
        before, after = (cursor, None) if token["direction"] == "before" else (None, cursor)
    if before is not None and after is not None:
        raise InvalidRequest("set before_message_id or after_message_id, not both")
    async with deps.uow(write=False) as tx:
        actor = await deps.acting_member(tx, caller)
        await deps.visible_group(tx, actor, target)
        items = await tx.list_messages(target, before=before, after=after, limit=limit + 1)
    forward = after is not None
    more = len(items) > limit
    if more:
        items = items[:limit] if forward else items[1:]
    next_token = ""
    if more and items:
        edge = items[-1] if forward else items[0]
        next_token = rules.encode_page_token(
            {"group": str(target), "direction": "after" if forward else "before", "cursor": str(edge.id)}
        )
    return Page(items, next_token)
