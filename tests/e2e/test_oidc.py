"""Signing in with a real OpenID Connect provider (npm's oidc-provider in a
process of its own), through the gateway and the IM, over HTTP.

The browser goes to the gateway's start route, through the provider's
login and consent pages, back to the gateway's callback, and lands on the
web UI with a session cookie (or with the reason it has none in the URL's
fragment). The IM verifies every ID token itself.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import aiohttp
import grpc
import pytest
from yarl import URL

from agentim.im.v1 import auth_pb2, auth_pb2_grpc
from gateway.bootstrap import GatewayApp
from gateway.oidc import FLOW_COOKIE
from gateway.sessions import COOKIE_NAME
from services.im.adapters import migrate
from services.im.adapters.sql import Database
from tests.conftest import RunningIM, start_im, stop_im
from tests.e2e.oidc.harness import (
    CLIENT_ID,
    CLIENT_SECRET,
    OTHER_CLIENT,
    FlowBrowser,
    Landing,
    ProviderProcess,
    code_flow,
)
from tests.gateway_support import PASSWORD, Api, Browser, new_workspace, start_gateway

pytestmark = pytest.mark.timeout(60)


@dataclass
class Stack:
    provider: ProviderProcess
    im: RunningIM
    gateway: GatewayApp
    api: Api
    # Two more replicas that refresh the session at every request: a sign-in
    # starts at the first and comes back to the second (OIDC_REDIRECT_URL).
    starts: GatewayApp
    finishes: GatewayApp

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    @property
    def callback(self) -> str:
        return f"{self.base}/v1/auth/oidc/callback"

    def browser(self) -> FlowBrowser:
        return FlowBrowser(self.base)

    @property
    def auth(self) -> auth_pb2_grpc.AuthServiceStub:
        return auth_pb2_grpc.AuthServiceStub(self.im.channel)


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    directory: Path = tmp_path_factory.mktemp("oidc")
    url = f"sqlite:///{directory / 'im.db'}"
    database = Database(url)
    await migrate.upgrade(database)
    await database.aclose()
    provider = ProviderProcess()
    issuer = await provider.start()
    oidc = {"OIDC_ISSUER": issuer, "OIDC_CLIENT_ID": CLIENT_ID}
    im = await start_im(url, **oidc)
    # No runtime: these tests never reach it.
    oidc["OIDC_CLIENT_SECRET"] = CLIENT_SECRET
    gateway = await start_gateway(im.address, "127.0.0.1:9", **oidc)
    refreshing = {**oidc, "GATEWAY_REFRESH_MARGIN_SECONDS": "3600"}
    finishes = await start_gateway(im.address, "127.0.0.1:9", **refreshing)
    callback = f"http://127.0.0.1:{finishes.port}/v1/auth/oidc/callback"
    starts = await start_gateway(im.address, "127.0.0.1:9", **refreshing, OIDC_REDIRECT_URL=callback)
    http = aiohttp.ClientSession()
    try:
        await provider.configure([f"http://127.0.0.1:{gateway.port}/v1/auth/oidc/callback", callback])
        yield Stack(provider, im, gateway, Api(http, f"http://127.0.0.1:{gateway.port}"), starts, finishes)
    finally:
        await http.close()
        for app in (starts, finishes, gateway):
            await app.stop()
        await stop_im(im)
        await provider.stop()


def email(prefix: str = "person") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}@example.test"


async def owner(stack: Stack) -> tuple[Browser, str]:
    """A workspace made with a password; its owner's browser and the workspace id."""
    ada, created = await new_workspace(stack.api, login=f"ada-{uuid.uuid4().hex[:6]}")
    return ada, created.body["workspace"]["id"]


async def invite(ada: Browser, bound_to: str = "") -> str:
    made = await ada.ok("POST", "/v1/auth/invites", body={"email": bound_to} if bound_to else {})
    secret: str = made["secret"]
    return secret


async def test_the_sign_in_page_offers_the_provider(stack: Stack) -> None:
    assert await stack.api.ok("GET", "/v1/auth/options") == {"oidc": True}


async def test_an_invited_person_joins_with_the_provider_and_signs_in_again_as_the_same_member(
    stack: Stack,
) -> None:
    ada, workspace = await owner(stack)
    address = email("bea")
    secret = await invite(ada, address)
    bea = stack.browser()
    try:
        landing = await bea.sign_in(address.upper(), invite=secret, name="Bea")
        assert landing.location == f"{stack.base}/", landing.fragment
        assert bea.cookie(COOKIE_NAME) and not bea.cookie(FLOW_COOKIE)
        status, session = await bea.session()
        assert status == 200, session
        member = session["member"]
        assert (member["displayName"], member["role"], member["kind"]) == (
            "Bea",
            "MEMBER_ROLE_MEMBER",
            "MEMBER_KIND_HUMAN",
        )
        assert session["workspace"]["id"] == workspace
        # The session acts as Bea, and as nobody else.
        status, made = await bea.call("POST", "/v1/groups", {"name": "from oidc"})
        assert status == 200 and made["group"]["memberIds"] == [member["id"]], made
        status, sent = await bea.call("POST", f"/v1/groups/{made['group']['id']}/messages", {"content": "hi"})
        assert status == 200 and sent["message"]["senderId"] == member["id"]
        # The invite is spent: joining with it again is refused...
        cy = stack.browser()
        again = await cy.sign_in(email("cy"), invite=secret)
        await cy.aclose()
        assert again.status == "FAILED_PRECONDITION" and "used already" in again.error, again.fragment
        # ...and signing out ends the session as for a password.
        status, _ = await bea.call("POST", "/v1/auth/sign-out")
        assert status == 200 and not bea.cookie(COOKIE_NAME)
        assert (await bea.session())[0] == 401
        # Back with the provider alone (no invite): the same member.
        landing = await bea.sign_in(address)
        assert landing.location == f"{stack.base}/", landing.fragment
        status, session = await bea.session()
        assert status == 200 and session["member"]["id"] == member["id"]
        # The owner reads both sign-ins in the audit log: the one that joined, then the other.
        log = await ada.ok("GET", "/v1/audit-events?page_size=50")
        signed_in = [e for e in log["auditEvents"] if e["action"] == "SignInWithOidc"]
        assert [e["actor"]["memberId"] for e in signed_in] == [member["id"]] * 2
        assert [e["target"]["kind"] for e in signed_in] == ["member", "invite"]
    finally:
        await bea.aclose()


async def test_an_open_invite_takes_whoever_the_provider_vouches_for(stack: Stack) -> None:
    ada, workspace = await owner(stack)
    secret = await invite(ada)
    dee = stack.browser()
    try:
        address = email("dee")
        landing = await dee.sign_in(address, invite=secret)
        assert landing.location == f"{stack.base}/", landing.fragment
        status, session = await dee.session()
        # No name chosen: the provider's.
        assert status == 200 and session["member"]["displayName"] == f"Person {address.split('@')[0]}"
        assert session["workspace"]["id"] == workspace
    finally:
        await dee.aclose()


async def test_an_unverified_email_an_unknown_email_and_no_email_are_refused_on_the_sign_in_page(
    stack: Stack,
) -> None:
    ada, _ = await owner(stack)
    secret = await invite(ada)
    for login, status, words in (
        (email("unverified"), "PERMISSION_DENIED", "has not verified the email"),
        (email("nobody"), "PERMISSION_DENIED", "no member of this workspace has this email; ask an admin"),
        (email("noemail"), "PERMISSION_DENIED", "gave no email address"),
    ):
        browser = stack.browser()
        try:
            # The unverified one even holds an invite: an invite needs a verified email too.
            landing = await browser.sign_in(login, **({"invite": secret} if login.startswith("unv") else {}))
            assert urlsplit(landing.location).path == "/", landing.location
            assert landing.status == status and words in landing.error, landing.fragment
            assert not browser.cookie(COOKIE_NAME)
            assert (await browser.session())[0] == 401
        finally:
            await browser.aclose()


async def test_a_tampered_state_and_a_replayed_callback_are_refused(stack: Stack) -> None:
    ada, _ = await owner(stack)
    address = email("eve")
    secret = await invite(ada, address)
    browser = stack.browser()
    try:
        start = f"{stack.base}/v1/auth/oidc/start?{urlencode({'invite': secret})}"
        callback = await browser.go(start, login=address, stop_at_callback=True)
        parts = urlsplit(callback)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        flow_cookie = browser.cookie(FLOW_COOKIE)
        tampered = urlunsplit(parts._replace(query=urlencode({**query, "state": query["state"][:-2] + "xx"})))
        refused = await browser.finish(tampered)
        assert refused.status == "UNAUTHENTICATED" and "state does not match" in refused.error
        # The invite is kept for another try, and nobody is signed in.
        assert refused.fragment.get("invite") == secret and not browser.cookie(COOKIE_NAME)
        # Without the flow cookie (cleared by the refusal), the genuine callback is refused too.
        assert "no sign-in" in (await browser.finish(callback)).error
        # With it back, the genuine callback signs in once...
        assert flow_cookie is not None
        restore = {FLOW_COOKIE: flow_cookie}
        where = URL(parts._replace(query="").geturl())
        browser.http.cookie_jar.update_cookies(restore, response_url=where)
        assert (await browser.finish(callback)).error == ""
        assert (await browser.session())[0] == 200
        # ...and a replay of it is refused by the provider (the code is spent).
        browser.http.cookie_jar.update_cookies(restore, response_url=where)
        replayed = await browser.finish(callback)
        assert replayed.status == "UNAUTHENTICATED" and "invalid_grant" in replayed.error, replayed.fragment
    finally:
        await browser.aclose()


async def test_a_replayed_id_token_and_one_for_another_client_are_refused_by_the_im(stack: Stack) -> None:
    ada, _ = await owner(stack)
    address = email("fay")
    secret = await invite(ada, address)
    id_token, nonce = await code_flow(stack.provider.issuer, stack.callback, login=address)
    first = await stack.auth.SignInWithOidc(
        auth_pb2.SignInWithOidcRequest(id_token=id_token, nonce=nonce, invite=secret), timeout=10
    )
    assert first.joined and first.tokens.member.display_name == f"Person {address.split('@')[0]}"
    with pytest.raises(grpc.aio.AioRpcError) as replayed:
        await stack.auth.SignInWithOidc(
            auth_pb2.SignInWithOidcRequest(id_token=id_token, nonce=nonce), timeout=10
        )
    assert replayed.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "used already" in (replayed.value.details() or "")
    other_token, other_nonce = await code_flow(
        stack.provider.issuer, stack.callback, login=address, client_id=OTHER_CLIENT
    )
    with pytest.raises(grpc.aio.AioRpcError) as foreign:
        await stack.auth.SignInWithOidc(
            auth_pb2.SignInWithOidcRequest(id_token=other_token, nonce=other_nonce), timeout=10
        )
    assert foreign.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "audience" in (foreign.value.details() or "")
    # A nonce other than the token's: refused, whatever the token.
    fresh_token, _ = await code_flow(stack.provider.issuer, stack.callback, login=address)
    with pytest.raises(grpc.aio.AioRpcError) as wrong_nonce:
        await stack.auth.SignInWithOidc(
            auth_pb2.SignInWithOidcRequest(id_token=fresh_token, nonce="another-nonce"), timeout=10
        )
    assert wrong_nonce.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "nonce" in (wrong_nonce.value.details() or "")


async def test_an_email_of_two_workspaces_asks_which_one(stack: Stack) -> None:
    address = email("gil")
    workspaces = []
    for _ in range(2):
        ada, workspace = await owner(stack)
        workspaces.append(workspace)
        joiner = stack.browser()
        try:
            landing = await joiner.sign_in(address, invite=await invite(ada, address))
            assert landing.error == "", landing.fragment
        finally:
            await joiner.aclose()
    browser = stack.browser()
    try:
        asked = await browser.sign_in(address)
        assert asked.status == "FAILED_PRECONDITION" and "choose the workspace" in asked.error
        assert workspaces[0] not in asked.location and workspaces[1] not in asked.location
        landing = await browser.sign_in(address, workspace=workspaces[1])
        assert landing.error == "", landing.fragment
        status, session = await browser.session()
        assert status == 200 and session["workspace"]["id"] == workspaces[1]
    finally:
        await browser.aclose()


async def test_a_password_owner_links_the_provider_and_then_signs_in_with_it(stack: Stack) -> None:
    ada, workspace = await owner(stack)
    address = email("ada")
    browser = stack.browser()
    try:
        # Linking needs a session: without one, the sign-in page says so.
        refused = await browser.sign_in(address, link="1")
        assert refused.status == "UNAUTHENTICATED" and "sign in first" in refused.error
        assert ada.cookie is not None
        browser.http.cookie_jar.update_cookies({COOKIE_NAME: ada.cookie}, response_url=URL(stack.base))
        linked = await browser.sign_in(address, link="1")
        assert linked.fragment == {"linked": address}, linked.location
        fresh = stack.browser()
        try:
            landing = await fresh.sign_in(address)
            assert landing.error == "", landing.fragment
            status, session = await fresh.session()
            assert status == 200 and session["workspace"]["id"] == workspace
            assert session["member"]["role"] == "MEMBER_ROLE_OWNER"
        finally:
            await fresh.aclose()
    finally:
        await browser.aclose()


async def test_linking_through_two_replicas_keeps_the_session_they_refresh(stack: Stack) -> None:
    # Each replica refreshes the session's tokens on the way: the one that
    # starts must hand the browser its new cookie, or the one that finishes
    # would present a spent refresh token (taken for a stolen one).
    starts = f"http://127.0.0.1:{stack.starts.port}"
    ada, created = await new_workspace(Api(stack.api.http, starts), login=f"ada-{uuid.uuid4().hex[:6]}")
    address = email("ada")
    browser = FlowBrowser(starts, f"http://127.0.0.1:{stack.finishes.port}")
    try:
        assert ada.cookie is not None
        browser.http.cookie_jar.update_cookies({COOKIE_NAME: ada.cookie}, response_url=URL(starts))
        landing = Landing(await browser.go(f"{starts}/v1/auth/oidc/start?link=1", login=address))
        assert landing.fragment == {"linked": address}, landing.location
        status, session = await browser.session()
        assert status == 200 and session["member"]["id"] == created.body["creator"]["id"]
        # Refused by the IM after both replicas refreshed: the session goes on all the same.
        # (Another browser with the same session: this one's provider session is Ada's.)
        other = FlowBrowser(starts, f"http://127.0.0.1:{stack.finishes.port}")
        try:
            kept = browser.cookie(COOKIE_NAME)
            assert kept is not None
            other.http.cookie_jar.update_cookies({COOKIE_NAME: kept}, response_url=URL(starts))
            refused = Landing(
                await other.go(f"{starts}/v1/auth/oidc/start?link=1", login=email("unverified"))
            )
            assert refused.status == "PERMISSION_DENIED" and "not verified" in refused.error, refused.location
            status, session = await other.session()
            assert status == 200 and session["member"]["id"] == created.body["creator"]["id"]
        finally:
            await other.aclose()
    finally:
        await browser.aclose()


async def test_a_sign_in_the_provider_refuses_comes_back_with_its_reason(stack: Stack) -> None:
    browser = stack.browser()
    try:
        aborted = {"error": "access_denied", "error_description": "End-User aborted"}
        landing = await browser.finish(f"{stack.callback}?{urlencode(aborted)}")
        # No flow cookie: that is what is said first.
        assert landing.status == "UNAUTHENTICATED" and "no sign-in" in landing.error
        callback = await browser.go(f"{stack.base}/v1/auth/oidc/start", login=email(), stop_at_callback=True)
        answer = {"error": "access_denied", "error_description": "End-User aborted", "state": "x"}
        denied = await browser.finish(f"{callback.split('?')[0]}?{urlencode(answer)}")
        assert "did not complete: End-User aborted" in denied.error, denied.fragment
    finally:
        await browser.aclose()


async def test_a_password_sign_in_needs_no_workspace(stack: Stack) -> None:
    login = f"hal-{uuid.uuid4().hex[:6]}"
    _, created = await new_workspace(stack.api, login=login)
    other = Browser(stack.api)
    signed = await other.call("POST", "/v1/auth/sign-in", body={"login": login, "password": PASSWORD})
    assert signed.status == 200 and other.cookie, signed.body
    assert (await other.who())["member"]["id"] == created.body["creator"]["id"]
