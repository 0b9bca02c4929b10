"""A service wired to the fakes, and shortcuts to populate it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from services.common.identity import Caller
from services.common.tokens import PrincipalKind
from services.im.domain.model import ContentType, Group, Member, MemberKind, Message, Workspace
from services.im.domain.rules import Limits
from services.im.service_layer.handlers import groups, members, messages, workspaces
from services.im.service_layer.handlers.deps import Deps
from services.im.service_layer.ports import TransactionalMessageLog
from tests.identities import caller_of, service_caller
from tests.unit.fakes import FakeClock, InMemoryStore, RecordingSignal

# The runtime's own token (a service, which acts as no member).
SERVICE = service_caller("runtime")


def me(member: Member) -> Caller:
    """A member calling for itself, with a token as the IM issues it."""
    kind = PrincipalKind.AGENT if member.kind is MemberKind.AGENT else PrincipalKind.HUMAN
    return caller_of(member.id, member.workspace_id, kind=kind, roles=(member.role.value,))


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@dataclass
class World:
    """The IM's handlers over a fresh in-memory store, with its fakes at hand."""

    store: InMemoryStore
    signal: RecordingSignal
    clock: FakeClock
    deps: Deps

    @classmethod
    def make(
        cls,
        *,
        limits: Limits | None = None,
        yield_on_call: bool = False,
        tick: timedelta = timedelta(seconds=1),
    ) -> World:
        store = InMemoryStore(yield_on_call=yield_on_call)
        signal = RecordingSignal()
        clock = FakeClock(tick=tick)
        deps = Deps(
            uow=store.transaction,
            messages=TransactionalMessageLog(store.transaction),
            signal=signal,
            limits=limits,
            clock=clock,
        )
        return cls(store=store, signal=signal, clock=clock, deps=deps)

    async def workspace(self, name: str = "acme", *, creator: str = "alice") -> tuple[Workspace, Member]:
        return await workspaces.create_workspace(
            self.deps,
            name=name,
            creator_display_name=creator,
            creator_kind=None,
            creator_avatar="",
            request_id="",
        )

    async def member(self, colleague: Member, name: str, *, kind: MemberKind = MemberKind.HUMAN) -> Member:
        """A new member in the colleague's workspace."""
        return await members.create_member(
            self.deps, me(colleague), workspace_id="", kind=kind, display_name=name, avatar="", request_id=""
        )

    async def group(self, creator: Member, *others: Member, name: str = "team") -> Group:
        return await groups.create_group(
            self.deps, me(creator), name=name, member_ids=[str(o.id) for o in others], request_id=""
        )

    async def send(
        self,
        sender: Member,
        group: Group,
        content: str = "hello",
        *,
        mentions: tuple[Member, ...] = (),
        reply_to: Message | None = None,
        metadata: dict[str, Any] | None = None,
        request_id: str = "",
        content_type: ContentType | None = None,
    ) -> Message:
        return await messages.send_message(
            self.deps,
            me(sender),
            group_id=str(group.id),
            content_type=content_type,
            content=content,
            mentions=[str(m.id) for m in mentions],
            reply_to_message_id=str(reply_to.id) if reply_to is not None else "",
            metadata=metadata or {},
            request_id=request_id,
        )
