"""Invites: an owner or admin makes one, a person joins with it (here with a
login and password; through the OpenID provider in `oidc`).

An invite's secret is returned once and stored as a hash.
"""

from __future__ import annotations

from dataclasses import replace

from uuid_utils.compat import uuid7

from services.common import audit
from services.im.domain import access, rules
from services.im.domain.accounts import Invite, IssuedTokens
from services.im.domain.commands import AcceptInvite, CreateInvite
from services.im.domain.errors import AlreadyTaken, NotFound, Unauthenticated, WrongState
from services.im.domain.model import Role
from services.im.service_layer.auth_ports import LoginTaken
from services.im.service_layer.handlers.auth_deps import (
    AuthDeps,
    authority,
    caller_record,
    calling_member,
    check_usable,
    join,
    member_record,
    new_session,
    remember,
    replay,
    session_tokens,
    signed_in_again,
)

INVALID_INVITE = "the invite is not valid"


async def create_invite(auth: AuthDeps, command: CreateInvite) -> tuple[Invite, str]:
    """An invite (bound to an email, if one is given) and its secret (shown this once).

    An invite bound to an email is accepted only through the OpenID
    provider, by the person it verifies has that email. A retry with the
    same request_id gives the same invite with a new secret (the first
    response may have been lost).
    """
    caller, ttl = command.caller, command.ttl
    role = command.role or Role.MEMBER
    rid = rules.check_request_id(command.request_id)
    bound = access.normalize_email(command.email) if command.email else None
    if bound is not None and auth.id_tokens is None:
        raise WrongState(
            "an invite is bound to an email only where people sign in with an OpenID Connect provider"
            " (OIDC_ISSUER), which proves the email; leave email empty"
        )
    allowed = authority(caller)
    secret = access.new_secret(access.INVITE_PREFIX)
    async with auth.uow() as tx:
        member = await calling_member(tx, caller)
        access.require_write(allowed, "create invites")
        access.check_invite(member, role)
        now = auth.now()
        expires = access.invite_expiry(ttl, now, auth.limits)
        fingerprint = rules.request_fingerprint(
            op="create_invite",
            role=role.value,
            ttl=ttl.total_seconds() if ttl else None,
            **({"email": bound} if bound else {}),
        )
        existing = await replay(tx, member.id, rid, fingerprint)
        if existing is not None:
            invite = await tx.get_invite(existing)
            if invite is None:
                raise NotFound(f"invite {existing} not found")
            if invite.used_at is not None:
                raise WrongState("the invite this request_id created has been accepted already")
            await tx.replace_invite_secret(invite.id, access.secret_hash(secret))
            details = {"role": invite.role.value, "repeated": "a new link for the same request_id"}
            invite = replace(invite, secret_hash=access.secret_hash(secret))
        else:
            if bound is not None and await tx.find_accounts_by_email(
                bound, workspace_id=member.workspace_id, limit=1
            ):
                raise AlreadyTaken(f"a member of this workspace has the email {bound} already")
            invite = Invite(
                id=uuid7(),
                workspace_id=member.workspace_id,
                role=role,
                secret_hash=access.secret_hash(secret),
                created_by=member.id,
                created_at=now,
                expires_at=expires,
                email=bound,
            )
            await tx.add_invite(invite)
            await remember(tx, member.id, rid, fingerprint, invite.id)
            details = {"role": role.value, "expire_time": expires.isoformat()}
        await tx.add_audit(
            caller_record(
                auth,
                caller,
                member,
                "CreateInvite",
                audit.Target("invite", str(invite.id)),
                request_id=rid,
                details=details,
            )
        )
        await tx.commit()
    return invite, secret


async def accept_invite(auth: AuthDeps, command: AcceptInvite) -> IssuedTokens:
    """Joins the invite's workspace as a person with a login and password;
    signed in. A retry with the same request_id signs the new member in again."""
    display_name = rules.check_name(command.display_name, "display_name", required=True)
    key = access.normalize_login(command.login)
    rid = rules.check_request_id(command.request_id)
    if not access.plausible_secret(command.invite, access.INVITE_PREFIX):
        raise Unauthenticated(INVALID_INVITE)
    fingerprint = rules.request_fingerprint(op="accept_invite", login=key, name=display_name)
    async with auth.uow(write=False) as tx:
        found = await tx.find_invite(access.secret_hash(command.invite))
        if found is None:
            raise Unauthenticated(INVALID_INVITE)
        earlier = await replay(tx, found.id, rid, fingerprint)
        member = await tx.get_member(earlier) if earlier is not None else None
    if member is not None:
        return await signed_in_again(auth, member, command.password)
    check_usable(auth, found)
    if found.email is not None:
        # Only the provider proves who has the email: a password proves nothing of it.
        raise WrongState(f"this invite is for {found.email} only: join with your organisation's sign-in")
    access.check_password(command.password, auth.limits)
    password_hash = await auth.passwords.hash(command.password)
    async with auth.uow() as tx:
        try:
            member = await join(
                auth, tx, found, display_name=display_name, login=key, password_hash=password_hash
            )
        except LoginTaken:
            raise AlreadyTaken(f"the login {key!r} is taken in this workspace") from None
        await remember(tx, found.id, rid, fingerprint, member.id)
        session = await new_session(auth, tx, member)
        await tx.add_audit(
            member_record(
                auth,
                member,
                "AcceptInvite",
                target=audit.Target("invite", str(found.id)),
                request_id=rid,
                details={"member_id": str(member.id), "role": member.role.value, "login": key},
            )
        )
        await tx.commit()
    return session_tokens(auth, member, session)
