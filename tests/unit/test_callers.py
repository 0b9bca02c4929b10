"""The IM's handlers with verified callers: what each kind of token may act as."""

from __future__ import annotations

import uuid

import pytest

from services.common.identity import Caller
from services.common.tokens import AccessClaims, PrincipalKind
from services.im.domain.commands import CreateMember, UpdateMember
from services.im.domain.errors import NotAllowed, Unauthenticated
from services.im.domain.model import Member, MemberKind
from services.im.service_layer.handlers import groups
from tests.unit.support import World


def token_of(member: Member, *, workspace_id: uuid.UUID | None = None) -> Caller:
    kind = PrincipalKind.AGENT if member.kind is MemberKind.AGENT else PrincipalKind.HUMAN
    return Caller(
        claims=AccessClaims(kind=kind, member_id=member.id, workspace_id=workspace_id or member.workspace_id)
    )


def service(name: str) -> Caller:
    return Caller(claims=AccessClaims(kind=PrincipalKind.SERVICE, service=name))


async def new_member(world: World, caller: Caller, workspace_id: uuid.UUID, kind: MemberKind) -> Member:
    return await world.bus.handle(
        CreateMember(
            caller=caller,
            workspace_id=str(workspace_id),
            kind=kind,
            display_name="new",
            avatar="",
            request_id="",
        )
    )


async def test_a_token_acts_as_its_member_in_its_workspace_only() -> None:
    world = World.make()
    _, alice = await world.workspace()
    page = await groups.list_groups(world.deps, token_of(alice), member_id="", page_size=0, page_token="")
    assert page.items == []
    forged = token_of(alice, workspace_id=uuid.uuid4())
    with pytest.raises(Unauthenticated, match="another workspace"):
        await groups.list_groups(world.deps, forged, member_id="", page_size=0, page_token="")


async def test_a_service_token_acts_as_no_member() -> None:
    world = World.make()
    _, alice = await world.workspace()
    group = await world.group(alice)
    with pytest.raises(NotAllowed, match="service's token names none"):
        await groups.get_group(world.deps, service("runtime"), str(group.id))


async def test_a_service_creates_agents_it_hosts_and_renames_only_those() -> None:
    world = World.make()
    workspace, alice = await world.workspace()
    runtime = service("runtime")
    agent = await new_member(world, runtime, workspace.id, MemberKind.AGENT)
    assert agent.host == "runtime"
    with pytest.raises(NotAllowed, match="only agent members"):
        await new_member(world, runtime, workspace.id, MemberKind.HUMAN)

    async def rename(caller: Caller, member: Member) -> Member:
        return await world.bus.handle(
            UpdateMember(
                caller=caller,
                member_id=str(member.id),
                display_name="renamed",
                avatar="",
                fields=["display_name"],
            )
        )

    assert (await rename(runtime, agent)).display_name == "renamed"
    for caller, target in [(runtime, alice), (service("memory"), agent), (token_of(alice), agent)]:
        with pytest.raises(NotAllowed):
            await rename(caller, target)
