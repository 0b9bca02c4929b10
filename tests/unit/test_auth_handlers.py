"""The identity handlers (sessions, invites, roles, tokens for programs) through
the message bus of the IM built on the in-memory fakes."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from services.common.errors import ServiceError
from services.common.identity import Caller
from services.common.tokens import AccessClaims, KeyRing, PrincipalKind, Scope, Verifier, keyring_source
from services.im import bootstrap
from services.im.adapters.service_credentials import ensure_embedded_credentials
from services.im.config import Settings
from services.im.domain.accounts import IssuedTokens, PersonalTokenScope
from services.im.domain.commands import (
    AcceptInvite,
    ChangePassword,
    CreateInvite,
    CreateMember,
    CreatePersonalToken,
    CreateWorkspace,
    ExchangePersonalToken,
    IssueAgentTokens,
    IssueServiceToken,
    RefreshTokens,
    RevokePersonalToken,
    SetMemberRole,
    SignIn,
    SignOut,
)
from services.im.domain.errors import (
    AlreadyTaken,
    InvalidRequest,
    NotAllowed,
    NotFound,
    TooManyAttempts,
    Unauthenticated,
    WrongState,
)
from services.im.domain.model import Member, MemberKind, Role, Workspace
from services.im.service_layer.auth_ports import ProviderKeys
from services.im.service_layer.handlers.auth_deps import AuthDeps
from services.im.service_layer.handlers.deps import Deps
from services.im.service_layer.handlers.machine_access import list_personal_tokens
from services.im.service_layer.messagebus import MessageBus
from tests.identities import caller_of, service_caller
from tests.unit.auth_fakes import FakePasswords
from tests.unit.fakes import FakeClock, InMemoryStore
from tests.unit.support import build_on_fakes, unique, unit_settings

PASSWORD = "correct horse battery"


def settings_in(directory: Path, **environ: str) -> Settings:
    """Unit-test settings with the signing key and service credentials in `directory`."""
    return unit_settings(
        environ={
            "AUTH_SIGNING_KEYS_DIR": str(directory / "keys"),
            "AUTH_SERVICE_CREDENTIALS_FILE": str(directory / "secrets" / "service-credentials"),
            **environ,
        }
    )


@dataclass
class AuthWorld:
    """The IM built on fakes, with its own signing key and service credentials."""

    store: InMemoryStore
    clock: FakeClock
    passwords: FakePasswords
    app: bootstrap.IMApp
    verifier: Verifier
    directory: Path

    @classmethod
    def make(cls, tmp_path: Path) -> AuthWorld:
        KeyRing.generate(tmp_path / "keys")
        ensure_embedded_credentials(tmp_path / "secrets" / "service-credentials")
        store = InMemoryStore()
        clock = FakeClock()
        passwords = FakePasswords()
        return cls(
            store=store,
            clock=clock,
            passwords=passwords,
            app=build_on_fakes(settings_in(tmp_path), store=store, clock=clock, passwords=passwords),
            verifier=Verifier(
                keyring_source(KeyRing.load(tmp_path / "keys")),
                clock=lambda: clock.now.timestamp(),  # noqa: PLW0108
            ),
            directory=tmp_path,
        )

    def rebuild(self, *, provider_keys: ProviderKeys | None = None, **environ: str) -> None:
        """Builds the IM again on the same fakes, with more settings (say, a provider's)."""
        self.app = build_on_fakes(
            settings_in(self.directory, **environ),
            store=self.store,
            clock=self.clock,
            passwords=self.passwords,
            provider_keys=provider_keys,
        )

    @property
    def deps(self) -> Deps:
        return self.app.deps

    @property
    def bus(self) -> MessageBus:
        return self.app.bus

    @property
    def auth(self) -> AuthDeps:
        return self.app.auth

    @property
    def keys(self) -> KeyRing:
        return self.app.identity.keys

    @property
    def runtime_secret(self) -> str:
        """The runtime's service secret, as its credentials file holds it."""
        return (self.directory / "secrets" / "runtime.secret").read_text().strip()

    async def owner(
        self, login: str = "ada", *, name: str = "", request_id: str = ""
    ) -> tuple[Workspace, Member, IssuedTokens]:
        workspace, creator, tokens = await self.bus.handle(
            CreateWorkspace(
                name=name or unique("ws"),
                creator_display_name="Ada",
                creator_kind=None,
                creator_avatar="",
                creator_login=login,
                creator_password=PASSWORD,
                request_id=request_id,
            )
        )
        assert tokens is not None
        return workspace, creator, tokens

    async def as_caller(self, tokens: IssuedTokens) -> Caller:
        return Caller(claims=await self.verifier.verify(tokens.access.token))

    async def invite_and_join(
        self, inviter: Caller, login: str, role: Role = Role.MEMBER, name: str = "Bea"
    ) -> IssuedTokens:
        _, secret = await self.bus.handle(CreateInvite(caller=inviter, role=role, ttl=None, request_id=""))
        return await self.bus.handle(
            AcceptInvite(invite=secret, display_name=name, login=login, password=PASSWORD, request_id="")
        )

    async def agent(self, workspace: Workspace, *, by_service: bool) -> Member:
        creator = next(m for m in self.store.state.members.values() if m.workspace_id == workspace.id)
        principal = (
            service_caller("runtime")
            if by_service
            else caller_of(creator.id, workspace.id, roles=(creator.role.value,))
        )
        return await self.bus.handle(
            CreateMember(
                caller=principal,
                workspace_id=str(workspace.id),
                kind=MemberKind.AGENT,
                display_name="helper",
                avatar="",
                request_id="",
            )
        )


@pytest.fixture
async def world(tmp_path: Path) -> AuthWorld:
    return AuthWorld.make(tmp_path)


def token_of(member: Member) -> Caller:
    """The caller of a token with the member's claims (as the IM would sign them)."""
    kind = PrincipalKind.AGENT if member.kind is MemberKind.AGENT else PrincipalKind.HUMAN
    return caller_of(member.id, member.workspace_id, kind=kind, roles=(member.role.value,))


# -- workspaces and signing in -----------------------------------------------------


async def test_a_creator_with_a_login_owns_the_workspace_and_is_signed_in(world: AuthWorld) -> None:
    workspace, creator, tokens = await world.owner(login="Ada@Example")
    assert creator.role is Role.OWNER and tokens.member == creator
    claims = await world.verifier.verify(tokens.access.token)
    assert (claims.kind, claims.member_id, claims.workspace_id, claims.roles, claims.scope) == (
        PrincipalKind.HUMAN,
        creator.id,
        workspace.id,
        ("owner",),
        Scope.READ_WRITE,
    )
    assert claims.expires_at == tokens.access.expires_at == world.clock.now + timedelta(minutes=15)
    assert tokens.refresh_token.startswith("aim_rt_")
    assert tokens.refresh_expires_at == world.clock.now + timedelta(days=30)
    account = world.store.state.auth.accounts[creator.id]
    assert account.login == "ada@example" and PASSWORD not in (account.password_hash or "")
    again = await world.bus.handle(
        SignIn(workspace_id=str(workspace.id), login="ADA@example", password=PASSWORD)
    )
    assert again.member.id == creator.id


async def test_a_creator_without_a_login_still_owns_the_workspace(world: AuthWorld) -> None:
    _, creator, tokens = await world.bus.handle(
        CreateWorkspace(
            name="w",
            creator_display_name="Ada",
            creator_kind=None,
            creator_avatar="",
            request_id="",
            creator_login="",
            creator_password="",
        )
    )
    assert tokens is None and creator.role is Role.OWNER
    assert creator.id not in world.store.state.auth.accounts


async def test_creating_a_workspace_with_an_account_is_checked_before_anything_is_stored(
    world: AuthWorld,
) -> None:
    cases = [
        ({"creator_login": "ada", "creator_password": ""}, "go together"),
        ({"creator_login": "", "creator_password": PASSWORD}, "go together"),
        ({"creator_login": "a", "creator_password": PASSWORD}, "login must be"),
        ({"creator_login": "ada", "creator_password": "too-short"}, "at least 10"),
        ({"creator_login": "ada", "creator_password": PASSWORD, "creator_kind": MemberKind.AGENT}, "HUMAN"),
    ]
    for fields, message in cases:
        values: dict[str, object] = {"creator_kind": None}
        values.update(fields)
        with pytest.raises(InvalidRequest, match=message) as caught:
            await world.bus.handle(
                CreateWorkspace(
                    name="w",
                    creator_display_name="Ada",
                    creator_avatar="",
                    request_id="",
                    **values,  # type: ignore[arg-type]
                )
            )
        assert "too-short" not in caught.value.message
    assert not world.store.state.workspaces


async def test_a_retried_creation_signs_in_again_with_the_same_password(world: AuthWorld) -> None:
    workspace, creator, first = await world.owner(name="acme", request_id="create-1")
    retried_ws, retried_creator, retried = await world.owner(name="acme", request_id="create-1")
    assert (retried_ws.id, retried_creator.id) == (workspace.id, creator.id)
    assert retried.refresh_token != first.refresh_token
    with pytest.raises(Unauthenticated):
        await world.bus.handle(
            CreateWorkspace(
                name=workspace.name,
                creator_display_name="Ada",
                creator_kind=None,
                creator_avatar="",
                request_id="create-1",
                creator_login="ada",
                creator_password="another password!",
            )
        )
    assert len(world.store.state.workspaces) == 1


async def test_a_wrong_login_and_a_wrong_password_get_the_same_answer(world: AuthWorld) -> None:
    workspace, _, _ = await world.owner()
    messages = set()
    for login, password in [("ada", "wrong password"), ("nobody", PASSWORD), ("x", PASSWORD), ("ada", "")]:
        with pytest.raises(Unauthenticated) as caught:
            await world.bus.handle(SignIn(workspace_id=str(workspace.id), login=login, password=password))
        messages.add(caught.value.message)
    assert messages == {"the login or password is wrong"}
    assert world.passwords.wasted == 1  # the unknown login took as long as a check


async def test_sign_in_is_throttled_per_login_and_a_success_clears_it(world: AuthWorld) -> None:
    workspace, _, _ = await world.owner()
    ws = str(workspace.id)
    for _ in range(5):
        with pytest.raises(Unauthenticated):
            await world.bus.handle(SignIn(workspace_id=ws, login="ada", password="wrong password"))
    with pytest.raises(TooManyAttempts) as caught:
        await world.bus.handle(SignIn(workspace_id=ws, login="ada", password=PASSWORD))
    assert caught.value.retry_after_seconds == pytest.approx(15 * 60)
    # Unknown logins are throttled alike (a refusal says nothing of whether one exists).
    for _ in range(5):
        with pytest.raises(Unauthenticated):
            await world.bus.handle(SignIn(workspace_id=ws, login="ghost", password="whatever pass"))
    with pytest.raises(TooManyAttempts):
        await world.bus.handle(SignIn(workspace_id=ws, login="ghost", password="whatever pass"))
    world.clock.advance(timedelta(minutes=15))
    assert (await world.bus.handle(SignIn(workspace_id=ws, login="ada", password=PASSWORD))).member
    # The success cleared the count: five more tries before a refusal.
    for _ in range(5):
        with pytest.raises(Unauthenticated):
            await world.bus.handle(SignIn(workspace_id=ws, login="ada", password="wrong password"))


# -- sessions ----------------------------------------------------------------------


async def test_refresh_tokens_rotate_and_a_reused_one_signs_the_session_out(world: AuthWorld) -> None:
    _, _, first = await world.owner()
    second = await world.bus.handle(RefreshTokens(refresh_token=first.refresh_token))
    third = await world.bus.handle(RefreshTokens(refresh_token=second.refresh_token))
    assert len({first.refresh_token, second.refresh_token, third.refresh_token}) == 3
    with pytest.raises(Unauthenticated, match="used already") as caught:
        await world.bus.handle(RefreshTokens(refresh_token=first.refresh_token))
    assert first.refresh_token not in caught.value.message
    # The whole family is gone, the newest token included.
    with pytest.raises(Unauthenticated):
        await world.bus.handle(RefreshTokens(refresh_token=third.refresh_token))
    family = {t.family_id for t in world.store.state.auth.refresh_tokens.values()}
    assert len(family) == 1
    assert all(t.revoked_at is not None for t in world.store.state.auth.refresh_tokens.values())


async def test_other_sessions_survive_a_reuse_and_expired_or_unknown_tokens_are_refused(
    world: AuthWorld,
) -> None:
    workspace, _, first = await world.owner()
    other = await world.bus.handle(SignIn(workspace_id=str(workspace.id), login="ada", password=PASSWORD))
    await world.bus.handle(RefreshTokens(refresh_token=first.refresh_token))
    with pytest.raises(Unauthenticated):
        await world.bus.handle(RefreshTokens(refresh_token=first.refresh_token))
    renewed = await world.bus.handle(RefreshTokens(refresh_token=other.refresh_token))
    for bad in ["", "aim_rt_unknown", "not-a-token", "aim_rt_" + "x" * 500]:
        with pytest.raises(Unauthenticated, match="not valid"):
            await world.bus.handle(RefreshTokens(refresh_token=bad))
    world.clock.advance(timedelta(days=30))
    with pytest.raises(Unauthenticated, match="not valid"):
        await world.bus.handle(RefreshTokens(refresh_token=renewed.refresh_token))


async def test_sign_out_ends_the_session_and_says_nothing_of_unknown_tokens(world: AuthWorld) -> None:
    workspace, _, first = await world.owner()
    other = await world.bus.handle(SignIn(workspace_id=str(workspace.id), login="ada", password=PASSWORD))
    second = await world.bus.handle(RefreshTokens(refresh_token=first.refresh_token))
    await world.bus.handle(
        SignOut(refresh_token=first.refresh_token)
    )  # an old token of the session is enough
    await world.bus.handle(SignOut(refresh_token=first.refresh_token))
    await world.bus.handle(SignOut(refresh_token="aim_rt_nothing"))
    await world.bus.handle(SignOut(refresh_token=""))
    with pytest.raises(Unauthenticated):
        await world.bus.handle(RefreshTokens(refresh_token=second.refresh_token))
    assert (await world.bus.handle(RefreshTokens(refresh_token=other.refresh_token))).member


async def test_changing_the_password_signs_out_every_other_session(world: AuthWorld) -> None:
    workspace, creator, tokens = await world.owner()
    caller = await world.as_caller(tokens)
    with pytest.raises(Unauthenticated, match="old_password"):
        await world.bus.handle(
            ChangePassword(caller=caller, old_password="not it at all", new_password="a new password")
        )
    with pytest.raises(InvalidRequest, match="new_password"):
        await world.bus.handle(ChangePassword(caller=caller, old_password=PASSWORD, new_password="short"))
    fresh = await world.bus.handle(
        ChangePassword(caller=caller, old_password=PASSWORD, new_password="a new password")
    )
    with pytest.raises(Unauthenticated):
        await world.bus.handle(RefreshTokens(refresh_token=tokens.refresh_token))
    assert (await world.bus.handle(RefreshTokens(refresh_token=fresh.refresh_token))).member.id == creator.id
    with pytest.raises(Unauthenticated):
        await world.bus.handle(SignIn(workspace_id=str(workspace.id), login="ada", password=PASSWORD))
    await world.bus.handle(SignIn(workspace_id=str(workspace.id), login="ada", password="a new password"))
    # Any token of the member's works; a member with no account has no password to change.
    await world.bus.handle(
        ChangePassword(caller=token_of(creator), old_password="a new password", new_password=PASSWORD)
    )
    agent = await world.agent(workspace, by_service=True)
    with pytest.raises(WrongState):
        await world.bus.handle(
            ChangePassword(caller=token_of(agent), old_password="x", new_password=PASSWORD)
        )
    with pytest.raises(Unauthenticated):
        await world.bus.handle(ChangePassword(caller=None, old_password=PASSWORD, new_password=PASSWORD))


# -- invites and roles ---------------------------------------------------------------


async def test_an_invite_works_once_and_gives_its_role(world: AuthWorld) -> None:
    workspace, _, tokens = await world.owner()
    owner = await world.as_caller(tokens)
    invite, secret = await world.bus.handle(
        CreateInvite(caller=owner, role=Role.ADMIN, ttl=None, request_id="")
    )
    assert secret.startswith("aim_inv_") and invite.expires_at == world.clock.now + timedelta(days=7)
    assert secret not in repr(invite)
    joined = await world.bus.handle(
        AcceptInvite(invite=secret, display_name="Bea", login="bea", password=PASSWORD, request_id="")
    )
    assert (joined.member.role, joined.member.kind, joined.member.workspace_id) == (
        Role.ADMIN,
        MemberKind.HUMAN,
        workspace.id,
    )
    assert (await world.verifier.verify(joined.access.token)).roles == ("admin",)
    with pytest.raises(WrongState, match="used already"):
        await world.bus.handle(
            AcceptInvite(invite=secret, display_name="Eve", login="eve", password=PASSWORD, request_id="")
        )
    with pytest.raises(Unauthenticated, match="not valid"):
        await world.bus.handle(
            AcceptInvite(
                invite="aim_inv_guess", display_name="Eve", login="eve", password=PASSWORD, request_id=""
            )
        )


async def test_an_expired_invite_or_a_taken_login_is_refused(world: AuthWorld) -> None:
    _, _, tokens = await world.owner()
    owner = await world.as_caller(tokens)
    _, short = await world.bus.handle(
        CreateInvite(caller=owner, role=None, ttl=timedelta(hours=1), request_id="")
    )
    _, other = await world.bus.handle(CreateInvite(caller=owner, role=None, ttl=None, request_id=""))
    with pytest.raises(AlreadyTaken, match="taken"):
        await world.bus.handle(
            AcceptInvite(invite=other, display_name="Ada 2", login="ADA", password=PASSWORD, request_id="")
        )
    # The refused acceptance left the invite usable.
    assert (
        await world.bus.handle(
            AcceptInvite(invite=other, display_name="Cy", login="cyd", password=PASSWORD, request_id="")
        )
    ).member.role is Role.MEMBER
    world.clock.advance(timedelta(hours=1))
    with pytest.raises(WrongState, match="expired"):
        await world.bus.handle(
            AcceptInvite(invite=short, display_name="Bea", login="bea", password=PASSWORD, request_id="")
        )


async def test_only_owners_and_admins_invite_and_a_retry_gets_a_new_secret(world: AuthWorld) -> None:
    _, _, tokens = await world.owner()
    owner = await world.as_caller(tokens)
    member = await world.as_caller(await world.invite_and_join(owner, "bea"))
    with pytest.raises(NotAllowed):
        await world.bus.handle(CreateInvite(caller=member, role=Role.MEMBER, ttl=None, request_id=""))
    with pytest.raises(InvalidRequest):
        await world.bus.handle(CreateInvite(caller=owner, role=Role.OWNER, ttl=None, request_id=""))
    first, first_secret = await world.bus.handle(
        CreateInvite(caller=owner, role=None, ttl=None, request_id="inv-1")
    )
    again, again_secret = await world.bus.handle(
        CreateInvite(caller=owner, role=None, ttl=None, request_id="inv-1")
    )
    assert again.id == first.id and again_secret != first_secret
    with pytest.raises(Unauthenticated):
        await world.bus.handle(
            AcceptInvite(
                invite=first_secret, display_name="Cy", login="cyd", password=PASSWORD, request_id=""
            )
        )
    await world.bus.handle(
        AcceptInvite(
            invite=again_secret, display_name="Cy", login="cyd", password=PASSWORD, request_id="join-1"
        )
    )
    # Accepting again with its request_id signs the new member in again.
    retried = await world.bus.handle(
        AcceptInvite(
            invite=again_secret, display_name="Cy", login="cyd", password=PASSWORD, request_id="join-1"
        )
    )
    assert retried.member.display_name == "Cy"
    with pytest.raises(WrongState):
        await world.bus.handle(CreateInvite(caller=owner, role=None, ttl=None, request_id="inv-1"))


async def test_roles_change_only_as_the_rules_say(world: AuthWorld) -> None:
    workspace, creator, tokens = await world.owner()
    owner = await world.as_caller(tokens)
    bea = await world.invite_and_join(owner, "bea", name="Bea")
    cy = await world.invite_and_join(owner, "cyd", name="Cy")
    bea_caller = await world.as_caller(bea)
    with pytest.raises(NotAllowed):
        await world.bus.handle(SetMemberRole(caller=bea_caller, member_id=str(cy.member.id), role=Role.ADMIN))
    made = await world.bus.handle(SetMemberRole(caller=owner, member_id=str(bea.member.id), role=Role.ADMIN))
    assert made.role is Role.ADMIN
    # Roles are read from the store, not from the (older) token.
    await world.bus.handle(SetMemberRole(caller=bea_caller, member_id=str(cy.member.id), role=Role.ADMIN))
    with pytest.raises(NotAllowed, match="only the owner"):
        await world.bus.handle(SetMemberRole(caller=bea_caller, member_id=str(cy.member.id), role=Role.OWNER))
    with pytest.raises(NotAllowed, match="taken away"):
        await world.bus.handle(SetMemberRole(caller=bea_caller, member_id=str(creator.id), role=Role.MEMBER))
    agent = await world.agent(workspace, by_service=True)
    with pytest.raises(InvalidRequest, match="agent"):
        await world.bus.handle(SetMemberRole(caller=owner, member_id=str(agent.id), role=Role.ADMIN))
    handed = await world.bus.handle(SetMemberRole(caller=owner, member_id=str(cy.member.id), role=Role.OWNER))
    assert handed.role is Role.OWNER
    assert world.store.state.members[creator.id].role is Role.ADMIN
    owners = [
        m
        for m in world.store.state.members.values()
        if m.workspace_id == workspace.id and m.role is Role.OWNER
    ]
    assert [m.id for m in owners] == [cy.member.id]
    _, _, elsewhere = await world.owner(login="zed")
    with pytest.raises(NotFound):
        await world.bus.handle(
            SetMemberRole(
                caller=await world.as_caller(elsewhere), member_id=str(bea.member.id), role=Role.MEMBER
            )
        )
    with pytest.raises(InvalidRequest):
        await world.bus.handle(SetMemberRole(caller=owner, member_id=str(bea.member.id), role=None))


async def test_a_read_only_token_changes_nothing(world: AuthWorld) -> None:
    _, creator, tokens = await world.owner()
    read_only = Caller(
        claims=AccessClaims(
            kind=PrincipalKind.HUMAN,
            member_id=creator.id,
            workspace_id=creator.workspace_id,
            scope=Scope.READ,
        )
    )
    with pytest.raises(NotAllowed, match="read-only"):
        await world.bus.handle(CreateInvite(caller=read_only, role=None, ttl=None, request_id=""))
    with pytest.raises(NotAllowed, match="read-only"):
        await world.bus.handle(SetMemberRole(caller=read_only, member_id=str(creator.id), role=Role.OWNER))
    with pytest.raises(NotAllowed):
        await world.bus.handle(
            CreatePersonalToken(
                caller=read_only, name="x", scope=PersonalTokenScope.READ, expire_time=None, request_id=""
            )
        )
    service = Caller(claims=AccessClaims(kind=PrincipalKind.SERVICE, service="runtime"))
    with pytest.raises(NotAllowed, match="service"):
        await world.bus.handle(CreateInvite(caller=service, role=None, ttl=None, request_id=""))
    assert tokens.member.id == creator.id


# -- personal access tokens ---------------------------------------------------------


async def test_personal_token_lifecycle(world: AuthWorld) -> None:
    _, creator, tokens = await world.owner()
    me = await world.as_caller(tokens)
    token, secret = await world.bus.handle(
        CreatePersonalToken(
            caller=me,
            name="ci",
            scope=PersonalTokenScope.READ,
            expire_time=world.clock.now + timedelta(minutes=5),
            request_id="",
        )
    )
    assert secret.startswith("aim_pat_") and token.last_used_at is None
    listed = await list_personal_tokens(world.auth, me, page_size=0, page_token="")
    assert [t.id for t in listed.items] == [token.id] and secret not in repr(listed.items)
    issued = await world.bus.handle(ExchangePersonalToken(secret=secret))
    claims = await world.verifier.verify(issued.token)
    assert (claims.member_id, claims.scope, claims.personal_token_id) == (creator.id, Scope.READ, token.id)
    # Never beyond the personal token's own expiry.
    assert issued.expires_at == token.expires_at
    assert world.store.state.auth.personal_tokens[token.id].last_used_at == world.clock.now
    # A token exchanged for a personal token makes no other one.
    with pytest.raises(NotAllowed, match="personal access token"):
        await world.bus.handle(
            CreatePersonalToken(
                caller=Caller(claims=claims),
                name="x",
                scope=PersonalTokenScope.READ,
                expire_time=None,
                request_id="",
            )
        )
    revoked = await world.bus.handle(RevokePersonalToken(caller=me, personal_token_id=str(token.id)))
    assert revoked.revoked_at is not None
    assert (
        await world.bus.handle(RevokePersonalToken(caller=me, personal_token_id=str(token.id)))
    ).revoked_at
    with pytest.raises(Unauthenticated, match="not valid"):
        await world.bus.handle(ExchangePersonalToken(secret=secret))


async def test_personal_tokens_expire_page_and_belong_to_their_member(world: AuthWorld) -> None:
    _, _, tokens = await world.owner()
    me = await world.as_caller(tokens)
    made = []
    for index in range(3):
        made.append(
            await world.bus.handle(
                CreatePersonalToken(
                    caller=me,
                    name=f"t{index}",
                    scope=PersonalTokenScope.WRITE,
                    expire_time=None,
                    request_id="",
                )
            )
        )
    first = await list_personal_tokens(world.auth, me, page_size=2, page_token="")
    rest = await list_personal_tokens(world.auth, me, page_size=2, page_token=first.next_token)
    assert [t.name for t in first.items + rest.items] == ["t2", "t1", "t0"] and rest.next_token == ""
    write = await world.bus.handle(ExchangePersonalToken(secret=made[0][1]))
    assert (await world.verifier.verify(write.token)).scope is Scope.READ_WRITE
    other = await world.as_caller(await world.invite_and_join(me, "bea"))
    with pytest.raises(NotFound):
        await world.bus.handle(RevokePersonalToken(caller=other, personal_token_id=str(made[0][0].id)))
    world.clock.advance(timedelta(days=90))
    with pytest.raises(Unauthenticated):
        await world.bus.handle(ExchangePersonalToken(secret=made[0][1]))
    with pytest.raises(InvalidRequest):
        await world.bus.handle(
            CreatePersonalToken(caller=me, name="x", scope=None, expire_time=None, request_id="")
        )


async def test_a_retried_personal_token_creation_gets_a_new_secret(world: AuthWorld) -> None:
    _, _, tokens = await world.owner()
    me = await world.as_caller(tokens)
    first, first_secret = await world.bus.handle(
        CreatePersonalToken(
            caller=me, name="ci", scope=PersonalTokenScope.READ, expire_time=None, request_id="pat-1"
        )
    )
    again, again_secret = await world.bus.handle(
        CreatePersonalToken(
            caller=me, name="ci", scope=PersonalTokenScope.READ, expire_time=None, request_id="pat-1"
        )
    )
    assert again.id == first.id and again_secret != first_secret
    with pytest.raises(Unauthenticated):
        await world.bus.handle(ExchangePersonalToken(secret=first_secret))
    await world.bus.handle(ExchangePersonalToken(secret=again_secret))


# -- services and agents -----------------------------------------------------------


async def test_a_service_gets_a_token_for_its_secret_only(world: AuthWorld) -> None:
    issued = await world.bus.handle(IssueServiceToken(service="runtime", secret=world.runtime_secret))
    claims = await world.verifier.verify(issued.token)
    assert (claims.kind, claims.service, claims.member_id) == (PrincipalKind.SERVICE, "runtime", None)
    messages = set()
    for service, secret in [
        ("runtime", "wrong"),
        ("memory", world.runtime_secret),
        ("", ""),
        ("runtime", "x" * 5000),
    ]:
        with pytest.raises(Unauthenticated) as caught:
            await world.bus.handle(IssueServiceToken(service=service, secret=secret))
        messages.add(caught.value.message)
    assert messages == {"the service name or secret is wrong"}


async def test_a_service_gets_tokens_only_for_the_agents_it_hosts(world: AuthWorld) -> None:
    workspace, creator, tokens = await world.owner()
    hosted = await world.agent(workspace, by_service=True)
    unhosted = await world.agent(workspace, by_service=False)
    assert (hosted.host, unhosted.host) == ("runtime", None)
    runtime = Caller(
        claims=await world.verifier.verify(
            (await world.bus.handle(IssueServiceToken(service="runtime", secret=world.runtime_secret))).token
        )
    )
    issued = await world.bus.handle(IssueAgentTokens(caller=runtime, agent_member_ids=[str(hosted.id)]))
    claims = await world.verifier.verify(issued[0].token)
    assert (claims.kind, claims.member_id, claims.host, claims.workspace_id) == (
        PrincipalKind.AGENT,
        hosted.id,
        "runtime",
        workspace.id,
    )
    memory = Caller(claims=AccessClaims(kind=PrincipalKind.SERVICE, service="memory"))
    for caller, ids in [
        (runtime, [unhosted.id]),
        (runtime, [creator.id]),
        (runtime, [hosted.id, uuid.uuid4()]),
        (memory, [hosted.id]),
        (await world.as_caller(tokens), [hosted.id]),
        (token_of(creator), [hosted.id]),
    ]:
        with pytest.raises(ServiceError) as caught:
            await world.bus.handle(IssueAgentTokens(caller=caller, agent_member_ids=[str(i) for i in ids]))
        assert isinstance(caught.value, NotAllowed)
    with pytest.raises(Unauthenticated):
        await world.bus.handle(IssueAgentTokens(caller=None, agent_member_ids=[str(hosted.id)]))
    with pytest.raises(InvalidRequest):
        await world.bus.handle(IssueAgentTokens(caller=runtime, agent_member_ids=[]))
