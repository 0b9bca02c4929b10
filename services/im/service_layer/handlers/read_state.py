"""What each member has read: marking, the unread messages, the chat list."""

from __future__ import annotations

from datetime import datetime

from services.common.identity import Caller
from services.im.domain import rules
from services.im.domain.commands import MarkRead
from services.im.domain.errors import InvalidRequest, NotAMember, NotFound
from services.im.domain.model import Chat, Group, Message, ReadState, ReadUpdated
from services.im.service_layer.handlers.deps import Deps, Page, recorded
from services.im.service_layer.ports import ReadOutcome


async def mark_read(deps: Deps, command: MarkRead) -> ReadState:
    target = rules.parse_id(command.group_id, "group_id")
    up_to = rules.parse_id(command.up_to_message_id, "up_to_message_id")
    actor = await deps.caller_member(command.caller)
    at = deps.clock()
    marked = await deps.inbox.mark_read(actor, target, up_to, at)
    match marked.outcome:
        case ReadOutcome.NO_GROUP:
            raise NotFound(f"group {target} not found")
        case ReadOutcome.NOT_A_MEMBER:
            raise NotAMember(f"member {actor.id} is not in group {target}")
        case ReadOutcome.NOT_IN_GROUP:
            raise InvalidRequest(f"up_to_message_id {up_to} is not a message of this group")
    state = marked.state
    assert state is not None
    if marked.sequence is not None:
        await deps.signal_committed(
            [recorded(actor.workspace_id, marked.sequence, at, ReadUpdated(read_state=state))]
        )
    return state


async def get_all_unread(deps: Deps, caller: Caller | None, *, page_size: int) -> tuple[list[Message], int]:
    limit = rules.page_size(
        page_size or deps.limits.max_unread_page_size,
        deps.limits,
        maximum=deps.limits.max_unread_page_size,
    )
    actor = await deps.caller_member(caller)
    messages, total = await deps.inbox.unread(actor.id, limit=limit)
    return messages, total - len(messages)


async def list_chats(deps: Deps, caller: Caller | None, *, page_size: int, page_token: str) -> Page[Chat]:
    limit = rules.page_size(page_size, deps.limits)
    start: tuple[str, str] | None = None
    if page_token:
        token = rules.decode_page_token(page_token, {"activity", "group"})
        start = (token["activity"], token["group"])
    async with deps.uow(write=False) as tx:
        actor = await deps.acting_member(tx, caller)
        groups = await tx.list_groups_of(actor.id, after=None, limit=None)
        last = await tx.last_messages([g.id for g in groups])

        def activity(group: Group) -> datetime:
            message = last.get(group.id)
            return message.sent_at if message is not None else group.created_at

        def key(group: Group) -> tuple[str, str]:
            return (activity(group).isoformat(), str(group.id))

        ordered = sorted(groups, key=key, reverse=True)
        if start is not None:
            ordered = [g for g in ordered if key(g) < start]
        page = ordered[:limit]
        counts = await tx.unread_counts(actor.id, [g.id for g in page])
    chats = [
        Chat(
            group=g,
            last_message=last.get(g.id),
            unread_count=counts.get(g.id, 0),
            last_activity_at=activity(g),
        )
        for g in page
    ]
    next_token = ""
    if len(ordered) > limit and page:
        activity_text, group_text = key(page[-1])
        next_token = rules.encode_page_token({"activity": activity_text, "group": group_text})
    return Page(chats, next_token)
