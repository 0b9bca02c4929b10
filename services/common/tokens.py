"""Signed access tokens: Ed25519 JWTs the IM issues and every service verifies.

The IM holds a `KeyRing` (a directory of PEM files, one per key, named by
key id) and signs with `sign`; every service verifies with a `Verifier`
that reads the IM's public keys (a JWKS) from a source it is given, keeps
them, and asks again only for a key id it does not know (at most once per
`refetch_seconds`) or when its copy is older than `max_age_seconds`. So
verifying costs no call.

Key directory (`AUTH_SIGNING_KEYS_DIR`): `<kid>.pem` files are signing
candidates and `<kid>.next.pem` files are published but never sign. The
signing key is the `<kid>.pem` whose kid sorts last **by name**: names
survive copies, backups and volume restores, where modification times do
not, and `KeyRing.generate` names keys by their UTC creation time
(`20261115T101500Z-1a2b3c4d`), so the last by name is the newest.

Rotation without downtime: `generate(dir, upcoming=True)` writes the next
key as `<kid>.next.pem`; reload (SIGHUP) publishes it; once every verifier
has fetched it (after their `max_age_seconds`; an unknown kid is fetched
anyway, within `refetch_seconds`), rename it to `<kid>.pem` and reload: it
signs. Remove the old key once no token it signed is still valid (the
access token lifetime).

Every verification failure raises `services.common.errors.Unauthenticated`
with a message for people that never contains the token. A JWKS source that
fails raises `Unavailable` (the caller's token may be fine; try again).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import enum
import logging
import os
import re
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from services.common.errors import Unauthenticated, Unavailable

logger = logging.getLogger(__name__)

ISSUER = "agentim"
AUDIENCE = "agentim"
ALGORITHM = "EdDSA"
DEFAULT_LIFETIME = timedelta(minutes=15)
DEFAULT_LEEWAY_SECONDS = 10.0
SERVICE_SUBJECT_PREFIX = "service:"
_KID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NEXT_SUFFIX = ".next.pem"

Jwks = dict[str, Any]
# Where a verifier gets the IM's public keys from: a call that returns a JWKS.
JwksSource = Callable[[], Awaitable[Mapping[str, Any]]]


class PrincipalKind(enum.StrEnum):
    """Who a token stands for."""

    HUMAN = "human"
    AGENT = "agent"
    SERVICE = "service"


class Scope(enum.StrEnum):
    """What a token may do: read only, or read and write."""

    READ = "read"
    READ_WRITE = "read write"


@dataclass(frozen=True, slots=True)
class AccessClaims:
    """What an access token says about its bearer.

    Attributes:
        kind: human, agent or service.
        member_id: the member (None for a service).
        workspace_id: the member's workspace (None for a service).
        roles: the member's workspace roles (owner, admin, member) when issued.
        scope: read, or read write.
        host: for an agent, the service that hosts it (e.g. "runtime").
        service: for a service, its name.
        issued_at, expires_at: the token's life (set by `stamped`).
        token_id: the token's unique id (`jti`).
        personal_token_id: the personal access token it was exchanged for, if any.
    """

    kind: PrincipalKind
    member_id: uuid.UUID | None = None
    workspace_id: uuid.UUID | None = None
    roles: tuple[str, ...] = ()
    scope: Scope = Scope.READ_WRITE
    host: str | None = None
    service: str | None = None
    issued_at: datetime | None = None
    expires_at: datetime | None = None
    token_id: str = ""
    personal_token_id: uuid.UUID | None = None

    def __post_init__(self) -> None:
        if self.kind is PrincipalKind.SERVICE:
            if not self.service or self.member_id is not None:
                raise ValueError("a service token names its service and no member")
        elif self.member_id is None or self.workspace_id is None:
            raise ValueError("a member's token names the member and its workspace")

    @property
    def can_write(self) -> bool:
        return self.scope is Scope.READ_WRITE

    @property
    def subject(self) -> str:
        """The `sub` claim: the member id, or `service:<name>`."""
        if self.kind is PrincipalKind.SERVICE:
            return f"{SERVICE_SUBJECT_PREFIX}{self.service}"
        return str(self.member_id)

    def stamped(self, *, now: datetime | None = None, lifetime: timedelta = DEFAULT_LIFETIME) -> AccessClaims:
        """The claims with issued_at, expires_at and token_id filled in where unset."""
        issued = self.issued_at or (now or datetime.now(UTC))
        return replace(
            self,
            issued_at=issued,
            expires_at=self.expires_at or issued + lifetime,
            token_id=self.token_id or uuid.uuid4().hex,
        )


# -- keys ------------------------------------------------------------------------------


class KeyRingError(Exception):
    """The key directory cannot be used (no signing key, unreadable or malformed file)."""


@dataclass(frozen=True)
class _Keys:
    signing_kid: str
    signing_key: Ed25519PrivateKey = field(repr=False)
    public: dict[str, Ed25519PublicKey] = field(repr=False)


def _kid_of(path: Path) -> tuple[str, bool] | None:
    """(kid, upcoming) of a key file's name, or None for files that are no key."""
    name = path.name
    upcoming = name.endswith(_NEXT_SUFFIX)
    if upcoming:
        kid = name[: -len(_NEXT_SUFFIX)]
    elif name.endswith(".pem"):
        kid = name[: -len(".pem")]
    else:
        return None
    return (kid, upcoming) if _KID.match(kid) else None


def has_signing_key(directory: Path) -> bool:
    """Whether the directory holds at least one `<kid>.pem` that may sign."""
    if not directory.is_dir():
        return False
    return any((found := _kid_of(p)) is not None and not found[1] for p in directory.iterdir())


class KeyRing:
    """The IM's Ed25519 keys, read from a directory (see the module docstring).

    Use `KeyRing.load(directory)`; `reload()` reads the directory again
    (the IM does it on SIGHUP) and keeps the keys it had if the directory
    is not usable now.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._keys: _Keys | None = None

    @classmethod
    def load(cls, directory: Path) -> KeyRing:
        """Reads the directory; raises KeyRingError if it has no usable signing key."""
        ring = cls(directory)
        ring.reload()
        return ring

    def reload(self) -> None:
        """Reads the directory again.

        Raises:
            KeyRingError: a file is unreadable or not an Ed25519 private key,
                or there is no `<kid>.pem` to sign with; the keys loaded
                before stay in use.
        """
        if not self.directory.is_dir():
            raise KeyRingError(f"{self.directory} is not a directory")
        signing: dict[str, Ed25519PrivateKey] = {}
        public: dict[str, Ed25519PublicKey] = {}
        for path in sorted(self.directory.iterdir()):
            found = _kid_of(path)
            if found is None:
                continue
            kid, upcoming = found
            if kid in public:
                raise KeyRingError(f"key {kid} is in the directory twice ({kid}.pem and {kid}.next.pem)")
            key = _read_private_key(path)
            public[kid] = key.public_key()
            if not upcoming:
                signing[kid] = key
        if not signing:
            raise KeyRingError(f"no signing key (<kid>.pem) in {self.directory}")
        kid = max(signing)
        self._keys = _Keys(signing_kid=kid, signing_key=signing[kid], public=public)

    def _loaded(self) -> _Keys:
        if self._keys is None:
            raise KeyRingError("the key ring is not loaded")
        return self._keys

    @property
    def signing_kid(self) -> str:
        return self._loaded().signing_kid

    @property
    def kids(self) -> list[str]:
        """Every published key id, in name order."""
        return sorted(self._loaded().public)

    def signing_key(self) -> tuple[str, Ed25519PrivateKey]:
        keys = self._loaded()
        return keys.signing_kid, keys.signing_key

    def jwks(self) -> Jwks:
        """The public keys as a JWKS (RFC 7517): OKP/Ed25519 with their kid; no private part."""
        return {"keys": [_public_jwk(kid, key) for kid, key in sorted(self._loaded().public.items())]}

    @staticmethod
    def generate(directory: Path, *, upcoming: bool = False, kid: str | None = None) -> str:
        """Writes a new Ed25519 key into the directory (made 0700 if missing), mode 0600.

        Args:
            directory: the key directory.
            upcoming: write `<kid>.next.pem` (published, not signing).
            kid: the key id; by default the UTC time and 8 random hex digits,
                so that name order is creation order.

        Returns:
            The new key's id.
        """
        kid = kid or f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}"
        if not _KID.match(kid):
            raise KeyRingError(f"key ids are 1-64 letters, digits, '-' or '_'; got {kid[:80]!r}")
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if (directory / f"{kid}.pem").exists() or (directory / f"{kid}{_NEXT_SUFFIX}").exists():
            raise KeyRingError(f"key {kid} exists already")
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        target = directory / (f"{kid}{_NEXT_SUFFIX}" if upcoming else f"{kid}.pem")
        # Written under a temporary name and renamed: a reader (a reload)
        # never sees half a key, and the file is never readable by others.
        scratch = directory / f".{kid}.{secrets.token_hex(4)}.tmp"
        descriptor = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "wb") as out:
                out.write(pem)
                out.flush()
                os.fsync(out.fileno())
            os.replace(scratch, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                scratch.unlink()
            raise
        return kid


def _read_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as error:
        raise KeyRingError(f"cannot read {path}: {error.strerror}") from None
    if mode & 0o077:
        logger.warning(
            "signing key %s is readable by other users (mode %o); make it 0600", path, mode & 0o777
        )
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise KeyRingError(f"{path} is not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyRingError(f"{path} is not an Ed25519 key")
    return key


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _public_jwk(kid: str, key: Ed25519PublicKey) -> dict[str, str]:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return {"kty": "OKP", "crv": "Ed25519", "x": _b64url(raw), "kid": kid, "alg": ALGORITHM, "use": "sig"}


def public_keys(jwks: Mapping[str, Any]) -> dict[str, Ed25519PublicKey]:
    """The Ed25519 signing keys of a JWKS by kid; other keys are skipped."""
    found: dict[str, Ed25519PublicKey] = {}
    keys = jwks.get("keys")
    if not isinstance(keys, list):
        return found
    for entry in keys:
        if not isinstance(entry, Mapping):
            continue
        kid, x = entry.get("kid"), entry.get("x")
        if entry.get("kty") != "OKP" or entry.get("crv") != "Ed25519":
            continue
        if entry.get("use", "sig") != "sig" or entry.get("alg", ALGORITHM) != ALGORITHM:
            continue
        if not isinstance(kid, str) or not isinstance(x, str):
            continue
        try:
            raw = base64.urlsafe_b64decode(x + "=" * (-len(x) % 4))
            found[kid] = Ed25519PublicKey.from_public_bytes(raw)
        except (ValueError, binascii.Error):
            logger.warning("skipping malformed key %r in the JWKS", kid[:64])
    return found


# -- signing ---------------------------------------------------------------------------


def sign(
    claims: AccessClaims,
    keyring: KeyRing,
    *,
    lifetime: timedelta = DEFAULT_LIFETIME,
    now: datetime | None = None,
) -> str:
    """Signs the claims with the key ring's signing key (EdDSA, its kid in the header).

    Claims without issued_at, expires_at or token_id get them (now, now +
    lifetime, a random id); use `claims.stamped(...)` first to know them.
    """
    claims = claims.stamped(now=now, lifetime=lifetime)
    assert claims.issued_at is not None and claims.expires_at is not None
    payload: dict[str, Any] = {
        "iss": ISSUER,
        "aud": AUDIENCE,
        "sub": claims.subject,
        "kind": claims.kind.value,
        "roles": list(claims.roles),
        "scope": claims.scope.value,
        "iat": int(claims.issued_at.timestamp()),
        "exp": int(claims.expires_at.timestamp()),
        "jti": claims.token_id,
    }
    if claims.workspace_id is not None:
        payload["ws"] = str(claims.workspace_id)
    if claims.host is not None:
        payload["host"] = claims.host
    if claims.personal_token_id is not None:
        payload["pat"] = str(claims.personal_token_id)
    kid, key = keyring.signing_key()
    return jwt.encode(payload, key, algorithm=ALGORITHM, headers={"kid": kid})


# -- verifying -------------------------------------------------------------------------


class Verifier:
    """Verifies access tokens against public keys from a JWKS source.

    Args:
        source: returns the current JWKS (e.g. `AuthService.GetSigningKeys`).
        refetch_seconds: an unknown kid makes it fetch again at most this often.
        max_age_seconds: keys older than this are fetched again before the
            next verification (a failed fetch keeps the old ones); 0: never.
        leeway_seconds: clock skew allowed on exp and iat.
        clock: seconds since the epoch (time.time), replaceable in tests.
        remembered: how many verified tokens are kept. A client sends the
            same token for its whole lifetime, and checking a signature (with
            PyJWT's parsing) costs about 0.4 ms of CPU per call, most of a
            small RPC; a token seen before is taken again without it, but only
            the very same string, only while the key that verified it is
            still the one published under its kid, and its times are checked
            every time.
    """

    def __init__(
        self,
        source: JwksSource,
        *,
        refetch_seconds: float = 30.0,
        max_age_seconds: float = 600.0,
        leeway_seconds: float = DEFAULT_LEEWAY_SECONDS,
        clock: Callable[[], float] = time.time,
        remembered: int = 10_000,
    ) -> None:
        self._remembered = remembered
        # token -> (its kid, the key that verified it, its payload, its claims)
        self._verified: OrderedDict[str, tuple[str, Ed25519PublicKey, Mapping[str, Any], AccessClaims]] = (
            OrderedDict()
        )
        self._source = source
        self._refetch = refetch_seconds
        self._max_age = max_age_seconds
        self._leeway = leeway_seconds
        self._clock = clock
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._fetched_at: float | None = None
        self._lock = asyncio.Lock()
        self.fetches = 0

    async def verify(self, token: str) -> AccessClaims:
        """The token's claims if it is genuine and valid now.

        Raises:
            Unauthenticated: malformed, not EdDSA, unknown key, bad
                signature, wrong issuer or audience, expired.
            Unavailable: the keys were never fetched and cannot be now.
        """
        if not token or len(token) > 8192:
            raise Unauthenticated("the access token is malformed")
        seen = self._verified.get(token)
        if seen is not None:
            seen_kid, verified_with, seen_payload, seen_claims = seen
            if await self._key(seen_kid) is verified_with:
                self._check_times(seen_payload)
                return seen_claims
            del self._verified[token]
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise Unauthenticated("the access token is malformed") from None
        algorithm = header.get("alg")
        if algorithm != ALGORITHM:
            shown = algorithm if isinstance(algorithm, str) and len(algorithm) <= 16 else "another algorithm"
            raise Unauthenticated(f"the access token is signed with {shown!r}; only {ALGORITHM} is accepted")
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise Unauthenticated("the access token names no signing key (kid)")
        key = await self._key(kid)
        try:
            # Times are checked below against this verifier's clock.
            payload = jwt.decode(
                token,
                key,
                algorithms=[ALGORITHM],
                audience=AUDIENCE,
                issuer=ISSUER,
                options={
                    "require": ["iss", "aud", "sub", "exp", "iat", "jti"],
                    "verify_exp": False,
                    "verify_iat": False,
                    "verify_nbf": False,
                },
            )
        except jwt.InvalidSignatureError:
            raise Unauthenticated("the access token's signature is invalid") from None
        except jwt.InvalidAudienceError:
            raise Unauthenticated("the access token is not meant for this system (audience)") from None
        except jwt.InvalidIssuerError:
            raise Unauthenticated("the access token was not issued by this system (issuer)") from None
        except jwt.PyJWTError:
            raise Unauthenticated("the access token is malformed") from None
        self._check_times(payload)
        claims = _claims(payload)
        if self._remembered > 0:
            if len(self._verified) >= self._remembered:
                self._verified.popitem(last=False)
            self._verified[token] = (kid, key, payload, claims)
        return claims

    def _check_times(self, payload: Mapping[str, Any]) -> None:
        now = self._clock()
        try:
            expires, issued = float(payload["exp"]), float(payload["iat"])
            starts = float(payload.get("nbf", issued))
        except (KeyError, TypeError, ValueError):
            raise Unauthenticated("the access token's claims are malformed") from None
        if expires <= now - self._leeway:
            raise Unauthenticated("the access token has expired")
        if issued > now + self._leeway or starts > now + self._leeway:
            raise Unauthenticated("the access token is not valid yet")

    async def _key(self, kid: str) -> Ed25519PublicKey:
        now = self._clock()
        stale = self._fetched_at is None or (self._max_age > 0 and now - self._fetched_at >= self._max_age)
        if stale or (kid not in self._keys and now - (self._fetched_at or 0.0) >= self._refetch):
            await self._fetch(required=self._fetched_at is None)
        key = self._keys.get(kid)
        if key is None:
            raise Unauthenticated("the access token is signed with an unknown key")
        return key

    async def _fetch(self, *, required: bool) -> None:
        started = self._fetched_at
        async with self._lock:
            if self._fetched_at != started:
                return  # another caller fetched meanwhile
            try:
                jwks = await self._source()
            except Exception as error:
                if required:
                    raise Unavailable("the signing keys cannot be fetched now; try again") from error
                # The keys we have still verify what they verified before.
                logger.warning("could not refresh the signing keys (%s); keeping the old ones", error)
                self._fetched_at = self._clock()
                return
            self._keys = public_keys(jwks)
            self._fetched_at = self._clock()
            self.fetches += 1


def _uuid(value: Any) -> uuid.UUID | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError("not a string")
    return uuid.UUID(value)


def _optional_text(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError("not a string")
    return value


def _claims(payload: Mapping[str, Any]) -> AccessClaims:
    try:
        kind = PrincipalKind(str(payload.get("kind")))
        subject = payload["sub"]
        if not isinstance(subject, str):
            raise ValueError("sub")
        roles = payload.get("roles", [])
        if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
            raise ValueError("roles")
        service = None
        member_id = None
        if kind is PrincipalKind.SERVICE:
            if not subject.startswith(SERVICE_SUBJECT_PREFIX):
                raise ValueError("sub")
            service = subject[len(SERVICE_SUBJECT_PREFIX) :]
        else:
            member_id = uuid.UUID(subject)
        return AccessClaims(
            kind=kind,
            member_id=member_id,
            workspace_id=_uuid(payload.get("ws")),
            roles=tuple(roles),
            scope=Scope(str(payload.get("scope"))),
            host=_optional_text(payload.get("host")),
            service=service,
            issued_at=datetime.fromtimestamp(int(payload["iat"]), UTC),
            expires_at=datetime.fromtimestamp(int(payload["exp"]), UTC),
            token_id=str(payload["jti"]),
            personal_token_id=_uuid(payload.get("pat")),
        )
    except (KeyError, ValueError, TypeError, OverflowError):
        raise Unauthenticated("the access token's claims are malformed") from None


def keyring_source(keyring: KeyRing) -> JwksSource:
    """A JWKS source reading a key ring of this process (it follows the ring's reloads)."""

    async def source() -> Mapping[str, Any]:
        return keyring.jwks()

    return source
