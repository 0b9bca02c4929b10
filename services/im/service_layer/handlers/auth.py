"""The IM's identity use cases: signing in and out, sessions, invites, roles.

Tokens for programs (personal access tokens, services, agents) are in
`services.im.service_layer.handlers.machine_access`; both build on
`auth_common.AuthBase`.

Secrets made here (refresh tokens, invites) are returned once and stored
as hashes; passwords are hashed (slowly, off the event loop) before any
transaction opens, so that no transaction waits on argon2.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Protocol

from uuid_utils.compat import uuid7

from services.common import audit
from services.common.identity import Caller
from services.common.status import status_name
from services.common.tokens import KeyRing
from services.im.domain import access, rules
from services.im.domain.accounts import Account, Invite, IssuedTokens, RefreshToken
from services.im.domain.commands import CreateWorkspace
from services.im.domain.errors import (
    AlreadyTaken,
    InvalidRequest,
    NotAllowed,
    NotFound,
    TooManyAttempts,
    Unauthenticated,
    WrongState,
)
from services.im.domain.model import Member, MemberKind, Role, Workspace
from services.im.service_layer.auth_ports import LoginTaken, Passwords
from services.im.service_layer.handlers.auth_common import WRONG_LOGIN, AuthBase, Clock
from services.im.service_layer.handlers.deps import CreationHook, utc_now
from services.im.service_layer.ports import Transaction, UnitOfWorkFactory

logger = logging.getLogger(__name__)

BAD_REFRESH = "the refresh token is not valid; sign in again"
# Which workspaces hold a login is never told: one message for every case.
WORKSPACE_REQUIRED = "this login needs its workspace: give the workspace id (workspace_id) as well"


class WorkspaceOpener(Protocol):
    """Creates a workspace with its owner: `workspaces.open_workspace`."""

    async def __call__(
        self,
        *,
        name: str,
        creator_display_name: str,
        creator_kind: MemberKind | None,
        creator_avatar: str,
        request_id: str,
        fingerprint_extra: Mapping[str, str] | None = None,
        within: CreationHook | None = None,
    ) -> tuple[Workspace, Member, bool]: ...


class MemberQuota(Protocol):
    """Refuses one more member over its workspace's quota: `members.check_member_quota`."""

    async def __call__(self, tx: Transaction, workspace_id: uuid.UUID, kind: MemberKind) -> None: ...


class AuthService(AuthBase):
    """Sign-in, sessions, passwords, workspace accounts, invites and roles.

    Args:
        open_workspace: `workspaces.open_workspace`, which creates a workspace
            with its owner (and runs a hook in that transaction).
        member_quota: `members.check_member_quota` (accepting an invite adds a person).
        oidc_configured: people may sign in with an OpenID Connect provider,
            so invites may be bound to an email (which only it proves).
        (the rest as `AuthBase`)
    """

    def __init__(
        self,
        *,
        open_workspace: WorkspaceOpener,
        uow: UnitOfWorkFactory,
        keys: KeyRing,
        passwords: Passwords,
        limits: access.AuthLimits | None = None,
        clock: Clock = utc_now,
        audit_log: audit.AuditLog | None = None,
        audit_settings: audit.AuditSettings | None = None,
        member_quota: MemberQuota | None = None,
        oidc_configured: bool = False,
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
        self._open_workspace = open_workspace
        self._member_quota = member_quota
        self._oidc_configured = oidc_configured

    def signing_keys(self) -> list[dict[str, str]]:
        """The published public keys (JWKS entries)."""
        keys: list[dict[str, str]] = self._keys.jwks()["keys"]
        return keys

    # -- signing in ---------------------------------------------------------------

    async def sign_in(self, *, workspace_id: str, login: str, password: str) -> IssuedTokens:
        """Tokens for the account with the login and password: in the workspace, or
        (without one) the one account in any workspace that the password fits.

        Raises:
            Unauthenticated: the login or password is wrong (one message for both).
            TooManyAttempts: too many attempts for the login lately.
            WrongState: no workspace, and the password fits accounts of several
                workspaces (or more workspaces hold the login than are checked).
        """
        workspace = rules.parse_id(workspace_id, "workspace_id") if workspace_id else None
        try:
            key = access.normalize_login(login)
        except InvalidRequest:
            raise Unauthenticated(WRONG_LOGIN) from None  # no such login can exist
        if not password or len(password) > access.MAX_PASSWORD_CHARS:
            raise Unauthenticated(WRONG_LOGIN)
        now = self._clock()
        candidates: list[Account] = []
        try:
            candidates = await self._throttled_candidates(workspace, key)
            if len(candidates) > self.limits.sign_in_max_workspaces:
                raise WrongState(WORKSPACE_REQUIRED)
            checked = [a for a in candidates if a.password_hash is not None]
            if not checked:
                await self._passwords.waste_time(password)
                raise Unauthenticated(WRONG_LOGIN)
            fits = await asyncio.gather(
                *(self._passwords.verify(a.password_hash or "", password) for a in checked)
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
                await self._record_sign_in_refusal(place, key, now, error, known=not named)
            raise
        account = matched[0]
        async with self._uow() as tx:
            member = await tx.get_member(account.member_id)
            if member is None:
                raise Unauthenticated(WRONG_LOGIN)
            # This account's count, and the count of the login in any workspace
            # (never another workspace's account: its count is its own).
            await tx.clear_sign_in_attempts(account.workspace_id, key)
            if workspace is None:
                await tx.clear_sign_in_attempts(access.ANY_WORKSPACE, key)
            secret, refresh = await self._new_session(tx, member)
            await tx.add_audit(self._member_action(member, "SignIn", details={"login": key}))
            await tx.commit()
        return self._tokens(member, secret, refresh)

    async def _record_sign_in_refusal(
        self,
        workspace: uuid.UUID,
        key: str,
        at: datetime,
        error: TooManyAttempts | Unauthenticated,
        *,
        known: bool,
    ) -> None:
        if not known:
            async with self._uow(write=False) as tx:
                if await tx.get_workspace(workspace) is None:
                    return
        await self._record_refusal(
            audit.refused(
                audit.ANONYMOUS,
                workspace_id=workspace,
                action="SignIn",
                target=audit.Target("login", key),
                at=at,
                code=status_name(error),
                reason=error.message,
            )
        )

    async def _throttled_candidates(self, workspace: uuid.UUID | None, key: str) -> list[Account]:
        """The accounts a sign-in may be for, its attempt counted; TooManyAttempts if refused.

        Without a workspace: every account with the login (more than
        `sign_in_max_workspaces` only to say so), less those under attack.
        """
        now = self._clock()
        most = self.limits.sign_in_max_workspaces
        # Counted before the password is checked, so that parallel guesses all count.
        async with self._uow() as tx:
            if workspace is not None:
                found = await tx.find_account(workspace, key)
                candidates = [found] if found is not None else []
                counted = [workspace]
            else:
                candidates = await tx.find_accounts_by_login(key, limit=most + 1)
                # Each account's own count too: going without the workspace is
                # no way around the limit of guesses at one account.
                counted = [access.ANY_WORKSPACE, *(a.workspace_id for a in candidates[:most])]
            attempts = [
                await tx.count_sign_in_attempt(w, key, at=now, window=self.limits.sign_in_window)
                for w in counted
            ]
            await tx.commit()
        waits = [access.sign_in_retry_after(a, now, self.limits) for a in attempts]
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
            raise TooManyAttempts(
                f"too many sign-in attempts for this login; try again in {math.ceil(refused)} seconds",
                retry_after_seconds=refused,
            )
        return candidates

    async def refresh(self, refresh_token: str) -> IssuedTokens:
        if not access.plausible_secret(refresh_token, access.REFRESH_TOKEN_PREFIX):
            raise Unauthenticated(BAD_REFRESH)
        now = self._now()
        async with self._uow() as tx:
            found = await tx.find_refresh_token(access.secret_hash(refresh_token))
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
            secret, refresh = await self._new_session(tx, member, family_id=found.family_id)
            await tx.commit()
        return self._tokens(member, secret, refresh)

    async def sign_out(self, refresh_token: str) -> None:
        """Ends the token's session; says nothing about tokens it does not know."""
        if not access.plausible_secret(refresh_token, access.REFRESH_TOKEN_PREFIX):
            return
        async with self._uow() as tx:
            found = await tx.find_refresh_token(access.secret_hash(refresh_token))
            if found is None:
                return
            await tx.revoke_refresh_family(found.family_id, self._now())
            member = await tx.get_member(found.member_id)
            if member is not None:
                await tx.add_audit(self._member_action(member, "SignOut"))
            await tx.commit()

    async def change_password(
        self, caller: Caller | None, *, old_password: str, new_password: str
    ) -> IssuedTokens:
        authority = self._authority(caller)
        access.check_password(new_password, self.limits, field="new_password")
        async with self._uow(write=False) as tx:
            member = await self._member(tx, caller)
            access.require_session(authority, "change the password")
            access.require_write(authority, "change the password")
            account = await tx.get_account(member.id)
        if account is None or account.password_hash is None or account.login is None:
            raise WrongState(
                "this member has no password (it signs in with the organisation's provider, or not at all)"
            )
        now = self._clock()
        # Guessing the old password is throttled like signing in.
        async with self._uow() as tx:
            attempts = await tx.count_sign_in_attempt(
                account.workspace_id, account.login, at=now, window=self.limits.sign_in_window
            )
            await tx.commit()
        wait = access.sign_in_retry_after(attempts, now, self.limits)
        if wait is not None:
            raise TooManyAttempts(
                f"too many attempts; try again in {math.ceil(wait)} seconds", retry_after_seconds=wait
            )
        if len(old_password) > access.MAX_PASSWORD_CHARS or not await self._passwords.verify(
            account.password_hash, old_password
        ):
            raise Unauthenticated("old_password is wrong")
        password_hash = await self._passwords.hash(new_password)
        async with self._uow() as tx:
            await tx.set_password(member.id, password_hash, self._now())
            await tx.revoke_refresh_tokens_of(member.id, self._now())
            await tx.clear_sign_in_attempts(account.workspace_id, account.login)
            secret, refresh = await self._new_session(tx, member)
            await tx.add_audit(
                self._action(caller, member, "ChangePassword", audit.Target("member", str(member.id)))
            )
            await tx.commit()
        return self._tokens(member, secret, refresh)

    # -- workspaces with an owner's account --------------------------------------------

    async def create_workspace(
        self, command: CreateWorkspace
    ) -> tuple[Workspace, Member, IssuedTokens | None]:
        """A workspace and its owner, with the owner's account and tokens if a login is given."""
        login, password, creator_kind = command.creator_login, command.creator_password, command.creator_kind
        if not login and not password:
            workspace, creator, _ = await self._open_workspace(
                name=command.name,
                creator_display_name=command.creator_display_name,
                creator_kind=creator_kind,
                creator_avatar=command.creator_avatar,
                request_id=command.request_id,
            )
            return workspace, creator, None
        if not login or not password:
            raise InvalidRequest("creator_login and creator_password go together")
        if creator_kind not in (None, MemberKind.HUMAN):
            raise InvalidRequest("only a HUMAN creator can have an account")
        key = access.normalize_login(login)
        access.check_password(password, self.limits, field="creator_password")
        password_hash = await self._passwords.hash(password)
        session: list[tuple[str, RefreshToken]] = []

        async def add_account(tx: Transaction, workspace: Workspace, creator: Member) -> None:
            now = self._now()
            await tx.add_account(
                Account(
                    member_id=creator.id,
                    workspace_id=workspace.id,
                    login=key,
                    password_hash=password_hash,
                    created_at=now,
                    password_changed_at=now,
                )
            )
            session.append(await self._new_session(tx, creator))

        hook: CreationHook = add_account
        workspace, creator, created = await self._open_workspace(
            name=command.name,
            creator_display_name=command.creator_display_name,
            creator_kind=creator_kind,
            creator_avatar=command.creator_avatar,
            request_id=command.request_id,
            fingerprint_extra={"login": key},
            within=hook,
        )
        if not created:
            # A retry: the first response (with its tokens) may have been lost.
            return workspace, creator, await self._signed_in_again(creator, password)
        secret, refresh = session[0]
        return workspace, creator, self._tokens(creator, secret, refresh)

    # -- invites ------------------------------------------------------------------

    async def create_invite(
        self,
        caller: Caller | None,
        *,
        role: Role | None,
        ttl: timedelta | None,
        request_id: str,
        email: str = "",
    ) -> tuple[Invite, str]:
        """An invite (bound to an email, if one is given) and its secret (shown this once).

        An invite bound to an email is accepted only through the OpenID
        provider, by the person it verifies has that email.
        """
        role = role or Role.MEMBER
        rid = rules.check_request_id(request_id)
        bound = access.normalize_email(email) if email else None
        if bound is not None and not self._oidc_configured:
            raise WrongState(
                "an invite is bound to an email only where people sign in with an OpenID Connect provider"
                " (OIDC_ISSUER), which proves the email; leave email empty"
            )
        authority = self._authority(caller)
        secret = access.new_secret(access.INVITE_PREFIX)
        async with self._uow() as tx:
            member = await self._member(tx, caller)
            access.require_write(authority, "create invites")
            access.check_invite(member, role)
            now = self._now()
            expires = access.invite_expiry(ttl, now, self.limits)
            fingerprint = rules.request_fingerprint(
                op="create_invite",
                role=role.value,
                ttl=ttl.total_seconds() if ttl else None,
                **({"email": bound} if bound else {}),
            )
            existing = await self._replay(tx, member.id, rid, fingerprint)
            if existing is not None:
                invite = await tx.get_invite(existing)
                if invite is None:
                    raise NotFound(f"invite {existing} not found")
                if invite.used_at is not None:
                    raise WrongState("the invite this request_id created has been accepted already")
                await tx.replace_invite_secret(invite.id, access.secret_hash(secret))
                await tx.add_audit(
                    self._action(
                        caller,
                        member,
                        "CreateInvite",
                        audit.Target("invite", str(invite.id)),
                        request_id=rid,
                        details={"role": invite.role.value, "repeated": "a new link for the same request_id"},
                    )
                )
                await tx.commit()
                return replace(invite, secret_hash=access.secret_hash(secret)), secret
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
            await self._remember(tx, member.id, rid, fingerprint, invite.id)
            await tx.add_audit(
                self._action(
                    caller,
                    member,
                    "CreateInvite",
                    audit.Target("invite", str(invite.id)),
                    request_id=rid,
                    details={"role": role.value, "expire_time": expires.isoformat()},
                )
            )
            await tx.commit()
        return invite, secret

    async def accept_invite(
        self, *, invite: str, display_name: str, login: str, password: str, request_id: str
    ) -> IssuedTokens:
        display_name = rules.check_name(display_name, "display_name", required=True)
        key = access.normalize_login(login)
        rid = rules.check_request_id(request_id)
        if not access.plausible_secret(invite, access.INVITE_PREFIX):
            raise Unauthenticated("the invite is not valid")
        invite_hash = access.secret_hash(invite)
        fingerprint = rules.request_fingerprint(op="accept_invite", login=key, name=display_name)
        async with self._uow(write=False) as tx:
            found = await tx.find_invite(invite_hash)
            if found is None:
                raise Unauthenticated("the invite is not valid")
            earlier = await self._replay(tx, found.id, rid, fingerprint)
            member = await tx.get_member(earlier) if earlier is not None else None
        if member is not None:
            return await self._signed_in_again(member, password)
        self._usable(found)
        if found.email is not None:
            # Only the provider proves who has the email: a password proves nothing of it.
            raise WrongState(f"this invite is for {found.email} only: join with your organisation's sign-in")
        access.check_password(password, self.limits)
        password_hash = await self._passwords.hash(password)
        async with self._uow() as tx:
            now = self._now()
            member = Member(
                id=uuid7(),
                workspace_id=found.workspace_id,
                kind=MemberKind.HUMAN,
                display_name=display_name,
                avatar="",
                created_at=now,
                role=found.role,
            )
            if self._member_quota is not None:
                await self._member_quota(tx, member.workspace_id, MemberKind.HUMAN)
            if not await tx.use_invite(found.id, member.id, now):
                raise WrongState("the invite has been used already")
            await tx.add_member(member)
            try:
                await tx.add_account(
                    Account(
                        member_id=member.id,
                        workspace_id=member.workspace_id,
                        login=key,
                        password_hash=password_hash,
                        created_at=now,
                        password_changed_at=now,
                    )
                )
            except LoginTaken:
                raise AlreadyTaken(f"the login {key!r} is taken in this workspace") from None
            await self._remember(tx, found.id, rid, fingerprint, member.id)
            secret, refresh = await self._new_session(tx, member)
            await tx.add_audit(
                self._member_action(
                    member,
                    "AcceptInvite",
                    target=audit.Target("invite", str(found.id)),
                    request_id=rid,
                    details={"member_id": str(member.id), "role": member.role.value, "login": key},
                )
            )
            await tx.commit()
        return self._tokens(member, secret, refresh)

    def _usable(self, invite: Invite) -> None:
        if invite.used_at is not None:
            raise WrongState("the invite has been used already")
        if invite.expires_at <= self._clock():
            raise WrongState("the invite has expired")

    # -- roles --------------------------------------------------------------------

    async def set_member_role(self, caller: Caller | None, *, member_id: str, role: Role | None) -> Member:
        if role is None:
            raise InvalidRequest("role is required (OWNER, ADMIN or MEMBER)")
        target_id = rules.parse_id(member_id, "member_id")
        authority = self._authority(caller)
        async with self._uow() as tx:
            member = await self._member(tx, caller)
            access.require_write(authority, "change roles")
            target = await tx.get_member(target_id)
            if target is None or target.workspace_id != member.workspace_id:
                raise NotFound(f"member {target_id} not found")
            changes = access.role_changes(member, target, role)
            for changed, new_role in changes:
                await tx.set_role(changed, new_role)
                await tx.add_audit(
                    self._action(
                        caller,
                        member,
                        "SetMemberRole",
                        audit.Target("member", str(changed)),
                        details={"role": new_role.value},
                    )
                )
            await tx.commit()
        if changes:
            logger.info("member %s set the role of %s to %s", member.id, target.id, role.value)
        return replace(target, role=dict(changes).get(target.id, target.role))

    # -- the audit log -------------------------------------------------------------

    async def list_audit_events(
        self, caller: Caller | None, query: audit.AuditQuery, *, page_size: int, page_token: str
    ) -> tuple[list[audit.AuditRecord], str]:
        """The IM's audit records of the caller's workspace, newest first (its owner and admins only)."""
        async with self._uow(write=False) as tx:
            member = await self._member(tx, caller)
        if caller is not None and caller.view_as is not None:
            raise NotAllowed("a view as an agent does not read the audit log")
        if member.role.value not in audit.ADMIN_ROLES:
            raise NotAllowed("only the workspace's owner and admins read its audit log")
        if self._audit_log is None:
            return [], ""
        return await audit.list_page(
            self._audit_log, member.workspace_id, query, page_token=page_token, size=page_size
        )
