"""Signing in with the organisation's OpenID Connect provider.

The gateway runs the authorization code flow (it is the relying party) and
hands the IM the ID token with the nonce it sent. The IM believes none of
it until it has checked the token itself (`AuthDeps.id_tokens`: the
signature against the provider's published keys, then every claim), and
spends the nonce, so that a token is good for one sign-in only. The
verified email then picks the member.
"""

from __future__ import annotations

import logging

from services.common import audit
from services.im.domain import access, rules
from services.im.domain.accounts import Invite, IssuedTokens
from services.im.domain.commands import LinkOidcAccount, SignInWithOidc
from services.im.domain.errors import (
    AlreadyTaken,
    InvalidRequest,
    NotAllowed,
    Unauthenticated,
    WrongState,
)
from services.im.domain.model import Member, MemberKind
from services.im.domain.oidc import VerifiedIdentity, member_name
from services.im.service_layer.auth_ports import EmailTaken
from services.im.service_layer.handlers.auth_deps import (
    AuthDeps,
    authority,
    caller_record,
    calling_member,
    check_usable,
    join,
    member_record,
    new_account,
    new_session,
    session_tokens,
)
from services.im.service_layer.handlers.invites import INVALID_INVITE

logger = logging.getLogger(__name__)

NO_MEMBER = "no member of this workspace has this email; ask an admin for an invite"
WORKSPACE_REQUIRED = (
    "members of more than one workspace have this email: choose the workspace (workspace_id)"
    " and sign in again"
)
NOT_CONFIGURED = "signing in with an OpenID Connect provider is not configured here (OIDC_ISSUER)"
REPLAYED = "this sign-in has been used already (an ID token works once); sign in again"


async def _verified(auth: AuthDeps, id_token: str, nonce: str) -> VerifiedIdentity:
    """The token's identity, its nonce spent (a second use is refused)."""
    if auth.id_tokens is None:
        raise WrongState(NOT_CONFIGURED)
    identity = await auth.id_tokens.verify(id_token, nonce)
    async with auth.uow() as tx:
        fresh = await tx.use_oidc_nonce(
            access.secret_hash(nonce), keep_until=identity.usable_until, now=auth.clock()
        )
        await tx.commit()
    if not fresh:
        logger.warning("an ID token was presented again: refused")
        raise Unauthenticated(REPLAYED)
    return identity


async def sign_in_with_oidc(auth: AuthDeps, command: SignInWithOidc) -> tuple[IssuedTokens, bool]:
    """Tokens of the member the token's email belongs to (made from the invite
    if there is none), and whether the member was made now."""
    invite, display_name = command.invite, command.display_name
    workspace = rules.parse_id(command.workspace_id, "workspace_id") if command.workspace_id else None
    rules.check_name(display_name, "display_name", required=False)
    if invite and not access.plausible_secret(invite, access.INVITE_PREFIX):
        raise Unauthenticated(INVALID_INVITE)
    identity = await _verified(auth, command.id_token, command.nonce)
    found: Invite | None = None
    if invite:
        async with auth.uow(write=False) as tx:
            found = await tx.find_invite(access.secret_hash(invite))
        if found is None:
            raise Unauthenticated(INVALID_INVITE)
        if workspace is not None and workspace != found.workspace_id:
            raise InvalidRequest("the invite is for another workspace than workspace_id")
        workspace = found.workspace_id
    async with auth.uow() as tx:
        accounts = await tx.find_accounts_by_email(identity.email, workspace_id=workspace, limit=2)
        if len(accounts) > 1:
            raise WrongState(WORKSPACE_REQUIRED)
        if accounts:
            member = await tx.get_member(accounts[0].member_id)
            if member is None:
                raise NotAllowed(NO_MEMBER)
            session = await new_session(auth, tx, member)
            await tx.add_audit(
                member_record(auth, member, "SignInWithOidc", details={"email": identity.email})
            )
            await tx.commit()
            logger.info("member %s signed in with the OpenID provider", member.id)
            return session_tokens(auth, member, session), False
        if found is None:
            raise NotAllowed(NO_MEMBER)
        check_usable(auth, found)
        if found.email is not None and found.email != identity.email:
            raise NotAllowed(
                f"this invite is for another email address; your organisation says you are {identity.email}"
            )
        try:
            member = await join(
                auth,
                tx,
                found,
                display_name=rules.check_name(
                    member_name(identity, display_name), "display_name", required=True
                ),
                email=identity.email,
            )
        except EmailTaken:
            # Joined meanwhile through another sign-in: that one made the member.
            raise AlreadyTaken("a member of this workspace has this email already; sign in again") from None
        session = await new_session(auth, tx, member)
        await tx.add_audit(
            member_record(
                auth,
                member,
                "SignInWithOidc",
                target=audit.Target("invite", str(found.id)),
                details={"member_id": str(member.id), "role": member.role.value, "email": identity.email},
            )
        )
        await tx.commit()
    logger.info("member %s joined workspace %s with the OpenID provider", member.id, member.workspace_id)
    return session_tokens(auth, member, session), True


async def link_oidc_account(auth: AuthDeps, command: LinkOidcAccount) -> tuple[Member, str]:
    """Gives the caller's account the token's verified email; the member and the email."""
    caller = command.caller
    allowed = authority(caller)
    async with auth.uow(write=False) as tx:
        member = await calling_member(tx, caller)
    access.require_session(allowed, "link an organisation account")
    access.require_write(allowed, "link an organisation account")
    if member.kind is not MemberKind.HUMAN:
        raise NotAllowed("only a person links an organisation account")
    identity = await _verified(auth, command.id_token, command.nonce)
    async with auth.uow() as tx:
        account = await tx.get_account(member.id)
        try:
            if account is None:
                # A person made before accounts existed: an account with the email only.
                await tx.add_account(new_account(member, auth.now(), email=identity.email))
            elif account.email != identity.email:
                await tx.set_account_email(member.id, identity.email)
        except EmailTaken:
            raise AlreadyTaken(
                f"another member of this workspace has the email {identity.email} already"
            ) from None
        await tx.add_audit(
            caller_record(
                auth,
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
