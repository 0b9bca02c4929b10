"""Signing in through the gateway: the sealed session cookie, CSRF, refresh,
sign-out, personal access tokens, and streams, against a real IM (and
runtime). No credential may reach the gateway's log."""

from __future__ import annotations

import logging

import pytest

from gateway.sessions import COOKIE_NAME
from tests.gateway_support import PASSWORD, Browser, as_member, new_workspace, sse
from tests.integration.test_gateway_http import Stack, stack

__all__ = ["stack"]  # a fixture


async def test_creating_a_workspace_signs_in_with_an_http_only_cookie_and_no_token_in_the_body(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    ada, created = await new_workspace(stack.api)
    cookie = created.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie and "Path=/" in cookie
    assert "Secure" not in cookie  # plain HTTP, GATEWAY_COOKIE_SECURE unset
    assert "tokens" not in created.body and "accessToken" not in str(created.body)
    session = await ada.who()
    workspace = created.body["workspace"]["id"]
    assert session["member"]["id"] == created.body["creator"]["id"]
    assert session["member"]["role"] == "MEMBER_ROLE_OWNER" and session["workspace"]["id"] == workspace

    # Signing in again, in another browser.
    bea = Browser(stack.api)
    wrong = await bea.call(
        "POST",
        "/v1/auth/sign-in",
        body={"workspaceId": workspace, "login": "ada", "password": "nope-nope"},
    )
    assert wrong.status == 401 and bea.cookie is None
    signed = await bea.call(
        "POST", "/v1/auth/sign-in", body={"workspaceId": workspace, "login": "ADA", "password": PASSWORD}
    )
    assert signed.status == 200 and bea.cookie and "tokens" not in signed.body
    again = await bea.who()
    assert again["member"]["id"] == session["member"]["id"] and again["csrfToken"] != session["csrfToken"]
    # A form post from another site cannot sign a browser in: JSON only.
    form = await Browser(stack.api).call(
        "POST",
        "/v1/auth/sign-in",
        data=f"workspaceId={workspace}&login=ada&password=x",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert form.status == 400

    # Nothing secret reaches the log.
    assert ada.cookie and bea.cookie
    for secret in (ada.cookie, bea.cookie, PASSWORD, ada.csrf or "", *_tokens_in(caplog)):
        assert secret not in caplog.text


def _tokens_in(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [word for word in caplog.text.split() if word.startswith(("eyJ", "aim_pat_", "aim_inv_"))]


async def test_without_a_session_the_api_is_401_and_with_one_changes_need_the_csrf_token(
    stack: Stack,
) -> None:
    anonymous = await stack.api.call("GET", "/v1/groups")
    assert anonymous.status == 401 and anonymous.error["status"] == "UNAUTHENTICATED"
    forged = await stack.api.call("GET", "/v1/groups", headers={"Cookie": f"{COOKIE_NAME}=AAAA{'x' * 80}"})
    assert forged.status == 401
    # Naming a member is no credential any more.
    ada, created = await new_workspace(stack.api)
    me = created.body["creator"]["id"]
    named = await stack.api.call("GET", "/v1/groups", headers={"X-Member-Id": me})
    assert named.status == 401

    assert (await ada.call("GET", "/v1/groups", csrf=False)).status == 200  # reads need none
    missing = await ada.call("POST", "/v1/groups", csrf=False, body={"name": "no csrf"})
    assert missing.status == 403 and missing.error["status"] == "PERMISSION_DENIED"
    wrong = await ada.call(
        "POST", "/v1/groups", csrf=False, body={"name": "x"}, headers={"X-CSRF-Token": "x"}
    )
    assert wrong.status == 403
    made = await ada.ok("POST", "/v1/groups", body={"name": "with csrf"})
    assert made["group"]["memberIds"] == [me]
    # A program's bearer token needs no CSRF token.
    assert (await stack.api.call("POST", "/v1/groups", member=me, body={"name": "program"})).status == 200


async def test_an_old_access_token_is_refreshed_and_the_cookie_set_again(stack: Stack) -> None:
    # Every access token (15 minutes) is "within the margin": each request refreshes.
    app, api = await stack.gateway_with(GATEWAY_REFRESH_MARGIN_SECONDS="3600")
    try:
        ada, _ = await new_workspace(api)
        first, csrf = ada.cookie, ada.csrf
        groups = await ada.call("GET", "/v1/groups")
        assert groups.status == 200 and ada.cookie and ada.cookie != first
        # The session (and its CSRF token) is the same; its tokens are new.
        assert (await ada.who())["csrfToken"] == csrf
        assert (await ada.call("POST", "/v1/groups", body={"name": "after refresh"})).status == 200
    finally:
        await app.stop()
    # A gateway that must refresh the first cookie's spent refresh token cannot:
    # the IM takes a reused refresh token for a stolen one.
    other, api = await stack.gateway_with(GATEWAY_REFRESH_MARGIN_SECONDS="3600")
    try:
        stale = Browser(api)
        stale.cookie = first
        assert (await stale.call("GET", "/v1/groups")).status == 401
    finally:
        await other.stop()


async def test_sign_out_makes_the_cookie_useless(stack: Stack) -> None:
    ada, _ = await new_workspace(stack.api)
    cookie = ada.cookie
    refused = await ada.call("POST", "/v1/auth/sign-out", csrf=False)
    assert refused.status == 403
    out = await ada.call("POST", "/v1/auth/sign-out")
    assert out.status == 200 and ada.cookie is None
    replayed = Browser(stack.api)
    replayed.cookie = cookie
    assert (await replayed.call("GET", "/v1/groups")).status == 401
    # Another gateway (no memory of the sign-out) refreshes and is refused by the IM.
    app, api = await stack.gateway_with(GATEWAY_REFRESH_MARGIN_SECONDS="3600")
    try:
        elsewhere = Browser(api)
        elsewhere.cookie = cookie
        assert (await elsewhere.call("GET", "/v1/groups")).status == 401
    finally:
        await app.stop()


async def test_streams_take_the_cookie_and_never_a_token_in_the_url(stack: Stack) -> None:
    ada, created = await new_workspace(stack.api)
    headers = {"Cookie": f"{COOKIE_NAME}={ada.cookie}"}
    async with sse(stack.http, f"{stack.base}/v1/events", headers=headers) as stream:
        group = (await ada.ok("POST", "/v1/groups", body={"name": "live"}))["group"]["id"]
        await ada.ok("POST", f"/v1/groups/{group}/messages", body={"content": "over the stream"})
        events = await stream.until("message_created")
        assert events[-1].json["messageCreated"]["message"]["content"] == "over the stream"
    token = as_member(created.body["creator"]["id"])["Authorization"].removeprefix("Bearer ")
    for name in ("access_token", "token"):
        in_url = await stack.api.call("GET", "/v1/events", params={name: token})
        assert in_url.status == 401


async def test_personal_tokens_work_as_bearer_and_a_read_token_cannot_post(stack: Stack) -> None:
    ada, created = await new_workspace(stack.api)
    group = (await ada.ok("POST", "/v1/groups", body={"name": "pat"}))["group"]["id"]
    read = await ada.ok(
        "POST", "/v1/auth/personal-tokens", body={"name": "reader", "scope": "PERSONAL_TOKEN_SCOPE_READ"}
    )
    write = await ada.ok(
        "POST", "/v1/auth/personal-tokens", body={"name": "writer", "scope": "PERSONAL_TOKEN_SCOPE_WRITE"}
    )
    assert read["secret"].startswith("aim_pat_")
    reader = {"Authorization": f"Bearer {read['secret']}"}
    writer = {"Authorization": f"Bearer {write['secret']}"}
    listed = await stack.api.call("GET", f"/v1/groups/{group}/messages", headers=reader)
    assert listed.status == 200
    posted = await stack.api.call(
        "POST", f"/v1/groups/{group}/messages", headers=reader, body={"content": "hi"}
    )
    assert posted.status == 403 and posted.error["status"] == "PERMISSION_DENIED"
    sent = await stack.api.call(
        "POST", f"/v1/groups/{group}/messages", headers=writer, body={"content": "hi"}
    )
    assert sent.status == 200 and sent.body["message"]["senderId"] == created.body["creator"]["id"]
    # Cached: the second call exchanges nothing, and still works.
    assert (await stack.api.call("GET", "/v1/groups", headers=writer)).status == 200
    unknown = await stack.api.call("GET", "/v1/groups", headers={"Authorization": "Bearer aim_pat_nope"})
    assert unknown.status == 401
    tokens = await ada.ok("GET", "/v1/auth/personal-tokens")
    assert {t["name"] for t in tokens["personalTokens"]} == {"reader", "writer"}
    assert "secret" not in str(tokens)
    revoked = await ada.ok("POST", f"/v1/auth/personal-tokens/{read['personalToken']['id']}:revoke")
    assert revoked["personalToken"]["revokeTime"]
    # Its exchange was cached, and is forgotten: refused at once; the other token still works.
    assert (await stack.api.call("GET", "/v1/groups", headers=reader)).status == 401
    assert (await stack.api.call("GET", "/v1/groups", headers=writer)).status == 200


async def test_admins_invite_people_who_accept_and_are_signed_in(stack: Stack) -> None:
    ada, created = await new_workspace(stack.api)
    invite = await ada.ok("POST", "/v1/auth/invites", body={"role": "MEMBER_ROLE_MEMBER"})
    assert invite["secret"].startswith("aim_inv_")
    bea = Browser(stack.api)
    accepted = await bea.call(
        "POST",
        "/v1/auth/accept-invite",
        body={"invite": invite["secret"], "displayName": "Bea", "login": "bea", "password": PASSWORD},
    )
    assert accepted.status == 200 and bea.cookie and "tokens" not in accepted.body
    session = await bea.who()
    assert session["member"]["displayName"] == "Bea" and session["member"]["role"] == "MEMBER_ROLE_MEMBER"
    # Bea may not invite, nor change roles; Ada may.
    assert (await bea.call("POST", "/v1/auth/invites", body={})).status == 403
    promoted = await ada.ok(
        "POST", f"/v1/members/{session['member']['id']}:setRole", body={"role": "MEMBER_ROLE_ADMIN"}
    )
    assert promoted["member"]["role"] == "MEMBER_ROLE_ADMIN"
    # Bea cannot view the workspace as another person.
    as_ada = await bea.call("GET", "/v1/groups", headers={"X-View-As": created.body["creator"]["id"]})
    assert as_ada.status == 403
    # Changing the password keeps Bea signed in, with new tokens in the cookie.
    before = bea.cookie
    changed = await bea.call(
        "POST", "/v1/auth/password", body={"oldPassword": PASSWORD, "newPassword": PASSWORD + "!"}
    )
    assert changed.status == 200 and bea.cookie != before and "tokens" not in changed.body
    assert (await bea.who())["member"]["displayName"] == "Bea"


async def test_the_owner_views_as_an_agent_through_x_view_as_and_x_member_id_asks_nothing(
    stack: Stack,
) -> None:
    ada, _ = await new_workspace(stack.api)
    agent = (await ada.ok("POST", "/v1/agents", body={"name": "scout"}))["agent"]
    shared = (
        await ada.ok("POST", "/v1/groups", body={"name": "with scout", "memberIds": [agent["memberId"]]})
    )["group"]
    own = (await ada.ok("POST", "/v1/groups", body={"name": "just ada"}))["group"]
    as_agent = await ada.ok("GET", "/v1/groups", headers={"X-View-As": agent["memberId"]})
    assert [g["id"] for g in as_agent["groups"]] == [shared["id"]]
    # The retired X-Member-Id is no view (nor a credential): Ada sees her own groups.
    named = await ada.ok("GET", "/v1/groups", headers={"X-Member-Id": agent["memberId"]})
    assert {g["id"] for g in named["groups"]} == {shared["id"], own["id"]}
    assert (
        await stack.api.call("GET", "/v1/groups", headers={"X-Member-Id": agent["memberId"]})
    ).status == 401


async def test_the_sign_in_options_say_whether_oidc_is_configured(stack: Stack) -> None:
    assert await stack.api.ok("GET", "/v1/auth/options") == {"oidc": False}


@pytest.mark.parametrize("secure", ["true"])
async def test_the_cookie_is_secure_when_configured(stack: Stack, secure: str) -> None:
    app, api = await stack.gateway_with(GATEWAY_COOKIE_SECURE=secure)
    try:
        _, created = await new_workspace(api)
        assert "Secure" in created.headers["Set-Cookie"]
    finally:
        await app.stop()
