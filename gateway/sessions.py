"""Browser sessions: the sealed cookie and its CSRF token (pure but for the key file).

A session is the person's access and refresh tokens, sealed into one cookie
with the gateway's key (AES-256-GCM: a cookie cannot be read or altered
without it). The gateway keeps no session table: any replica with the same
key serves any session. The CSRF token is an HMAC of the session's random
id, so it stays the same across token refreshes and needs no storage.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

COOKIE_NAME = "agentim_session"
CSRF_HEADER = "X-CSRF-Token"
KEY_BYTES = 32
_NONCE_BYTES = 12
# Binds sealed cookies to their purpose and format version.
_SEAL_CONTEXT = b"agentim gateway session v1"
# A sign-in with the OpenID provider in progress (gateway.oidc): sealed with
# the same key for another purpose, so neither kind opens as the other.
_FLOW_CONTEXT = b"agentim gateway oidc flow v1"
_CSRF_CONTEXT = b"agentim gateway csrf v1"
# A cookie larger than browsers keep (4096 bytes with its name) is refused unread.
MAX_COOKIE_CHARS = 4000


class SessionKeyError(ValueError):
    """The session key is malformed."""


def _b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def parse_session_key(text: str) -> bytes:
    """A 32-byte key written as 64 hex digits or as base64 (standard or URL-safe).

    Raises:
        SessionKeyError: anything else.
    """
    text = text.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    try:
        raw = _b64decode(text.replace("+", "-").replace("/", "_"))
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != KEY_BYTES:
        raise SessionKeyError(f"expected {KEY_BYTES} bytes as 64 hex digits or base64")
    return raw


def new_session_key() -> str:
    """A new key, as GATEWAY_SESSION_KEY takes it (base64url)."""
    return _b64encode(secrets.token_bytes(KEY_BYTES))


def load_or_create_key(path: Path) -> bytes:
    """The key in `path`, made (mode 0600, directory 0700) if the file does not exist."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process made it meanwhile
        else:
            with os.fdopen(descriptor, "w") as file:
                file.write(new_session_key() + "\n")
    return parse_session_key(path.read_text())


@dataclass(frozen=True)
class Session:
    """One signed-in browser: who, and the tokens that prove it.

    Attributes:
        session_id: random, made at sign-in and kept across refreshes (the
            CSRF token derives from it).
        member_id, workspace_id: the person.
        access_token: the current access token (a JWT).
        access_expires_at: its expiry, seconds since the epoch.
        refresh_token: the refresh token that renews it.
    """

    session_id: str
    member_id: str
    workspace_id: str
    access_token: str = field(repr=False)
    access_expires_at: float
    refresh_token: str = field(repr=False)

    def renewed(self, *, access_token: str, access_expires_at: float, refresh_token: str) -> Session:
        return replace(
            self, access_token=access_token, access_expires_at=access_expires_at, refresh_token=refresh_token
        )


def new_session_id() -> str:
    return _b64encode(secrets.token_bytes(16))


class SessionSealer:
    """Seals sessions into cookie values and opens them; derives CSRF tokens.

    Args:
        key: the gateway's 32-byte session key.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise SessionKeyError(f"the session key must be {KEY_BYTES} bytes")
        # Separate keys for separate uses, both from the one configured key.
        self._aead = AESGCM(hmac.digest(key, _SEAL_CONTEXT, hashlib.sha256))
        self._csrf_key = hmac.digest(key, _CSRF_CONTEXT, hashlib.sha256)

    def _seal(self, payload: bytes, context: bytes) -> str:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        return _b64encode(nonce + self._aead.encrypt(nonce, payload, context))

    def _open(self, value: str, context: bytes) -> Any:
        """The JSON sealed in a value for `context`; raises ValueError (or InvalidTag) if it is none."""
        if not value or len(value) > MAX_COOKIE_CHARS:
            raise ValueError("not a sealed value")
        raw = _b64decode(value)
        return json.loads(self._aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], context))

    def seal_flow(self, flow: Mapping[str, Any]) -> str:
        """Seals an OpenID Connect sign-in in progress (see gateway.oidc)."""
        return self._seal(json.dumps(dict(flow), separators=(",", ":")).encode(), _FLOW_CONTEXT)

    def open_flow(self, value: str) -> dict[str, Any] | None:
        """The sign-in sealed by `seal_flow`; None if it is not one of ours, or was altered."""
        try:
            opened = self._open(value, _FLOW_CONTEXT)
        except (binascii.Error, ValueError, InvalidTag):
            return None
        return opened if isinstance(opened, dict) else None

    def seal(self, session: Session) -> str:
        payload = json.dumps(
            {
                "sid": session.session_id,
                "mem": session.member_id,
                "ws": session.workspace_id,
                "at": session.access_token,
                "exp": session.access_expires_at,
                "rt": session.refresh_token,
            },
            separators=(",", ":"),
        ).encode()
        return self._seal(payload, _SEAL_CONTEXT)

    def open(self, value: str) -> Session | None:
        """The session sealed in a cookie value; None if it is not one of ours, or was altered."""
        try:
            payload = self._open(value, _SEAL_CONTEXT)
            return Session(
                session_id=str(payload["sid"]),
                member_id=str(payload["mem"]),
                workspace_id=str(payload["ws"]),
                access_token=str(payload["at"]),
                access_expires_at=float(payload["exp"]),
                refresh_token=str(payload["rt"]),
            )
        except (binascii.Error, ValueError, InvalidTag, KeyError, TypeError):
            return None

    def csrf_token(self, session: Session) -> str:
        return _b64encode(hmac.digest(self._csrf_key, session.session_id.encode(), hashlib.sha256))

    def csrf_matches(self, session: Session, presented: str | None) -> bool:
        if not presented:
            return False
        return hmac.compare_digest(
            presented.encode(errors="surrogateescape"), self.csrf_token(session).encode()
        )
