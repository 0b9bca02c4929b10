"""The access rules and the authentication step (services.common.authn), without a server."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from services.common.authn import (
    AGENT,
    HUMAN,
    AuthenticationInterceptor,
    Policy,
    Service,
    acting_as,
    current_caller,
    public,
    reads,
    writes,
)
from services.common.errors import PermissionDenied, Unauthenticated
from services.common.identity import Caller, bearer_metadata
from services.common.tokens import AccessClaims, KeyRing, PrincipalKind, Scope, Verifier, keyring_source, sign

SEND = "/test.v1.ChatService/Send"
LIST = "/test.v1.ChatService/List"
ADMIN = "/test.v1.ChatService/ListAll"
OPEN = "/test.v1.ChatService/SignIn"

POLICY = Policy.of_service(
    "test.v1.ChatService",
    {
        "Send": writes(HUMAN, AGENT),
        "List": reads(HUMAN, AGENT, Service("memory")),
        "ListAll": reads(Service("runtime")),
        "SignIn": public(),
    },
)


def person(scope: Scope = Scope.READ_WRITE) -> AccessClaims:
    return AccessClaims(
        kind=PrincipalKind.HUMAN, member_id=uuid.uuid4(), workspace_id=uuid.uuid4(), scope=scope
    )


def agent() -> AccessClaims:
    return AccessClaims(
        kind=PrincipalKind.AGENT, member_id=uuid.uuid4(), workspace_id=uuid.uuid4(), host="runtime"
    )


def service(name: str) -> AccessClaims:
    return AccessClaims(kind=PrincipalKind.SERVICE, service=name)


@pytest.mark.parametrize(
    ("claims", "method", "allowed"),
    [
        (person(), SEND, True),
        (agent(), SEND, True),
        (service("runtime"), SEND, False),
        (person(Scope.READ), SEND, False),
        (person(Scope.READ), LIST, True),
        (service("memory"), LIST, True),
        (service("runtime"), LIST, False),
        (service("runtime"), ADMIN, True),
        (person(), ADMIN, False),
        (service("memory"), ADMIN, False),
    ],
)
def test_a_rule_admits_exactly_the_kinds_and_services_it_names(
    claims: AccessClaims, method: str, allowed: bool
) -> None:
    rule = POLICY.rule_for(method)
    assert rule is not None
    assert (rule.refusal(Caller(claims=claims)) is None) is allowed


def test_health_and_reflection_are_public_and_unknown_methods_have_no_rule() -> None:
    assert POLICY.rule_for("/grpc.health.v1.Health/Check") == public()
    assert POLICY.rule_for("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") == public()
    assert POLICY.rule_for("/test.v1.ChatService/Nope") is None


def test_two_rules_for_one_method_are_refused() -> None:
    with pytest.raises(ValueError, match="two rules"):
        _ = POLICY | Policy.of_service("test.v1.ChatService", {"Send": reads(HUMAN)})


@pytest.fixture
def ring(tmp_path: Path) -> KeyRing:
    KeyRing.generate(tmp_path)
    return KeyRing.load(tmp_path)


def interceptor(ring: KeyRing) -> AuthenticationInterceptor:
    verifier = Verifier(keyring_source(ring), refetch_seconds=0)
    return AuthenticationInterceptor(POLICY, verifier)


async def test_a_valid_token_yields_its_caller(ring: KeyRing) -> None:
    claims = person()
    caller = await interceptor(ring).authenticate(SEND, bearer_metadata(sign(claims, ring)))
    assert caller is not None and caller.claims.member_id == claims.member_id


async def test_no_credential_is_unauthenticated_and_a_public_rpc_needs_none(ring: KeyRing) -> None:
    with pytest.raises(Unauthenticated, match="Bearer"):
        await interceptor(ring).authenticate(SEND, ())
    assert await interceptor(ring).authenticate(OPEN, ()) is None


async def test_a_method_without_a_rule_is_denied_even_to_a_valid_caller(ring: KeyRing) -> None:
    with pytest.raises(PermissionDenied, match=r"no access rule for /test\.v1\.ChatService/Nope"):
        await interceptor(ring).authenticate(
            "/test.v1.ChatService/Nope", bearer_metadata(sign(person(), ring))
        )


async def test_a_read_only_token_may_read_but_not_write(ring: KeyRing) -> None:
    token = sign(person(Scope.READ), ring)
    assert await interceptor(ring).authenticate(LIST, bearer_metadata(token)) is not None
    with pytest.raises(PermissionDenied, match="read-only"):
        await interceptor(ring).authenticate(SEND, bearer_metadata(token))


@pytest.mark.parametrize("key", ["x-member-id", "x-agentim-service"])
async def test_the_retired_headers_name_nobody_and_the_refusal_says_so(ring: KeyRing, key: str) -> None:
    with pytest.raises(Unauthenticated) as refused:
        await interceptor(ring).authenticate(SEND, ((key, str(uuid.uuid4())),))
    assert str(refused.value) == (
        f"`{key}` is no longer accepted: this call needs `authorization: Bearer <access token>`"
        " (see docs/security.md)"
    )
    # Beside a valid token, they change nothing: the token names the caller.
    claims = person()
    caller = await interceptor(ring).authenticate(
        SEND, ((key, str(uuid.uuid4())), *bearer_metadata(sign(claims, ring)))
    )
    assert caller is not None and caller.member_id == claims.member_id


def test_acting_as_sets_the_current_caller_for_the_block() -> None:
    caller = Caller(claims=person())
    assert current_caller() is None
    with acting_as(caller):
        assert current_caller() is caller
    assert current_caller() is None
