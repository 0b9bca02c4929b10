"""The gateway as OpenID Connect relying party: the authorization code flow with PKCE.

`start` makes the flow's secrets (state, nonce, PKCE verifier), to be kept
in a short-lived sealed cookie, and the provider's authorization URL;
`finish` checks the state the provider sent back against the cookie's and
exchanges the code (with the verifier and the client secret) for the ID
token. The gateway never judges the ID token: it hands it with the nonce
to the IM (`AuthService.SignInWithOidc`), which verifies it itself.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlencode

from gateway.sessions import SessionSealer
from services.common.oidc import ProviderClient, ProviderError

FLOW_COOKIE = "agentim_oidc"
# Sent back only to the callback (and start, which replaces it).
FLOW_COOKIE_PATH = "/v1/auth/oidc"
# How long a person may take at the provider.
FLOW_MAX_AGE_S = 600
CALLBACK_PATH = "/v1/auth/oidc/callback"
SCOPES = "openid email profile"


class FlowError(Exception):
    """The sign-in cannot go on; the message is for the person."""


def _random() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()


def pkce_challenge(verifier: str) -> str:
    """RFC 7636's S256 challenge of a verifier."""
    return base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()


@dataclass(frozen=True)
class Flow:
    """One sign-in at the provider, from start to callback (sealed in the flow cookie).

    Attributes:
        state: binds the callback to this browser (CSRF of the callback).
        nonce: binds the ID token to this sign-in (the IM checks and spends it).
        verifier: the PKCE code verifier.
        redirect_uri: the callback URL sent to the provider (sent again with the code).
        started_at: seconds since the epoch.
        invite, workspace_id, display_name: what to pass on to the IM.
        link_session: for linking a signed-in person's account: their session id.
    """

    state: str = field(repr=False)
    nonce: str = field(repr=False)
    verifier: str = field(repr=False)
    redirect_uri: str
    started_at: float
    invite: str = field(default="", repr=False)
    workspace_id: str = ""
    display_name: str = ""
    link_session: str = ""


class RelyingParty:
    """Starts and finishes sign-ins with the provider.

    Args:
        client: the provider's HTTP client (discovery, token endpoint).
        sealer: seals the flow cookie with the gateway's session key.
        clock: seconds since the epoch, replaceable in tests.
    """

    def __init__(
        self, client: ProviderClient, sealer: SessionSealer, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.client = client
        self._sealer = sealer
        self._clock = clock

    async def aclose(self) -> None:
        await self.client.aclose()

    async def start(
        self,
        *,
        redirect_uri: str,
        invite: str = "",
        workspace_id: str = "",
        display_name: str = "",
        link_session: str = "",
    ) -> tuple[str, str]:
        """The provider's authorization URL to send the browser to, and the flow cookie's value.

        Raises:
            ProviderError: the provider's discovery document cannot be had.
        """
        discovery = await self.client.discovery()
        flow = Flow(
            state=_random(),
            nonce=_random(),
            verifier=_random(),
            redirect_uri=redirect_uri,
            started_at=self._clock(),
            invite=invite,
            workspace_id=workspace_id,
            display_name=display_name,
            link_session=link_session,
        )
        query = urlencode(
            {
                "response_type": "code",
                "client_id": self.client.settings.client_id,
                "redirect_uri": redirect_uri,
                "scope": SCOPES,
                "state": flow.state,
                "nonce": flow.nonce,
                "code_challenge": pkce_challenge(flow.verifier),
                "code_challenge_method": "S256",
            }
        )
        separator = "&" if "?" in discovery.authorization_endpoint else "?"
        return f"{discovery.authorization_endpoint}{separator}{query}", self._sealer.seal_flow(asdict(flow))

    def open(self, cookie: str | None) -> Flow:
        """The flow of a callback's cookie.

        Raises:
            FlowError: no flow cookie, one not sealed here, or too old.
        """
        sealed = self._sealer.open_flow(cookie) if cookie else None
        try:
            flow = Flow(**sealed) if sealed is not None else None
        except TypeError:
            flow = None
        if flow is None:
            raise FlowError(
                "no sign-in with your organisation was started in this browser (or it was altered); try again"
            )
        if self._clock() - flow.started_at > FLOW_MAX_AGE_S:
            raise FlowError("the sign-in with your organisation took too long; try again")
        return flow

    async def finish(self, flow: Flow, query: dict[str, str]) -> str:
        """The ID token for the provider's answer to `flow` (the callback's query).

        Raises:
            FlowError: the provider said no, the state is not this flow's,
                no code, or the token endpoint refused (its reason in the message).
        """
        if "error" in query:
            reason = query.get("error_description") or query["error"]
            raise FlowError(f"your organisation's sign-in did not complete: {reason[:200]}")
        issuer = query.get("iss")
        if issuer is not None and issuer != self.client.settings.issuer:
            # RFC 9207: the answer comes from another provider (a mix-up attack).
            raise FlowError("the sign-in was answered by another provider than the configured one; try again")
        state = query.get("state", "")
        if not hmac.compare_digest(state.encode(errors="surrogateescape"), flow.state.encode()):
            raise FlowError(
                "the sign-in's state does not match the one started in this browser"
                " (an old or forged link?); try again"
            )
        code = query.get("code", "")
        if not code or len(code) > 2048:
            raise FlowError("the provider sent no authorization code; try again")
        try:
            answer: dict[str, Any] = await self.client.exchange_code(
                code=code, redirect_uri=flow.redirect_uri, code_verifier=flow.verifier
            )
        except ProviderError as error:
            raise FlowError(str(error)) from None
        id_token = answer.get("id_token")
        if not isinstance(id_token, str) or not id_token:
            raise FlowError(
                "the provider's token endpoint returned no ID token (is the `openid` scope allowed?)"
            )
        return id_token
