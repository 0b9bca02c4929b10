"""The HTTP entrypoint: aiohttp handlers for the API, SSE streams, health, the
OpenAPI document and the web UI's files.

Handlers are thin: route -> request message -> upstream call -> JSON. What a
route calls and how messages look come from `routes` and the descriptors;
errors become the JSON error body in one middleware.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlencode

import grpc
from aiohttp import web

from agentim.im.v1 import im_pb2
from gateway import openapi, sse
from gateway.auth import Authenticator, Credentials, permission_denied
from gateway.config import Settings
from gateway.errors import (
    HttpError,
    bad_request,
    method_not_allowed,
    not_configured,
    not_found,
    too_large,
    too_large_upstream,
)
from gateway.oidc import CALLBACK_PATH, FLOW_COOKIE, FLOW_COOKIE_PATH, FLOW_MAX_AGE_S, FlowError, RelyingParty
from gateway.routes import (
    REVOKES_PERSONAL_TOKEN,
    SSE_MEMBER_PARAM,
    Access,
    Matched,
    MethodNotAllowed,
    Resume,
    Route,
    RouteTable,
)
from gateway.sessions import COOKIE_NAME, CSRF_HEADER, Session
from gateway.transcoding import build_request, dumps, message_json
from gateway.upstream import Metadata, Upstreams
from services.common.errors import InvalidArgument
from services.common.identity import VIEW_AS_KEY, WATCH_START_CURSOR_KEY, bearer_metadata
from services.common.oidc import ProviderError
from services.common.request_rules import check_request

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The agent whose view a person reads (the web UI's "view as"); no credential.
VIEW_AS_HEADER = "X-View-As"
CORS_ALLOW_HEADERS = f"Authorization, {VIEW_AS_HEADER}, {CSRF_HEADER}, Content-Type, Last-Event-ID"
CORS_ALLOW_METHODS = "GET, POST, PATCH, DELETE, OPTIONS"
CORS_MAX_AGE_S = 600
_JSON = "application/json"
# How long a checked "view as" stands before it is checked again.
VIEW_CHECK_SECONDS = 60.0
# The session cookie's life: the refresh token's (30 days by default); the
# IM decides when the session really ends.
SESSION_COOKIE_MAX_AGE_S = 30 * 24 * 3600
_HTTP_STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    413: "RESOURCE_EXHAUSTED",
    429: "RESOURCE_EXHAUSTED",
}

# The web UI's policy (also in its page's meta tag, where browsers ignore
# frame-ancestors), sent on every response: an API answer or an error page
# rendered in a browser gets no more rights than the UI.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self';"
    " font-src 'self'; base-uri 'none'; form-action 'none'; object-src 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # For browsers that predate frame-ancestors.
    "X-Frame-Options": "DENY",
}

PLACEHOLDER_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Agent IM</title></head>
<body><h1>Agent IM gateway</h1>
<p>The web UI is not installed (no <code>index.html</code> in the gateway's static directory).
The API is served under <code>/v1</code>; its description is at <a href="/openapi.json">/openapi.json</a>.</p>
</body></html>
"""


def shutting_down() -> HttpError:
    """What a stream ended (or refused) because the gateway is stopping says."""
    return HttpError(
        503,
        "UNAVAILABLE",
        "the gateway is shutting down; reconnect to resume after the last event received"
        " (EventSource does so by itself, with Last-Event-ID)",
    )


def error_response(error: HttpError) -> web.Response:
    return web.Response(
        text=dumps(error.body()), status=error.code, content_type=_JSON, headers=error.headers
    )


def _valid_member_id(value: str) -> bool:
    # gRPC metadata values must be printable ASCII; the service checks the rest.
    return bool(value) and all(33 <= ord(c) < 127 for c in value)


class Gateway:
    """The HTTP API over the upstream services. Holds no state of its own.

    Args:
        settings: the gateway's settings.
        upstreams: the gRPC channels to the IM and the runtime.
        table: the route table.
    """

    def __init__(
        self,
        settings: Settings,
        upstreams: Upstreams,
        authenticator: Authenticator,
        table: RouteTable | None = None,
        *,
        oidc: RelyingParty | None = None,
    ) -> None:
        self._settings = settings
        self._upstreams = upstreams
        self._auth = authenticator
        self._oidc = oidc
        self.table = table or RouteTable()
        self._openapi = dumps(openapi.build(tuple(self.table.routes)))
        # (caller, member) -> until when the caller may view as that member.
        self._views: dict[tuple[str, str], float] = {}
        self._origins = set(settings.cors_origins)
        self._streams: set[asyncio.Future[None]] = set()
        self.shutting_down = False

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def application(self) -> web.Application:
        app = web.Application(
            client_max_size=self._settings.max_body_bytes,
            middlewares=[self._errors, self._preflight],
        )
        app.on_response_prepare.append(self._cors_headers)
        app.on_response_prepare.append(self._security_headers)
        app.on_shutdown.append(self._on_shutdown)
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{path:.+}", self._static)
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/openapi.json", self._openapi_doc)
        app.router.add_get("/v1/auth/session", self._session)
        app.router.add_post("/v1/auth/sign-out", self._sign_out)
        app.router.add_get("/v1/auth/options", self._options)
        app.router.add_get("/v1/auth/oidc/start", self._oidc_start)
        app.router.add_get(CALLBACK_PATH, self._oidc_callback)
        app.router.add_route("*", "/v1{tail:(/.*)?}", self._api)
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        return app

    # --- middlewares and signals -------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            response = await handler(request)
        except HttpError as error:
            response = error_response(error)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            status = _HTTP_STATUS_NAMES.get(error.status, "UNKNOWN")
            response = error_response(HttpError(error.status, status, error.reason))
        # The path only: never a header, cookie or query string.
        logger.debug(
            "%s %s %s %.1f ms",
            request.method,
            request.path,
            response.status,
            1000 * (time.perf_counter() - started),
        )
        return response

    def _allowed_origin(self, origin: str) -> bool:
        return "*" in self._origins or origin.rstrip("/") in self._origins

    @web.middleware
    async def _preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if (
            request.method != "OPTIONS"
            or origin is None
            or "Access-Control-Request-Method" not in request.headers
        ):
            return await handler(request)
        if not self._allowed_origin(origin):
            raise HttpError(403, "PERMISSION_DENIED", f"origin {origin[:100]!r} is not allowed")
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Methods": CORS_ALLOW_METHODS,
                "Access-Control-Allow-Headers": CORS_ALLOW_HEADERS,
                "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
            },
        )

    async def _cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and self._origins and self._allowed_origin(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers.add("Vary", "Origin")

    async def _security_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)

    async def _on_shutdown(self, app: web.Application) -> None:
        """Ends every SSE stream with an UNAVAILABLE `error` event; clients reconnect
        (elsewhere) with Last-Event-ID."""
        self.shutting_down = True
        for stop in list(self._streams):
            if not stop.done():
                stop.set_result(None)

    # --- open routes -------------------------------------------------------------

    async def _index(self, request: web.Request) -> web.StreamResponse:
        page = self._settings.static_dir / "index.html"
        if page.is_file():
            return web.FileResponse(page, headers={"Cache-Control": "no-cache"})
        return web.Response(text=PLACEHOLDER_PAGE, content_type="text/html")

    async def _static(self, request: web.Request) -> web.StreamResponse:
        root = self._settings.static_dir.resolve()
        target = (root / request.match_info["path"]).resolve()
        if not target.is_relative_to(root) or not target.is_file():
            raise not_found(f"no file {request.path!r}")
        return web.FileResponse(target, headers={"Cache-Control": "no-cache"})

    async def _health(self, request: web.Request) -> web.Response:
        if self.shutting_down:
            statuses = {name: "UNKNOWN" for name in self._upstreams.addresses}
            serving = False
        else:
            statuses = await self._upstreams.health()
            serving = all(status == "SERVING" for status in statuses.values())
        body = {"status": "SERVING" if serving else "NOT_SERVING", "upstreams": statuses}
        return web.Response(text=dumps(body), status=200 if serving else 503, content_type=_JSON)

    async def _openapi_doc(self, request: web.Request) -> web.Response:
        return web.Response(text=self._openapi, content_type=_JSON)

    async def _unknown(self, request: web.Request) -> web.Response:
        raise not_found(f"no route for {request.path[:200]!r}")

    # --- the API -----------------------------------------------------------------

    async def _api(self, request: web.Request) -> web.StreamResponse:
        match = self.table.match(request.method, request.rel_url.raw_path)
        if match is None:
            raise not_found(f"no route for {request.path[:200]!r}")
        if isinstance(match, MethodNotAllowed):
            raise method_not_allowed(match.allowed)
        route = match.route
        credentials: Credentials | None = None
        if route.access is Access.SIGNED_IN:
            # (A read-only token's writes are the services' to refuse: they
            # know which RPCs write.)
            credentials = await self._credentials(request)
        elif route.opens_session and request.content_type != _JSON:
            # A cross-site form cannot send JSON without CORS's permission:
            # nobody signs a browser into an account of theirs.
            raise bad_request(f"send the request as {_JSON}")
        metadata = await self._metadata(request, credentials, streaming=route.streaming)
        if route.streaming:
            response = await self._stream(request, match, metadata, credentials)
        else:
            response = await self._unary(request, match, metadata)
            if (route.service, route.rpc) in REVOKES_PERSONAL_TOKEN and credentials is not None:
                self._auth.forget_exchanges(credentials.member_id)
        renewed = credentials is not None and credentials.renewed and credentials.session is not None
        # (A stream's response set it before it started.)
        if renewed and not response.prepared:
            assert credentials is not None and credentials.session is not None
            self._set_cookie(request, response, credentials.session)
        return response

    async def _credentials(self, request: web.Request) -> Credentials:
        return await self._auth.authenticate(
            method=request.method,
            authorization=request.headers.get("Authorization"),
            cookie=request.cookies.get(COOKIE_NAME),
            csrf=request.headers.get(CSRF_HEADER),
        )

    async def _metadata(
        self, request: web.Request, credentials: Credentials | None, *, streaming: bool
    ) -> Metadata:
        """The caller's access token and, for a view through an agent's eyes
        (the browser's `X-View-As`), that agent in `x-agentim-view-as`."""
        if credentials is None:
            return ()
        acting = request.headers.get(VIEW_AS_HEADER, "").strip()
        if not acting and streaming:
            acting = request.query.get(SSE_MEMBER_PARAM, "").strip()
        if acting and acting != credentials.member_id:
            await self._check_view(credentials, acting)
        metadata = bearer_metadata(credentials.access_token)
        if acting and acting != credentials.member_id:
            metadata += ((VIEW_AS_KEY, acting),)
        return metadata

    async def _check_view(self, credentials: Credentials, member_id: str) -> None:
        """Lets a person view as an agent of their workspace, and as nobody else.

        Raises:
            HttpError: 403 for a person, 404 for a member the caller cannot see.
        """
        if not _valid_member_id(member_id):
            raise bad_request(f"{VIEW_AS_HEADER} is not a valid member id")
        key = (credentials.member_id, member_id)
        now = time.monotonic()
        if self._views.get(key, 0.0) > now:
            return
        route = self.table.match("GET", f"/v1/members/{member_id}")
        assert isinstance(route, Matched)
        request = self._upstreams.new_request(route.route)
        setattr(request, "member_id", member_id)  # noqa: B010
        try:
            found: Any = await self._upstreams.unary(
                route.route,
                request,
                bearer_metadata(credentials.access_token),
            )
        except grpc.aio.AioRpcError as error:
            raise HttpError.from_grpc(error.code(), error.details()) from None
        if (
            found.member.kind != im_pb2.MEMBER_KIND_AGENT
            or found.member.workspace_id != credentials.workspace_id
        ):
            raise permission_denied("you may view as yourself and as the workspace's agents only")
        if len(self._views) > 10_000:
            self._views.clear()
        self._views[key] = now + VIEW_CHECK_SECONDS

    def _set_cookie(self, request: web.Request, response: web.StreamResponse, session: Session) -> None:
        response.set_cookie(
            COOKIE_NAME,
            self._auth.sealer.seal(session),
            path="/",
            httponly=True,
            samesite="Lax",
            secure=self._settings.cookie_secure or request.secure,
            # Outlives its access token: the refresh token renews it.
            max_age=SESSION_COOKIE_MAX_AGE_S,
        )

    def _clear_cookie(self, request: web.Request, response: web.StreamResponse) -> None:
        response.del_cookie(
            COOKIE_NAME,
            path="/",
            httponly=True,
            samesite="Lax",
            secure=self._settings.cookie_secure or request.secure,
        )

    # --- sessions ----------------------------------------------------------------------

    async def _session(self, request: web.Request) -> web.StreamResponse:
        """Who is signed in (the member, fresh from the IM), with the session's CSRF token."""
        credentials = await self._credentials(request)
        if credentials.session is None:
            raise bad_request("GET /v1/auth/session describes a browser session; none was sent")
        metadata = bearer_metadata(credentials.access_token)
        member_route = self.table.match("GET", f"/v1/members/{credentials.member_id}")
        workspace_route = self.table.match("GET", f"/v1/workspaces/{credentials.workspace_id}")
        assert isinstance(member_route, Matched) and isinstance(workspace_route, Matched)
        member_request = im_pb2.GetMemberRequest(member_id=credentials.member_id)
        workspace_request = im_pb2.GetWorkspaceRequest(workspace_id=credentials.workspace_id)
        try:
            member: Any = await self._upstreams.unary(member_route.route, member_request, metadata)
            workspace: Any = await self._upstreams.unary(workspace_route.route, workspace_request, metadata)
        except grpc.aio.AioRpcError as error:
            raise HttpError.from_grpc(error.code(), error.details()) from None
        body = (
            '{"member":'
            + message_json(member.member)
            + ',"workspace":'
            + message_json(workspace.workspace)
            + ',"csrfToken":'
            + dumps(self._auth.sealer.csrf_token(credentials.session))
            + "}"
        )
        response = web.Response(text=body, content_type=_JSON, headers={"Cache-Control": "no-store"})
        if credentials.renewed:
            self._set_cookie(request, response, credentials.session)
        return response

    async def _sign_out(self, request: web.Request) -> web.StreamResponse:
        """Ends the session (its refresh token revoked at the IM) and clears the cookie.

        Without a valid session there is nothing to end: it still clears the cookie.
        """
        cookie = request.cookies.get(COOKIE_NAME)
        session = self._auth.sealer.open(cookie) if cookie else None
        if session is not None:
            if not self._auth.sealer.csrf_matches(session, request.headers.get(CSRF_HEADER)):
                raise permission_denied(f"signing out needs the session's CSRF token in {CSRF_HEADER}")
            await self._auth.sign_out(session)
        response = web.Response(text="{}", content_type=_JSON)
        self._clear_cookie(request, response)
        return response

    async def _options(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text=dumps({"oidc": self._oidc is not None}), content_type=_JSON)

    # --- signing in with the organisation's OpenID Connect provider --------------------

    def _relying_party(self) -> RelyingParty:
        if self._oidc is None:
            raise not_found("signing in with an OpenID Connect provider is not configured here (OIDC_ISSUER)")
        return self._oidc

    def _back_to_page(self, request: web.Request, **fragment: str) -> web.Response:
        """Sends the browser back to the web UI (a 303), which reads what happened from
        the URL's fragment (never sent to a server); the flow cookie goes."""
        shown = {name: value for name, value in fragment.items() if value}
        location = "/" + ("#" + urlencode(shown) if shown else "")
        response = web.Response(status=303, headers={"Location": location, "Cache-Control": "no-store"})
        response.del_cookie(
            FLOW_COOKIE,
            path=FLOW_COOKIE_PATH,
            httponly=True,
            samesite="Lax",
            secure=self._settings.cookie_secure or request.secure,
        )
        return response

    def _refused(self, request: web.Request, message: str, status: str, *, invite: str = "") -> web.Response:
        return self._back_to_page(request, signin_error=message, signin_status=status, invite=invite)

    async def _oidc_start(self, request: web.Request) -> web.StreamResponse:
        """Sends the browser to the provider, with the flow's secrets in a sealed cookie.

        Query: `invite` (join with it), `workspace` (the workspace to sign in
        to), `name` (a new member's name), `link=1` (link the signed-in
        person's account instead of signing in).
        """
        party = self._relying_party()
        invite = request.query.get("invite", "").strip()
        workspace = request.query.get("workspace", "").strip()
        name = request.query.get("name", "").strip()
        if invite and (not invite.startswith("aim_inv_") or len(invite) > 128):
            return self._refused(request, "the invite is not valid", "UNAUTHENTICATED")
        if workspace:
            try:
                workspace = str(uuid.UUID(workspace))
            except ValueError:
                return self._refused(
                    request, "the workspace id is not valid", "INVALID_ARGUMENT", invite=invite
                )
        if len(name) > 100:
            return self._refused(
                request, "the name may be at most 100 characters", "INVALID_ARGUMENT", invite=invite
            )
        link_session = ""
        renewed: Session | None = None
        if request.query.get("link") == "1":
            try:
                credentials = await self._credentials(request)
            except HttpError as error:
                return self._refused(request, f"sign in first: {error.message}", error.status)
            if credentials.session is None:
                return self._refused(request, "linking needs a browser session", "UNAUTHENTICATED")
            link_session = credentials.session.session_id
            # Refreshed on the way: the browser must keep the new tokens (the old
            # refresh token is spent, and using it again would end the session).
            renewed = credentials.session if credentials.renewed else None
        redirect_uri = self._settings.oidc_redirect_url or f"{request.scheme}://{request.host}{CALLBACK_PATH}"
        try:
            url, cookie = await party.start(
                redirect_uri=redirect_uri,
                invite=invite,
                workspace_id=workspace,
                display_name=name,
                link_session=link_session,
            )
        except ProviderError as error:
            logger.warning("cannot start a sign-in with the OpenID provider: %s", error)
            refused = self._refused(request, str(error), "UNAVAILABLE", invite=invite)
            if renewed is not None:
                self._set_cookie(request, refused, renewed)
            return refused
        response = web.Response(status=303, headers={"Location": url, "Cache-Control": "no-store"})
        response.set_cookie(
            FLOW_COOKIE,
            cookie,
            path=FLOW_COOKIE_PATH,
            httponly=True,
            # Lax: the provider's redirect back is a top-level GET, which carries it.
            samesite="Lax",
            secure=self._settings.cookie_secure or request.secure,
            max_age=FLOW_MAX_AGE_S,
        )
        if renewed is not None:
            self._set_cookie(request, response, renewed)
        return response

    async def _oidc_callback(self, request: web.Request) -> web.StreamResponse:
        """The provider's answer: checks it against the flow cookie, gets the ID token,
        and has the IM sign the person in (or link their account); then back to the UI."""
        party = self._relying_party()
        try:
            flow = party.open(request.cookies.get(FLOW_COOKIE))
        except FlowError as error:
            return self._refused(request, str(error), "UNAUTHENTICATED")
        try:
            id_token = await party.finish(flow, dict(request.query))
        except FlowError as error:
            return self._refused(request, str(error), "UNAUTHENTICATED", invite=flow.invite)
        if flow.link_session:
            try:
                credentials = await self._credentials(request)
            except HttpError as error:
                return self._refused(request, error.message, error.status)
            session = credentials.session
            if session is None or session.session_id != flow.link_session:
                return self._refused(
                    request, "the browser was signed in as someone else meanwhile", "UNAUTHENTICATED"
                )
            try:
                email = await self._auth.link_oidc(credentials, id_token=id_token, nonce=flow.nonce)
            except HttpError as error:
                response = self._refused(request, error.message, error.status)
            else:
                response = self._back_to_page(request, linked=email)
            # Refreshed on the way: the browser keeps the new tokens, whatever the outcome.
            if credentials.renewed:
                self._set_cookie(request, response, session)
            return response
        try:
            session = await self._auth.sign_in_with_oidc(
                id_token=id_token,
                nonce=flow.nonce,
                workspace_id=flow.workspace_id,
                invite=flow.invite,
                display_name=flow.display_name,
            )
        except HttpError as error:
            return self._refused(request, error.message, error.status, invite=flow.invite)
        response = self._back_to_page(request)
        self._set_cookie(request, response, session)
        return response

    async def _body(self, request: web.Request) -> bytes:
        limit = self._settings.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise too_large(limit)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large(limit) from None

    def _check(self, message: Any) -> None:
        """Refuses what the services would refuse before any call: the rules every
        request obeys (400) and the services' size limit (413, not the 429 of a quota)."""
        try:
            check_request(message)
        except InvalidArgument as error:
            raise bad_request(error.message) from None
        size = message.ByteSize()
        if size > self._settings.upstream_max_message_bytes:
            raise too_large_upstream(size, self._settings.upstream_max_message_bytes)

    async def _unary(self, request: web.Request, match: Matched, metadata: Metadata) -> web.Response:
        route = match.route
        if not self._upstreams.serves(route):
            raise not_configured(route.service)
        body: bytes | None = None
        query: list[tuple[str, str]] = list(request.query.items())
        if route.has_body:
            body = await self._body(request)
            if query:
                raise bad_request("query parameters are not accepted here: send the fields in the JSON body")
        message = build_request(
            self._upstreams.new_request(route), body=body, query=query, path_params=match.path_params
        )
        self._check(message)
        try:
            response: Any = await self._upstreams.unary(route, message, metadata)
        except grpc.aio.AioRpcError as error:
            raise HttpError.from_grpc(error.code(), error.details(), error.trailing_metadata()) from None
        session: Session | None = None
        if route.opens_session and response.HasField("tokens"):
            # The tokens stay with the gateway, sealed in the cookie: no page script can read them.
            previous = self._auth.sealer.open(request.cookies.get(COOKIE_NAME, ""))
            keep = previous if previous is not None and route.access is Access.SIGNED_IN else None
            session = self._auth.session_from(response.tokens, previous=keep)
            response.ClearField("tokens")
        answer = web.Response(text=message_json(response), content_type=_JSON)
        if session is not None:
            self._set_cookie(request, answer, session)
        return answer

    async def _stream(
        self, request: web.Request, match: Matched, metadata: Metadata, credentials: Credentials | None
    ) -> web.StreamResponse:
        if self.shutting_down:
            # On a connection kept alive: it would outlive the streams just ended.
            raise shutting_down()
        route = match.route
        message = build_request(
            self._upstreams.new_request(route),
            body=None,
            query=request.query.items(),
            path_params=match.path_params,
            skip=(SSE_MEMBER_PARAM,),
        )
        self._check(message)
        start = int(getattr(message, "after_sequence", 0)) if route.resume is Resume.STEP_SEQUENCE else 0
        last_event_id = request.headers.get("Last-Event-ID", "").strip()
        if last_event_id and route.resume is not Resume.NONE:
            start = sse.apply_last_event_id(route.resume, message, last_event_id)
        ids = sse.ResumeIds(route.resume, after_sequence=start)
        call = self._upstreams.stream(route, message, metadata)
        stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._streams.add(stop)
        try:
            headers = await self._opened(route, call)
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream; charset=utf-8",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",
                }
            )
            if credentials is not None and credentials.renewed and credentials.session is not None:
                self._set_cookie(request, response, credentials.session)
            await response.prepare(request)
            # The subscription is in place: say so at once.
            await response.write(
                sse.opening(self._settings.sse_retry_ms, self._start_id(route, headers, start))
            )
            await self._pump(call, response, ids, stop)
            return response
        finally:
            self._streams.discard(stop)
            call.cancel()

    @staticmethod
    def _start_id(route: Route, headers: dict[str, str], start: int) -> str | None:
        if route.resume is Resume.CURSOR:
            return headers.get(WATCH_START_CURSOR_KEY)
        if route.resume is Resume.STEP_SEQUENCE:
            return str(start)
        return None

    async def _opened(self, route: Route, call: Any) -> dict[str, str]:
        """Waits for the stream's headers (sent once the upstream has subscribed); returns them.

        Raises:
            HttpError: the call failed before (its status), or took too long (504).
        """
        try:
            metadata = await asyncio.wait_for(call.initial_metadata(), self._settings.call_timeout_seconds)
        except TimeoutError:
            raise HttpError(504, "DEADLINE_EXCEEDED", f"{route.rpc} did not open in time") from None
        except grpc.aio.AioRpcError as error:
            raise HttpError.from_grpc(error.code(), error.details()) from None
        if call.done():
            code = await call.code()
            if code != grpc.StatusCode.OK:
                raise HttpError.from_grpc(code, await call.details())
        return {str(key): str(value) for key, value in (metadata or ())}

    async def _pump(
        self, call: Any, response: web.StreamResponse, ids: sse.ResumeIds, stop: asyncio.Future[None]
    ) -> None:
        """Copies the stream's messages to SSE events until it ends, fails, or the gateway stops."""
        loop = asyncio.get_running_loop()
        heartbeat = self._settings.heartbeat_seconds
        ends_at = loop.time() + self._settings.sse_max_seconds if self._settings.sse_max_seconds else None
        read: asyncio.Future[Any] | None = None
        try:
            while True:
                timeout = heartbeat
                if ends_at is not None:
                    timeout = min(timeout, ends_at - loop.time())
                    if timeout <= 0:
                        return
                if read is None:
                    read = asyncio.ensure_future(call.read())
                done, _ = await asyncio.wait(
                    (read, stop), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if read in done:
                    current, read = read, None
                    try:
                        item = current.result()
                    except grpc.aio.AioRpcError as error:
                        await response.write(
                            sse.error_frame(HttpError.from_grpc(error.code(), error.details()))
                        )
                        return
                    except asyncio.CancelledError:
                        # The read (not this task): the channel closed at shutdown.
                        return
                    if item is grpc.aio.EOF:
                        return
                    await response.write(ids.encode(item))
                elif stop.done():
                    # Said, not just dropped: EventSource reconnects (to another
                    # replica, or this one once it is back) with Last-Event-ID.
                    await response.write(sse.error_frame(shutting_down()))
                    return
                elif ends_at is None or loop.time() < ends_at:
                    await response.write(sse.PING)
        except ConnectionError:
            # The client went away; the call is cancelled by our caller.
            return
        finally:
            if read is not None:
                read.cancel()
