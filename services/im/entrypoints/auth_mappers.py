"""Identity objects to protobuf messages and back; nothing else."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from google.protobuf import duration_pb2, timestamp_pb2

from agentim.im.v1 import auth_pb2, im_pb2
from services.im.domain.accounts import Invite, IssuedAccess, IssuedTokens, PersonalToken, PersonalTokenScope
from services.im.domain.errors import InvalidRequest
from services.im.entrypoints.mappers import ROLES_OUT, member, timestamp

SCOPES = {
    auth_pb2.PERSONAL_TOKEN_SCOPE_READ: PersonalTokenScope.READ,
    auth_pb2.PERSONAL_TOKEN_SCOPE_WRITE: PersonalTokenScope.WRITE,
}
SCOPES_OUT = {v: k for k, v in SCOPES.items()}


def personal_token_scope(value: int) -> PersonalTokenScope | None:
    if value == auth_pb2.PERSONAL_TOKEN_SCOPE_UNSPECIFIED:
        return None
    if value not in SCOPES:
        raise InvalidRequest(f"scope {value} is not a known scope")
    return SCOPES[value]  # type: ignore[index]


def duration(value: duration_pb2.Duration, field: str) -> timedelta:
    try:
        return value.ToTimedelta()
    except (OverflowError, ValueError):
        raise InvalidRequest(f"{field} is out of range") from None


def time(value: timestamp_pb2.Timestamp, field: str) -> datetime:
    try:
        return value.ToDatetime(tzinfo=UTC)
    except (OverflowError, ValueError, OSError):
        raise InvalidRequest(f"{field} is out of range") from None


def tokens(issued: IssuedTokens) -> im_pb2.Tokens:
    return im_pb2.Tokens(
        access_token=issued.access.token,
        refresh_token=issued.refresh_token,
        access_expire_time=timestamp(issued.access.expires_at),
        refresh_expire_time=timestamp(issued.refresh_expires_at),
        member=member(issued.member),
    )


def access_expiry(issued: IssuedAccess) -> timestamp_pb2.Timestamp:
    return timestamp(issued.expires_at)


def invite(i: Invite) -> auth_pb2.Invite:
    return auth_pb2.Invite(
        id=str(i.id),
        workspace_id=str(i.workspace_id),
        role=ROLES_OUT[i.role],
        creator_id=str(i.created_by),
        create_time=timestamp(i.created_at),
        expire_time=timestamp(i.expires_at),
        email=i.email or "",
    )


def personal_token(t: PersonalToken) -> auth_pb2.PersonalToken:
    out = auth_pb2.PersonalToken(
        id=str(t.id),
        name=t.name,
        scope=SCOPES_OUT[t.scope],
        create_time=timestamp(t.created_at),
        expire_time=timestamp(t.expires_at),
    )
    if t.last_used_at is not None:
        out.last_use_time.CopyFrom(timestamp(t.last_used_at))
    if t.revoked_at is not None:
        out.revoke_time.CopyFrom(timestamp(t.revoked_at))
    return out


def signing_key(jwk: dict[str, str]) -> auth_pb2.SigningKey:
    return auth_pb2.SigningKey(
        kid=jwk["kid"], kty=jwk["kty"], crv=jwk["crv"], x=jwk["x"], alg=jwk["alg"], use=jwk["use"]
    )


def jwks(keys: list[auth_pb2.SigningKey]) -> dict[str, list[dict[str, str]]]:
    """The keys of a GetSigningKeys response as a JWKS (for `tokens.Verifier`)."""
    return {
        "keys": [
            {"kid": k.kid, "kty": k.kty, "crv": k.crv, "x": k.x, "alg": k.alg, "use": k.use} for k in keys
        ]
    }
