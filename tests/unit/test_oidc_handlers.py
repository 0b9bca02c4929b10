"""Signing in without a workspace, invites bound to an email, and signing in,
joining and linking with the OpenID provider: the handlers against the fakes."""

from __future__ import annotations

import secrets
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from services.common.identity import Caller
from services.im.domain import access
from services.im.domain.accounts import IssuedTokens, PersonalTokenScope
from services.im.domain.commands import (
    AcceptInvite,
    ChangePassword,
    CreateInvite,
    CreatePersonalToken,
    CreateWorkspace,
    ExchangePersonalToken,
    LinkOidcAccount,
    SignIn,
    SignInWithOidc,
)
from services.im.domain.errors import (
    AlreadyTaken,
    InvalidRequest,
    NotAllowed,
    QuotaExceeded,
    TooManyAttempts,
    Unauthenticated,
    WrongState,
)
from services.im.domain.model import Role, Workspace
from services.im.domain.rules import Quotas
from services.im.service_layer.handlers.oidc import NO_MEMBER
from services.im.service_layer.handlers.sessions import WORKSPACE_REQUIRED
from tests.oidc_support import TestIssuer
from tests.unit.test_auth_handlers import PASSWORD, AuthWorld
from tests.unit.test_oidc_tokens import FakeKeys

ISSUER = "https://id.example.test"


class OidcWorld:
    """An AuthWorld built with a provider that is a TestIssuer."""

    def __init__(self, world: AuthWorld, issuer: TestIssuer, *, configured: bool = True) -> None:
        self.world = world
        self.issuer = issuer
        # Invites may be bound to an email where the provider proves emails.
        if configured:
            world.rebuild(provider_keys=FakeKeys(issuer), OIDC_ISSUER=ISSUER, OIDC_CLIENT_ID=issuer.client_id)

    def token(self, email: str, **claims: Any) -> tuple[str, str]:
        """An ID token for `email`, issued now by the world's clock, and its nonce."""
        nonce = secrets.token_urlsafe(12)
        now = int(self.world.clock.now.timestamp())
        return self.issuer.id_token(email=email, nonce=nonce, iat=now, exp=now + 300, **claims), nonce

    async def sign_in(
        self, email: str, *, workspace: Workspace | None = None, invite: str = "", name: str = ""
    ) -> tuple[IssuedTokens, bool]:
        token, nonce = self.token(email)
        return await self.world.bus.handle(
            SignInWithOidc(
                id_token=token,
                nonce=nonce,
                workspace_id=str(workspace.id) if workspace else "",
                invite=invite,
                display_name=name,
            )
        )


@pytest.fixture(scope="module")
def issuer() -> TestIssuer:
    return TestIssuer(issuer=ISSUER)


@pytest.fixture
async def world(tmp_path: Path) -> AuthWorld:
    return AuthWorld.make(tmp_path)


@pytest.fixture
def oidc(world: AuthWorld, issuer: TestIssuer) -> OidcWorld:
    return OidcWorld(world, issuer)


async def workspace_with(world: AuthWorld, login: str, password: str) -> tuple[Workspace, IssuedTokens]:
    workspace, _, tokens = await world.bus.handle(
        CreateWorkspace(
            name="ws",
            creator_display_name="Ada",
            creator_kind=None,
            creator_avatar="",
            creator_login=login,
            creator_password=password,
            request_id="",
        )
    )
    assert tokens is not None
    return workspace, tokens


async def owner_caller(world: AuthWorld) -> tuple[Workspace, Caller]:
    workspace, _, tokens = await world.owner(login=f"own-{secrets.token_hex(3)}")
    return workspace, await world.as_caller(tokens)


# -- signing in with a password, without the workspace ------------------------------------


async def test_without_a_workspace_the_password_picks_the_account(world: AuthWorld) -> None:
    first, ada1 = await workspace_with(world, "ada", "first password")
    second, ada2 = await workspace_with(world, "ada", "second password")

    async def sign_in(*, workspace_id: str, login: str, password: str) -> IssuedTokens:
        return await world.bus.handle(SignIn(workspace_id=workspace_id, login=login, password=password))

    assert (await sign_in(workspace_id="", login="ADA", password="first password")).member == ada1.member
    assert (await sign_in(workspace_id="", login="ada", password="second password")).member == ada2.member
    with pytest.raises(Unauthenticated, match="login or password is wrong"):
        await sign_in(workspace_id="", login="ada", password="third password")
    # One password for both: which workspace, the caller must say (and is not told).
    await workspace_with(world, "bob", "same password")
    await workspace_with(world, "bob", "same password")
    with pytest.raises(WrongState) as caught:
        await sign_in(workspace_id="", login="bob", password="same password")
    assert caught.value.message == WORKSPACE_REQUIRED and str(first.id) not in caught.value.message
    # With the workspace, as before.
    assert (await sign_in(workspace_id=str(second.id), login="ada", password="second password")).member
    with pytest.raises(InvalidRequest, match="workspace_id is not a valid id"):
        await sign_in(workspace_id="nope", login="ada", password="second password")


async def test_an_unknown_login_costs_a_check_and_gets_the_same_answer(world: AuthWorld) -> None:
    await workspace_with(world, "ada", PASSWORD)
    messages = set()
    for login in ("ghost", "ada"):
        with pytest.raises(Unauthenticated) as caught:
            await world.bus.handle(SignIn(workspace_id="", login=login, password="not it at all"))
        messages.add(caught.value.message)
    assert len(messages) == 1 and world.passwords.wasted == 1


async def test_guesses_without_the_workspace_count_against_every_account(world: AuthWorld) -> None:
    workspace, _ = await workspace_with(world, "ada", PASSWORD)
    for _ in range(5):
        with pytest.raises(Unauthenticated):
            await world.bus.handle(SignIn(workspace_id="", login="ada", password="wrong password"))
    # Refused without the workspace, and with it: the guesses counted there too.
    for ws in ("", str(workspace.id)):
        with pytest.raises(TooManyAttempts):
            await world.bus.handle(SignIn(workspace_id=ws, login="ada", password=PASSWORD))
    world.clock.advance(timedelta(minutes=15))
    assert (await world.bus.handle(SignIn(workspace_id="", login="ada", password=PASSWORD))).member


async def test_an_account_under_attack_does_not_lock_out_the_login_elsewhere(world: AuthWorld) -> None:
    victim, victim_tokens = await workspace_with(world, "ada", "victim password")
    attacked, _ = await workspace_with(world, "ada", "attacked password")
    for _ in range(6):
        with pytest.raises((Unauthenticated, TooManyAttempts)):
            await world.bus.handle(SignIn(workspace_id=str(attacked.id), login="ada", password="guess guess"))
    signed = await world.bus.handle(SignIn(workspace_id="", login="ada", password="victim password"))
    assert signed.member == victim_tokens.member and signed.member.workspace_id == victim.id
    # The attacked account itself stays refused, however it is asked for.
    with pytest.raises(Unauthenticated):
        await world.bus.handle(SignIn(workspace_id="", login="ada", password="attacked password"))
    with pytest.raises(TooManyAttempts):
        await world.bus.handle(
            SignIn(workspace_id=str(attacked.id), login="ada", password="attacked password")
        )


async def test_a_login_of_too_many_workspaces_needs_the_workspace(world: AuthWorld) -> None:
    world.rebuild(AUTH_SIGN_IN_MAX_WORKSPACES="2")
    for index in range(3):
        await workspace_with(world, "ada", f"password number {index}")
    with pytest.raises(WrongState, match="needs its workspace"):
        await world.bus.handle(SignIn(workspace_id="", login="ada", password="password number 0"))


# -- invites bound to an email ----------------------------------------------------------------


async def test_an_invite_bound_to_an_email_is_for_the_provider_s_sign_in_only(
    world: AuthWorld, issuer: TestIssuer
) -> None:
    workspace, owner = await owner_caller(world)
    # Without a provider nothing proves an email: no invite is bound to one.
    with pytest.raises(WrongState, match="OIDC_ISSUER"):
        await world.bus.handle(
            CreateInvite(caller=owner, role=None, ttl=None, request_id="", email="bea@x.test")
        )
    oidc = OidcWorld(world, issuer)
    invite, secret = await world.bus.handle(
        CreateInvite(caller=owner, role=None, ttl=None, request_id="r1", email=" Bea@Example.TEST ")
    )
    assert invite.email == "bea@example.test"
    # A password proves nothing of the email.
    with pytest.raises(WrongState, match=r"for bea@example\.test only: join with your organisation"):
        await world.bus.handle(
            AcceptInvite(invite=secret, display_name="Bea", login="bea", password=PASSWORD, request_id="")
        )
    joined, _ = await oidc.sign_in("bea@example.test", invite=secret)
    assert world.store.state.auth.accounts[joined.member.id].email == "bea@example.test"
    assert joined.member.workspace_id == workspace.id
    # Nobody else of the workspace gets an invite for it now.
    with pytest.raises(AlreadyTaken, match=r"has the email bea@example\.test"):
        await world.bus.handle(
            CreateInvite(caller=owner, role=None, ttl=None, request_id="", email="BEA@example.test")
        )
    with pytest.raises(InvalidRequest, match="email must be an email address"):
        await world.bus.handle(
            CreateInvite(caller=owner, role=None, ttl=None, request_id="", email="not an email")
        )


# -- the OpenID provider -----------------------------------------------------------------------


async def test_a_member_with_the_email_signs_in_once_per_token(world: AuthWorld, oidc: OidcWorld) -> None:
    _, owner = await owner_caller(world)
    _, secret = await world.bus.handle(
        CreateInvite(caller=owner, role=None, ttl=None, request_id="", email="cy@x.test")
    )
    cy, _ = await oidc.sign_in("cy@x.test", invite=secret)
    token, nonce = oidc.token("CY@x.test")
    issued, joined = await world.bus.handle(
        SignInWithOidc(id_token=token, nonce=nonce, workspace_id="", invite="", display_name="")
    )
    assert issued.member == cy.member and not joined
    assert (await world.verifier.verify(issued.access.token)).member_id == cy.member.id
    with pytest.raises(Unauthenticated, match="used already"):
        await world.bus.handle(
            SignInWithOidc(id_token=token, nonce=nonce, workspace_id="", invite="", display_name="")
        )
    # The nonce is stored hashed, and forgotten once the token is of no use.
    assert nonce not in str(world.store.state.auth.oidc_nonces)
    assert access.secret_hash(nonce) in world.store.state.auth.oidc_nonces
    world.clock.advance(timedelta(minutes=12))
    await oidc.sign_in("cy@x.test")
    assert access.secret_hash(nonce) not in world.store.state.auth.oidc_nonces


async def test_an_unknown_email_is_refused_and_an_invite_makes_the_member(
    world: AuthWorld, oidc: OidcWorld
) -> None:
    workspace, owner = await owner_caller(world)
    with pytest.raises(NotAllowed) as caught:
        await oidc.sign_in("dee@x.test")
    assert caught.value.message == NO_MEMBER
    _, secret = await world.bus.handle(CreateInvite(caller=owner, role=Role.ADMIN, ttl=None, request_id=""))
    issued, joined = await oidc.sign_in("Dee@X.test", invite=secret)
    assert joined and issued.member.role is Role.ADMIN and issued.member.workspace_id == workspace.id
    assert issued.member.display_name == "Dee"  # the token's name
    account = world.store.state.auth.accounts[issued.member.id]
    assert (account.email, account.login, account.password_hash) == ("dee@x.test", None, None)
    # Signing in again needs no invite; the spent invite takes nobody else.
    again, joined_again = await oidc.sign_in("dee@x.test")
    assert again.member == issued.member and not joined_again
    with pytest.raises(WrongState, match="used already"):
        await oidc.sign_in("eve@x.test", invite=secret)
    # A member made through the provider has no password to sign in or change with.
    with pytest.raises(WrongState, match="has no password"):
        await world.bus.handle(
            ChangePassword(caller=await world.as_caller(issued), old_password="x", new_password=PASSWORD)
        )


async def test_joining_through_the_provider_counts_against_the_workspace_s_quota(
    world: AuthWorld, oidc: OidcWorld
) -> None:
    world.deps.quotas = Quotas(members=1, agents=1, groups=1)
    workspace, owner = await owner_caller(world)
    _, secret = await world.bus.handle(CreateInvite(caller=owner, role=None, ttl=None, request_id=""))
    with pytest.raises(QuotaExceeded):
        await oidc.sign_in("dee@x.test", invite=secret)
    assert len([m for m in world.store.state.members.values() if m.workspace_id == workspace.id]) == 1
    # The invite is not spent: with room made, it takes Dee.
    world.deps.quotas = Quotas(members=2, agents=1, groups=1)
    _, joined = await oidc.sign_in("dee@x.test", invite=secret)
    assert joined


async def test_an_invite_bound_to_an_email_takes_that_email_only(world: AuthWorld, oidc: OidcWorld) -> None:
    _, owner = await owner_caller(world)
    _, secret = await world.bus.handle(
        CreateInvite(caller=owner, role=None, ttl=None, request_id="", email="fay@x.test")
    )
    with pytest.raises(NotAllowed, match="invite is for another email address"):
        await oidc.sign_in("mallory@x.test", invite=secret)
    issued, joined = await oidc.sign_in("FAY@x.test", invite=secret, name="Fay F.")
    assert joined and issued.member.display_name == "Fay F."
    world.clock.advance(timedelta(days=8))
    _, expiring = await world.bus.handle(
        CreateInvite(caller=owner, role=None, ttl=timedelta(days=1), request_id="")
    )
    world.clock.advance(timedelta(days=2))
    with pytest.raises(WrongState, match="expired"):
        await oidc.sign_in("gus@x.test", invite=expiring)
    with pytest.raises(Unauthenticated, match="invite is not valid"):
        await oidc.sign_in("gus@x.test", invite="aim_inv_guess")


async def test_an_email_of_several_workspaces_needs_the_workspace(world: AuthWorld, oidc: OidcWorld) -> None:
    spaces = []
    for _ in range(2):
        workspace, owner = await owner_caller(world)
        _, secret = await world.bus.handle(CreateInvite(caller=owner, role=None, ttl=None, request_id=""))
        await oidc.sign_in("hal@x.test", invite=secret)
        spaces.append(workspace)
    with pytest.raises(WrongState, match="choose the workspace"):
        await oidc.sign_in("hal@x.test")
    issued, _ = await oidc.sign_in("hal@x.test", workspace=spaces[1])
    assert issued.member.workspace_id == spaces[1].id
    # An invite names its own workspace.
    _, owner = await owner_caller(world)
    _, secret = await world.bus.handle(CreateInvite(caller=owner, role=None, ttl=None, request_id=""))
    with pytest.raises(InvalidRequest, match="another workspace"):
        await oidc.sign_in("hal@x.test", invite=secret, workspace=spaces[0])


async def test_a_signed_in_person_links_the_provider(world: AuthWorld, oidc: OidcWorld) -> None:
    workspace, tokens = await workspace_with(world, "ivy", PASSWORD)
    ivy = await world.as_caller(tokens)
    token, nonce = oidc.token("Ivy@x.test")
    member, email = await world.bus.handle(LinkOidcAccount(caller=ivy, id_token=token, nonce=nonce))
    assert (member, email) == (tokens.member, "ivy@x.test")
    issued, _ = await oidc.sign_in("ivy@x.test")
    assert issued.member == tokens.member
    # The password still works.
    assert (await world.bus.handle(SignIn(workspace_id="", login="ivy", password=PASSWORD))).member
    # Another member of the workspace cannot take the email.
    _, secret = await world.bus.handle(CreateInvite(caller=ivy, role=None, ttl=None, request_id=""))
    joe = await world.bus.handle(
        AcceptInvite(invite=secret, display_name="Joe", login="joe", password=PASSWORD, request_id="")
    )
    token, nonce = oidc.token("ivy@x.test")
    with pytest.raises(AlreadyTaken, match="another member of this workspace"):
        await world.bus.handle(
            LinkOidcAccount(caller=await world.as_caller(joe), id_token=token, nonce=nonce)
        )
    # A personal token is not a signed-in person.
    _, pat = await world.bus.handle(
        CreatePersonalToken(
            caller=ivy, name="ci", scope=PersonalTokenScope.WRITE, expire_time=None, request_id=""
        )
    )
    program = Caller(
        claims=await world.verifier.verify((await world.bus.handle(ExchangePersonalToken(secret=pat))).token)
    )
    token, nonce = oidc.token("ivy@x.test")
    with pytest.raises(NotAllowed, match="only a signed-in person"):
        await world.bus.handle(LinkOidcAccount(caller=program, id_token=token, nonce=nonce))
    assert workspace.id == tokens.member.workspace_id


async def test_nothing_works_when_the_provider_is_not_configured(
    world: AuthWorld, issuer: TestIssuer
) -> None:
    unconfigured = OidcWorld(world, issuer, configured=False)
    with pytest.raises(WrongState, match="not configured"):
        await unconfigured.sign_in("kim@x.test")
