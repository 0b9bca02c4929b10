"""A service wired to the fakes, and shortcuts to populate it."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from services.common.identity import Caller
from services.common.tokens import PrincipalKind
from services.im import bootstrap
from services.im.config import Settings
from services.im.domain.commands import CreateGroup, CreateMember, CreateWorkspace, SendMessage
from services.im.domain.model import ContentType, Group, Member, MemberKind, Message, Workspace
from services.im.domain.rules import Limits
from services.im.service_layer.auth_ports import ProviderKeys
from services.im.service_layer.handlers.deps import Deps
from services.im.service_layer.messagebus import MessageBus
from tests.auth_support import auth_environment
from tests.identities import caller_of, service_caller
from tests.unit.auth_fakes import FakePasswords, InMemoryAuditLog
from tests.unit.fakes import FakeClock, InMemoryStore, RecordingSignal

# The runtime's own token (a service, which acts as no member).
SERVICE = service_caller("runtime")


def me(member: Member) -> Caller:
    """A member calling for itself, with a token as the IM issues it."""
    kind = PrincipalKind.AGENT if member.kind is MemberKind.AGENT else PrincipalKind.HUMAN
    return caller_of(member.id, member.workspace_id, kind=kind, roles=(member.role.value,))


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def unit_settings(*, limits: Limits | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """IM settings for tests on fakes: the test keys and credentials; no database is opened."""
    settings = Settings.from_env(
        {
            "DATABASE_URL": "sqlite://",
            "IM_GRPC_ADDRESS": "127.0.0.1:0",
            **auth_environment(),
            **(environ or {}),
        }
    )
    return settings if limits is None else replace(settings, limits=limits)


def build_on_fakes(
    settings: Settings,
    *,
    store: InMemoryStore | None = None,
    clock: FakeClock | None = None,
    passwords: FakePasswords | None = None,
    provider_keys: ProviderKeys | None = None,
) -> bootstrap.IMApp:
    """The IM as `bootstrap.build` wires it, on an in-memory store, signal,
    audit log, passwords and clock (each reachable from the app or the fake)."""
    return bootstrap.build(
        settings,
        store=store or InMemoryStore(),
        audit_log=InMemoryAuditLog(),
        signal=RecordingSignal(),
        passwords=passwords or FakePasswords(),
        provider_keys=provider_keys,
        clock=clock or FakeClock(),
    )


@dataclass
class World:
    """The IM built on a fresh in-memory store, with its fakes at hand."""

    store: InMemoryStore
    signal: RecordingSignal
    clock: FakeClock
    app: bootstrap.IMApp

    @property
    def deps(self) -> Deps:
        return self.app.deps

    @property
    def bus(self) -> MessageBus:
        return self.app.bus

    @classmethod
    def make(
        cls,
        *,
        limits: Limits | None = None,
        yield_on_call: bool = False,
        tick: timedelta = timedelta(seconds=1),
    ) -> World:
        store = InMemoryStore(yield_on_call=yield_on_call)
        clock = FakeClock(tick=tick)
        app = build_on_fakes(unit_settings(limits=limits), store=store, clock=clock)
        assert isinstance(app.signal, RecordingSignal)
        return cls(store=store, signal=app.signal, clock=clock, app=app)

    @classmethod
    def make_beside(cls, world: World) -> World:
        """Another replica of the IM on the same store and clock, with its own signal."""
        app = build_on_fakes(world.app.settings, store=world.store, clock=world.clock)
        assert isinstance(app.signal, RecordingSignal)
        return cls(store=world.store, signal=app.signal, clock=world.clock, app=app)

    async def __aenter__(self) -> World:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.app.stop()

    async def workspace(self, name: str = "acme", *, creator: str = "alice") -> tuple[Workspace, Member]:
        workspace, made, _ = await self.bus.handle(CreateWorkspace(name=name, creator_display_name=creator))
        return workspace, made

    async def member(self, colleague: Member, name: str, *, kind: MemberKind = MemberKind.HUMAN) -> Member:
        """A new member in the colleague's workspace."""
        return await self.bus.handle(
            CreateMember(
                caller=me(colleague), workspace_id="", kind=kind, display_name=name, avatar="", request_id=""
            )
        )

    async def group(self, creator: Member, *others: Member, name: str = "team") -> Group:
        return await self.bus.handle(
            CreateGroup(caller=me(creator), name=name, member_ids=[str(o.id) for o in others], request_id="")
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
        return await self.bus.handle(
            SendMessage(
                caller=me(sender),
                group_id=str(group.id),
                content_type=content_type,
                content=content,
                mentions=[str(m.id) for m in mentions],
                reply_to_message_id=str(reply_to.id) if reply_to is not None else "",
                metadata=metadata or {},
                request_id=request_id,
            )
        )
