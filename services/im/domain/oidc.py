"""What an OpenID Connect ID token must say before the IM believes it (pure).

The signature is checked elsewhere (`service_layer.handlers.oidc`); these are the
claim rules of OpenID Connect Core 1.0, section 3.1.3.7, plus ours: the
token is fresh (issued within `max_age`), carries the nonce of this
sign-in, and names an email the provider has verified. Every refusal says
which rule failed, never the token.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from services.im.domain import access
from services.im.domain.errors import InvalidRequest, NotAllowed, Unauthenticated

# Names taken from a token are shown at most this long in messages and as member names.
_SHOWN_CHARS = 80
MAX_NONCE_CHARS = 256


@dataclass(frozen=True, slots=True)
class IdTokenRules:
    """What a valid ID token of the configured provider looks like.

    Attributes:
        issuer: `OIDC_ISSUER`, compared exactly with `iss`.
        client_id: `OIDC_CLIENT_ID`, which `aud` must hold.
        leeway: clock skew allowed on `exp`, `iat` and `nbf`.
        max_age: how long after `iat` the token may still be used to sign in
            (the flow takes seconds; an older token is a replayed or stale one).
    """

    issuer: str
    client_id: str
    leeway: timedelta = timedelta(seconds=60)
    max_age: timedelta = timedelta(minutes=10)


@dataclass(frozen=True, slots=True)
class VerifiedIdentity:
    """Who the provider says signed in.

    Attributes:
        subject: the provider's id for the person (`sub`).
        email: the verified email, normalized.
        name: the person's name as the provider gives it ('' if none).
        usable_until: when the token stops being usable here: its nonce
            must be remembered until then.
    """

    subject: str
    email: str
    name: str
    usable_until: datetime


def _shown(value: object) -> str:
    text = str(value)
    return repr(text[:_SHOWN_CHARS] + ("..." if len(text) > _SHOWN_CHARS else ""))


def _time(payload: Mapping[str, Any], claim: str, *, required: bool) -> datetime | None:
    value = payload.get(claim)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Unauthenticated(f"the ID token's {claim!r} claim is missing or not a number")
    try:
        return datetime.fromtimestamp(value, UTC)
    except (OverflowError, OSError, ValueError):
        raise Unauthenticated(f"the ID token's {claim!r} claim is out of range") from None


def check_nonce_format(nonce: str) -> None:
    if not nonce or len(nonce) > MAX_NONCE_CHARS:
        raise InvalidRequest(f"nonce is required (at most {MAX_NONCE_CHARS} characters)")


def check_claims(
    payload: Mapping[str, Any], *, nonce: str, rules: IdTokenRules, now: datetime
) -> VerifiedIdentity:
    """The identity an ID token's (signature-checked) claims prove.

    Raises:
        Unauthenticated: a claim is missing or wrong (issuer, audience,
            authorized party, times, nonce, subject).
        NotAllowed: the token is genuine but its email is not verified, or
            it has none.
    """
    issuer = payload.get("iss")
    if issuer != rules.issuer:
        raise Unauthenticated(
            f"the ID token was issued by {_shown(issuer)}, not by the configured provider {rules.issuer!r}"
        )
    audience = payload.get("aud")
    audiences = [audience] if isinstance(audience, str) else audience
    if not isinstance(audiences, list) or rules.client_id not in audiences:
        raise Unauthenticated("the ID token is not meant for this system (its audience is another client)")
    authorized = payload.get("azp")
    if (len(audiences) > 1 or authorized is not None) and authorized != rules.client_id:
        raise Unauthenticated("the ID token was issued to another client (azp)")
    expires = _time(payload, "exp", required=True)
    issued = _time(payload, "iat", required=True)
    starts = _time(payload, "nbf", required=False)
    assert expires is not None and issued is not None
    if expires <= now - rules.leeway:
        raise Unauthenticated("the ID token has expired; sign in again")
    if issued > now + rules.leeway or (starts is not None and starts > now + rules.leeway):
        raise Unauthenticated("the ID token is not valid yet (check the clocks)")
    if issued < now - rules.max_age - rules.leeway:
        raise Unauthenticated("the ID token was issued too long ago; sign in again")
    claimed = payload.get("nonce")
    if not isinstance(claimed, str) or not hmac.compare_digest(claimed.encode(), nonce.encode()):
        raise Unauthenticated("the ID token's nonce does not match this sign-in; sign in again")
    subject = payload.get("sub")
    if not isinstance(subject, str) or not subject:
        raise Unauthenticated("the ID token names no subject (sub)")
    raw_email = payload.get("email")
    if not isinstance(raw_email, str) or not raw_email:
        raise NotAllowed(
            "the provider gave no email address (it must put `email` and `email_verified`"
            " in the ID token for the `email` scope)"
        )
    try:
        email = access.normalize_email(raw_email)
    except InvalidRequest:
        raise NotAllowed(f"the provider's email {_shown(raw_email)} is not an email address") from None
    # Some providers send the boolean as a string.
    verified = payload.get("email_verified")
    if verified is not True and verified != "true":
        raise NotAllowed(
            f"the provider has not verified the email address {email}; verify it there, then sign in again"
        )
    name = payload.get("name")
    if not isinstance(name, str):
        name = ""
    usable_until = min(expires, issued + rules.max_age) + rules.leeway
    return VerifiedIdentity(
        subject=subject, email=email, name=name.strip()[:_SHOWN_CHARS], usable_until=usable_until
    )


def member_name(identity: VerifiedIdentity, chosen: str) -> str:
    """The name of a member who joins through the provider: theirs, the token's, or the email's local part."""
    return chosen.strip() or identity.name or identity.email.split("@", 1)[0]
