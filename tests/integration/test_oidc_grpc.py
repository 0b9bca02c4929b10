"""SignIn without a workspace, and SignInWithOidc, over real gRPC on SQLite and
PostgreSQL, with the IM fetching a test issuer's keys over HTTP.

The whole flow with a real provider is in tests/e2e/test_oidc.py; here is
what needs the real databases: the one-time nonce under concurrency, emails
unique per workspace whatever their case, and nothing secret stored.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
import sqlalchemy as sa

from agentim.im.v1 import auth_pb2, im_pb2
from services.im.adapters.tables import metadata as im_tables
from tests.conftest import RunningIM
from tests.integration.test_auth_grpc import PASSWORD, auth_stub, bearer, code_of
from tests.oidc_support import TestIssuer


@pytest.fixture
async def issuer() -> AsyncIterator[TestIssuer]:
    issuer = TestIssuer()
    await issuer.start()
    yield issuer
    await issuer.stop()


@pytest.fixture
async def oidc_im(im_factory: Callable[..., Any], issuer: TestIssuer) -> RunningIM:
    running: RunningIM = await im_factory(**issuer.environment())
    return running


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def workspace(im: RunningIM, login: str, password: str = PASSWORD) -> im_pb2.CreateWorkspaceResponse:
    created: im_pb2.CreateWorkspaceResponse = await im.stub.CreateWorkspace(
        im_pb2.CreateWorkspaceRequest(
            name=unique("ws"), creator_display_name="Ada", creator_login=login, creator_password=password
        )
    )
    return created


def oidc_request(issuer: TestIssuer, email: str, **fields: str) -> auth_pb2.SignInWithOidcRequest:
    nonce = secrets.token_urlsafe(16)
    return auth_pb2.SignInWithOidcRequest(
        id_token=issuer.id_token(email=email, nonce=nonce), nonce=nonce, **fields
    )


async def test_sign_in_without_the_workspace(im: RunningIM) -> None:
    auth = auth_stub(im)
    login = unique("ada")
    first = await workspace(im, login, "first password")
    second = await workspace(im, login, "second password")
    for created, password in ((first, "first password"), (second, "second password")):
        signed = await auth.SignIn(auth_pb2.SignInRequest(login=login.upper(), password=password))
        assert signed.tokens.member.id == created.creator.id
    same = unique("bob")
    await workspace(im, same)
    await workspace(im, same)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await auth.SignIn(auth_pb2.SignInRequest(login=same, password=PASSWORD))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "give the workspace id" in (caught.value.details() or "")
    assert await code_of(auth.SignIn(auth_pb2.SignInRequest(login=same, password="wrong password"))) == (
        grpc.StatusCode.UNAUTHENTICATED
    )


async def test_an_invited_email_joins_once_and_signs_in_after(oidc_im: RunningIM, issuer: TestIssuer) -> None:
    auth = auth_stub(oidc_im)
    created = await workspace(oidc_im, unique("own"))
    email = f"{unique('bea')}@Example.test"
    made = await auth.CreateInvite(
        auth_pb2.CreateInviteRequest(email=email, role=im_pb2.MEMBER_ROLE_ADMIN),
        metadata=bearer(created.tokens),
    )
    assert made.invite.email == email.lower()
    # Only the provider proves the email: a password cannot accept it.
    with pytest.raises(grpc.aio.AioRpcError) as by_password:
        await auth.AcceptInvite(
            auth_pb2.AcceptInviteRequest(
                invite=made.secret, display_name="B", login=unique("bea"), password=PASSWORD
            )
        )
    assert by_password.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "join with your organisation" in (by_password.value.details() or "")
    joined = await auth.SignInWithOidc(
        oidc_request(issuer, email.upper(), invite=made.secret, display_name="Bea")
    )
    assert joined.joined and joined.tokens.member.role == im_pb2.MEMBER_ROLE_ADMIN
    again = await auth.SignInWithOidc(oidc_request(issuer, email))
    assert not again.joined and again.tokens.member.id == joined.tokens.member.id
    # The email is the member's in this workspace, whatever its case.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await auth.CreateInvite(
            auth_pb2.CreateInviteRequest(email=email.upper()), metadata=bearer(created.tokens)
        )
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_refusals_have_their_status(oidc_im: RunningIM, issuer: TestIssuer) -> None:
    auth = auth_stub(oidc_im)
    email = f"{unique('cy')}@example.test"
    cases = [
        (oidc_request(issuer, email), grpc.StatusCode.PERMISSION_DENIED, "ask an admin for an invite"),
        (
            auth_pb2.SignInWithOidcRequest(
                id_token=issuer.id_token(email=email, nonce="n1", email_verified=False), nonce="n1"
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            "has not verified",
        ),
        (
            auth_pb2.SignInWithOidcRequest(
                id_token=issuer.id_token(email=email, nonce="n2", aud="someone-else"), nonce="n2"
            ),
            grpc.StatusCode.UNAUTHENTICATED,
            "audience",
        ),
        (
            auth_pb2.SignInWithOidcRequest(id_token="x.y.z", nonce="n3"),
            grpc.StatusCode.UNAUTHENTICATED,
            "malformed",
        ),
        (
            auth_pb2.SignInWithOidcRequest(nonce="n4"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "id_token is required",
        ),
        (oidc_request(issuer, email, workspace_id="nope"), grpc.StatusCode.INVALID_ARGUMENT, "workspace_id"),
    ]
    for request, code, words in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await auth.SignInWithOidc(request)
        assert (caught.value.code(), words in (caught.value.details() or "")) == (code, True), (
            caught.value.details()
        )


async def test_one_token_signs_in_once_even_sent_at_once(oidc_im: RunningIM, issuer: TestIssuer) -> None:
    auth = auth_stub(oidc_im)
    created = await workspace(oidc_im, unique("own"))
    made = await auth.CreateInvite(auth_pb2.CreateInviteRequest(), metadata=bearer(created.tokens))
    request = oidc_request(issuer, f"{unique('dee')}@example.test", invite=made.secret)
    results = await asyncio.gather(*(auth.SignInWithOidc(request) for _ in range(4)), return_exceptions=True)
    signed = [r for r in results if isinstance(r, auth_pb2.SignInWithOidcResponse)]
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(signed) == 1 and len(refused) == 3
    assert {e.code() for e in refused} == {grpc.StatusCode.UNAUTHENTICATED}


async def test_without_the_provider_configured_or_reachable(
    im: RunningIM, im_factory: Callable[..., Any], issuer: TestIssuer
) -> None:
    request = oidc_request(issuer, "eve@example.test")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await auth_stub(im).SignInWithOidc(request)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not configured" in (caught.value.details() or "")
    created = await workspace(im, unique("own"))
    with pytest.raises(grpc.aio.AioRpcError) as bound:
        await auth_stub(im).CreateInvite(
            auth_pb2.CreateInviteRequest(email="eve@example.test"), metadata=bearer(created.tokens)
        )
    assert bound.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await issuer.stop()
    down: RunningIM = await im_factory(**issuer.environment(), OIDC_HTTP_TIMEOUT_SECONDS="2")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await auth_stub(down).SignInWithOidc(request)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot be reached" in (caught.value.details() or "")


async def test_no_nonce_or_id_token_is_stored_or_logged(
    oidc_im: RunningIM, issuer: TestIssuer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    auth = auth_stub(oidc_im)
    created = await workspace(oidc_im, unique("own"))
    made = await auth.CreateInvite(auth_pb2.CreateInviteRequest(), metadata=bearer(created.tokens))
    request = oidc_request(issuer, f"{unique('fay')}@example.test", invite=made.secret)
    await auth.SignInWithOidc(request)
    await code_of(auth.SignInWithOidc(request))  # the replay is logged: without the token
    async with oidc_im.app.database.engine.connect() as conn:
        for table in im_tables.sorted_tables:
            stored = "\n".join(repr(tuple(row)) for row in (await conn.execute(sa.select(table))).all())
            assert request.nonce not in stored and request.id_token not in stored, table.name
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert "presented again" in logged
    assert request.nonce not in logged and request.id_token not in logged
