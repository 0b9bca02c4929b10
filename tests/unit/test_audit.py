"""The audit log's rules (services.common.audit): who the actor is, what a
refusal records, what details keep, page tokens, settings, pruning; and the
IM's and the runtime's handlers recording with their changes (fakes)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from services.common import audit
from services.common.audit_boundary import AuditPruner, refusal_record
from services.common.errors import InvalidArgument, PermissionDenied, Unauthenticated, Unavailable
from services.common.identity import Caller
from services.common.outages import DATABASE, DependencyUnavailable
from services.common.settings import ConfigError, EnvReader
from services.common.tokens import AccessClaims, PrincipalKind, Scope
from services.im.domain.commands import CreateGroup, CreateInvite, CreateMember, SetAgentOwners, SetMemberRole
from services.im.domain.errors import QuotaExceeded
from services.im.domain.model import MemberKind, Role
from services.im.domain.rules import Quotas, check_quota
from tests.unit.auth_fakes import InMemoryAuditLog
from tests.unit.test_auth_handlers import AuthWorld

NOW = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
WS = uuid.uuid4()
ADA = uuid.uuid4()


def person(*, roles: tuple[str, ...] = ("member",), view_as: uuid.UUID | None = None) -> Caller:
    claims = AccessClaims(
        kind=PrincipalKind.HUMAN, member_id=ADA, workspace_id=WS, roles=roles, scope=Scope.READ_WRITE
    )
    return Caller(claims=claims, view_as=view_as)


def test_the_actor_is_the_verified_caller() -> None:
    assert audit.actor_of(person()) == audit.Actor("human", member_id=ADA)
    # A view as an agent acts as the person (reads only; writes through a view are refused).
    assert audit.actor_of(person(view_as=uuid.uuid4())) == audit.Actor("human", member_id=ADA)
    agent = AccessClaims(kind=PrincipalKind.AGENT, member_id=ADA, workspace_id=WS, host="runtime")
    assert audit.actor_of(Caller(claims=agent)).kind == "agent"
    service = Caller(claims=AccessClaims(kind=PrincipalKind.SERVICE, service="runtime"))
    assert audit.actor_of(service) == audit.Actor("service", service="runtime")
    assert audit.actor_of(service).key == "service:runtime"
    assert audit.actor_of(None) == audit.ANONYMOUS


def test_details_never_keep_what_looks_like_a_secret() -> None:
    kept = audit.safe_details(
        {
            "name": "ci",
            "password": "hunter2",
            "new_password": "x",
            "api_key": "sk-1",
            "apiKey": "sk-2",
            "secret": "s",
            "refresh_token": "t",
            "Authorization": "Bearer x",
            "count": 3,
            "long": "y" * 1000,
        }
    )
    assert kept == {"name": "ci", "count": "3", "long": "y" * audit.MAX_DETAIL_CHARS}


def test_a_refusal_is_recorded_for_a_caller_of_a_known_workspace_only() -> None:
    target = audit.Target("member", str(uuid.uuid4()))

    def record(error: BaseException, caller: Caller | None) -> audit.AuditRecord | None:
        return refusal_record(error, caller, action="SetMemberRole", target=target, request_id="r-1", at=NOW)

    denied = record(PermissionDenied("only admins change roles"), person())
    assert denied is not None
    assert (denied.workspace_id, denied.actor.member_id, denied.code, denied.reason, denied.count) == (
        WS,
        ADA,
        "PERMISSION_DENIED",
        "only admins change roles",
        1,
    )
    assert (denied.target, denied.request_id, denied.at, denied.last_at, denied.ok) == (
        target,
        "r-1",
        NOW,
        NOW,
        False,
    )
    assert record(Unauthenticated("old_password is wrong"), person()) is not None
    internal = record(RuntimeError("boom with details"), person())
    assert internal is not None and (internal.code, internal.reason) == ("INTERNAL", "internal error")
    # No workspace known: a token-less caller, a service acting for nobody.
    assert record(Unauthenticated("no token"), None) is None
    service = Caller(claims=AccessClaims(kind=PrincipalKind.SERVICE, service="runtime"))
    assert record(PermissionDenied("no"), service) is None
    # The service could not answer: nothing happened, nothing is recorded.
    assert record(Unavailable("database down"), person()) is None
    assert record(DependencyUnavailable(DATABASE, "down"), person()) is None
    long = record(InvalidArgument("x" * 1000), person())
    assert long is not None and len(long.reason) == audit.MAX_REASON_CHARS


def test_a_reason_never_keeps_credentials_it_quotes() -> None:
    reason = (
        "model.base_url must be an http(s) URL, got 'ftp://bot:sk-SECRET@llm.example/v1';"
        " header Bearer eyJhbGciOi.x.y; token aim_pat_AbC-123_xyz"
    )
    record = refusal_record(
        InvalidArgument(reason),
        person(),
        action="UpdateAgent",
        target=audit.Target("agent"),
        request_id="",
        at=NOW,
    )
    assert record is not None
    assert record.reason == (
        "model.base_url must be an http(s) URL, got 'ftp://***@llm.example/v1';"
        " header Bearer ***; token aim_***"
    )


def test_page_tokens_belong_to_their_query() -> None:
    query = audit.AuditQuery(action="SignIn", outcome=audit.OutcomeFilter.REFUSED)
    cursor = audit.Cursor(NOW, uuid.uuid4())
    token = audit.encode_cursor(cursor, query)
    assert audit.decode_cursor(token, query) == cursor
    assert audit.decode_cursor("", query) is None
    with pytest.raises(InvalidArgument, match="another query"):
        audit.decode_cursor(token, audit.AuditQuery(action="SignOut"))
    for bad in ("garbage", "!!!", token[:-4]):
        with pytest.raises(InvalidArgument):
            audit.decode_cursor(bad, query)


def test_queries_and_page_sizes_are_checked() -> None:
    assert audit.page_size(0) == 50
    assert audit.page_size(1000) == 200
    with pytest.raises(InvalidArgument):
        audit.page_size(-1)
    with pytest.raises(InvalidArgument, match="end_time"):
        audit.check_query(audit.AuditQuery(start=NOW, end=NOW))
    with pytest.raises(InvalidArgument, match="actor"):
        audit.check_query(audit.AuditQuery(actor="x" * 201))


def test_settings_default_to_a_year_and_zero_keeps_forever() -> None:
    assert audit.read_audit_settings(EnvReader({})).retention == timedelta(days=365)
    settings = audit.read_audit_settings(EnvReader({"AUDIT_RETENTION_DAYS": "0"}))
    assert settings.retention is None
    reader = EnvReader({"AUDIT_RETENTION_DAYS": "-1", "AUDIT_PRUNE_INTERVAL_SECONDS": "1"})
    audit.read_audit_settings(reader)
    with pytest.raises(ConfigError) as raised:
        reader.finish()
    assert len(raised.value.problems) == 2


def test_a_quota_refuses_at_its_limit_and_zero_is_none() -> None:
    check_quota("groups", 3, 2)
    check_quota("groups", 0, 10**6)
    with pytest.raises(QuotaExceeded) as raised:
        check_quota("groups", 3, 3)
    assert raised.value.quota_violation is not None
    assert raised.value.quota_violation.subject == "workspace:groups"
    assert "quota of 3 groups" in raised.value.message


async def test_the_pruner_prunes_past_the_retention_at_start_and_stops() -> None:
    log = InMemoryAuditLog()
    pruner = AuditPruner(log, audit.AuditSettings(retention=timedelta(days=30)), clock=lambda: NOW)
    pruner.start()
    for _ in range(50):
        if log.pruned_before:
            break
        await asyncio.sleep(0.01)
    await pruner.aclose()
    await pruner.aclose()
    assert log.pruned_before == [NOW - timedelta(days=30)]
    # Kept forever: nothing to run.
    forever = AuditPruner(log, audit.AuditSettings(retention=None))
    forever.start()
    assert await forever.prune_once() == 0
    await forever.aclose()


# -- handlers record with their changes (fakes) -------------------------------------


@pytest.fixture
async def world(tmp_path: Path) -> AuthWorld:
    return AuthWorld.make(tmp_path)


def actions(world: AuthWorld) -> list[str]:
    return [r.action for r in world.store.state.audit]


async def test_a_role_change_records_each_member_it_changes_and_nothing_when_none(world: AuthWorld) -> None:
    _, ada, tokens = await world.owner()
    owner = await world.as_caller(tokens)
    bea = (await world.invite_and_join(owner, "bea")).member
    before = len(world.store.state.audit)
    await world.bus.handle(SetMemberRole(caller=owner, member_id=str(bea.id), role=Role.ADMIN))
    await world.bus.handle(SetMemberRole(caller=owner, member_id=str(bea.id), role=Role.ADMIN))
    new = world.store.state.audit[before:]
    assert [(r.action, r.target.id, dict(r.details)) for r in new] == [
        ("SetMemberRole", str(bea.id), {"role": "admin"})
    ]
    # Handing over the workspace changes two members: two records.
    await world.bus.handle(SetMemberRole(caller=owner, member_id=str(bea.id), role=Role.OWNER))
    handed = world.store.state.audit[before + 1 :]
    assert sorted((r.target.id, r.details["role"]) for r in handed) == sorted(
        [(str(bea.id), "owner"), (str(ada.id), "admin")]
    )


async def test_a_refused_change_leaves_no_success_record(world: AuthWorld) -> None:
    _, _, tokens = await world.owner()
    owner = await world.as_caller(tokens)
    cy = await world.as_caller(await world.invite_and_join(owner, "cyd"))
    before = actions(world)
    with pytest.raises(PermissionDenied):
        await world.bus.handle(SetMemberRole(caller=cy, member_id=str(tokens.member.id), role=Role.MEMBER))
    # The refusal is the boundary's to record (AuditInterceptor); the handler wrote nothing.
    assert actions(world) == before


async def test_a_member_over_its_quota_is_refused_before_anything_is_stored(world: AuthWorld) -> None:
    world.deps.quotas = Quotas(members=2, agents=1, groups=1)
    workspace, _, tokens = await world.owner()
    owner = await world.as_caller(tokens)
    await world.invite_and_join(owner, "bea")
    _, secret = await world.bus.handle(CreateInvite(caller=owner, role=None, ttl=None, request_id=""))
    with pytest.raises(QuotaExceeded):
        await world.bus.handle(
            CreateMember(
                caller=owner,
                workspace_id="",
                kind=MemberKind.HUMAN,
                display_name="Cy",
                avatar="",
                request_id="",
            )
        )
    people = [m for m in world.store.state.members.values() if m.workspace_id == workspace.id]
    assert len(people) == 2
    await world.agent(workspace, by_service=True)
    with pytest.raises(QuotaExceeded):
        await world.agent(workspace, by_service=True)
    await world.bus.handle(CreateGroup(caller=owner, name="one", member_ids=[], request_id=""))
    with pytest.raises(QuotaExceeded):
        await world.bus.handle(CreateGroup(caller=owner, name="two", member_ids=[], request_id=""))
    assert secret


async def test_only_the_hosting_service_names_an_agents_owner(world: AuthWorld) -> None:
    workspace, ada, tokens = await world.owner()
    owner = await world.as_caller(tokens)
    with pytest.raises(PermissionDenied, match="hosts an agent"):
        await world.bus.handle(
            CreateMember(
                caller=owner,
                workspace_id="",
                kind=MemberKind.AGENT,
                display_name="bot",
                avatar="",
                request_id="",
                owner_id=str(ada.id),
            )
        )
    runtime = Caller(claims=AccessClaims(kind=PrincipalKind.SERVICE, service="runtime"))
    agent = await world.bus.handle(
        CreateMember(
            caller=runtime,
            workspace_id=str(workspace.id),
            kind=MemberKind.AGENT,
            display_name="bot",
            avatar="",
            request_id="",
            owner_id=str(ada.id),
        )
    )
    assert agent.owner_id == ada.id
    with pytest.raises(InvalidArgument, match="not a person"):
        await world.bus.handle(SetAgentOwners(caller=runtime, owners=[(str(agent.id), str(agent.id))]))
    memory = Caller(claims=AccessClaims(kind=PrincipalKind.SERVICE, service="memory"))
    with pytest.raises(PermissionDenied):
        await world.bus.handle(SetAgentOwners(caller=memory, owners=[(str(agent.id), str(ada.id))]))
    assert await world.bus.handle(SetAgentOwners(caller=runtime, owners=[(str(agent.id), str(ada.id))])) == 0
    bea = (await world.invite_and_join(owner, "bea")).member
    assert await world.bus.handle(SetAgentOwners(caller=runtime, owners=[(str(agent.id), str(bea.id))])) == 1
    assert world.store.state.members[agent.id].owner_id == bea.id
    assert actions(world)[-1] == "SetAgentOwners"
