"""The IM's use cases (the handlers of `services.im.service_layer.handlers`) against the in-memory fakes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta

import pytest

from services.im.domain import rules
from services.im.domain.commands import (
    AddGroupMembers,
    CreateGroup,
    CreateMember,
    CreateWorkspace,
    EditMessage,
    GetOrCreateDirectGroup,
    MarkRead,
    RemoveGroupMembers,
    RenameGroup,
    SendMessage,
    UpdateMember,
)
from services.im.domain.errors import (
    Conflict,
    InvalidRequest,
    LimitExceeded,
    NotAllowed,
    NotAMember,
    NotFound,
    RequestIdReused,
    Unauthenticated,
    WrongState,
)
from services.im.domain.model import (
    NIL_ID,
    ContentType,
    GroupChanged,
    GroupKind,
    Member,
    MemberKind,
    Message,
    MessageCreated,
    MessageEdited,
    ReadUpdated,
)
from services.im.service_layer.handlers import groups, members, messages, read_state, workspaces
from services.im.service_layer.handlers.deps import Deps
from services.im.service_layer.ports import TransactionalMessageLog
from tests.identities import caller_of
from tests.unit.fakes import failing
from tests.unit.support import SERVICE, World, me, unique


@pytest.fixture
async def world() -> AsyncIterator[World]:
    async with World.make() as made:
        yield made


async def people(world: World, count: int) -> list[Member]:
    """A workspace's creator followed by count - 1 more members."""
    _, creator = await world.workspace(unique("ws"))
    found = [creator]
    for index in range(1, count):
        found.append(await world.member(creator, f"member-{index}"))
    return found


# -- workspaces -------------------------------------------------------------


async def test_create_workspace_makes_the_workspace_and_its_creator(world: World) -> None:
    workspace, creator, _ = await world.bus.handle(
        CreateWorkspace(
            name="  acme  ",
            creator_display_name=" alice ",
            creator_kind=None,
            creator_avatar="https://a/b.png",
            request_id="",
        )
    )
    assert workspace.name == "acme"
    assert creator.display_name == "alice"
    assert creator.kind is MemberKind.HUMAN
    assert creator.avatar == "https://a/b.png"
    assert creator.workspace_id == workspace.id
    assert workspace.created_at.tzinfo is not None
    stored = await workspaces.get_workspace(world.deps, me(creator), str(workspace.id))
    assert stored == workspace
    assert await members.get_member(world.deps, me(creator), str(creator.id)) == creator


async def test_create_workspace_validates(world: World) -> None:
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            CreateWorkspace(
                name=" ", creator_display_name="a", creator_kind=None, creator_avatar="", request_id=""
            )
        )
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            CreateWorkspace(
                name="w", creator_display_name="", creator_kind=None, creator_avatar="", request_id=""
            )
        )
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            CreateWorkspace(
                name="w", creator_display_name="a", creator_kind=None, creator_avatar="", request_id="r" * 129
            )
        )
    assert world.store.state.workspaces == {}


async def test_create_workspace_retry_with_request_id_returns_the_first_result(world: World) -> None:
    rid = unique("rid")

    async def create(name: str = "acme") -> tuple[object, Member, object]:
        return await world.bus.handle(
            CreateWorkspace(
                name=name,
                creator_display_name="alice",
                creator_kind=MemberKind.AGENT,
                creator_avatar="",
                request_id=rid,
            )
        )

    first = await create()
    again = await create()
    assert again == first
    assert len(world.store.state.workspaces) == 1
    assert len(world.store.state.members) == 1
    with pytest.raises(RequestIdReused):
        await create(name="other")
    assert len(world.store.state.workspaces) == 1


async def test_concurrent_create_workspace_with_one_request_id_makes_one_workspace() -> None:
    world = World.make(yield_on_call=True)
    rid = unique("rid")

    async def create() -> tuple[object, Member, object]:
        return await world.bus.handle(
            CreateWorkspace(
                name="acme",
                creator_display_name="alice",
                creator_kind=None,
                creator_avatar="",
                request_id=rid,
            )
        )

    results = await asyncio.gather(*(create() for _ in range(4)))
    assert all(r == results[0] for r in results)
    assert len(world.store.state.workspaces) == 1
    assert len(world.store.state.members) == 1
    assert world.store.open_claims() == 0


async def test_get_workspace_only_the_callers_own(world: World) -> None:
    workspace, alice = await world.workspace()
    other, _ = await world.workspace("other")
    assert await workspaces.get_workspace(world.deps, me(alice), str(workspace.id)) == workspace
    with pytest.raises(NotFound):
        await workspaces.get_workspace(world.deps, me(alice), str(other.id))
    assert await workspaces.get_workspace(world.deps, SERVICE, str(other.id)) == other
    with pytest.raises(NotFound):
        await workspaces.get_workspace(world.deps, SERVICE, str(uuid.uuid4()))
    with pytest.raises(Unauthenticated):
        await workspaces.get_workspace(world.deps, None, str(workspace.id))


async def test_list_workspaces_member_sees_its_own_and_service_pages_through_all(world: World) -> None:
    made = [await world.workspace(f"ws-{i}") for i in range(5)]
    page = await workspaces.list_workspaces(world.deps, me(made[2][1]), page_size=0, page_token="")
    assert [w.id for w in page.items] == [made[2][0].id]
    assert page.next_token == ""

    seen: list[uuid.UUID] = []
    token = ""
    while True:
        page = await workspaces.list_workspaces(world.deps, SERVICE, page_size=2, page_token=token)
        assert len(page.items) <= 2
        seen += [w.id for w in page.items]
        token = page.next_token
        if not token:
            break
    assert seen == sorted(w.id for w, _ in made)


# -- members ------------------------------------------------------------------


async def test_create_and_get_member(world: World) -> None:
    workspace, alice = await world.workspace()
    bot = await world.bus.handle(
        CreateMember(
            caller=me(alice),
            workspace_id="",
            kind=MemberKind.AGENT,
            display_name=" bot ",
            avatar="a",
            request_id="",
        )
    )
    assert bot.workspace_id == workspace.id
    assert bot.kind is MemberKind.AGENT
    assert bot.display_name == "bot"
    assert await members.get_member(world.deps, me(alice), str(bot.id)) == bot
    # Naming its own workspace explicitly works too; a service must name one.
    named = await world.bus.handle(
        CreateMember(
            caller=me(alice),
            workspace_id=str(workspace.id),
            kind=MemberKind.HUMAN,
            display_name="carol",
            avatar="",
            request_id="",
        )
    )
    assert named.workspace_id == workspace.id
    by_service = await world.bus.handle(
        CreateMember(
            caller=SERVICE,
            workspace_id=str(workspace.id),
            kind=MemberKind.AGENT,
            display_name="d",
            avatar="",
            request_id="",
        )
    )
    assert (by_service.workspace_id, by_service.host) == (workspace.id, "runtime")
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            CreateMember(
                caller=SERVICE,
                workspace_id="",
                kind=MemberKind.AGENT,
                display_name="d",
                avatar="",
                request_id="",
            )
        )
    with pytest.raises(NotAllowed, match="a service creates only agent members"):
        await world.bus.handle(
            CreateMember(
                caller=SERVICE,
                workspace_id=str(workspace.id),
                kind=MemberKind.HUMAN,
                display_name="d",
                avatar="",
                request_id="",
            )
        )


async def test_create_member_refuses_other_workspaces_and_missing_identity(world: World) -> None:
    _, alice = await world.workspace()
    other, _ = await world.workspace("other")
    with pytest.raises(NotFound):
        await world.bus.handle(
            CreateMember(
                caller=me(alice),
                workspace_id=str(other.id),
                kind=MemberKind.HUMAN,
                display_name="x",
                avatar="",
                request_id="",
            )
        )
    with pytest.raises(Unauthenticated):
        await world.bus.handle(
            CreateMember(
                caller=None,
                workspace_id=str(other.id),
                kind=MemberKind.HUMAN,
                display_name="x",
                avatar="",
                request_id="",
            )
        )
    with pytest.raises(Unauthenticated):
        await world.bus.handle(
            CreateMember(
                caller=caller_of(uuid.uuid4(), alice.workspace_id),
                workspace_id="",
                kind=MemberKind.HUMAN,
                display_name="x",
                avatar="",
                request_id="",
            )
        )
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            CreateMember(
                caller=me(alice), workspace_id="", kind=None, display_name="x", avatar="", request_id=""
            )
        )
    assert {m.workspace_id for m in world.store.state.members.values()} == {alice.workspace_id, other.id}
    assert len(world.store.state.members) == 2


async def test_create_member_is_idempotent_per_request_id(world: World) -> None:
    _, alice = await world.workspace()
    rid = unique("rid")

    async def create(name: str) -> Member:
        return await world.bus.handle(
            CreateMember(
                caller=me(alice),
                workspace_id="",
                kind=MemberKind.AGENT,
                display_name=name,
                avatar="",
                request_id=rid,
            )
        )

    first = await create("bot")
    assert await create("bot") == first
    with pytest.raises(RequestIdReused):
        await create("other bot")
    assert len(world.store.state.members) == 2


async def test_get_member_of_another_workspace_is_not_found(world: World) -> None:
    _, alice = await world.workspace()
    _, zed = await world.workspace("other")
    with pytest.raises(NotFound):
        await members.get_member(world.deps, me(alice), str(zed.id))
    with pytest.raises(NotFound):
        await members.get_member(world.deps, me(alice), str(uuid.uuid4()))
    with pytest.raises(Unauthenticated):
        await members.get_member(world.deps, None, str(alice.id))
    assert await members.get_member(world.deps, SERVICE, str(zed.id)) == zed


async def test_list_members_pages_cover_every_member_once_in_id_order(world: World) -> None:
    everyone = await people(world, 7)
    await people(world, 3)  # another workspace's members stay out
    seen: list[uuid.UUID] = []
    token = ""
    pages = 0
    while True:
        page = await members.list_members(
            world.deps, me(everyone[0]), workspace_id="", page_size=3, page_token=token
        )
        pages += 1
        seen += [m.id for m in page.items]
        token = page.next_token
        if not token:
            break
    assert seen == sorted(m.id for m in everyone)
    assert pages == 3
    with pytest.raises(InvalidRequest):
        await members.list_members(
            world.deps, me(everyone[0]), workspace_id="", page_size=3, page_token="garbage"
        )


async def test_update_member_only_self(world: World) -> None:
    alice, bob = await people(world, 2)
    _, zed = await world.workspace("other")
    updated = await world.bus.handle(
        UpdateMember(
            caller=me(alice),
            member_id=str(alice.id),
            display_name=" Alice ",
            avatar="ignored",
            fields=["display_name"],
        )
    )
    assert updated.display_name == "Alice"
    assert updated.avatar == alice.avatar
    assert await members.get_member(world.deps, me(bob), str(alice.id)) == updated

    updated = await world.bus.handle(
        UpdateMember(
            caller=me(alice), member_id=str(alice.id), display_name="", avatar="pic", fields=["avatar"]
        )
    )
    assert (updated.display_name, updated.avatar) == ("Alice", "pic")

    with pytest.raises(NotAllowed):
        await world.bus.handle(
            UpdateMember(
                caller=me(bob),
                member_id=str(alice.id),
                display_name="mallory",
                avatar="",
                fields=["display_name"],
            )
        )
    with pytest.raises(NotFound):
        await world.bus.handle(
            UpdateMember(
                caller=me(zed),
                member_id=str(alice.id),
                display_name="mallory",
                avatar="",
                fields=["display_name"],
            )
        )
    with pytest.raises(Unauthenticated):
        await world.bus.handle(
            UpdateMember(
                caller=None,
                member_id=str(alice.id),
                display_name="mallory",
                avatar="",
                fields=["display_name"],
            )
        )
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            UpdateMember(
                caller=me(alice), member_id=str(alice.id), display_name="x", avatar="", fields=["kind"]
            )
        )
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            UpdateMember(caller=me(alice), member_id=str(alice.id), display_name="x", avatar="", fields=[])
        )
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            UpdateMember(
                caller=me(alice),
                member_id=str(alice.id),
                display_name=" ",
                avatar="",
                fields=["display_name"],
            )
        )
    assert world.store.state.members[alice.id] == updated
    # A service may update the agents it hosts, and no one else.
    hosted = await world.bus.handle(
        CreateMember(
            caller=SERVICE,
            workspace_id=str(alice.workspace_id),
            kind=MemberKind.AGENT,
            display_name="bot",
            avatar="",
            request_id="",
        )
    )
    renamed = await world.bus.handle(
        UpdateMember(
            caller=SERVICE, member_id=str(hosted.id), display_name="Bot", avatar="", fields=["display_name"]
        )
    )
    assert world.store.state.members[hosted.id] == renamed
    with pytest.raises(NotAllowed):
        await world.bus.handle(
            UpdateMember(
                caller=SERVICE, member_id=str(bob.id), display_name="Bob", avatar="", fields=["display_name"]
            )
        )


# -- groups -------------------------------------------------------------------


async def test_create_group_includes_the_caller_and_records_the_event(world: World) -> None:
    alice, bob, carol = await people(world, 3)
    group = await world.bus.handle(
        CreateGroup(
            caller=me(alice),
            name=" team ",
            member_ids=[str(bob.id), str(carol.id), str(bob.id)],
            request_id="",
        )
    )
    assert group.name == "team"
    assert group.kind is GroupKind.GROUP
    assert group.creator_id == alice.id
    assert set(group.member_ids) == {alice.id, bob.id, carol.id}
    assert len(group.member_ids) == 3
    stored = await groups.get_group(world.deps, me(carol), str(group.id))
    assert set(stored.member_ids) == set(group.member_ids)

    events = world.store.events_of(alice.workspace_id)
    assert len(events) == 1
    event = events[0].event
    assert isinstance(event, GroupChanged)
    assert event.group.id == group.id
    assert set(event.added_member_ids) == {alice.id, bob.id, carol.id}
    assert world.signal.published == [(alice.workspace_id, 1)]


async def test_create_group_with_only_the_caller(world: World) -> None:
    (alice,) = await people(world, 1)
    group = await world.bus.handle(CreateGroup(caller=me(alice), name="notes", member_ids=[], request_id=""))
    assert group.member_ids == (alice.id,)


async def test_create_group_refuses_unknown_and_foreign_members(world: World) -> None:
    alice, bob = await people(world, 2)
    _, zed = await world.workspace("other")
    for stranger in (uuid.uuid4(), zed.id):
        with pytest.raises(NotFound):
            await world.bus.handle(
                CreateGroup(
                    caller=me(alice), name="t", member_ids=[str(bob.id), str(stranger)], request_id=""
                )
            )
    with pytest.raises(InvalidRequest):
        await world.bus.handle(CreateGroup(caller=me(alice), name="t", member_ids=["nope"], request_id=""))
    with pytest.raises(InvalidRequest):
        await world.bus.handle(CreateGroup(caller=me(alice), name="", member_ids=[], request_id=""))
    with pytest.raises(Unauthenticated):
        await world.bus.handle(CreateGroup(caller=None, name="t", member_ids=[], request_id=""))
    assert world.store.state.groups == {}
    assert world.store.state.memberships == {}
    assert world.store.events_of(alice.workspace_id) == []
    assert world.signal.published == []


async def test_group_size_limit_on_create_and_add() -> None:
    world = World.make(limits=rules.Limits(max_group_members=3))
    alice, bob, carol, dave = await people(world, 4)
    with pytest.raises(LimitExceeded):
        await world.group(alice, bob, carol, dave)
    group = await world.group(alice, bob, carol)
    with pytest.raises(LimitExceeded):
        await world.bus.handle(
            AddGroupMembers(caller=me(alice), group_id=str(group.id), member_ids=[str(dave.id)])
        )
    assert len((await groups.get_group(world.deps, me(alice), str(group.id))).member_ids) == 3


async def test_create_group_is_idempotent_per_request_id(world: World) -> None:
    alice, bob, carol = await people(world, 3)
    rid = unique("rid")
    first = await world.bus.handle(
        CreateGroup(caller=me(alice), name="t", member_ids=[str(bob.id)], request_id=rid)
    )
    again = await world.bus.handle(
        CreateGroup(caller=me(alice), name="t", member_ids=[str(bob.id)], request_id=rid)
    )
    assert again.id == first.id
    assert len(world.store.state.groups) == 1
    with pytest.raises(RequestIdReused):
        await world.bus.handle(
            CreateGroup(caller=me(alice), name="t", member_ids=[str(carol.id)], request_id=rid)
        )
    # request_ids are per caller: bob may use the same one.
    bobs = await world.bus.handle(
        CreateGroup(caller=me(bob), name="t", member_ids=[str(alice.id)], request_id=rid)
    )
    assert bobs.id != first.id
    assert len(world.store.events_of(alice.workspace_id)) == 2


async def test_rename_group(world: World) -> None:
    alice, bob, outsider = await people(world, 3)
    _, zed = await world.workspace("other")
    group = await world.group(alice, bob)
    renamed = await world.bus.handle(
        RenameGroup(caller=me(bob), group_id=str(group.id), name=" new ", fields=["name"])
    )
    assert renamed.name == "new"
    assert (await groups.get_group(world.deps, me(alice), str(group.id))).name == "new"
    last = world.store.events_of(alice.workspace_id)[-1].event
    assert isinstance(last, GroupChanged)
    assert last.group.name == "new"
    assert (last.added_member_ids, last.removed_member_ids) == ((), ())

    with pytest.raises(NotAMember):
        await world.bus.handle(
            RenameGroup(caller=me(outsider), group_id=str(group.id), name="x", fields=["name"])
        )
    with pytest.raises(NotFound):
        await world.bus.handle(RenameGroup(caller=me(zed), group_id=str(group.id), name="x", fields=["name"]))
    with pytest.raises(NotFound):
        await world.bus.handle(
            RenameGroup(caller=me(alice), group_id=str(uuid.uuid4()), name="x", fields=["name"])
        )
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            RenameGroup(caller=me(alice), group_id=str(group.id), name="x", fields=["kind"])
        )
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            RenameGroup(caller=me(alice), group_id=str(group.id), name="", fields=["name"])
        )
    assert world.store.state.groups[group.id].name == "new"


async def test_add_and_remove_group_members(world: World) -> None:
    alice, bob, carol, dave = await people(world, 4)
    group = await world.group(alice, bob)

    grown = await world.bus.handle(
        AddGroupMembers(
            caller=me(bob), group_id=str(group.id), member_ids=[str(carol.id), str(dave.id), str(alice.id)]
        )
    )
    assert set(grown.member_ids) == {alice.id, bob.id, carol.id, dave.id}
    added = world.store.events_of(alice.workspace_id)[-1].event
    assert isinstance(added, GroupChanged)
    assert set(added.added_member_ids) == {carol.id, dave.id}

    shrunk = await world.bus.handle(
        RemoveGroupMembers(
            caller=me(alice), group_id=str(group.id), member_ids=[str(dave.id), str(uuid.uuid4())]
        )
    )
    assert set(shrunk.member_ids) == {alice.id, bob.id, carol.id}
    removed = world.store.events_of(alice.workspace_id)[-1].event
    assert isinstance(removed, GroupChanged)
    assert removed.removed_member_ids == (dave.id,)
    assert dave.id not in removed.group.member_ids

    # Nothing to change: no event.
    events = len(world.store.events_of(alice.workspace_id))
    await world.bus.handle(
        AddGroupMembers(caller=me(alice), group_id=str(group.id), member_ids=[str(bob.id)])
    )
    await world.bus.handle(
        RemoveGroupMembers(caller=me(alice), group_id=str(group.id), member_ids=[str(dave.id)])
    )
    assert len(world.store.events_of(alice.workspace_id)) == events

    # The removed member no longer sees the group.
    with pytest.raises(NotAMember):
        await groups.get_group(world.deps, me(dave), str(group.id))
    with pytest.raises(NotAMember):
        await world.send(dave, group)
    with pytest.raises(NotAMember):
        await world.bus.handle(
            AddGroupMembers(caller=me(dave), group_id=str(group.id), member_ids=[str(dave.id)])
        )
    assert group.id not in {
        g.id
        for g in (
            await groups.list_groups(world.deps, me(dave), member_id="", page_size=0, page_token="")
        ).items
    }


async def test_add_group_members_refuses_unknown_and_empty(world: World) -> None:
    alice, bob = await people(world, 2)
    _, zed = await world.workspace("other")
    group = await world.group(alice, bob)
    for stranger in (uuid.uuid4(), zed.id):
        with pytest.raises(NotFound):
            await world.bus.handle(
                AddGroupMembers(caller=me(alice), group_id=str(group.id), member_ids=[str(stranger)])
            )
    with pytest.raises(InvalidRequest):
        await world.bus.handle(AddGroupMembers(caller=me(alice), group_id=str(group.id), member_ids=[]))
    with pytest.raises(InvalidRequest):
        await world.bus.handle(RemoveGroupMembers(caller=me(alice), group_id=str(group.id), member_ids=[]))
    assert set(world.store.state.memberships[group.id]) == {alice.id, bob.id}


async def test_non_member_cannot_see_a_group(world: World) -> None:
    alice, bob, outsider = await people(world, 3)
    group = await world.group(alice, bob)
    with pytest.raises(NotAMember):
        await groups.get_group(world.deps, me(outsider), str(group.id))
    with pytest.raises(NotAMember):
        await messages.list_messages(
            world.deps,
            me(outsider),
            group_id=str(group.id),
            page_size=0,
            page_token="",
            before_message_id="",
            after_message_id="",
        )


async def test_list_groups(world: World) -> None:
    alice, bob = await people(world, 2)
    teams = [await world.group(alice, bob, name=f"g{i}") for i in range(5)]
    mine = await world.group(alice, name="mine")
    seen: list[uuid.UUID] = []
    token = ""
    while True:
        page = await groups.list_groups(world.deps, me(bob), member_id="", page_size=2, page_token=token)
        seen += [g.id for g in page.items]
        token = page.next_token
        if not token:
            break
    assert seen == sorted(g.id for g in teams)
    with pytest.raises(NotAllowed):
        await groups.list_groups(world.deps, me(bob), member_id=str(alice.id), page_size=0, page_token="")
    as_service = await groups.list_groups(
        world.deps, SERVICE, member_id=str(alice.id), page_size=0, page_token=""
    )
    assert [g.id for g in as_service.items] == sorted([*(g.id for g in teams), mine.id])
    with pytest.raises(InvalidRequest):
        await groups.list_groups(world.deps, SERVICE, member_id="", page_size=0, page_token="")


# -- direct groups --------------------------------------------------------------


async def test_direct_group_is_one_per_pair_from_either_side(world: World) -> None:
    alice, bob, carol = await people(world, 3)
    direct, created = await world.bus.handle(
        GetOrCreateDirectGroup(caller=me(alice), peer_member_id=str(bob.id))
    )
    assert created
    assert direct.kind is GroupKind.DIRECT
    assert set(direct.member_ids) == {alice.id, bob.id}
    again, created = await world.bus.handle(
        GetOrCreateDirectGroup(caller=me(alice), peer_member_id=str(bob.id))
    )
    assert (again.id, created) == (direct.id, False)
    theirs, created = await world.bus.handle(
        GetOrCreateDirectGroup(caller=me(bob), peer_member_id=str(alice.id))
    )
    assert (theirs.id, created) == (direct.id, False)
    other, created = await world.bus.handle(
        GetOrCreateDirectGroup(caller=me(carol), peer_member_id=str(alice.id))
    )
    assert created
    assert other.id != direct.id
    assert len(world.store.events_of(alice.workspace_id)) == 2


async def test_direct_group_refuses_self_and_strangers(world: World) -> None:
    (alice,) = await people(world, 1)
    _, zed = await world.workspace("other")
    with pytest.raises(InvalidRequest):
        await world.bus.handle(GetOrCreateDirectGroup(caller=me(alice), peer_member_id=str(alice.id)))
    with pytest.raises(NotFound):
        await world.bus.handle(GetOrCreateDirectGroup(caller=me(alice), peer_member_id=str(zed.id)))
    with pytest.raises(NotFound):
        await world.bus.handle(GetOrCreateDirectGroup(caller=me(alice), peer_member_id=str(uuid.uuid4())))
    assert world.store.state.groups == {}


async def test_concurrent_direct_group_from_both_sides_makes_one_group() -> None:
    world = World.make(yield_on_call=True)
    alice, bob = await people(world, 2)
    results = await asyncio.gather(
        world.bus.handle(GetOrCreateDirectGroup(caller=me(alice), peer_member_id=str(bob.id))),
        world.bus.handle(GetOrCreateDirectGroup(caller=me(bob), peer_member_id=str(alice.id))),
        world.bus.handle(GetOrCreateDirectGroup(caller=me(alice), peer_member_id=str(bob.id))),
    )
    assert len({group.id for group, _ in results}) == 1
    assert sorted(created for _, created in results) == [False, False, True]
    assert len(world.store.state.groups) == 1
    assert len(world.store.events_of(alice.workspace_id)) == 1


async def test_direct_group_cannot_be_renamed_or_changed(world: World) -> None:
    alice, bob, carol = await people(world, 3)
    direct, _ = await world.bus.handle(GetOrCreateDirectGroup(caller=me(alice), peer_member_id=str(bob.id)))
    with pytest.raises(WrongState):
        await world.bus.handle(
            RenameGroup(caller=me(alice), group_id=str(direct.id), name="x", fields=["name"])
        )
    with pytest.raises(WrongState):
        await world.bus.handle(
            AddGroupMembers(caller=me(alice), group_id=str(direct.id), member_ids=[str(carol.id)])
        )
    with pytest.raises(WrongState):
        await world.bus.handle(
            RemoveGroupMembers(caller=me(alice), group_id=str(direct.id), member_ids=[str(bob.id)])
        )
    with pytest.raises(NotAMember):
        await world.bus.handle(
            RenameGroup(caller=me(carol), group_id=str(direct.id), name="x", fields=["name"])
        )
    assert set((await groups.get_group(world.deps, me(bob), str(direct.id))).member_ids) == {alice.id, bob.id}
    assert len(world.store.events_of(alice.workspace_id)) == 1


# -- sending ----------------------------------------------------------------------


async def test_send_message_stores_it_and_signals_only_after_commit(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    seen_at_signal: list[tuple[int, int, bool]] = []

    def receiver(workspace_id: uuid.UUID | None, sequence: int) -> None:
        assert workspace_id is not None
        committed = world.store.last_sequence(workspace_id)
        messages = len(world.store.state.messages)
        seen_at_signal.append((sequence, committed, messages == 1))

    world.signal.connect(receiver)
    message = await world.send(
        alice,
        group,
        "hi @bob",
        mentions=(bob,),
        metadata={"k": [1, 2]},
        content_type=ContentType.CODE,
    )
    assert message.sender_id == alice.id
    assert message.group_id == group.id
    assert message.workspace_id == alice.workspace_id
    assert message.mentions == (bob.id,)
    assert message.content_type is ContentType.CODE
    assert message.metadata == {"k": [1, 2]}
    assert world.store.state.messages[message.id] == message
    assert await messages.get_message(world.deps, me(bob), str(message.id)) == message

    events = world.store.events_of(alice.workspace_id)
    assert events[-1].sequence == 2
    created = events[-1].event
    assert isinstance(created, MessageCreated)
    assert created.message.id == message.id
    assert created.message.content == "hi @bob"
    assert events[-1].group_id == group.id
    # The signal came after the commit and named the committed sequence.
    assert seen_at_signal == [(2, 2, True)]
    assert world.signal.published[-1] == (alice.workspace_id, 2)


async def test_send_message_defaults_to_text(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    assert (await world.send(alice, group)).content_type is ContentType.TEXT


async def test_send_message_refuses_non_members(world: World) -> None:
    alice, bob, outsider = await people(world, 3)
    _, zed = await world.workspace("other")
    group = await world.group(alice, bob)
    with pytest.raises(NotAMember):
        await world.send(outsider, group)
    with pytest.raises(NotFound):
        await world.send(zed, group)
    with pytest.raises(Unauthenticated):
        await world.bus.handle(
            SendMessage(
                caller=None,
                group_id=str(group.id),
                content_type=None,
                content="x",
                mentions=[],
                reply_to_message_id="",
                metadata={},
                request_id="",
            )
        )
    assert world.store.state.messages == {}
    assert len(world.signal.published) == 1  # the group's creation only


async def test_mentions_must_be_group_members(world: World) -> None:
    alice, bob, outsider = await people(world, 3)
    group = await world.group(alice, bob)
    with pytest.raises(InvalidRequest):
        await world.send(alice, group, mentions=(bob, outsider))
    assert world.store.state.messages == {}
    message = await world.send(alice, group, mentions=(bob, alice, bob))
    assert message.mentions == (bob.id, alice.id)


async def test_reply_to_must_be_a_message_of_the_group(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    elsewhere = await world.group(alice, name="other")
    original = await world.send(bob, group, "question")
    foreign = await world.send(alice, elsewhere, "note")
    reply = await world.send(alice, group, "answer", reply_to=original)
    assert reply.reply_to == original.id
    with pytest.raises(InvalidRequest):
        await world.send(alice, group, "answer", reply_to=foreign)
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            SendMessage(
                caller=me(alice),
                group_id=str(group.id),
                content_type=None,
                content="x",
                mentions=[],
                reply_to_message_id=str(uuid.uuid4()),
                metadata={},
                request_id="",
            )
        )
    assert len(world.store.state.messages) == 3


async def test_send_message_limits() -> None:
    world = World.make(limits=rules.Limits(max_content_bytes=8, max_mentions=1, max_metadata_bytes=16))
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    await world.send(alice, group, "12345678")
    with pytest.raises(InvalidRequest):
        await world.send(alice, group, "123456789")
    with pytest.raises(InvalidRequest):
        await world.send(alice, group, "  ")
    with pytest.raises(InvalidRequest):
        await world.send(alice, group, "ok", mentions=(alice, bob))
    with pytest.raises(InvalidRequest):
        await world.send(alice, group, "ok", metadata={"key": "x" * 20})
    with pytest.raises(InvalidRequest):
        await world.send(alice, group, request_id="r" * 129)
    assert len(world.store.state.messages) == 1


async def test_send_message_retry_returns_the_same_message(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    rid = unique("rid")
    first = await world.send(alice, group, "once", request_id=rid, mentions=(bob,))
    world.clock.advance(timedelta(minutes=5))
    again = await world.send(alice, group, "once", request_id=rid, mentions=(bob,))
    assert again == first
    assert len(world.store.state.messages) == 1
    created = [e for e in world.store.events_of(alice.workspace_id) if isinstance(e.event, MessageCreated)]
    assert len(created) == 1
    # Another sender's request_id space is its own.
    bobs = await world.send(bob, group, "once", request_id=rid)
    assert bobs.id != first.id


@pytest.mark.parametrize(
    ("content", "mention", "metadata", "content_type"),
    [
        ("different", True, None, None),
        ("once", False, None, None),
        ("once", True, {"x": 1}, None),
        ("once", True, None, ContentType.CODE),
    ],
)
async def test_send_message_request_id_reused_for_a_different_payload(
    world: World,
    content: str,
    mention: bool,
    metadata: dict[str, int] | None,
    content_type: ContentType | None,
) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    rid = unique("rid")
    await world.send(alice, group, "once", request_id=rid, mentions=(bob,))
    with pytest.raises(RequestIdReused):
        await world.send(
            alice,
            group,
            content,
            mentions=(bob,) if mention else (),
            metadata=metadata,
            content_type=content_type,
            request_id=rid,
        )
    assert len(world.store.state.messages) == 1


async def test_send_message_request_id_reused_in_another_group(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    other = await world.group(alice, bob, name="other")
    rid = unique("rid")
    await world.send(alice, group, "once", request_id=rid)
    with pytest.raises(RequestIdReused):
        await world.send(alice, other, "once", request_id=rid)


async def test_concurrent_retries_of_one_send_store_one_message() -> None:
    world = World.make(yield_on_call=True)
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    rid = unique("rid")
    sent = await asyncio.gather(*(world.send(alice, group, "once", request_id=rid) for _ in range(3)))
    assert len({m.id for m in sent}) == 1
    assert len(world.store.state.messages) == 1
    created = [e for e in world.store.events_of(alice.workspace_id) if isinstance(e.event, MessageCreated)]
    assert len(created) == 1
    assert world.store.open_claims() == 0


async def test_concurrent_sends_get_gap_free_sequences_in_commit_order() -> None:
    world = World.make(yield_on_call=True)
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    await asyncio.gather(*(world.send(m, group, f"m{i}") for i in range(10) for m in (alice, bob)))
    events = world.store.events_of(alice.workspace_id)
    assert [e.sequence for e in events] == list(range(1, 22))
    assert sorted(s for _, s in world.signal.published) == list(range(1, 22))


async def test_a_failed_signal_does_not_fail_the_send(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    world.signal.fail_with = ConnectionError("redis is down")
    message = await world.send(alice, group)
    assert world.store.state.messages[message.id] == message
    assert world.store.last_sequence(alice.workspace_id) == 2


async def test_a_failure_mid_transaction_leaves_no_partial_state(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    before = world.store.state
    published = list(world.signal.published)

    world.store.hooks["append_event"] = failing(RuntimeError("disk full"))
    with pytest.raises(RuntimeError):
        await world.send(alice, group, "lost")
    with pytest.raises(RuntimeError):
        await world.group(alice, bob, name="lost too")
    with pytest.raises(RuntimeError):
        await world.bus.handle(
            RenameGroup(caller=me(alice), group_id=str(group.id), name="lost", fields=["name"])
        )
    assert world.store.state is before
    assert world.store.state.messages == {}
    assert len(world.store.state.groups) == 1
    assert world.store.state.groups[group.id].name == "team"
    assert world.signal.published == published

    del world.store.hooks["append_event"]
    sent = await world.send(alice, group, "kept")
    assert list(world.store.state.messages) == [sent.id]
    assert world.store.events_of(alice.workspace_id)[-1].sequence == 2


async def test_a_failure_after_the_insert_leaves_no_request_id_behind(world: World) -> None:
    world.store.hooks["remember_request"] = failing(RuntimeError("boom"))
    with pytest.raises(RuntimeError):
        await world.bus.handle(
            CreateWorkspace(
                name="acme", creator_display_name="a", creator_kind=None, creator_avatar="", request_id="r1"
            )
        )
    assert world.store.state.workspaces == {}
    assert world.store.state.members == {}
    del world.store.hooks["remember_request"]
    workspace, _, _ = await world.bus.handle(
        CreateWorkspace(
            name="acme", creator_display_name="a", creator_kind=None, creator_avatar="", request_id="r1"
        )
    )
    assert list(world.store.state.workspaces) == [workspace.id]


# -- editing ----------------------------------------------------------------------------


async def test_edit_message_by_the_sender(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    message = await world.send(alice, group, "draft")
    world.clock.set(world.clock.now + timedelta(hours=1))
    edited = await world.bus.handle(
        EditMessage(caller=me(alice), message_id=str(message.id), content="final")
    )
    assert edited.content == "final"
    assert edited.edited_at is not None
    assert edited.edited_at > message.sent_at
    assert edited.sent_at == message.sent_at
    assert await messages.get_message(world.deps, me(bob), str(message.id)) == edited
    last = world.store.events_of(alice.workspace_id)[-1].event
    assert isinstance(last, MessageEdited)
    assert last.message.content == "final"


async def test_edit_message_refusals(world: World) -> None:
    alice, bob, outsider = await people(world, 3)
    group = await world.group(alice, bob)
    message = await world.send(alice, group, "draft")
    with pytest.raises(NotAllowed):
        await world.bus.handle(EditMessage(caller=me(bob), message_id=str(message.id), content="hijack"))
    with pytest.raises(NotAMember):
        await world.bus.handle(EditMessage(caller=me(outsider), message_id=str(message.id), content="hijack"))
    with pytest.raises(NotFound):
        await world.bus.handle(EditMessage(caller=me(alice), message_id=str(uuid.uuid4()), content="x"))
    with pytest.raises(InvalidRequest):
        await world.bus.handle(EditMessage(caller=me(alice), message_id=str(message.id), content=" "))
    assert world.store.state.messages[message.id] == message


# -- history ----------------------------------------------------------------------------


async def history(world: World, reader: Member, group_id: uuid.UUID, **start: str) -> list[list[Message]]:
    """Every page of a listing, following its page tokens."""
    pages: list[list[Message]] = []
    token = ""
    while True:
        page = await messages.list_messages(
            world.deps,
            me(reader),
            group_id=str(group_id),
            page_size=4,
            page_token=token,
            before_message_id=start.get("before", "") if not token else "",
            after_message_id=start.get("after", "") if not token else "",
        )
        pages.append(page.items)
        token = page.next_token
        if not token:
            return pages
        assert len(pages) < 50, "paging does not end"


async def test_list_messages_backwards_covers_everything_once(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    other = await world.group(alice, bob, name="other")
    sent = [await world.send(alice if i % 2 else bob, group, f"m{i}") for i in range(10)]
    await world.send(alice, other, "not here")
    pages = await history(world, bob, group.id)
    assert [len(p) for p in pages] == [4, 4, 2]
    for page in pages:
        assert [m.id for m in page] == sorted(m.id for m in page)
    flattened = [m for page in reversed(pages) for m in page]
    assert [m.id for m in flattened] == [m.id for m in sent]

    before_last = await history(world, bob, group.id, before=str(sent[-1].id))
    assert [m.id for page in reversed(before_last) for m in page] == [m.id for m in sent[:-1]]


async def test_list_messages_forwards_covers_everything_once(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    sent = [await world.send(alice, group, f"m{i}") for i in range(9)]
    pages = await history(world, bob, group.id, after=str(NIL_ID))
    assert [len(p) for p in pages] == [4, 4, 1]
    assert [m.id for page in pages for m in page] == [m.id for m in sent]
    after_second = await history(world, bob, group.id, after=str(sent[1].id))
    assert [m.id for page in after_second for m in page] == [m.id for m in sent[2:]]
    # Exactly a page's worth: the last page says there is no more.
    exact = await history(world, bob, group.id, after=str(sent[4].id))
    assert [len(p) for p in exact] == [4]


async def test_list_messages_empty_group(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    assert await history(world, alice, group.id) == [[]]


async def test_list_messages_refuses_bad_cursors(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    other = await world.group(alice, bob, name="other")
    for _ in range(3):
        await world.send(alice, group)
    page = await messages.list_messages(
        world.deps,
        me(alice),
        group_id=str(group.id),
        page_size=1,
        page_token="",
        before_message_id="",
        after_message_id="",
    )
    assert page.next_token

    async def listing(
        group_id: uuid.UUID, *, token: str = "", before: str = "", after: str = "", page_size: int = 1
    ) -> None:
        await messages.list_messages(
            world.deps,
            me(alice),
            group_id=str(group_id),
            page_size=page_size,
            page_token=token,
            before_message_id=before,
            after_message_id=after,
        )

    with pytest.raises(InvalidRequest):
        await listing(other.id, token=page.next_token)
    with pytest.raises(InvalidRequest):
        await listing(group.id, token="garbage")
    with pytest.raises(InvalidRequest):
        await listing(group.id, token=rules.encode_page_token({"after": str(uuid.uuid4())}))
    sideways = {"group": str(group.id), "direction": "sideways", "cursor": str(uuid.uuid4())}
    with pytest.raises(InvalidRequest):
        await listing(group.id, token=rules.encode_page_token(sideways))
    with pytest.raises(InvalidRequest):
        await listing(group.id, before=str(uuid.uuid4()), after=str(uuid.uuid4()))
    with pytest.raises(InvalidRequest):
        await listing(group.id, before="nope")
    with pytest.raises(InvalidRequest):
        await listing(group.id, page_size=-1)


# -- read state ----------------------------------------------------------------------------


async def unread_of(world: World, member: Member) -> dict[uuid.UUID, int]:
    page = await read_state.list_chats(world.deps, me(member), page_size=0, page_token="")
    return {chat.group.id: chat.unread_count for chat in page.items}


async def test_mark_read_moves_forward_only_and_ignores_own_messages(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    first = await world.send(bob, group, "1")
    second = await world.send(bob, group, "2")
    await world.send(alice, group, "mine")
    third = await world.send(bob, group, "3")
    assert (await unread_of(world, alice))[group.id] == 3
    assert (await unread_of(world, bob))[group.id] == 1

    state = await world.bus.handle(
        MarkRead(caller=me(alice), group_id=str(group.id), up_to_message_id=str(second.id))
    )
    assert (state.last_read_message_id, state.unread_count) == (second.id, 1)
    assert world.store.state.memberships[group.id][alice.id].last_read_message_id == second.id
    read_event = world.store.events_of(alice.workspace_id)[-1].event
    assert isinstance(read_event, ReadUpdated)
    assert read_event.read_state == state

    events = len(world.store.events_of(alice.workspace_id))
    backwards = await world.bus.handle(
        MarkRead(caller=me(alice), group_id=str(group.id), up_to_message_id=str(first.id))
    )
    assert (backwards.last_read_message_id, backwards.unread_count) == (second.id, 1)
    assert len(world.store.events_of(alice.workspace_id)) == events
    same = await world.bus.handle(
        MarkRead(caller=me(alice), group_id=str(group.id), up_to_message_id=str(second.id))
    )
    assert same == state
    assert len(world.store.events_of(alice.workspace_id)) == events

    done = await world.bus.handle(
        MarkRead(caller=me(alice), group_id=str(group.id), up_to_message_id=str(third.id))
    )
    assert done.unread_count == 0
    assert (await unread_of(world, alice))[group.id] == 0
    # Bob's position is his own.
    assert world.store.state.memberships[group.id][bob.id].last_read_message_id == NIL_ID


async def test_mark_read_refusals(world: World) -> None:
    alice, bob, outsider = await people(world, 3)
    group = await world.group(alice, bob)
    other = await world.group(alice, name="other")
    message = await world.send(bob, group)
    elsewhere = await world.send(alice, other)
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            MarkRead(caller=me(alice), group_id=str(group.id), up_to_message_id=str(elsewhere.id))
        )
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            MarkRead(caller=me(alice), group_id=str(group.id), up_to_message_id=str(uuid.uuid4()))
        )
    with pytest.raises(NotAMember):
        await world.bus.handle(
            MarkRead(caller=me(outsider), group_id=str(group.id), up_to_message_id=str(message.id))
        )
    assert world.store.state.memberships[group.id][alice.id].last_read_message_id == NIL_ID


async def test_get_all_unread_oldest_first_across_groups() -> None:
    world = World.make(limits=rules.Limits(max_unread_page_size=4))
    alice, bob, carol = await people(world, 3)
    one = await world.group(alice, bob, name="one")
    two = await world.group(alice, carol, name="two")
    unrelated = await world.group(bob, carol, name="unrelated")
    expected = []
    for i in range(3):
        expected.append(await world.send(bob, one, f"one-{i}"))
        await world.send(alice, one, "mine")
        expected.append(await world.send(carol, two, f"two-{i}"))
        await world.send(bob, unrelated, "not for alice")

    messages, remaining = await read_state.get_all_unread(world.deps, me(alice), page_size=2)
    assert [m.id for m in messages] == [m.id for m in expected[:2]]
    assert remaining == 4
    messages, remaining = await read_state.get_all_unread(world.deps, me(alice), page_size=0)
    assert [m.id for m in messages] == [m.id for m in expected[:4]]  # capped
    assert remaining == 2
    messages, remaining = await read_state.get_all_unread(world.deps, me(alice), page_size=1000)
    assert len(messages) == 4
    assert remaining == 2

    await world.bus.handle(
        MarkRead(caller=me(alice), group_id=str(one.id), up_to_message_id=str(expected[4].id))
    )
    messages, remaining = await read_state.get_all_unread(world.deps, me(alice), page_size=0)
    assert [m.id for m in messages] == [expected[1].id, expected[3].id, expected[5].id]
    assert remaining == 0
    with pytest.raises(InvalidRequest):
        await read_state.get_all_unread(world.deps, me(alice), page_size=-1)
    with pytest.raises(Unauthenticated):
        await read_state.get_all_unread(world.deps, None, page_size=0)


async def test_get_all_unread_excludes_groups_left(world: World) -> None:
    alice, bob = await people(world, 2)
    group = await world.group(alice, bob)
    await world.send(alice, group, "for bob")
    assert len((await read_state.get_all_unread(world.deps, me(bob), page_size=0))[0]) == 1
    await world.bus.handle(
        RemoveGroupMembers(caller=me(alice), group_id=str(group.id), member_ids=[str(bob.id)])
    )
    assert await read_state.get_all_unread(world.deps, me(bob), page_size=0) == ([], 0)


# -- chats ---------------------------------------------------------------------------------


async def test_list_chats_orders_by_latest_activity_with_unread_counts(world: World) -> None:
    alice, bob = await people(world, 2)
    first = await world.group(alice, bob, name="first")
    second = await world.group(alice, bob, name="second")
    direct, _ = await world.bus.handle(GetOrCreateDirectGroup(caller=me(bob), peer_member_id=str(alice.id)))
    quiet = await world.group(bob, name="bob only")
    world.clock.advance(timedelta(minutes=1))
    await world.send(bob, first, "wake up")
    await world.send(bob, first, "again")
    world.clock.advance(timedelta(minutes=1))
    latest = await world.send(alice, second, "mine")

    page = await read_state.list_chats(world.deps, me(alice), page_size=0, page_token="")
    assert [c.group.id for c in page.items] == [second.id, first.id, direct.id]
    assert [c.unread_count for c in page.items] == [0, 2, 0]
    assert page.items[0].last_message == latest
    assert page.items[0].last_activity_at == latest.sent_at
    assert page.items[2].last_message is None
    assert page.items[2].last_activity_at == direct.created_at
    assert page.next_token == ""

    bobs = await read_state.list_chats(world.deps, me(bob), page_size=0, page_token="")
    assert [c.group.id for c in bobs.items] == [second.id, first.id, quiet.id, direct.id]
    assert [c.unread_count for c in bobs.items] == [1, 0, 0, 0]


async def test_list_chats_pages_cover_every_chat_once_in_order() -> None:
    # A still clock: every chat has the same activity time, so ties are broken by id.
    world = World.make(tick=timedelta(0))
    alice, bob = await people(world, 2)
    groups = [await world.group(alice, bob, name=f"g{i}") for i in range(7)]
    world.clock.advance()
    await world.send(bob, groups[3])
    seen: list[uuid.UUID] = []
    token = ""
    while True:
        page = await read_state.list_chats(world.deps, me(alice), page_size=2, page_token=token)
        assert len(page.items) <= 2
        seen += [c.group.id for c in page.items]
        token = page.next_token
        if not token:
            break
    rest = sorted((g.id for g in groups if g.id != groups[3].id), key=str, reverse=True)
    assert seen == [groups[3].id, *rest]
    with pytest.raises(InvalidRequest):
        await read_state.list_chats(world.deps, me(alice), page_size=2, page_token="garbage")


async def test_list_chats_with_no_groups(world: World) -> None:
    (alice,) = await people(world, 1)
    page = await read_state.list_chats(world.deps, me(alice), page_size=0, page_token="")
    assert (page.items, page.next_token) == ([], "")


async def test_service_default_limits() -> None:
    world = World.make()
    deps = Deps(
        uow=world.store.transaction,
        messages=TransactionalMessageLog(world.store.transaction),
        signal=world.signal,
    )
    assert deps.limits == rules.Limits()


async def test_a_valid_message_the_log_refuses_is_reported_as_a_conflict() -> None:
    class RefusingLog(TransactionalMessageLog):
        async def append(self, message: Message, at: datetime) -> int | None:
            return None  # as if the group changed between the append and the diagnosis

    world = World.make()
    deps = Deps(
        uow=world.store.transaction, messages=RefusingLog(world.store.transaction), signal=world.signal
    )
    _, alice = await world.workspace()
    group = await groups.create_group(
        deps, CreateGroup(caller=me(alice), name="g", member_ids=[], request_id="")
    )
    published = list(world.signal.published)
    with pytest.raises(Conflict):
        await messages.send_message(
            deps,
            SendMessage(
                caller=me(alice),
                group_id=str(group.id),
                content_type=None,
                content="hello",
                mentions=[],
                reply_to_message_id="",
                metadata={},
                request_id="",
            ),
        )
    assert world.signal.published == published
