"""The identity rules (services/im/domain/access.py): roles, invites, lifetimes, throttling."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from services.im.domain import access
from services.im.domain.accounts import SignInFailures
from services.im.domain.errors import InvalidRequest, NotAllowed
from services.im.domain.model import Member, MemberKind, Role

NOW = datetime(2026, 11, 15, 12, 0, tzinfo=UTC)
LIMITS = access.AuthLimits()


def person(
    role: Role = Role.MEMBER, *, kind: MemberKind = MemberKind.HUMAN, host: str | None = None
) -> Member:
    return Member(
        id=uuid.uuid4(),
        workspace_id=uuid.UUID(int=1),
        kind=kind,
        display_name="x",
        avatar="",
        created_at=NOW,
        role=role,
        host=host,
    )


def test_logins_are_normalized_and_checked() -> None:
    assert access.normalize_login("  Ada.Lovelace@Example ") == "ada.lovelace@example"
    full_width = "\uff21\uff24\uff21_01"  # full-width letters fold to ASCII
    assert access.normalize_login(full_width) == "ada_01"
    for bad in ["", "ab", "a" * 65, "ada lovelace", "ädä", "ada\x00", "<script>"]:
        with pytest.raises(InvalidRequest, match="login must be"):
            access.normalize_login(bad)


def test_passwords_need_the_minimum_length_and_are_never_repeated() -> None:
    access.check_password("0123456789", LIMITS)
    with pytest.raises(InvalidRequest) as caught:
        access.check_password("short-pw", LIMITS)
    assert "short-pw" not in caught.value.message and "at least 10" in caught.value.message
    with pytest.raises(InvalidRequest, match="at most"):
        access.check_password("x" * 1025, LIMITS)
    access.check_password("eight888", access.AuthLimits(password_min_length=8))


def test_secrets_are_prefixed_random_and_hashed() -> None:
    one, two = access.new_secret("aim_pat_"), access.new_secret("aim_pat_")
    assert one != two and one.startswith("aim_pat_") and len(one) == len("aim_pat_") + 43
    assert access.secret_hash(one) != one and len(access.secret_hash(one)) == 64
    assert access.plausible_secret(one, "aim_pat_")
    assert not access.plausible_secret(one, "aim_rt_")
    assert not access.plausible_secret("aim_pat_" + "x" * 200, "aim_pat_")


def test_only_owners_and_admins_who_are_people_invite_and_never_as_owner() -> None:
    access.check_invite(person(Role.OWNER), Role.ADMIN)
    access.check_invite(person(Role.ADMIN), Role.MEMBER)
    with pytest.raises(NotAllowed):
        access.check_invite(person(Role.MEMBER), Role.MEMBER)
    with pytest.raises(NotAllowed):
        access.check_invite(person(Role.ADMIN, kind=MemberKind.AGENT), Role.MEMBER)
    with pytest.raises(InvalidRequest, match="ADMIN or MEMBER"):
        access.check_invite(person(Role.OWNER), Role.OWNER)


def test_role_changes() -> None:
    owner, admin, member = person(Role.OWNER), person(Role.ADMIN), person()
    agent = person(kind=MemberKind.AGENT)
    assert access.role_changes(admin, member, Role.ADMIN) == [(member.id, Role.ADMIN)]
    assert access.role_changes(owner, admin, Role.MEMBER) == [(admin.id, Role.MEMBER)]
    assert access.role_changes(admin, admin, Role.MEMBER) == [(admin.id, Role.MEMBER)]
    assert access.role_changes(admin, member, Role.MEMBER) == []
    # Ownership is handed over: the old owner becomes an admin.
    assert access.role_changes(owner, member, Role.OWNER) == [(member.id, Role.OWNER), (owner.id, Role.ADMIN)]
    assert access.role_changes(owner, owner, Role.OWNER) == []
    with pytest.raises(NotAllowed, match="only the owner"):
        access.role_changes(admin, member, Role.OWNER)
    for caller in (admin, owner):
        with pytest.raises(NotAllowed, match="cannot be taken away"):
            access.role_changes(caller, owner, Role.ADMIN)
    with pytest.raises(NotAllowed, match="owner and admins"):
        access.role_changes(member, member, Role.ADMIN)
    with pytest.raises(InvalidRequest, match="agent"):
        access.role_changes(owner, agent, Role.ADMIN)
    with pytest.raises(InvalidRequest, match="agent"):
        access.role_changes(owner, agent, Role.OWNER)


def test_scopes_and_personal_tokens_limit_what_a_token_may_do() -> None:
    access.require_write(access.Authority(), "x")
    with pytest.raises(NotAllowed, match="read-only"):
        access.require_write(access.Authority(can_write=False), "change roles")
    access.require_session(access.Authority(), "x")
    with pytest.raises(NotAllowed, match="personal access token"):
        access.require_session(access.Authority(via_personal_token=True), "create personal access tokens")


def test_lifetimes() -> None:
    assert access.invite_expiry(None, NOW, LIMITS) == NOW + timedelta(days=7)
    assert access.invite_expiry(timedelta(hours=1), NOW, LIMITS) == NOW + timedelta(hours=1)
    for bad in (timedelta(0), timedelta(seconds=-1), timedelta(days=31)):
        with pytest.raises(InvalidRequest):
            access.invite_expiry(bad, NOW, LIMITS)
    assert access.personal_token_expiry(None, NOW, LIMITS) == NOW + timedelta(days=90)
    soon = NOW + timedelta(days=1)
    assert access.personal_token_expiry(soon, NOW, LIMITS) == soon
    for when in (NOW, NOW - timedelta(days=1), NOW + timedelta(days=366)):
        with pytest.raises(InvalidRequest):
            access.personal_token_expiry(when, NOW, LIMITS)


def test_sign_in_is_refused_after_the_allowed_attempts_until_the_window_ends() -> None:
    ws = uuid.uuid4()
    start = NOW - timedelta(minutes=5)
    assert access.sign_in_retry_after(SignInFailures(ws, "ada", 5, start), NOW, LIMITS) is None
    wait = access.sign_in_retry_after(SignInFailures(ws, "ada", 6, start), NOW, LIMITS)
    assert wait == pytest.approx(600)
    # Never "retry in 0 seconds".
    late = NOW - timedelta(minutes=15)
    assert access.sign_in_retry_after(SignInFailures(ws, "ada", 9, late), NOW, LIMITS) == 1.0


def test_a_service_gets_only_the_agents_it_hosts() -> None:
    hosted = person(kind=MemberKind.AGENT, host="runtime")
    assert access.check_hosted("runtime", hosted.id, hosted) is hosted
    refusals = [
        (hosted, "memory"),
        (person(kind=MemberKind.AGENT), "runtime"),
        (person(), "runtime"),
        (None, "runtime"),
    ]
    for member, service in refusals:
        with pytest.raises(NotAllowed, match="does not host"):
            access.check_hosted(service, uuid.uuid4(), member)
