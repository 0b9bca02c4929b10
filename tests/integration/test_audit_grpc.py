"""The IM's audit log over real gRPC, on SQLite and PostgreSQL, with real tokens.

Each privileged action leaves exactly one record (actor, target, outcome);
refusals are recorded (and counted together when repeated); only the
workspace's owner and admins list it, and only their workspace's records;
pages are stable; no secret is ever in a record.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from google.protobuf import field_mask_pb2

from agentim.audit.v1 import audit_pb2
from agentim.im.v1 import auth_pb2, im_pb2
from services.im.adapters.tables import audit_events
from tests.auth_support import service_secret
from tests.authn_support import PASSWORD, Person, auth_stub, invite, service_token, sign_up
from tests.conftest import RunningIM

Metadata = tuple[tuple[str, str], ...]


async def audit_log(
    im: RunningIM,
    md: Metadata,
    *,
    page_size: int = 200,
    page_token: str = "",
    **query: Any,
) -> auth_pb2.ListAuditEventsResponse:
    return await auth_stub(im).ListAuditEvents(
        auth_pb2.ListAuditEventsRequest(
            page_size=page_size, page_token=page_token, query=audit_pb2.AuditQuery(**query)
        ),
        metadata=md,
    )


async def everything(im: RunningIM, md: Metadata, **query: Any) -> list[audit_pb2.AuditEvent]:
    events: list[audit_pb2.AuditEvent] = []
    token = ""
    while True:
        page = await audit_log(im, md, page_size=50, page_token=token, **query)
        events.extend(page.audit_events)
        token = page.next_page_token
        if not token:
            return events


def only(events: Sequence[audit_pb2.AuditEvent], action: str) -> audit_pb2.AuditEvent:
    found = [e for e in events if e.action == action]
    assert len(found) == 1, f"{action}: {len(found)} records: {found}"
    return found[0]


async def refusal(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def test_each_privileged_action_of_the_im_leaves_one_record(im: RunningIM) -> None:
    auth = auth_stub(im)
    workspace, owner = await sign_up(im, "Ada")
    bea = await invite(im, owner, "Bea")
    # Signing in, and a wrong password.
    signed = await auth.SignIn(
        auth_pb2.SignInRequest(workspace_id=workspace.id, login="bea-login", password=PASSWORD)
    )
    await refusal(
        auth.SignIn(
            auth_pb2.SignInRequest(workspace_id=workspace.id, login="bea-login", password="wrong one!")
        )
    )
    await auth.SignOut(auth_pb2.SignOutRequest(refresh_token=signed.tokens.refresh_token))
    changed = await auth.ChangePassword(
        auth_pb2.ChangePasswordRequest(old_password=PASSWORD, new_password="another good password"),
        metadata=bea.md,
    )
    bea = Person(changed.tokens.member, changed.tokens.access_token)
    await auth.SetMemberRole(
        auth_pb2.SetMemberRoleRequest(member_id=bea.id, role=im_pb2.MEMBER_ROLE_ADMIN), metadata=owner.md
    )
    token = await auth.CreatePersonalToken(
        auth_pb2.CreatePersonalTokenRequest(name="ci", scope=auth_pb2.PERSONAL_TOKEN_SCOPE_WRITE),
        metadata=owner.md,
    )
    await auth.RevokePersonalToken(
        auth_pb2.RevokePersonalTokenRequest(personal_token_id=token.personal_token.id), metadata=owner.md
    )
    runtime = await service_token(im, "runtime")
    agent = (
        await im.stub.CreateMember(
            im_pb2.CreateMemberRequest(
                kind=im_pb2.MEMBER_KIND_AGENT,
                display_name="helper",
                workspace_id=workspace.id,
                owner_id=owner.id,
                request_id="agent-1",
            ),
            metadata=runtime,
        )
    ).member
    assert agent.owner_id == owner.id
    await im.stub.UpdateMember(
        im_pb2.UpdateMemberRequest(
            member=im_pb2.Member(id=owner.id, display_name="Ada L."),
            update_mask=field_mask_pb2.FieldMask(paths=["display_name"]),
        ),
        metadata=owner.md,
    )

    events = await everything(im, owner.md)
    times = [(e.time.ToDatetime(), e.id) for e in events]
    assert times == sorted(times, reverse=True), "newest first"
    assert {e.workspace_id for e in events} == {workspace.id}
    assert {e.service for e in events} == {"im"}

    created = only(events, "CreateWorkspace")
    assert (created.actor.member_id, created.target.kind, created.target.id) == (
        owner.id,
        "workspace",
        workspace.id,
    )
    invited = only(events, "CreateInvite")
    assert (invited.actor.kind, invited.actor.member_id, invited.target.kind) == ("human", owner.id, "invite")
    accepted = only(events, "AcceptInvite")
    assert (accepted.actor.member_id, accepted.details["member_id"]) == (bea.id, bea.id)
    sign_ins = [e for e in events if e.action == "SignIn"]
    assert sorted(e.outcome.code for e in sign_ins) == ["OK", "UNAUTHENTICATED"]
    ok = next(e for e in sign_ins if e.outcome.code == "OK")
    assert (ok.actor.member_id, ok.target.id) == (bea.id, bea.id)
    failed = next(e for e in sign_ins if e.outcome.code != "OK")
    assert (failed.actor.kind, failed.target.kind, failed.target.id) == ("anonymous", "login", "bea-login")
    assert failed.outcome.reason == "the login or password is wrong"
    assert only(events, "SignOut").actor.member_id == bea.id
    assert only(events, "ChangePassword").target.id == bea.id
    role = only(events, "SetMemberRole")
    assert (role.actor.member_id, role.target.id, role.details["role"]) == (owner.id, bea.id, "admin")
    made = only(events, "CreatePersonalToken")
    assert (made.target.kind, made.target.id, made.details["scope"]) == (
        "personal_token",
        token.personal_token.id,
        "write",
    )
    assert only(events, "RevokePersonalToken").target.id == token.personal_token.id
    member = only(events, "CreateMember")
    assert (member.actor.kind, member.actor.service, member.target.id) == ("service", "runtime", agent.id)
    assert (member.request_id, member.details["owner_id"]) == ("agent-1", owner.id)
    updated = only(events, "UpdateMember")
    assert (updated.target.id, updated.details["fields"]) == (owner.id, "display_name")
    assert all(e.count == 1 for e in events)

    # A retry of the same create (its request_id) changes nothing and records nothing.
    again = await im.stub.CreateMember(
        im_pb2.CreateMemberRequest(
            kind=im_pb2.MEMBER_KIND_AGENT,
            display_name="helper",
            workspace_id=workspace.id,
            owner_id=owner.id,
            request_id="agent-1",
        ),
        metadata=runtime,
    )
    assert again.member.id == agent.id
    assert len([e for e in await everything(im, owner.md) if e.action == "CreateMember"]) == 1


async def test_refusals_are_recorded_and_counted_together(im: RunningIM) -> None:
    auth = auth_stub(im)
    workspace, owner = await sign_up(im, "Ada")
    cy = await invite(im, owner, "Cy")
    for _ in range(3):
        error = await refusal(
            auth.SetMemberRole(
                auth_pb2.SetMemberRoleRequest(member_id=owner.id, role=im_pb2.MEMBER_ROLE_MEMBER),
                metadata=cy.md,
            )
        )
        assert error.code() is grpc.StatusCode.PERMISSION_DENIED
    # Refused by the rule itself (an agent never invites), before any handler.
    runtime = await service_token(im, "runtime")
    agent = (
        await im.stub.CreateMember(
            im_pb2.CreateMemberRequest(
                kind=im_pb2.MEMBER_KIND_AGENT, display_name="bot", workspace_id=workspace.id
            ),
            metadata=runtime,
        )
    ).member
    issued = await auth.IssueAgentTokens(
        auth_pb2.IssueAgentTokensRequest(agent_member_ids=[agent.id]), metadata=runtime
    )
    agent_md = (("authorization", f"Bearer {issued.agent_tokens[0].access_token}"),)
    error = await refusal(auth.CreateInvite(auth_pb2.CreateInviteRequest(), metadata=agent_md))
    assert error.code() is grpc.StatusCode.PERMISSION_DENIED
    # A wrong old password: UNAUTHENTICATED, from a caller of a known workspace.
    await refusal(
        auth.ChangePassword(
            auth_pb2.ChangePasswordRequest(old_password="not it at all", new_password="whatever long"),
            metadata=cy.md,
        )
    )
    # A read is never recorded, refused or not.
    await refusal(audit_log(im, cy.md))

    refused = await everything(im, owner.md, outcome=audit_pb2.AUDIT_OUTCOME_FILTER_REFUSED)
    assert {e.action for e in refused} == {"SetMemberRole", "CreateInvite", "ChangePassword"}
    role = only(refused, "SetMemberRole")
    assert (role.actor.member_id, role.target.id, role.outcome.code, role.count) == (
        cy.id,
        owner.id,
        "PERMISSION_DENIED",
        3,
    )
    assert role.last_time.ToDatetime() >= role.time.ToDatetime()
    by_agent = only(refused, "CreateInvite")
    assert (by_agent.actor.kind, by_agent.actor.member_id) == ("agent", agent.id)
    assert by_agent.outcome.reason == "an agent may not make this call"
    assert only(refused, "ChangePassword").outcome.code == "UNAUTHENTICATED"
    assert all(e.outcome.code != "OK" for e in refused)
    ok = await everything(im, owner.md, outcome=audit_pb2.AUDIT_OUTCOME_FILTER_OK)
    assert ok and all(e.outcome.code == "OK" for e in ok)


async def test_only_admins_list_and_only_their_workspace(im: RunningIM) -> None:
    _, ada = await sign_up(im, "Ada")
    bea = await invite(im, ada, "Bea", im_pb2.MEMBER_ROLE_ADMIN)
    cy = await invite(im, ada, "Cy")
    other_ws, eve = await sign_up(im, "Eve")
    await invite(im, eve, "Fay")
    error = await refusal(audit_log(im, cy.md))
    assert error.code() is grpc.StatusCode.PERMISSION_DENIED
    runtime = await service_token(im, "runtime")
    assert (await refusal(audit_log(im, runtime))).code() is grpc.StatusCode.PERMISSION_DENIED
    assert (await refusal(audit_log(im, ()))).code() is grpc.StatusCode.UNAUTHENTICATED

    mine = await everything(im, bea.md)
    assert mine and {e.workspace_id for e in mine} == {ada.member.workspace_id}
    theirs = await everything(im, eve.md)
    assert theirs and {e.workspace_id for e in theirs} == {other_ws.id}
    assert not {e.id for e in mine} & {e.id for e in theirs}
    # Filters name nothing of another workspace into view.
    assert await everything(im, bea.md, actor=eve.id) == []


async def test_filters_and_stable_pages(im: RunningIM) -> None:
    auth = auth_stub(im)
    _, ada = await sign_up(im, "Ada")
    for index in range(7):
        await auth.CreateInvite(auth_pb2.CreateInviteRequest(request_id=f"inv-{index}"), metadata=ada.md)
    before = await everything(im, ada.md)
    first = await audit_log(im, ada.md, page_size=3)
    assert len(first.audit_events) == 3 and first.next_page_token
    # Newer records arriving between pages do not shift the pages that follow.
    await auth.CreateInvite(auth_pb2.CreateInviteRequest(), metadata=ada.md)
    seen = list(first.audit_events)
    token = first.next_page_token
    while token:
        page = await audit_log(im, ada.md, page_size=3, page_token=token)
        seen.extend(page.audit_events)
        token = page.next_page_token
    assert [e.id for e in seen] == [e.id for e in before]

    invites = await everything(im, ada.md, action="CreateInvite")
    assert len(invites) == 8 and {e.action for e in invites} == {"CreateInvite"}
    assert {e.request_id for e in invites} >= {f"inv-{i}" for i in range(7)}
    assert await everything(im, ada.md, actor=ada.id) == await everything(im, ada.md)
    target = invites[-1].target.id
    assert [e.target.id for e in await everything(im, ada.md, target_id=target)] == [target]
    middle = invites[4].time.ToDatetime(tzinfo=UTC)
    start = audit_pb2.AuditQuery().start_time
    start.FromDatetime(middle)
    later = await everything(im, ada.md, action="CreateInvite", start_time=start)
    assert {e.id for e in later} == {e.id for e in invites if e.time.ToDatetime(tzinfo=UTC) >= middle}
    end = audit_pb2.AuditQuery().end_time
    end.FromDatetime(middle)
    earlier = await everything(im, ada.md, action="CreateInvite", end_time=end)
    assert {e.id for e in earlier} | {e.id for e in later} == {e.id for e in invites}

    # A page token is for the query it was made for; a bad range is refused.
    other = await refusal(audit_log(im, ada.md, page_size=3, page_token=first.next_page_token, action="X"))
    assert other.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (
        await refusal(audit_log(im, ada.md, page_token="garbage"))
    ).code() is grpc.StatusCode.INVALID_ARGUMENT
    backwards = audit_pb2.AuditQuery()
    backwards.start_time.FromDatetime(middle + timedelta(minutes=1))
    backwards.end_time.FromDatetime(middle)
    refused = await refusal(
        auth.ListAuditEvents(auth_pb2.ListAuditEventsRequest(query=backwards), metadata=ada.md)
    )
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (await refusal(audit_log(im, ada.md, page_size=-1))).code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_no_secret_is_ever_in_a_record(im: RunningIM) -> None:
    auth = auth_stub(im)
    workspace, ada = await sign_up(im, "Ada")
    made = await auth.CreateInvite(auth_pb2.CreateInviteRequest(), metadata=ada.md)
    accepted = await auth.AcceptInvite(
        auth_pb2.AcceptInviteRequest(invite=made.secret, display_name="Bea", login="bea", password=PASSWORD)
    )
    signed = await auth.SignIn(
        auth_pb2.SignInRequest(workspace_id=workspace.id, login="bea", password=PASSWORD)
    )
    await refusal(
        auth.SignIn(auth_pb2.SignInRequest(workspace_id=workspace.id, login="bea", password="guess-Secret-1"))
    )
    pat = await auth.CreatePersonalToken(
        auth_pb2.CreatePersonalTokenRequest(name="ci", scope=auth_pb2.PERSONAL_TOKEN_SCOPE_READ),
        metadata=ada.md,
    )
    await auth.ChangePassword(
        auth_pb2.ChangePasswordRequest(old_password=PASSWORD, new_password="New-Password-42"),
        metadata=(("authorization", f"Bearer {signed.tokens.access_token}"),),
    )
    await refusal(
        auth.IssueServiceToken(auth_pb2.IssueServiceTokenRequest(service="runtime", secret="not-the-secret"))
    )
    runtime = await service_token(im, "runtime")
    assert runtime
    secrets = [
        PASSWORD,
        "guess-Secret-1",
        "New-Password-42",
        "not-the-secret",
        service_secret("runtime"),
        made.secret,
        pat.secret,
        accepted.tokens.refresh_token,
        accepted.tokens.access_token,
        signed.tokens.refresh_token,
        signed.tokens.access_token,
        ada.access_token,
    ]
    async with im.app.database.engine.connect() as conn:
        rows = (await conn.execute(sa.select(audit_events))).all()
    text = json.dumps([[str(v) for v in row] for row in rows])
    assert rows and "IssueServiceToken" in text
    for secret in secrets:
        assert secret not in text
    # The service's token is recorded with no workspace: no workspace's admins list it.
    service_rows = [r for r in rows if r.action == "IssueServiceToken"]
    assert {r.workspace_id for r in service_rows} == {None}
    assert {r.code for r in service_rows} == {"OK", "UNAUTHENTICATED"}
    assert all(e.action != "IssueServiceToken" for e in await everything(im, ada.md))


async def test_a_failed_sign_in_to_no_workspace_records_nothing(im: RunningIM) -> None:
    auth = auth_stub(im)
    _, ada = await sign_up(im, "Ada")
    nowhere = str(uuid.uuid4())
    await refusal(auth.SignIn(auth_pb2.SignInRequest(workspace_id=nowhere, login="x", password="whatever")))
    async with im.app.database.engine.connect() as conn:
        found = (
            await conn.execute(
                sa.select(sa.func.count()).where(audit_events.c.workspace_id == uuid.UUID(nowhere))
            )
        ).scalar()
    assert found == 0
    assert ada.id


async def test_old_records_are_pruned(im: RunningIM) -> None:
    _, ada = await sign_up(im, "Ada")
    # Made to look 400 days old; the retention (365 days) prunes it.
    async with im.app.database.engine.begin() as conn:
        await conn.execute(
            audit_events.update()
            .where(audit_events.c.actor_member_id == uuid.UUID(ada.id))
            .values(at=datetime.now(UTC) - timedelta(days=400))
        )
    assert await im.app.audit_pruner.prune_once() >= 1
    assert await everything(im, ada.md) == []


async def test_concurrent_refusals_are_all_counted(im: RunningIM) -> None:
    auth = auth_stub(im)
    _, ada = await sign_up(im, "Ada")
    cy = await invite(im, ada, "Cy")
    calls = [
        refusal(
            auth.CreateInvite(auth_pb2.CreateInviteRequest(role=im_pb2.MEMBER_ROLE_ADMIN), metadata=cy.md)
        )
        for _ in range(8)
    ]
    await asyncio.gather(*calls)
    refused = await everything(im, ada.md, outcome=audit_pb2.AUDIT_OUTCOME_FILTER_REFUSED)
    assert sum(e.count for e in refused if e.action == "CreateInvite") == 8
