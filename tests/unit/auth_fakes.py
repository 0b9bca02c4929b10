"""The identity part of the in-memory fake unit of work, and a fast fake password hasher.

`FakeAuthRecords` is a mixin of `fakes.FakeTransaction`: its tables live in
`AuthState`, one field of the fake's `State`, copied and replayed with it.
"""

from __future__ import annotations

import abc
import hashlib
import hmac
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

from services.common import audit
from services.im.domain.accounts import Account, Invite, PersonalToken, RefreshToken, SignInFailures
from services.im.domain.model import Role
from services.im.service_layer.auth_ports import AuthRecords, EmailTaken, LoginTaken, Passwords

T = TypeVar("T")


@dataclass
class AuthState:
    accounts: dict[uuid.UUID, Account] = field(default_factory=dict)
    refresh_tokens: dict[uuid.UUID, RefreshToken] = field(default_factory=dict)
    invites: dict[uuid.UUID, Invite] = field(default_factory=dict)
    personal_tokens: dict[uuid.UUID, PersonalToken] = field(default_factory=dict)
    attempts: dict[tuple[uuid.UUID, str], SignInFailures] = field(default_factory=dict)
    oidc_nonces: dict[str, datetime] = field(default_factory=dict)

    def copy(self) -> AuthState:
        return AuthState(
            accounts=dict(self.accounts),
            refresh_tokens=dict(self.refresh_tokens),
            invites=dict(self.invites),
            personal_tokens=dict(self.personal_tokens),
            attempts=dict(self.attempts),
            oidc_nonces=dict(self.oidc_nonces),
        )

    def login_taken(self, workspace_id: uuid.UUID, login: str | None) -> bool:
        return login is not None and any(
            a.workspace_id == workspace_id and a.login == login for a in self.accounts.values()
        )

    def email_taken(
        self, workspace_id: uuid.UUID, email: str | None, *, besides: uuid.UUID | None = None
    ) -> bool:
        return email is not None and any(
            a.workspace_id == workspace_id and a.email == email and a.member_id != besides
            for a in self.accounts.values()
        )


class FakeAuthRecords(AuthRecords):
    """`AuthRecords` over `AuthState`; the transaction provides the plumbing below."""

    @abc.abstractmethod
    async def _enter(self, name: str) -> None: ...

    @abc.abstractmethod
    def _auth(self) -> AuthState:
        """The state this transaction sees."""

    @abc.abstractmethod
    def _auth_change(self, change: Callable[[AuthState], T]) -> T:
        """Applies a change now and records it for commit."""

    @abc.abstractmethod
    async def _auth_unique(
        self, key: Hashable, exists: Callable[[AuthState], bool], error: Exception
    ) -> None:
        """A unique index: waits for other writers of the key, raises the error if it exists."""

    @abc.abstractmethod
    def _set_member_role(self, member_id: uuid.UUID, role: Role) -> None: ...

    # -- accounts and roles ---------------------------------------------------------

    async def add_account(self, account: Account) -> None:
        await self._enter("add_account")
        await self._auth_unique(
            ("login", account.workspace_id, account.login),
            lambda a: a.login_taken(account.workspace_id, account.login),
            LoginTaken(account.login or ""),
        )
        await self._auth_unique(
            ("email", account.workspace_id, account.email),
            lambda a: a.email_taken(account.workspace_id, account.email),
            EmailTaken(account.email or ""),
        )
        self._auth_change(lambda a: a.accounts.__setitem__(account.member_id, account))

    async def get_account(self, member_id: uuid.UUID) -> Account | None:
        await self._enter("get_account")
        return self._auth().accounts.get(member_id)

    async def find_account(self, workspace_id: uuid.UUID, login: str) -> Account | None:
        await self._enter("find_account")
        for account in self._auth().accounts.values():
            if account.workspace_id == workspace_id and account.login == login:
                return account
        return None

    async def find_accounts_by_login(self, login: str, *, limit: int) -> list[Account]:
        await self._enter("find_accounts_by_login")
        found = [a for a in self._auth().accounts.values() if a.login == login]
        return sorted(found, key=lambda a: a.workspace_id)[:limit]

    async def find_accounts_by_email(
        self, email: str, *, workspace_id: uuid.UUID | None, limit: int
    ) -> list[Account]:
        await self._enter("find_accounts_by_email")
        found = [
            a
            for a in self._auth().accounts.values()
            if a.email == email and (workspace_id is None or a.workspace_id == workspace_id)
        ]
        return sorted(found, key=lambda a: a.workspace_id)[:limit]

    async def set_account_email(self, member_id: uuid.UUID, email: str) -> None:
        await self._enter("set_account_email")
        account = self._auth().accounts.get(member_id)
        if account is None:
            return
        await self._auth_unique(
            ("email", account.workspace_id, email),
            lambda a: a.email_taken(account.workspace_id, email, besides=member_id),
            EmailTaken(email),
        )
        self._auth_change(lambda a: _update(a.accounts, member_id, email=email))

    async def set_password(self, member_id: uuid.UUID, password_hash: str, at: datetime) -> None:
        await self._enter("set_password")

        def change(a: AuthState) -> None:
            current = a.accounts.get(member_id)
            if current is not None:
                a.accounts[member_id] = replace(current, password_hash=password_hash, password_changed_at=at)

        self._auth_change(change)

    async def set_role(self, member_id: uuid.UUID, role: Role) -> None:
        await self._enter("set_role")
        self._set_member_role(member_id, role)

    # -- refresh tokens -------------------------------------------------------------

    async def add_refresh_token(self, token: RefreshToken) -> None:
        await self._enter("add_refresh_token")
        self._auth_change(lambda a: a.refresh_tokens.__setitem__(token.id, token))

    async def find_refresh_token(self, token_hash: str) -> RefreshToken | None:
        await self._enter("find_refresh_token")
        return next((t for t in self._auth().refresh_tokens.values() if t.token_hash == token_hash), None)

    async def use_refresh_token(self, token_id: uuid.UUID, at: datetime) -> bool:
        await self._enter("use_refresh_token")
        await self._auth_unique(("refresh-use", token_id), lambda a: False, LookupError())

        def change(a: AuthState) -> bool:
            current = a.refresh_tokens.get(token_id)
            if current is None or current.used_at is not None or current.revoked_at is not None:
                return False
            a.refresh_tokens[token_id] = replace(current, used_at=at)
            return True

        return self._auth_change(change)

    async def revoke_refresh_family(self, family_id: uuid.UUID, at: datetime) -> None:
        await self._enter("revoke_refresh_family")
        self._auth_change(lambda a: _revoke(a, lambda t: t.family_id == family_id, at))

    async def revoke_refresh_tokens_of(self, member_id: uuid.UUID, at: datetime) -> None:
        await self._enter("revoke_refresh_tokens_of")
        self._auth_change(lambda a: _revoke(a, lambda t: t.member_id == member_id, at))

    # -- invites --------------------------------------------------------------------

    async def add_invite(self, invite: Invite) -> None:
        await self._enter("add_invite")
        self._auth_change(lambda a: a.invites.__setitem__(invite.id, invite))

    async def get_invite(self, invite_id: uuid.UUID) -> Invite | None:
        await self._enter("get_invite")
        return self._auth().invites.get(invite_id)

    async def find_invite(self, secret_hash: str) -> Invite | None:
        await self._enter("find_invite")
        return next((i for i in self._auth().invites.values() if i.secret_hash == secret_hash), None)

    async def use_invite(self, invite_id: uuid.UUID, member_id: uuid.UUID, at: datetime) -> bool:
        await self._enter("use_invite")

        def change(a: AuthState) -> bool:
            current = a.invites.get(invite_id)
            if current is None or current.used_at is not None:
                return False
            a.invites[invite_id] = replace(current, used_at=at, used_by=member_id)
            return True

        return self._auth_change(change)

    async def replace_invite_secret(self, invite_id: uuid.UUID, secret_hash: str) -> None:
        await self._enter("replace_invite_secret")
        self._auth_change(lambda a: _update(a.invites, invite_id, secret_hash=secret_hash))

    # -- OpenID Connect ----------------------------------------------------------------

    async def use_oidc_nonce(self, nonce_hash: str, *, keep_until: datetime, now: datetime) -> bool:
        await self._enter("use_oidc_nonce")
        await self._auth_unique(("oidc-nonce", nonce_hash), lambda a: False, LookupError())

        def change(a: AuthState) -> bool:
            for kept in [h for h, until in a.oidc_nonces.items() if until < now]:
                del a.oidc_nonces[kept]
            if nonce_hash in a.oidc_nonces:
                return False
            a.oidc_nonces[nonce_hash] = keep_until
            return True

        return self._auth_change(change)

    # -- personal access tokens ------------------------------------------------------

    async def add_personal_token(self, token: PersonalToken) -> None:
        await self._enter("add_personal_token")
        self._auth_change(lambda a: a.personal_tokens.__setitem__(token.id, token))

    async def get_personal_token(self, token_id: uuid.UUID) -> PersonalToken | None:
        await self._enter("get_personal_token")
        return self._auth().personal_tokens.get(token_id)

    async def find_personal_token(self, secret_hash: str) -> PersonalToken | None:
        await self._enter("find_personal_token")
        tokens = self._auth().personal_tokens.values()
        return next((t for t in tokens if t.secret_hash == secret_hash), None)

    async def list_personal_tokens(
        self, member_id: uuid.UUID, *, before: uuid.UUID | None, limit: int
    ) -> list[PersonalToken]:
        await self._enter("list_personal_tokens")
        mine = [
            t
            for t in self._auth().personal_tokens.values()
            if t.member_id == member_id and (before is None or t.id < before)
        ]
        return sorted(mine, key=lambda t: t.id, reverse=True)[:limit]

    async def revoke_personal_token(self, token_id: uuid.UUID, at: datetime) -> None:
        await self._enter("revoke_personal_token")

        def change(a: AuthState) -> None:
            current = a.personal_tokens.get(token_id)
            if current is not None and current.revoked_at is None:
                a.personal_tokens[token_id] = replace(current, revoked_at=at)

        self._auth_change(change)

    async def touch_personal_token(self, token_id: uuid.UUID, at: datetime) -> None:
        await self._enter("touch_personal_token")
        self._auth_change(lambda a: _update(a.personal_tokens, token_id, last_used_at=at))

    async def replace_personal_token_secret(self, token_id: uuid.UUID, secret_hash: str) -> None:
        await self._enter("replace_personal_token_secret")
        self._auth_change(lambda a: _update(a.personal_tokens, token_id, secret_hash=secret_hash))

    # -- sign-in attempts ------------------------------------------------------------

    async def count_sign_in_attempt(
        self, workspace_id: uuid.UUID, login: str, *, at: datetime, window: timedelta
    ) -> SignInFailures:
        await self._enter("count_sign_in_attempt")

        def change(a: AuthState) -> SignInFailures:
            key = (workspace_id, login)
            current = a.attempts.get(key)
            if current is None or current.window_start <= at - window:
                counted = SignInFailures(workspace_id, login, 1, at)
            else:
                counted = replace(current, count=current.count + 1)
            a.attempts[key] = counted
            return counted

        return self._auth_change(change)

    async def clear_sign_in_attempts(self, workspace_id: uuid.UUID, login: str) -> None:
        await self._enter("clear_sign_in_attempts")
        self._auth_change(lambda a: a.attempts.pop((workspace_id, login), None))


def _revoke(state: AuthState, which: Callable[[RefreshToken], bool], at: datetime) -> None:
    for token_id, token in list(state.refresh_tokens.items()):
        if which(token) and token.revoked_at is None:
            state.refresh_tokens[token_id] = replace(token, revoked_at=at)


def _update(rows: dict[uuid.UUID, Any], key: uuid.UUID, **changes: Any) -> None:
    current = rows.get(key)
    if current is not None:
        rows[key] = replace(current, **changes)


class FakePasswords(Passwords):
    """Salted SHA-256 instead of argon2: the same contract, in microseconds."""

    def __init__(self) -> None:
        self.hashed: list[str] = []
        self.wasted = 0

    async def hash(self, password: str) -> str:
        self.hashed.append(password)
        salt = uuid.uuid4().hex
        return f"fake${salt}${hashlib.sha256((salt + password).encode()).hexdigest()}"

    async def verify(self, password_hash: str, password: str) -> bool:
        try:
            _, salt, digest = password_hash.split("$")
        except ValueError:
            return False
        return hmac.compare_digest(digest, hashlib.sha256((salt + password).encode()).hexdigest())

    async def waste_time(self, password: str) -> None:
        self.wasted += 1


class InMemoryAuditLog(audit.AuditLog):
    """Keeps the records it is given in a list; lists none; counts prunes."""

    def __init__(self) -> None:
        self.records: list[audit.AuditRecord] = []
        self.pruned_before: list[datetime] = []

    async def record_refusal(self, record: audit.AuditRecord, *, window: timedelta) -> None:
        self.records.append(record)

    async def record(self, record: audit.AuditRecord) -> None:
        self.records.append(record)

    async def list(
        self, workspace_id: uuid.UUID, query: audit.AuditQuery, *, after: audit.Cursor | None, limit: int
    ) -> list[audit.AuditRecord]:
        return []

    async def prune(self, *, before: datetime) -> int:
        self.pruned_before.append(before)
        return 1
