"""AuthService over real gRPC, on SQLite and PostgreSQL.

Every access token handed out here is checked the way other services will
check it: by a `Verifier` fed by `GetSigningKeys`. The last tests look in
every table and in every log line of the calls for the secrets the calls
made: none may be there in clear.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from agentim.im.v1 import auth_pb2, auth_pb2_grpc, im_pb2
from services.common.identity import bearer_metadata
from services.common.tokens import KeyRing, PrincipalKind, Scope, Verifier
from services.im.adapters.tables import metadata as im_tables
from services.im.entrypoints.auth_mappers import jwks
from tests.auth_support import service_secret
from tests.conftest import RunningIM
from tests.identities import as_member, legacy_member_header

PASSWORD = "correct horse battery"


def auth_stub(im: RunningIM) -> auth_pb2_grpc.AuthServiceStub:
    return auth_pb2_grpc.AuthServiceStub(im.channel)


def verifier_for(im: RunningIM, **options: Any) -> Verifier:
    """A verifier fed by GetSigningKeys, as every other service's will be."""
    stub = auth_stub(im)

    async def source() -> Mapping[str, Any]:
        response = await stub.GetSigningKeys(auth_pb2.GetSigningKeysRequest(), timeout=5)
        return jwks(list(response.keys))

    return Verifier(source, **options)


async def owner(im: RunningIM, login: str = "ada", **fields: Any) -> im_pb2.CreateWorkspaceResponse:
    request = im_pb2.CreateWorkspaceRequest(
        name=f"ws-{uuid.uuid4().hex[:6]}",
        creator_display_name="Ada",
        creator_login=login,
        creator_password=PASSWORD,
        **fields,
    )
    response: im_pb2.CreateWorkspaceResponse = await im.stub.CreateWorkspace(request)
    return response


async def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    code: grpc.StatusCode = caught.value.code()
    return code


def bearer(tokens: im_pb2.Tokens) -> tuple[tuple[str, str], ...]:
    return bearer_metadata(tokens.access_token)


async def test_sign_up_sign_in_refresh_and_sign_out(im: RunningIM) -> None:
    auth = auth_stub(im)
    verifier = verifier_for(im)
    created = await owner(im)
    assert created.creator.role == im_pb2.MEMBER_ROLE_OWNER
    tokens = created.tokens
    assert tokens.member.id == created.creator.id and tokens.refresh_token.startswith("aim_rt_")
    claims = await verifier.verify(tokens.access_token)
    assert (claims.member_id, claims.roles, claims.kind) == (
        uuid.UUID(created.creator.id),
        ("owner",),
        PrincipalKind.HUMAN,
    )
    assert int(claims.expires_at.timestamp()) == tokens.access_expire_time.seconds  # type: ignore[union-attr]
    # The access token works where a caller is needed.
    listed = await auth.ListPersonalTokens(auth_pb2.ListPersonalTokensRequest(), metadata=bearer(tokens))
    assert list(listed.personal_tokens) == []
    signed_in = (
        await auth.SignIn(
            auth_pb2.SignInRequest(workspace_id=created.workspace.id, login="ADA", password=PASSWORD)
        )
    ).tokens
    await verifier.verify(signed_in.access_token)
    wrong_login = auth.SignIn(
        auth_pb2.SignInRequest(workspace_id=created.workspace.id, login="bob", password=PASSWORD)
    )
    wrong_password = auth.SignIn(
        auth_pb2.SignInRequest(workspace_id=created.workspace.id, login="ada", password="not the password")
    )
    details = []
    for call in (wrong_login, wrong_password):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        details.append(caught.value.details())
    assert details[0] == details[1]
    # Rotation, then reuse of a rotated token: the whole session goes.
    second = (
        await auth.RefreshTokens(auth_pb2.RefreshTokensRequest(refresh_token=tokens.refresh_token))
    ).tokens
    await verifier.verify(second.access_token)
    assert (
        await code_of(auth.RefreshTokens(auth_pb2.RefreshTokensRequest(refresh_token=tokens.refresh_token)))
        == grpc.StatusCode.UNAUTHENTICATED
    )
    assert (
        await code_of(auth.RefreshTokens(auth_pb2.RefreshTokensRequest(refresh_token=second.refresh_token)))
        == grpc.StatusCode.UNAUTHENTICATED
    )
    # The other session is untouched until it signs out.
    third = (
        await auth.RefreshTokens(auth_pb2.RefreshTokensRequest(refresh_token=signed_in.refresh_token))
    ).tokens
    await auth.SignOut(auth_pb2.SignOutRequest(refresh_token=third.refresh_token))
    await auth.SignOut(auth_pb2.SignOutRequest(refresh_token=third.refresh_token))
    assert (
        await code_of(auth.RefreshTokens(auth_pb2.RefreshTokensRequest(refresh_token=third.refresh_token)))
        == grpc.StatusCode.UNAUTHENTICATED
    )


async def test_sign_in_is_throttled_with_retry_info(im: RunningIM) -> None:
    auth = auth_stub(im)
    created = await owner(im)
    request = auth_pb2.SignInRequest(
        workspace_id=created.workspace.id, login="ada", password="wrong password"
    )
    for _ in range(5):
        assert await code_of(auth.SignIn(request)) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await auth.SignIn(
            auth_pb2.SignInRequest(workspace_id=created.workspace.id, login="ada", password=PASSWORD)
        )
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(caught.value)
    assert status is not None
    retry = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(retry)
    assert 0 < retry.retry_delay.seconds <= 15 * 60


async def test_tokens_are_refused_when_tampered_and_bearer_beats_x_member_id(im: RunningIM) -> None:
    auth = auth_stub(im)
    created = await owner(im)
    other = await owner(im, login="zed")
    token = created.tokens.access_token
    tampered = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    for metadata in [
        bearer_metadata(tampered),
        (("authorization", "Basic abc"),),
        (("authorization", "Bearer "),),
        # A bad token is refused even with a good x-member-id beside it.
        (*bearer_metadata("not.a.jwt"), *legacy_member_header(created.creator.id)),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await auth.ListPersonalTokens(auth_pb2.ListPersonalTokensRequest(), metadata=metadata)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert token not in (caught.value.details() or "")
    # The token names the caller, whatever x-member-id says.
    made = await auth.CreatePersonalToken(
        auth_pb2.CreatePersonalTokenRequest(name="mine", scope=auth_pb2.PERSONAL_TOKEN_SCOPE_READ),
        metadata=(*bearer(created.tokens), *legacy_member_header(other.creator.id)),
    )
    theirs = await auth.ListPersonalTokens(
        auth_pb2.ListPersonalTokensRequest(), metadata=as_member(other.creator.id)
    )
    assert list(theirs.personal_tokens) == []
    mine = await auth.ListPersonalTokens(
        auth_pb2.ListPersonalTokensRequest(), metadata=bearer(created.tokens)
    )
    assert [t.id for t in mine.personal_tokens] == [made.personal_token.id]


async def test_invites_are_used_once_and_expire(im: RunningIM) -> None:
    auth = auth_stub(im)
    verifier = verifier_for(im)
    created = await owner(im)
    made = await auth.CreateInvite(
        auth_pb2.CreateInviteRequest(role=im_pb2.MEMBER_ROLE_ADMIN), metadata=bearer(created.tokens)
    )
    assert made.secret.startswith("aim_inv_") and made.invite.role == im_pb2.MEMBER_ROLE_ADMIN
    joined = (
        await auth.AcceptInvite(
            auth_pb2.AcceptInviteRequest(
                invite=made.secret, display_name="Bea", login="bea", password=PASSWORD
            )
        )
    ).tokens
    assert joined.member.role == im_pb2.MEMBER_ROLE_ADMIN and joined.member.kind == im_pb2.MEMBER_KIND_HUMAN
    assert (await verifier.verify(joined.access_token)).roles == ("admin",)
    # The new member is a member like any other.
    found = await im.stub.GetMember(
        im_pb2.GetMemberRequest(member_id=joined.member.id), metadata=as_member(created.creator.id)
    )
    assert found.member.role == im_pb2.MEMBER_ROLE_ADMIN
    assert (
        await code_of(
            auth.AcceptInvite(
                auth_pb2.AcceptInviteRequest(
                    invite=made.secret, display_name="Eve", login="eve", password=PASSWORD
                )
            )
        )
        == grpc.StatusCode.FAILED_PRECONDITION
    )
    brief = await auth.CreateInvite(
        auth_pb2.CreateInviteRequest(ttl=duration_pb2.Duration(seconds=1)), metadata=bearer(joined)
    )
    assert brief.invite.role == im_pb2.MEMBER_ROLE_MEMBER
    # The invite expires one second after it was made (whole seconds).
    expiry = brief.invite.expire_time.ToDatetime()
    assert expiry - brief.invite.create_time.ToDatetime() == timedelta(seconds=1)
    await asyncio.sleep(1.1)
    assert (
        await code_of(
            auth.AcceptInvite(
                auth_pb2.AcceptInviteRequest(
                    invite=brief.secret, display_name="Cy", login="cyd", password=PASSWORD
                )
            )
        )
        == grpc.StatusCode.FAILED_PRECONDITION
    )
    plain = (
        await auth.SignIn(
            auth_pb2.SignInRequest(workspace_id=created.workspace.id, login="bea", password=PASSWORD)
        )
    ).tokens
    assert plain.member.id == joined.member.id


async def test_roles_change_and_are_refused_over_the_wire(im: RunningIM) -> None:
    auth = auth_stub(im)
    created = await owner(im)
    owner_md = bearer(created.tokens)

    async def join(login: str) -> im_pb2.Tokens:
        made = await auth.CreateInvite(auth_pb2.CreateInviteRequest(), metadata=owner_md)
        return (
            await auth.AcceptInvite(
                auth_pb2.AcceptInviteRequest(
                    invite=made.secret, display_name=login, login=login, password=PASSWORD
                )
            )
        ).tokens

    bea, cyd = await join("bea"), await join("cyd")
    assert (
        await code_of(
            auth.SetMemberRole(
                auth_pb2.SetMemberRoleRequest(member_id=cyd.member.id, role=im_pb2.MEMBER_ROLE_ADMIN),
                metadata=bearer(bea),
            )
        )
        == grpc.StatusCode.PERMISSION_DENIED
    )
    made_admin = await auth.SetMemberRole(
        auth_pb2.SetMemberRoleRequest(member_id=bea.member.id, role=im_pb2.MEMBER_ROLE_ADMIN),
        metadata=owner_md,
    )
    assert made_admin.member.role == im_pb2.MEMBER_ROLE_ADMIN
    for role, member_id in [
        (im_pb2.MEMBER_ROLE_OWNER, cyd.member.id),
        (im_pb2.MEMBER_ROLE_MEMBER, created.creator.id),
    ]:
        assert (
            await code_of(
                auth.SetMemberRole(
                    auth_pb2.SetMemberRoleRequest(member_id=member_id, role=role), metadata=bearer(bea)
                )
            )
            == grpc.StatusCode.PERMISSION_DENIED
        )
    handed = await auth.SetMemberRole(
        auth_pb2.SetMemberRoleRequest(member_id=cyd.member.id, role=im_pb2.MEMBER_ROLE_OWNER),
        metadata=as_member(created.creator.id),
    )
    assert handed.member.role == im_pb2.MEMBER_ROLE_OWNER
    old_owner = await im.stub.GetMember(
        im_pb2.GetMemberRequest(member_id=created.creator.id), metadata=as_member(cyd.member.id)
    )
    assert old_owner.member.role == im_pb2.MEMBER_ROLE_ADMIN
    assert (
        await code_of(
            auth.SetMemberRole(
                auth_pb2.SetMemberRoleRequest(member_id=bea.member.id, role=im_pb2.MEMBER_ROLE_MEMBER),
                metadata=bearer_metadata("x.y.z"),
            )
        )
        == grpc.StatusCode.UNAUTHENTICATED
    )


async def test_personal_tokens_are_exchanged_for_access_tokens_of_their_scope(im: RunningIM) -> None:
    auth = auth_stub(im)
    verifier = verifier_for(im)
    created = await owner(im)
    md = bearer(created.tokens)
    made = await auth.CreatePersonalToken(
        auth_pb2.CreatePersonalTokenRequest(name="ci", scope=auth_pb2.PERSONAL_TOKEN_SCOPE_READ), metadata=md
    )
    assert made.secret.startswith("aim_pat_")
    exchanged = await auth.ExchangePersonalToken(auth_pb2.ExchangePersonalTokenRequest(secret=made.secret))
    claims = await verifier.verify(exchanged.access_token)
    assert (claims.scope, str(claims.personal_token_id), str(claims.member_id)) == (
        Scope.READ,
        made.personal_token.id,
        created.creator.id,
    )
    assert exchanged.access_expire_time.seconds <= made.personal_token.expire_time.seconds
    listed = await auth.ListPersonalTokens(auth_pb2.ListPersonalTokensRequest(), metadata=md)
    assert listed.personal_tokens[0].HasField("last_use_time")
    assert made.secret not in str(listed)
    # A read-only token changes nothing, and makes no personal token.
    read_only = bearer_metadata(exchanged.access_token)
    for call in (
        auth.CreateInvite(auth_pb2.CreateInviteRequest(), metadata=read_only),
        auth.CreatePersonalToken(
            auth_pb2.CreatePersonalTokenRequest(name="x", scope=auth_pb2.PERSONAL_TOKEN_SCOPE_WRITE),
            metadata=read_only,
        ),
    ):
        assert await code_of(call) == grpc.StatusCode.PERMISSION_DENIED
    await auth.RevokePersonalToken(
        auth_pb2.RevokePersonalTokenRequest(personal_token_id=made.personal_token.id), metadata=md
    )
    assert (
        await code_of(auth.ExchangePersonalToken(auth_pb2.ExchangePersonalTokenRequest(secret=made.secret)))
        == grpc.StatusCode.UNAUTHENTICATED
    )


async def test_services_get_tokens_for_the_agents_they_host_only(im: RunningIM) -> None:
    auth = auth_stub(im)
    verifier = verifier_for(im)
    created = await owner(im)
    issued = await auth.IssueServiceToken(
        auth_pb2.IssueServiceTokenRequest(service="runtime", secret=service_secret("runtime"))
    )
    claims = await verifier.verify(issued.access_token)
    assert (claims.kind, claims.service) == (PrincipalKind.SERVICE, "runtime")
    assert (
        await code_of(
            auth.IssueServiceToken(
                auth_pb2.IssueServiceTokenRequest(service="runtime", secret=service_secret("memory"))
            )
        )
        == grpc.StatusCode.UNAUTHENTICATED
    )
    # An agent the runtime creates (with its own token) is hosted by it.
    hosted = (
        await im.stub.CreateMember(
            im_pb2.CreateMemberRequest(
                kind=im_pb2.MEMBER_KIND_AGENT, display_name="helper", workspace_id=created.workspace.id
            ),
            metadata=bearer_metadata(issued.access_token),
        )
    ).member
    unhosted = (
        await im.stub.CreateMember(
            im_pb2.CreateMemberRequest(kind=im_pb2.MEMBER_KIND_AGENT, display_name="stray"),
            metadata=as_member(created.creator.id),
        )
    ).member
    runtime_md = bearer_metadata(issued.access_token)
    agents = await auth.IssueAgentTokens(
        auth_pb2.IssueAgentTokensRequest(agent_member_ids=[hosted.id]), metadata=runtime_md
    )
    agent_claims = await verifier.verify(agents.agent_tokens[0].access_token)
    assert (agent_claims.kind, str(agent_claims.member_id), agent_claims.host) == (
        PrincipalKind.AGENT,
        hosted.id,
        "runtime",
    )
    memory = await auth.IssueServiceToken(
        auth_pb2.IssueServiceTokenRequest(service="memory", secret=service_secret("memory"))
    )
    for ids, metadata in [
        ([unhosted.id], runtime_md),
        ([created.creator.id], runtime_md),
        ([hosted.id], bearer_metadata(memory.access_token)),
        ([hosted.id], bearer(created.tokens)),
        ([hosted.id], as_member(created.creator.id)),
    ]:
        assert (
            await code_of(
                auth.IssueAgentTokens(
                    auth_pb2.IssueAgentTokensRequest(agent_member_ids=ids), metadata=metadata
                )
            )
            == grpc.StatusCode.PERMISSION_DENIED
        )


async def test_keys_rotate_through_reload_without_refusing_a_token(im_factory: Any, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    old = KeyRing.generate(keys, kid="20260101T000000Z-aaaaaaaa")
    im: RunningIM = await im_factory(AUTH_SIGNING_KEYS_DIR=str(keys))
    auth = auth_stub(im)
    verifier = verifier_for(im, refetch_seconds=0)
    before = (await owner(im)).tokens
    await verifier.verify(before.access_token)
    upcoming = KeyRing.generate(keys, upcoming=True, kid="20260201T000000Z-bbbbbbbb")
    im.app.reload_identity()
    published = await auth.GetSigningKeys(auth_pb2.GetSigningKeysRequest())
    assert [k.kid for k in published.keys] == [old, upcoming]
    assert all(k.kty == "OKP" and k.crv == "Ed25519" and k.alg == "EdDSA" for k in published.keys)
    (keys / f"{upcoming}.next.pem").rename(keys / f"{upcoming}.pem")
    im.app.reload_identity()
    after = (await owner(im, login="bob")).tokens
    assert (await verifier.verify(after.access_token)).member_id is not None
    assert (await verifier.verify(before.access_token)).member_id is not None
    # The IM itself still takes the old key's tokens while it is published.
    await auth.ListPersonalTokens(auth_pb2.ListPersonalTokensRequest(), metadata=bearer(before))
    (keys / f"{old}.pem").unlink()
    im.app.reload_identity()
    assert [k.kid for k in (await auth.GetSigningKeys(auth_pb2.GetSigningKeysRequest())).keys] == [upcoming]
    # A broken directory changes nothing.
    (keys / "zzz.pem").write_text("junk")
    im.app.reload_identity()
    assert [k.kid for k in (await auth.GetSigningKeys(auth_pb2.GetSigningKeysRequest())).keys] == [upcoming]


async def test_no_secret_is_stored_in_clear_or_logged(
    im: RunningIM, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    auth = auth_stub(im)
    secrets = [PASSWORD, "second password!", service_secret("runtime")]
    created = await owner(im, login=f"s{uuid.uuid4().hex[:8]}")
    md = bearer(created.tokens)
    secrets += [created.tokens.refresh_token, created.tokens.access_token]
    refreshed = (
        await auth.RefreshTokens(auth_pb2.RefreshTokensRequest(refresh_token=created.tokens.refresh_token))
    ).tokens
    secrets.append(refreshed.refresh_token)
    invite = await auth.CreateInvite(auth_pb2.CreateInviteRequest(), metadata=md)
    secrets.append(invite.secret)
    joined = (
        await auth.AcceptInvite(
            auth_pb2.AcceptInviteRequest(
                invite=invite.secret, display_name="Bea", login=f"b{uuid.uuid4().hex[:8]}", password=PASSWORD
            )
        )
    ).tokens
    secrets.append(joined.refresh_token)
    changed = (
        await auth.ChangePassword(
            auth_pb2.ChangePasswordRequest(old_password=PASSWORD, new_password="second password!"),
            metadata=bearer(joined),
        )
    ).tokens
    secrets.append(changed.refresh_token)
    pat = await auth.CreatePersonalToken(
        auth_pb2.CreatePersonalTokenRequest(name="ci", scope=auth_pb2.PERSONAL_TOKEN_SCOPE_WRITE), metadata=md
    )
    secrets.append(pat.secret)
    await auth.ExchangePersonalToken(auth_pb2.ExchangePersonalTokenRequest(secret=pat.secret))
    await auth.IssueServiceToken(
        auth_pb2.IssueServiceTokenRequest(service="runtime", secret=service_secret("runtime"))
    )
    # Refusals too: a reused refresh token, a wrong password.
    await code_of(
        auth.RefreshTokens(auth_pb2.RefreshTokensRequest(refresh_token=created.tokens.refresh_token))
    )
    await code_of(
        auth.SignIn(
            auth_pb2.SignInRequest(
                workspace_id=created.workspace.id, login="nobody", password="second password!"
            )
        )
    )
    engine = im.app.database.engine
    async with engine.connect() as conn:
        for table in im_tables.sorted_tables:
            rows = (await conn.execute(sa.select(table))).all()
            stored = "\n".join(repr(tuple(row)) for row in rows)
            for secret in secrets:
                assert secret not in stored, f"a secret is stored in clear in {table.name}"
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert caplog.records, "the calls logged nothing at all: the check would prove nothing"
    for secret in secrets:
        assert secret not in logged
    assert database_url
