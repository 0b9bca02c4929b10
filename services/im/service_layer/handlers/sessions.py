"""Signing in with a password, sessions (refreshing, signing out), changing
the password, and the keys access tokens are checked with.

Passwords are hashed and checked (slowly, off the event loop) outside any
transaction, so that no transaction waits on argon2.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import datetime

from services.common import audit
from services.im.domain import access, rules
from services.im.domain.accounts import Account, IssuedTokens
from services.im.domain.commands import ChangePassword, RefreshTokens, SignIn, SignOut
from services.im.domain.errors import InvalidRequest, TooManyAttempts, Unauthenticated, WrongState
from services.im.service_layer.handlers.auth_deps import (
    WRONG_LOGIN,
    AuthDeps,
    authority,
    caller_record,
    calling_member,
    count_attempts,
    member_record,
    new_session,
    record_refusal,
    session_tokens,
    too_many,
)

logger = logging.getLogger(__name__)

BAD_REFRESH = "the refresh token is not valid; sign in again"
# Which workspaces hold a login is never told: one message for every case.
WORKSPACE_REQUIRED = "this login needs its workspace: give the workspace id (workspace_id) as well"


def signing_keys(auth: AuthDeps) -> list[dict[str, str]]:
    """The published public keys (JWKS entries)."""
    keys: list[dict[str, str]] = auth.keys.jwks()["keys"]
    return keys


# -- signing in ---------------------------------------------------------------------


async def sign_in(auth: AuthDeps, command: SignIn) -> IssuedTokens:
    """Tokens for the account with the login and password: in the workspace, or
    (without one) the one account in any workspace that the password fits.

    Raises:
        Unauthenticated: the login or password is wrong (one message for both).
        TooManyAttempts: too many attempts for the login lately.
        WrongState: no workspace, and the password fits accounts of several
            workspaces (or more workspaces hold the login than are checked).
    """
    password = command.password
    workspace = rules.parse_id(command.workspace_id, "workspace_id") if command.workspace_id else None
    try:
        key = access.normalize_login(command.login)
    except InvalidRequest:
        raise Unauthenticated(WRONG_LOGIN) from None  # no such login can exist
    if not password or len(password) > access.MAX_PASSWORD_CHARS:
        raise Unauthenticated(WRONG_LOGIN)
    now = auth.clock()
    candidates: list[Account] = []
    try:
        candidates = await _throttled_candidates(auth, workspace, key)
        if len(candidates) > auth.limits.sign_in_max_workspaces:
            raise WrongState(WORKSPACE_REQUIRED)
        checked = [a for a in candidates if a.password_hash is not None]
        if not checked:
            await auth.passwords.waste_time(password)
            raise Unauthenticated(WRONG_LOGIN)
        fits = await asyncio.gather(
            *(auth.passwords.verify(a.password_hash or "", password) for a in checked)
        )
        matched = [a for a, fit in zip(checked, fits, strict=True) if fit]
        if not matched:
            raise Unauthenticated(WRONG_LOGIN)
        if len(matched) > 1:
            raise WrongState(WORKSPACE_REQUIRED)
    except (TooManyAttempts, Unauthenticated) as error:
        # In the workspace named, if it exists (anyone may name any id),
        # or in each workspace that holds the login.
        named = [workspace] if workspace is not None else []
        for place in named or sorted({a.workspace_id for a in candidates}):
            await _record_sign_in_refusal(auth, place, key, now, error, known=not named)
        raise
    account = matched[0]
    async with auth.uow() as tx:
        member = await tx.get_member(account.member_id)
        if member is None:
            raise Unauthenticated(WRONG_LOGIN)
        # This account's count, and the count of the login in any workspace
        # (never another workspace's account: its count is its own).
        await tx.clear_sign_in_attempts(account.workspace_id, key)
        if workspace is None:
            await tx.clear_sign_in_attempts(access.ANY_WORKSPACE, key)
        session = await new_session(auth, tx, member)
        await tx.add_audit(member_record(auth, member, "SignIn", details={"login": key}))
        await tx.commit()
    return session_tokens(auth, member, session)


async def _record_sign_in_refusal(
    auth: AuthDeps,
    workspace: uuid.UUID,
    key: str,
    at: datetime,
    error: TooManyAttempts | Unauthenticated,
    *,
    known: bool,
) -> None:
    if not known:
        async with auth.uow(write=False) as tx:
            if await tx.get_workspace(workspace) is None:
                return
    await record_refusal(
        auth, error, action="SignIn", target=audit.Target("login", key), workspace_id=workspace, at=at
    )


async def _throttled_candidates(auth: AuthDeps, workspace: uuid.UUID | None, key: str) -> list[Account]:
    """The accounts a sign-in may be for, its attempt counted; TooManyAttempts if refused.

    Without a workspace: every account with the login (more than
    `sign_in_max_workspaces` only to say so), less those under attack.
    """
    now = auth.clock()
    most = auth.limits.sign_in_max_workspaces
    async with auth.uow() as tx:
        if workspace is not None:
            found = await tx.find_account(workspace, key)
            candidates = [found] if found is not None else []
            counted = [workspace]
        else:
            candidates = await tx.find_accounts_by_login(key, limit=most + 1)
            # Each account's own count too: going without the workspace is
            # no way around the limit of guesses at one account.
            counted = [access.ANY_WORKSPACE, *(a.workspace_id for a in candidates[:most])]
        waits = await count_attempts(auth, tx, counted, key, now)
        await tx.commit()
    # The login's own count (of this workspace, or of any) refuses all; an
    # account of one workspace under attack drops out only itself (whoever
    # holds the login elsewhere, say in a workspace of the attacker's own,
    # cannot lock everyone else out).
    refused = waits[0]
    if refused is None and workspace is None and len(candidates) <= most:
        open_accounts = [a for a, w in zip(candidates, waits[1:], strict=True) if w is None]
        if candidates and not open_accounts:
            refused = max(w for w in waits[1:] if w is not None)
        candidates = open_accounts
    if refused is not None:
        logger.info("a sign-in was refused: too many attempts for one login")
        raise too_many("sign-in attempts for this login", refused)
    return candidates


# -- sessions -----------------------------------------------------------------------


async def refresh_tokens(auth: AuthDeps, command: RefreshTokens) -> IssuedTokens:
    """The next refresh token of the session and a new access token; a token
    used twice signs its whole session out (one of the copies is a thief's)."""
    if not access.plausible_secret(command.refresh_token, access.REFRESH_TOKEN_PREFIX):
        raise Unauthenticated(BAD_REFRESH)
    now = auth.now()
    async with auth.uow() as tx:
        found = await tx.find_refresh_token(access.secret_hash(command.refresh_token))
        if found is None or found.revoked_at is not None or found.expires_at <= now:
            raise Unauthenticated(BAD_REFRESH)
        if found.used_at is not None or not await tx.use_refresh_token(found.id, now):
            # Used before: this copy or the other is a thief's. End the session for both.
            await tx.revoke_refresh_family(found.family_id, now)
            await tx.commit()
            logger.warning(
                "a refresh token of member %s was used twice: its session is signed out", found.member_id
            )
            raise Unauthenticated(
                "this refresh token was used already, so its session has been signed out; sign in again"
            )
        member = await tx.get_member(found.member_id)
        if member is None:
            raise Unauthenticated(BAD_REFRESH)
        session = await new_session(auth, tx, member, family_id=found.family_id)
        await tx.commit()
    return session_tokens(auth, member, session)


async def sign_out(auth: AuthDeps, command: SignOut) -> None:
    """Ends the token's session; says nothing about tokens it does not know."""
    if not access.plausible_secret(command.refresh_token, access.REFRESH_TOKEN_PREFIX):
        return
    async with auth.uow() as tx:
        found = await tx.find_refresh_token(access.secret_hash(command.refresh_token))
        if found is None:
            return
        await tx.revoke_refresh_family(found.family_id, auth.now())
        member = await tx.get_member(found.member_id)
        if member is not None:
            await tx.add_audit(member_record(auth, member, "SignOut"))
        await tx.commit()


async def change_password(auth: AuthDeps, command: ChangePassword) -> IssuedTokens:
    """Sets a new password (the old one proves the caller), signs out every
    session of the member and gives a new one."""
    caller = command.caller
    allowed = authority(caller)
    access.check_password(command.new_password, auth.limits, field="new_password")
    async with auth.uow(write=False) as tx:
        member = await calling_member(tx, caller)
        access.require_session(allowed, "change the password")
        access.require_write(allowed, "change the password")
        account = await tx.get_account(member.id)
    if account is None or account.password_hash is None or account.login is None:
        raise WrongState(
            "this member has no password (it signs in with the organisation's provider, or not at all)"
        )
    # Guessing the old password is throttled like signing in.
    async with auth.uow() as tx:
        [wait] = await count_attempts(auth, tx, [account.workspace_id], account.login, auth.clock())
        await tx.commit()
    if wait is not None:
        raise too_many("attempts", wait)
    if len(command.old_password) > access.MAX_PASSWORD_CHARS or not await auth.passwords.verify(
        account.password_hash, command.old_password
    ):
        raise Unauthenticated("old_password is wrong")
    password_hash = await auth.passwords.hash(command.new_password)
    async with auth.uow() as tx:
        await tx.set_password(member.id, password_hash, auth.now())
        await tx.revoke_refresh_tokens_of(member.id, auth.now())
        await tx.clear_sign_in_attempts(account.workspace_id, account.login)
        session = await new_session(auth, tx, member)
        await tx.add_audit(
            caller_record(auth, caller, member, "ChangePassword", audit.Target("member", str(member.id)))
        )
        await tx.commit()
    return session_tokens(auth, member, session)
