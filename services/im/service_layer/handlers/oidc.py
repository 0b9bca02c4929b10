"""Signing in with the organisation's OpenID Connect provider.

The gateway runs the authorization code flow (it is the relying party) and
hands the IM the ID token with the nonce it sent. The IM believes none of
it until it has checked the token itself (`IdTokenVerifier`: the signature
against the provider's published keys, then `domain.oidc.check_claims`),
and spends the nonce, so that a token is good for one sign-in only. The
verified email then picks the member (`OidcAccess`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import jwt
from uuid_utils.compat import uuid7

from services.common import audit
from services.common.identity import Caller
from services.common.tokens import KeyRing
from services.im.domain import access, rules
from services.im.domain.accounts import Account, Invite, IssuedTokens
from services.im.domain.errors import (
    AlreadyTaken,
    InvalidRequest,
    NotAllowed,
    ProviderUnavailable,
    Unauthenticated,
    WrongState,
)
from services.im.domain.model import Member, MemberKind
from services.im.domain.oidc import (
    IdTokenRules,
    VerifiedIdentity,
    check_claims,
    check_nonce_format,
    member_name,
)
from services.im.service_layer.auth_ports import EmailTaken, Passwords, ProviderKeys
from services.im.service_layer.handlers.auth import MemberQuota
from services.im.service_layer.handlers.auth_common import AuthBase, Clock
from services.im.service_layer.handlers.deps import utc_now
from services.im.service_layer.ports import Transaction, UnitOfWorkFactory

logger = logging.getLogger(__name__)

# Asymmetric algorithms only: with HS256 the client secret (which the
# gateway holds) would sign tokens, and "none" signs nothing.
ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
MAX_ID_TOKEN_CHARS = 16384
NO_MEMBER = "no member of this workspace has this email; ask an admin for an invite"
WORKSPACE_REQUIRED = (
    "members of more than one workspace have this email: choose the workspace (workspace_id)"
    " and sign in again"
)
NOT_CONFIGURED = "signing in with an OpenID Connect provider is not configured here (OIDC_ISSUER)"
REPLAYED = "this sign-in has been used already (an ID token works once); sign in again"


class IdTokenVerifier:
    """Checks ID tokens of one provider: signature, then claims.

    Args:
        keys: the provider's JWKS.
        rules: the issuer, client id and times a token must match.
        refetch_seconds: a key id it does not know makes it fetch the keys
            again, at most this often (the provider may have rotated them).
        max_age_seconds: keys older than this are fetched again first.
        clock: current time, replaceable in tests.
    """

    def __init__(
        self,
        keys: ProviderKeys,
        rules: IdTokenRules,
        *,
        refetch_seconds: float = 10.0,
        max_age_seconds: float = 3600.0,
        clock: Clock = utc_now,
    ) -> None:
        self._source = keys
        self.rules = rules
        self._refetch = timedelta(seconds=refetch_seconds)
        self._max_age = timedelta(seconds=max_age_seconds)
        self._clock = clock
        self._keys: list[Mapping[str, Any]] = []
        self._fetched_at: datetime | None = None
        self._lock = asyncio.Lock()
        self.fetches = 0

    async def verify(self, id_token: str, nonce: str) -> VerifiedIdentity:
        """Who the token proves signed in, for the sign-in that sent `nonce`.

        Raises:
            InvalidRequest: no token or no nonce.
            Unauthenticated: malformed, a refused algorithm, an unknown key,
                a bad signature, or a claim that fails (domain.oidc).
            NotAllowed: genuine, but without a verified email.
            ProviderUnavailable: the keys were never fetched and cannot be now.
        """
        if not id_token:
            raise InvalidRequest("id_token is required")
        check_nonce_format(nonce)
        if len(id_token) > MAX_ID_TOKEN_CHARS:
            raise Unauthenticated("the ID token is malformed (too long)")
        try:
            header = jwt.get_unverified_header(id_token)
        except jwt.PyJWTError:
            raise Unauthenticated("the ID token is malformed") from None
        algorithm = header.get("alg")
        if algorithm not in ALGORITHMS:
            shown = algorithm if isinstance(algorithm, str) and len(algorithm) <= 16 else "another algorithm"
            raise Unauthenticated(
                f"the ID token is signed with {shown!r}; only {', '.join(sorted(ALGORITHMS))} are accepted"
            )
        kid = header.get("kid")
        jwk = await self._key(kid if isinstance(kid, str) and kid else None)
        if jwk.get("alg") not in (None, algorithm):
            raise Unauthenticated("the ID token's algorithm is not the one its key is published for")
        try:
            key = jwt.PyJWK(dict(jwk), algorithm=algorithm)
        except jwt.PyJWTError:
            raise Unauthenticated(f"the provider's key for this ID token cannot verify {algorithm}") from None
        try:
            # Only the signature here: domain.oidc checks every claim, with its own messages.
            payload = jwt.decode(
                id_token,
                key,
                algorithms=[algorithm],
                options={
                    "verify_signature": True,
                    "verify_exp": False,
                    "verify_iat": False,
                    "verify_nbf": False,
                    "verify_aud": False,
                    "verify_iss": False,
                    "require": [],
                },
            )
        except jwt.InvalidSignatureError:
            raise Unauthenticated("the ID token's signature is invalid") from None
        except jwt.PyJWTError:
            raise Unauthenticated("the ID token is malformed") from None
        return check_claims(payload, nonce=nonce, rules=self.rules, now=self._clock())

    async def _key(self, kid: str | None) -> Mapping[str, Any]:
        now = self._clock()
        fetched = self._fetched_at
        if (
            fetched is None
            or now - fetched >= self._max_age
            or (self._find(kid) is None and now - fetched >= self._refetch)
        ):
            await self._fetch(required=fetched is None)
        found = self._find(kid)
        if found is None:
            if kid is None:
                raise Unauthenticated("the ID token names no key (kid) and the provider publishes several")
            raise Unauthenticated("the ID token is signed with a key the provider does not publish")
        return found

    def _find(self, kid: str | None) -> Mapping[str, Any] | None:
        if kid is None:
            return self._keys[0] if len(self._keys) == 1 else None
        return next((k for k in self._keys if k.get("kid") == kid), None)

    async def _fetch(self, *, required: bool) -> None:
        started = self._fetched_at
        async with self._lock:
            if self._fetched_at != started:
                return  # fetched by another sign-in meanwhile
            try:
                jwks = await self._source.fetch()
            except ProviderUnavailable:
                if required:
                    raise
                logger.warning("could not refresh the OpenID provider's keys; keeping the old ones")
                self._fetched_at = self._clock()
                return
            keys = jwks.get("keys")
            if not isinstance(keys, list):
                keys = []
            # Keys for encryption, or of no known type, verify nothing.
            self._keys = [
                k for k in keys if isinstance(k, dict) and k.get("use", "sig") == "sig" and "kty" in k
            ]
            self._fetched_at = self._clock()
            self.fetches += 1


class OidcAccess(AuthBase):
    """Signing in, joining with an invite, and linking an account, through the provider.

    Args:
        verifier: checks the provider's ID tokens; None when OpenID Connect
            is not configured (every call is then FAILED_PRECONDITION).
        (the rest as `AuthBase`)
    """

    def __init__(
        self,
        *,
        verifier: IdTokenVerifier | None,
        uow: UnitOfWorkFactory,
        keys: KeyRing,
        passwords: Passwords,
        limits: access.AuthLimits | None = None,
        clock: Clock = utc_now,
        audit_log: audit.AuditLog | None = None,
        audit_settings: audit.AuditSettings | None = None,
        member_quota: MemberQuota | None = None,
    ) -> None:
        super().__init__(
            uow=uow,
            keys=keys,
            passwords=passwords,
            limits=limits,
            clock=clock,
            audit_log=audit_log,
            audit_settings=audit_settings,
        )
        self._verifier = verifier
        self._member_quota = member_quota

    @property
    def configured(self) -> bool:
        return self._verifier is not None

    async def _verified(self, id_token: str, nonce: str) -> VerifiedIdentity:
        """The token's identity, its nonce spent (a second use is refused)."""
        if self._verifier is None:
            raise WrongState(NOT_CONFIGURED)
        identity = await self._verifier.verify(id_token, nonce)
        async with self._uow() as tx:
            fresh = await tx.use_oidc_nonce(
                access.secret_hash(nonce), keep_until=identity.usable_until, now=self._clock()
            )
            await tx.commit()
        if not fresh:
            logger.warning("an ID token was presented again: refused")
            raise Unauthenticated(REPLAYED)
        return identity

    async def sign_in(
        self, *, id_token: str, nonce: str, workspace_id: str, invite: str, display_name: str
    ) -> tuple[IssuedTokens, bool]:
        """Tokens of the member the token's email belongs to (made from the invite
        if there is none), and whether the member was made now."""
        workspace = rules.parse_id(workspace_id, "workspace_id") if workspace_id else None
        rules.check_name(display_name, "display_name", required=False)
        if invite and not access.plausible_secret(invite, access.INVITE_PREFIX):
            raise Unauthenticated("the invite is not valid")
        identity = await self._verified(id_token, nonce)
        found: Invite | None = None
        if invite:
            async with self._uow(write=False) as tx:
                found = await tx.find_invite(access.secret_hash(invite))
            if found is None:
                raise Unauthenticated("the invite is not valid")
            if workspace is not None and workspace != found.workspace_id:
                raise InvalidRequest("the invite is for another workspace than workspace_id")
            workspace = found.workspace_id
        async with self._uow() as tx:
            accounts = await tx.find_accounts_by_email(identity.email, workspace_id=workspace, limit=2)
            if len(accounts) > 1:
                raise WrongState(WORKSPACE_REQUIRED)
            if accounts:
                member = await tx.get_member(accounts[0].member_id)
                if member is None:
                    raise NotAllowed(NO_MEMBER)
                secret, refresh = await self._new_session(tx, member)
                await tx.add_audit(
                    self._member_action(member, "SignInWithOidc", details={"email": identity.email})
                )
                await tx.commit()
                logger.info("member %s signed in with the OpenID provider", member.id)
                return self._tokens(member, secret, refresh), False
            if found is None:
                raise NotAllowed(NO_MEMBER)
            member = await self._join(tx, found, identity, display_name)
            secret, refresh = await self._new_session(tx, member)
            await tx.add_audit(
                self._member_action(
                    member,
                    "SignInWithOidc",
                    target=audit.Target("invite", str(found.id)),
                    details={"member_id": str(member.id), "role": member.role.value, "email": identity.email},
                )
            )
            await tx.commit()
        logger.info("member %s joined workspace %s with the OpenID provider", member.id, member.workspace_id)
        return self._tokens(member, secret, refresh), True

    async def _join(
        self, tx: Transaction, invite: Invite, identity: VerifiedIdentity, display_name: str
    ) -> Member:
        if invite.used_at is not None:
            raise WrongState("the invite has been used already")
        if invite.expires_at <= self._clock():
            raise WrongState("the invite has expired")
        if invite.email is not None and invite.email != identity.email:
            raise NotAllowed(
                f"this invite is for another email address; your organisation says you are {identity.email}"
            )
        now = self._now()
        member = Member(
            id=uuid7(),
            workspace_id=invite.workspace_id,
            kind=MemberKind.HUMAN,
            display_name=rules.check_name(member_name(identity, display_name), "display_name", required=True),
            avatar="",
            created_at=now,
            role=invite.role,
        )
        if self._member_quota is not None:
            await self._member_quota(tx, member.workspace_id, MemberKind.HUMAN)
        if not await tx.use_invite(invite.id, member.id, now):
            raise WrongState("the invite has been used already")
        await tx.add_member(member)
        try:
            await tx.add_account(
                Account(
                    member_id=member.id,
                    workspace_id=member.workspace_id,
                    login=None,
                    password_hash=None,
                    created_at=now,
                    password_changed_at=now,
                    email=identity.email,
                )
            )
        except EmailTaken:
            # Joined meanwhile through another sign-in: that one made the member.
            raise AlreadyTaken("a member of this workspace has this email already; sign in again") from None
        return member

    async def link(self, caller: Caller | None, *, id_token: str, nonce: str) -> tuple[Member, str]:
        """Gives the caller's account the token's verified email; the member and the email."""
        authority = self._authority(caller)
        async with self._uow(write=False) as tx:
            member = await self._member(tx, caller)
        access.require_session(authority, "link an organisation account")
        access.require_write(authority, "link an organisation account")
        if member.kind is not MemberKind.HUMAN:
            raise NotAllowed("only a person links an organisation account")
        identity = await self._verified(id_token, nonce)
        async with self._uow() as tx:
            account = await tx.get_account(member.id)
            try:
                if account is None:
                    # A person made before accounts existed: an account with the email only.
                    now = self._now()
                    await tx.add_account(
                        Account(
                            member_id=member.id,
                            workspace_id=member.workspace_id,
                            login=None,
                            password_hash=None,
                            created_at=now,
                            password_changed_at=now,
                            email=identity.email,
                        )
                    )
                elif account.email != identity.email:
                    await tx.set_account_email(member.id, identity.email)
            except EmailTaken:
                raise AlreadyTaken(
                    f"another member of this workspace has the email {identity.email} already"
                ) from None
            await tx.add_audit(
                self._action(
                    caller,
                    member,
                    "LinkOidcAccount",
                    audit.Target("member", str(member.id)),
                    details={"email": identity.email},
                )
            )
            await tx.commit()
        logger.info("member %s linked an account of the OpenID provider", member.id)
        return member, identity.email
