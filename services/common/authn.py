"""Authentication of every call, under one policy table per service.

Each service names, for every RPC it serves, who may call it (a `Rule`):
nobody needs a credential (`PUBLIC`), or the kinds of principal allowed
(people, agents, named services) and whether the RPC writes, which a
read-only token may not do. The `AuthenticationInterceptor` checks the
caller against the rule before any handler runs and hands the verified
`Caller` to the handler through `current_caller()`. A method without a rule
is never served (deny by default).

The interceptor only decides *who may call*; *on what* (this group, that
agent) stays with the handlers, which take the `Caller`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from agentim.im.v1 import auth_pb2, auth_pb2_grpc
from services.common.errors import PermissionDenied, Unauthenticated
from services.common.identity import AUTHORIZATION_KEY, VIEW_AS_KEY, Caller, identify, retired_keys_in
from services.common.tokens import JwksSource, PrincipalKind, Verifier

HUMAN = PrincipalKind.HUMAN
AGENT = PrincipalKind.AGENT

# Served to anyone, whatever the table says: probes must work without a
# credential, and reflection describes only what the protos already publish.
OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)

NEEDS_TOKEN_MESSAGE = f"this call needs `{AUTHORIZATION_KEY}: Bearer <access token>`"


@dataclass(frozen=True, slots=True)
class Service:
    """A service principal by name, as a rule names it (`Service("runtime")`)."""

    name: str


@dataclass(frozen=True, slots=True)
class Audited:
    """An RPC whose refusals and failures go to the audit log (`services.common.audit`).

    Attributes:
        target_kind: what it acts on (`member`, `agent`, ...).
        target_field: the request field holding the target's id (dotted for
            a nested one: `agent.id`); empty when the request names none.
    """

    target_kind: str
    target_field: str = ""


@dataclass(frozen=True, slots=True)
class Rule:
    """Who may call one RPC.

    Attributes:
        public: anyone, with no credential (the caller is then None).
        kinds: the member kinds allowed (human, agent).
        services: the services allowed, by name.
        writes: the RPC changes something: a read-only token may not call it.
        audit: the RPC is a privileged action: its refusals are recorded at
            the boundary (its handler records its successes).
    """

    public: bool = False
    kinds: frozenset[PrincipalKind] = frozenset()
    services: frozenset[str] = frozenset()
    writes: bool = False
    audit: Audited | None = None

    def audited(self, target_kind: str, target_field: str = "") -> Rule:
        """This rule, for an RPC whose actions are recorded in the audit log."""
        return dataclasses.replace(self, audit=Audited(target_kind, target_field))

    def __post_init__(self) -> None:
        if PrincipalKind.SERVICE in self.kinds:
            raise ValueError("name services with Service(name), not the service kind")

    def refusal(self, caller: Caller) -> str | None:
        """Why `caller` may not make this call, or None if it may."""
        if self.public:
            return None
        claims = caller.claims
        if claims.kind is PrincipalKind.SERVICE:
            if claims.service not in self.services:
                return f"the service {claims.service!r} may not make this call"
        elif claims.kind not in self.kinds:
            return f"{'an agent' if claims.kind is AGENT else 'a person'} may not make this call"
        if self.writes and not claims.can_write:
            return "this call writes, and the access token is read-only"
        return None


def public() -> Rule:
    """A rule for an RPC anyone may call with no credential."""
    return Rule(public=True)


def _rule(who: Iterable[PrincipalKind | Service], *, writes: bool) -> Rule:
    kinds = frozenset(w for w in who if isinstance(w, PrincipalKind))
    services = frozenset(w.name for w in who if isinstance(w, Service))
    return Rule(kinds=kinds, services=services, writes=writes)


def reads(*who: PrincipalKind | Service) -> Rule:
    """A rule for an RPC that changes nothing, callable by `who` (any scope)."""
    return _rule(who, writes=False)


def writes(*who: PrincipalKind | Service) -> Rule:
    """A rule for an RPC that changes something, callable by `who` with a write scope."""
    return _rule(who, writes=True)


@dataclass(frozen=True)
class Policy:
    """Full method name (`/agentim.im.v1.IMService/SendMessage`) -> its `Rule`.

    A method with no rule is refused; the methods of `OPEN_SERVICES` are public.
    """

    rules: Mapping[str, Rule] = field(default_factory=dict)

    @classmethod
    def of_service(cls, service: str, rules: Mapping[str, Rule]) -> Policy:
        """A policy for one service's methods, named by their short names."""
        return cls({f"/{service}/{method}": rule for method, rule in rules.items()})

    def __or__(self, other: Policy) -> Policy:
        overlap = self.rules.keys() & other.rules.keys()
        if overlap:
            raise ValueError(f"two rules for {sorted(overlap)}")
        return Policy({**self.rules, **other.rules})

    def __iter__(self) -> Iterator[str]:
        return iter(self.rules)

    def rule_for(self, method: str) -> Rule | None:
        """The method's rule; None if it has none (it must then be refused)."""
        found = self.rules.get(method)
        if found is None and method.lstrip("/").partition("/")[0] in OPEN_SERVICES:
            return public()
        return found


_current_caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar(
    "agentim_current_caller", default=None
)


def current_caller() -> Caller | None:
    """The verified caller of the call being handled (None for a public RPC,
    or outside a call)."""
    return _current_caller.get()


_identified_caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar(
    "agentim_identified_caller", default=None
)


def identified_caller() -> Caller | None:
    """The caller as identified, even when its rule then refused it (for the
    audit log, which records refusals); None before identification."""
    return _identified_caller.get()


@contextlib.contextmanager
def acting_as(caller: Caller | None) -> Iterator[None]:
    """Makes `caller` the current caller inside the block (for tests and tools)."""
    token = _current_caller.set(caller)
    try:
        yield
    finally:
        _current_caller.reset(token)


class AuthenticationInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call against the policy before its handler runs.

    A public RPC goes on with no caller. Otherwise the caller is identified
    by its access token (`identify`) and must fit the method's rule: no
    token (whatever else the call sends), or one that does not verify, is
    UNAUTHENTICATED; a caller of
    a kind or service the rule does not name, or a read-only token on a
    writing RPC, is PERMISSION_DENIED; a method with no rule is
    PERMISSION_DENIED for everyone.

    The check runs inside the wrapped behaviour, not in `intercept_service`:
    grpc.aio may run the handler in another task, and the caller is handed
    over in a context variable, which only the handler's task sees. Place it
    after the error-mapping interceptor (which turns its errors into
    statuses) and before the rate limiter (which counts per verified caller).

    Args:
        policy: the rules of every method served.
        verifier: checks access tokens.
        honour_view_as: let a person's token read as an agent (`VIEW_AS_KEY`).
    """

    def __init__(self, policy: Policy, verifier: Verifier, *, honour_view_as: bool = False) -> None:
        self._honour_view_as = honour_view_as
        self._policy = policy
        self._verifier = verifier

    async def authenticate(
        self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None
    ) -> Caller | None:
        """The verified caller of a call to `method`, None for a public RPC.

        Raises:
            Unauthenticated: no credential, or one that does not verify.
            PermissionDenied: the caller may not call `method`.
        """
        rule = self._policy.rule_for(method)
        if rule is None:
            raise PermissionDenied(f"no access rule for {method}")
        if rule.public:
            return None
        items = list(metadata or ())
        caller = await identify(items, verifier=self._verifier)
        _identified_caller.set(caller)
        if caller is None:
            retired = retired_keys_in(items)
            if retired:
                raise Unauthenticated(
                    f"`{retired[0]}` is no longer accepted: {NEEDS_TOKEN_MESSAGE} (see docs/security.md)"
                )
            raise Unauthenticated(NEEDS_TOKEN_MESSAGE)
        refusal = rule.refusal(caller)
        if refusal is not None:
            raise PermissionDenied(refusal)
        if self._honour_view_as:
            caller = _with_view(caller, items, writes=rule.writes)
        return caller

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        metadata = handler_call_details.invocation_metadata

        async def admit() -> None:
            # Each call runs in a task of its own, whose context ends with it:
            # nothing to reset.
            _current_caller.set(await self.authenticate(method, metadata))

        return wrap_behaviour(handler, before=admit)


def _with_view(caller: Caller, items: list[tuple[str, str | bytes]], *, writes: bool) -> Caller:
    """The caller reading through an agent's eyes, if it asks to (VIEW_AS_KEY).

    Only a person's token may ask, and only to read: the view acts as the
    agent, so a write would be the agent's. That the member is an agent of
    the caller's workspace, and one the person may view as (an admin or the
    workspace's owner, or the agent's owner), is the service's to check: it
    knows its members and their owners.

    Raises:
        PermissionDenied: anyone else, or a writing call.
        Unauthenticated: the header holds no member id.
    """
    raw = next((value for key, value in items if key.lower() == VIEW_AS_KEY), None)
    if raw is None:
        return caller
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        viewed = uuid.UUID(text.strip())
    except ValueError:
        raise Unauthenticated(f"{VIEW_AS_KEY} is not a valid member id") from None
    if viewed == caller.member_id:
        return caller
    claims = caller.claims
    if claims.kind is not PrincipalKind.HUMAN:
        raise PermissionDenied(f"only a person's access token may carry {VIEW_AS_KEY}")
    if writes:
        raise PermissionDenied("a view as an agent is read-only")
    return dataclasses.replace(caller, view_as=viewed)


def wrap_behaviour(
    handler: grpc.RpcMethodHandler, *, before: Callable[[], Awaitable[None]]
) -> grpc.RpcMethodHandler:
    """The handler with `before` awaited first, in the task that runs the
    behaviour (unary, async-generator streams, and streams written with
    `context.write`); other handlers (client streaming) are returned as they are."""
    if handler.unary_unary is not None:
        inner_unary = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await before()
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
        inner_stream = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await before()
            async with contextlib.aclosing(inner_stream(request, context)) as items:
                async for item in items:
                    yield item

        return grpc.unary_stream_rpc_method_handler(
            stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        inner_writer = handler.unary_stream

        async def writer(request: Any, context: grpc.aio.ServicerContext) -> None:
            await before()
            await inner_writer(request, context)

        return grpc.unary_stream_rpc_method_handler(
            writer,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler


def im_signing_keys(channel: grpc.aio.Channel, *, timeout_seconds: float = 5.0) -> JwksSource:
    """A JWKS source asking the IM's `AuthService.GetSigningKeys` over `channel`.

    For the services other than the IM: their `Verifier` calls it only for
    an unknown key id or keys past their age, never per request.
    """
    stub = auth_pb2_grpc.AuthServiceStub(channel)

    async def source() -> Mapping[str, Any]:
        response = await stub.GetSigningKeys(auth_pb2.GetSigningKeysRequest(), timeout=timeout_seconds)
        return {
            "keys": [
                {"kid": k.kid, "kty": k.kty, "crv": k.crv, "x": k.x, "alg": k.alg, "use": k.use}
                for k in response.keys
            ]
        }

    return source
