"""Who an HTTP request comes from: a browser session (cookie + CSRF token), an
access token, or a personal access token; and the calls to the IM's
AuthService that keep sessions alive (refresh, sign-out, exchange).

The gateway is not a principal: every call it forwards carries the caller's
own access token, and nothing else names who the caller is.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format

from agentim.im.v1 import auth_pb2, auth_pb2_grpc, im_pb2
from gateway.errors import HttpError, unauthenticated
from gateway.sessions import CSRF_HEADER, Session, SessionSealer, new_session_id
from services.common.errors import Unauthenticated, Unavailable
from services.common.identity import bearer_metadata
from services.common.tokens import Verifier

logger = logging.getLogger(__name__)

PERSONAL_TOKEN_PREFIX = "aim_pat_"
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# A refreshed session is handed to the requests that come with the old cookie
# meanwhile (a page sends several at once): refreshing again with the spent
# refresh token would count as theft and sign the person out.
_REFRESH_REUSE_SECONDS = 60.0
# A personal token's exchanged access token is used until this close to its
# expiry, and for this long at most: a token revoked through another replica
# stops working here within that time (through this one, at once).
_EXCHANGE_MARGIN_SECONDS = 60.0
_EXCHANGE_REUSE_SECONDS = 60.0


def permission_denied(message: str) -> HttpError:
    return HttpError(403, "PERMISSION_DENIED", message)


@dataclass(frozen=True)
class Credentials:
    """The caller of one request.

    Attributes:
        access_token: forwarded as `authorization: Bearer`.
        member_id: the member the token is for.
        workspace_id: the member's workspace.
        can_write: False for a read-only token (of a read personal token).
        session: the browser session, if the request came with the cookie.
        renewed: the session's tokens were refreshed: the cookie must be set again.
    """

    access_token: str
    member_id: str
    workspace_id: str
    can_write: bool
    session: Session | None = None
    renewed: bool = False


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode(errors="surrogateescape")).hexdigest()


def _grpc_error(error: grpc.aio.AioRpcError) -> HttpError:
    if error.code() == grpc.StatusCode.UNAUTHENTICATED:
        return unauthenticated(error.details() or "the credentials are not valid")
    return HttpError.from_grpc(error.code(), error.details(), error.trailing_metadata())


class Authenticator:
    """Authenticates requests and keeps browser sessions fresh.

    Args:
        channel: a channel to the IM (it serves AuthService).
        sealer: seals and opens session cookies.
        refresh_margin_seconds: a session's access token this close to its
            expiry is refreshed before the request is forwarded.
        call_timeout_seconds: deadline of each call to the IM.
        clock: seconds since the epoch, replaceable in tests.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        sealer: SessionSealer,
        *,
        refresh_margin_seconds: float = 60.0,
        call_timeout_seconds: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._stub = auth_pb2_grpc.AuthServiceStub(channel)
        self._timeout = call_timeout_seconds
        self.sealer = sealer
        self._margin = refresh_margin_seconds
        self._clock = clock
        self._verifier = Verifier(self._signing_keys, clock=clock)
        # Refresh token hash -> the refresh in flight or just done (see _REFRESH_REUSE_SECONDS).
        self._refreshes: dict[str, tuple[float, asyncio.Future[Session]]] = {}
        # Personal token hash -> (credentials, usable until).
        self._exchanged: dict[str, tuple[Credentials, float]] = {}
        # Signed-out session ids -> when their last access token expires. Per
        # process: behind several replicas the refresh token's revocation is
        # what ends the session everywhere, at the latest when its access token expires.
        self._signed_out: dict[str, float] = {}

    async def _signing_keys(self) -> Mapping[str, Any]:
        response = await self._stub.GetSigningKeys(auth_pb2.GetSigningKeysRequest(), timeout=self._timeout)
        return {"keys": [json_format.MessageToDict(key) for key in response.keys]}

    # --- authenticating requests -------------------------------------------------------------

    async def authenticate(
        self, *, method: str, authorization: str | None, cookie: str | None, csrf: str | None
    ) -> Credentials:
        """The request's caller.

        An `Authorization` header wins over the cookie (a program's request),
        and needs no CSRF token: a browser never adds one by itself.

        Raises:
            HttpError: 401 without valid credentials; 403 for a session's
                state-changing request without its CSRF token.
        """
        if authorization is not None:
            scheme, _, token = authorization.strip().partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not token:
                raise unauthenticated(
                    "Authorization must be 'Bearer <access token or personal access token>'"
                )
            if token.startswith(PERSONAL_TOKEN_PREFIX):
                return await self._exchange(token)
            return await self._verified(token)
        if not cookie:
            raise unauthenticated(
                "sign in first (POST /v1/auth/sign-in), or send Authorization: Bearer <token>"
            )
        session = self.sealer.open(cookie)
        if session is None or self._is_signed_out(session):
            raise unauthenticated("the session is not valid any more; sign in again")
        if method in UNSAFE_METHODS and not self.sealer.csrf_matches(session, csrf):
            raise permission_denied(f"this request needs the session's CSRF token in {CSRF_HEADER}")
        renewed = False
        if session.access_expires_at - self._clock() < self._margin:
            session = await self.refresh(session)
            renewed = True
        return Credentials(
            access_token=session.access_token,
            member_id=session.member_id,
            workspace_id=session.workspace_id,
            can_write=True,
            session=session,
            renewed=renewed,
        )

    async def _verified(self, token: str) -> Credentials:
        try:
            claims = await self._verifier.verify(token)
        except Unauthenticated as error:
            raise unauthenticated(error.message) from None
        except Unavailable as error:
            raise HttpError(503, "UNAVAILABLE", error.message) from None
        if claims.member_id is None or claims.workspace_id is None:
            raise permission_denied("a service's token cannot be used through the gateway")
        return Credentials(
            access_token=token,
            member_id=str(claims.member_id),
            workspace_id=str(claims.workspace_id),
            can_write=claims.can_write,
        )

    async def _exchange(self, secret: str) -> Credentials:
        key = _hash(secret)
        now = self._clock()
        cached = self._exchanged.get(key)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            response = await self._stub.ExchangePersonalToken(
                auth_pb2.ExchangePersonalTokenRequest(secret=secret), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as error:
            self._exchanged.pop(key, None)
            raise _grpc_error(error) from None
        credentials = await self._verified(response.access_token)
        expires = (
            response.access_expire_time.ToDatetime().timestamp()
            if response.HasField("access_expire_time")
            else now
        )
        self._forget_expired(now)
        usable_until = min(expires - _EXCHANGE_MARGIN_SECONDS, now + _EXCHANGE_REUSE_SECONDS)
        self._exchanged[key] = (credentials, usable_until)
        return credentials

    def forget_exchanges(self, member_id: str) -> None:
        """Drops the member's exchanged personal tokens (one was revoked: which one,
        the cache cannot tell); the others are exchanged again on their next use."""
        for key in [k for k, (c, _) in self._exchanged.items() if c.member_id == member_id]:
            del self._exchanged[key]

    def _forget_expired(self, now: float) -> None:
        for key in [k for k, (_, until) in self._exchanged.items() if until <= now]:
            del self._exchanged[key]
        for sid in [s for s, until in self._signed_out.items() if until <= now]:
            del self._signed_out[sid]
        for key in [k for k, (at, _) in self._refreshes.items() if now - at > _REFRESH_REUSE_SECONDS]:
            del self._refreshes[key]

    def _is_signed_out(self, session: Session) -> bool:
        return session.session_id in self._signed_out

    # --- sessions ----------------------------------------------------------------------------

    def session_from(self, tokens: im_pb2.Tokens, *, previous: Session | None = None) -> Session:
        """The session holding new tokens (keeping the id, so the CSRF token, of `previous`)."""
        expires = tokens.access_expire_time.ToDatetime().timestamp()
        if previous is not None:
            return previous.renewed(
                access_token=tokens.access_token,
                access_expires_at=expires,
                refresh_token=tokens.refresh_token,
            )
        return Session(
            session_id=new_session_id(),
            member_id=tokens.member.id,
            workspace_id=tokens.member.workspace_id,
            access_token=tokens.access_token,
            access_expires_at=expires,
            refresh_token=tokens.refresh_token,
        )

    async def refresh(self, session: Session) -> Session:
        """The session with fresh tokens (one RefreshTokens per refresh token, however many ask).

        Raises:
            HttpError: 401 when the refresh token no longer works (signed out, expired, reused).
        """
        key = _hash(session.refresh_token)
        now = self._clock()
        self._forget_expired(now)
        found = self._refreshes.get(key)
        if found is None:
            future: asyncio.Future[Session] = asyncio.ensure_future(self._refresh(session))
            self._refreshes[key] = (now, future)
        else:
            future = found[1]
        try:
            return await asyncio.shield(future)
        except HttpError:
            self._refreshes.pop(key, None)
            raise

    async def _refresh(self, session: Session) -> Session:
        try:
            response = await self._stub.RefreshTokens(
                auth_pb2.RefreshTokensRequest(refresh_token=session.refresh_token), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise unauthenticated("the session has ended; sign in again") from None
            raise _grpc_error(error) from None
        return self.session_from(response.tokens, previous=session)

    async def sign_out(self, session: Session) -> None:
        """Revokes the session's refresh token (and its line) at the IM.

        The cookie stops working on this gateway at once, and everywhere
        when its access token expires (it cannot be refreshed).
        """
        self._signed_out[session.session_id] = session.access_expires_at
        try:
            await self._stub.SignOut(
                auth_pb2.SignOutRequest(refresh_token=session.refresh_token), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as error:
            raise _grpc_error(error) from None

    # --- the organisation's OpenID Connect provider ------------------------------------------

    async def sign_in_with_oidc(
        self, *, id_token: str, nonce: str, workspace_id: str, invite: str, display_name: str
    ) -> Session:
        """A new session for the person an ID token names (the IM verifies the token).

        Raises:
            HttpError: the IM's refusal (its status and message).
        """
        try:
            response = await self._stub.SignInWithOidc(
                auth_pb2.SignInWithOidcRequest(
                    id_token=id_token,
                    nonce=nonce,
                    workspace_id=workspace_id,
                    invite=invite,
                    display_name=display_name,
                ),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as error:
            raise _grpc_error(error) from None
        return self.session_from(response.tokens)

    async def link_oidc(self, credentials: Credentials, *, id_token: str, nonce: str) -> str:
        """Links the signed-in person's account to the ID token's verified email; returns the email.

        Raises:
            HttpError: the IM's refusal (its status and message).
        """
        try:
            response = await self._stub.LinkOidcAccount(
                auth_pb2.LinkOidcAccountRequest(id_token=id_token, nonce=nonce),
                metadata=bearer_metadata(credentials.access_token),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as error:
            raise _grpc_error(error) from None
        return str(response.email)
