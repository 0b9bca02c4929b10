"""The access tokens a service calls other services with: its own, and its agents'.

A service (the runtime, the memory) holds a credential, a secret the IM
knows the hash of, and exchanges it for a SERVICE access token
(`AuthService.IssueServiceToken`); with that token, the runtime gets AGENT
access tokens for the agents it hosts (`AuthService.IssueAgentTokens`), and
for no one else: the IM refuses a person or another service's agent.

`ServiceToken` and `AgentTokens` keep the tokens and get new ones ahead of
expiry (when a quarter of their life is left), one request at a time;
`AgentTokens` asks for the tokens of every agent wanted at the same moment
in one call. Neither ever logs a token or a secret.

Where the secret comes from (`read_service_secret`): `<NAME>_SERVICE_SECRET`,
else the file `<NAME>_SERVICE_SECRET_FILE`, else (the embedded default) the
file the IM makes on first start, `$AGENTIM_DATA_DIR/secrets/<name>.secret`,
read when first needed since the IM may start after the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import Any

import grpc

from agentim.im.v1 import auth_pb2, auth_pb2_grpc
from services.common.errors import Unavailable
from services.common.settings import EnvReader

logger = logging.getLogger(__name__)

# A token is renewed once less than this share of its life is left.
RENEW_AT_REMAINING = 0.25
# A member the IM would not give a token for is asked about again after this.
REFUSAL_SECONDS = 300.0
MAX_AGENTS_PER_CALL = 100


class TokenRefused(Exception):
    """The IM refused to issue the token (wrong credential, an agent not ours)."""


@dataclass(frozen=True, slots=True)
class Issued:
    token: str
    expires_at: float  # seconds since the epoch


# Source of a secret: returns it, or None when there is none (yet).
SecretSource = Callable[[], str | None]


def secret_from(*, value: str | None, path: Path | None) -> SecretSource:
    """The secret given, else the content of `path` (re-read until found)."""
    found: list[str] = [value] if value else []

    def read() -> str | None:
        if found:
            return found[0]
        if path is None:
            return None
        try:
            text = path.read_text().strip()
        except OSError:
            return None
        if text:
            found.append(text)
        return text or None

    return read


class ServiceToken:
    """The service's own access token, got with its credential and renewed ahead of expiry.

    Args:
        service: the service's name as the IM knows it (`runtime`, `memory`).
        secret: where its secret comes from.
        issue: exchanges (service, secret) for a token (IssueServiceToken).
        clock: seconds since the epoch.
    """

    def __init__(
        self,
        *,
        service: str,
        secret: SecretSource,
        issue: Callable[[str, str], Awaitable[Issued]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.service = service
        self._secret = secret
        self._issue = issue
        self._clock = clock
        self._held: Issued | None = None
        self._issued_at = 0.0
        self._lock = asyncio.Lock()
        self.issued = 0

    def _fresh(self) -> str | None:
        held = self._held
        if held is None:
            return None
        now = self._clock()
        if now < held.expires_at - (held.expires_at - self._issued_at) * RENEW_AT_REMAINING:
            return held.token
        return None

    async def get(self) -> str | None:
        """The token; None when the service has no credential (yet).

        Raises:
            TokenRefused: the IM refused the credential.
            Exception: whatever `issue` raises when the IM cannot be reached.
        """
        token = self._fresh()
        if token is not None:
            return token
        async with self._lock:
            token = self._fresh()
            if token is not None:
                return token
            secret = self._secret()
            if secret is None:
                return None
            now = self._clock()
            try:
                issued = await self._issue(self.service, secret)
            except TokenRefused:
                logger.error("the IM refused the credential of service %s", self.service)
                raise
            except Exception:
                held = self._held
                # The token held is still good for a while: use it and try again later.
                if held is not None and now < held.expires_at - 5:
                    logger.warning(
                        "could not renew the %s service token; using the current one", self.service
                    )
                    return held.token
                raise
            self._held, self._issued_at = issued, now
            self.issued += 1
            return issued.token


class AgentTokens:
    """AGENT access tokens of the agents a service hosts, kept per agent.

    Args:
        issue: (service token, agent member ids) -> their tokens in order
            (IssueAgentTokens); raises TokenRefused if the IM refuses any.
        service: the service's own token, to ask with.
        clock: seconds since the epoch.
    """

    def __init__(
        self,
        *,
        issue: Callable[[str, Sequence[uuid.UUID]], Awaitable[list[Issued]]],
        service: ServiceToken,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._issue = issue
        self._service = service
        self._clock = clock
        self._held: dict[uuid.UUID, tuple[Issued, float]] = {}
        self._refused: dict[uuid.UUID, float] = {}
        self._waiting: dict[uuid.UUID, asyncio.Future[str | None]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self.calls = 0

    def _due(self, member_id: uuid.UUID, now: float) -> bool:
        held = self._held.get(member_id)
        if held is None:
            return True
        issued, at = held
        return now >= issued.expires_at - (issued.expires_at - at) * RENEW_AT_REMAINING

    def held(self, member_id: uuid.UUID) -> str | None:
        """The token held for the agent now, if any (for tests and diagnostics)."""
        held = self._held.get(member_id)
        return held[0].token if held is not None else None

    async def get(self, member_id: uuid.UUID) -> str | None:
        """The agent's token; None if the IM will not issue one (not an agent
        this service hosts) or the service has no credential.

        Raises:
            Exception: whatever the IM client raises when the IM is away.
        """
        now = self._clock()
        if not self._due(member_id, now):
            return self._held[member_id][0].token
        if self._refused.get(member_id, 0.0) > now:
            return None
        waiting = self._waiting.get(member_id)
        if waiting is None:
            waiting = asyncio.get_running_loop().create_future()
            self._waiting[member_id] = waiting
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.create_task(self._flush(), name="agent-tokens")
        held = self._held.get(member_id)
        if held is not None and now < held[0].expires_at - 5:
            return held[0].token  # renewed in the background meanwhile
        return await asyncio.shield(waiting)

    async def _flush(self) -> None:
        # Everyone asking in this turn of the loop joins the batch.
        await asyncio.sleep(0)
        while self._waiting:
            now = self._clock()
            batch = list(self._waiting)[:MAX_AGENTS_PER_CALL]
            # Tokens due soon ride along, room permitting.
            soon = [
                m for m, (i, _) in self._held.items() if m not in self._waiting and now >= i.expires_at - 60
            ]
            batch += soon[: MAX_AGENTS_PER_CALL - len(batch)]
            futures = {m: self._waiting.pop(m) for m in batch if m in self._waiting}
            try:
                results = await self._ask(batch, now)
            except BaseException as error:
                for future in futures.values():
                    if not future.done():
                        future.set_exception(
                            error if isinstance(error, Exception) else Unavailable("stopped")
                        )
                        future.exception()  # read: nobody may be waiting any more
                if not isinstance(error, Exception):
                    raise
                continue
            for member_id, future in futures.items():
                if not future.done():
                    future.set_result(results.get(member_id))

    async def _ask(self, batch: list[uuid.UUID], now: float) -> dict[uuid.UUID, str | None]:
        service = await self._service.get()
        if service is None:
            return {}
        try:
            self.calls += 1
            issued = await self._issue(service, batch)
        except TokenRefused:
            if len(batch) == 1:
                self._refused[batch[0]] = now + REFUSAL_SECONDS
                self._held.pop(batch[0], None)
                return {}
            # One of them is not ours: ask for each alone to find which.
            found: dict[uuid.UUID, str | None] = {}
            for member_id in batch:
                found.update(await self._ask([member_id], now))
            return found
        for member_id, one in zip(batch, issued, strict=True):
            self._held[member_id] = (one, now)
        return {m: i.token for m, i in zip(batch, issued, strict=True)}

    async def aclose(self) -> None:
        """Stops a request in flight. Idempotent."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher


# -- the IM's AuthService --------------------------------------------------------


_REFUSALS = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)


class AuthClient:
    """The calls of the IM's AuthService a service makes, over its channel to the IM.

    Raises `TokenRefused` for a refusal and `Unavailable` when the IM cannot
    answer; messages never hold a secret or a token.
    """

    def __init__(self, channel: grpc.aio.Channel, *, deadline_seconds: float = 10.0) -> None:
        self._stub = auth_pb2_grpc.AuthServiceStub(channel)
        self._deadline = deadline_seconds

    async def _call(self, rpc: Callable[..., Any], request: Any, **options: Any) -> Any:
        try:
            return await rpc(request, timeout=self._deadline, **options)
        except grpc.aio.AioRpcError as error:
            if error.code() in _REFUSALS:
                raise TokenRefused(f"{error.code().name}: {error.details()}") from None
            raise Unavailable(f"the IM's AuthService is unavailable ({error.code().name})") from None

    async def service_token(self, service: str, secret: str) -> Issued:
        response = await self._call(
            self._stub.IssueServiceToken, auth_pb2.IssueServiceTokenRequest(service=service, secret=secret)
        )
        return Issued(response.access_token, response.access_expire_time.ToDatetime(tzinfo=UTC).timestamp())

    async def agent_tokens(self, service_token: str, members: Sequence[uuid.UUID]) -> list[Issued]:
        response = await self._call(
            self._stub.IssueAgentTokens,
            auth_pb2.IssueAgentTokensRequest(agent_member_ids=[str(m) for m in members]),
            metadata=(("authorization", f"Bearer {service_token}"),),
        )
        return [
            Issued(t.access_token, t.access_expire_time.ToDatetime(tzinfo=UTC).timestamp())
            for t in response.agent_tokens
        ]

    async def signing_keys(self) -> Mapping[str, Any]:
        """The IM's JWKS (a `Verifier`'s source)."""
        response = await self._stub.GetSigningKeys(auth_pb2.GetSigningKeysRequest(), timeout=self._deadline)
        fields = ("kid", "kty", "crv", "x", "alg", "use")
        return {"keys": [{name: getattr(key, name) for name in fields} for key in response.keys]}


# -- configuration ------------------------------------------------------------------


@dataclass(frozen=True)
class ServiceSecretSettings:
    """Where a service's credential comes from (see the module's docstring)."""

    value: str | None = field(default=None, repr=False)
    path: Path | None = None

    def source(self) -> SecretSource:
        """The secret's source (it gives None while there is no secret: settings
        outside the embedded default insist on one, which the IM writes there)."""
        return secret_from(value=self.value, path=self.path)


def read_service_secret(
    env: EnvReader, *, prefix: str, service: str, data_dir: Path, embedded: bool
) -> ServiceSecretSettings:
    """`<prefix>_SERVICE_SECRET` or `<prefix>_SERVICE_SECRET_FILE`; the embedded
    default falls back to the IM's `<data_dir>/secrets/<service>.secret`.
    Outside the embedded default one of them is required (a problem otherwise)."""
    value = env.optional(f"{prefix}_SERVICE_SECRET")
    file = env.optional(f"{prefix}_SERVICE_SECRET_FILE")
    if value is not None:
        return ServiceSecretSettings(value=value)
    if file is not None:
        path = Path(file)
        if not embedded and not path.is_file():
            env.problem(f"{prefix}_SERVICE_SECRET_FILE: no readable file at {path}")
        return ServiceSecretSettings(path=path)
    if embedded:
        return ServiceSecretSettings(path=data_dir / "secrets" / f"{service}.secret")
    env.problem(
        f"{prefix}_SERVICE_SECRET or {prefix}_SERVICE_SECRET_FILE is required outside the embedded"
        f" default: the {service} service's credential, which the IM's AUTH_SERVICE_CREDENTIALS_FILE"
        " lists by its SHA-256 (docs/security.md)"
    )
    return ServiceSecretSettings()
