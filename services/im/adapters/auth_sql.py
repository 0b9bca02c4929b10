"""The identity part of the IM's SQL unit of work (`AuthRecords`).

A mixin of `sql.SqlTransaction`: the same statements run on SQLite and
PostgreSQL. Inserts that may clash use ON CONFLICT DO NOTHING and look at
the row count, since an IntegrityError would abort a PostgreSQL transaction.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from services.common.sql import UtcDateTime
from services.im.adapters.tables import (
    accounts,
    invites,
    members,
    oidc_nonces,
    personal_tokens,
    refresh_tokens,
    sign_in_attempts,
)
from services.im.domain.accounts import (
    Account,
    Invite,
    PersonalToken,
    PersonalTokenScope,
    RefreshToken,
    SignInFailures,
)
from services.im.domain.model import Role
from services.im.service_layer.auth_ports import AuthRecords, EmailTaken, LoginTaken


def _account(row: sa.Row[Any]) -> Account:
    return Account(
        member_id=row.member_id,
        workspace_id=row.workspace_id,
        login=row.login,
        password_hash=row.password_hash,
        created_at=row.created_at,
        password_changed_at=row.password_changed_at,
        email=row.email,
    )


def _refresh_token(row: sa.Row[Any]) -> RefreshToken:
    return RefreshToken(
        id=row.id,
        family_id=row.family_id,
        member_id=row.member_id,
        token_hash=row.token_hash,
        created_at=row.created_at,
        expires_at=row.expires_at,
        used_at=row.used_at,
        revoked_at=row.revoked_at,
    )


def _invite(row: sa.Row[Any]) -> Invite:
    return Invite(
        id=row.id,
        workspace_id=row.workspace_id,
        role=Role(row.role),
        secret_hash=row.secret_hash,
        created_by=row.created_by,
        created_at=row.created_at,
        expires_at=row.expires_at,
        used_at=row.used_at,
        used_by=row.used_by,
        email=row.email,
    )


def _personal_token(row: sa.Row[Any]) -> PersonalToken:
    return PersonalToken(
        id=row.id,
        member_id=row.member_id,
        workspace_id=row.workspace_id,
        name=row.name,
        scope=PersonalTokenScope(row.scope),
        secret_hash=row.secret_hash,
        created_at=row.created_at,
        expires_at=row.expires_at,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
    )


class SqlAuthRecords(AuthRecords):
    """`AuthRecords` in SQL; the transaction class provides the plumbing below."""

    @property
    @abc.abstractmethod
    def on_sqlite(self) -> bool:
        """Whether the database is SQLite (else PostgreSQL)."""

    @abc.abstractmethod
    async def _execute(self, statement: sa.Executable, parameters: Any = None) -> sa.CursorResult[Any]: ...

    @abc.abstractmethod
    async def _rows(self, statement: sa.Executable) -> Sequence[sa.Row[Any]]: ...

    def _insert(self, table: sa.Table) -> Any:
        return (sqlite_insert if self.on_sqlite else postgresql_insert)(table)

    # -- accounts and roles ---------------------------------------------------------

    async def add_account(self, account: Account) -> None:
        # No conflict target: a clash on the login or on the email is skipped
        # alike (either would abort a PostgreSQL transaction), then told apart.
        result = await self._execute(
            self._insert(accounts)
            .values(
                member_id=account.member_id,
                workspace_id=account.workspace_id,
                login=account.login,
                password_hash=account.password_hash,
                created_at=account.created_at,
                password_changed_at=account.password_changed_at,
                email=account.email,
            )
            .on_conflict_do_nothing()
        )
        if result.rowcount:
            return
        if account.email is not None and await self.find_accounts_by_email(
            account.email, workspace_id=account.workspace_id, limit=1
        ):
            raise EmailTaken(account.email)
        raise LoginTaken(account.login or "")

    async def get_account(self, member_id: uuid.UUID) -> Account | None:
        rows = await self._rows(accounts.select().where(accounts.c.member_id == member_id))
        return _account(rows[0]) if rows else None

    async def find_account(self, workspace_id: uuid.UUID, login: str) -> Account | None:
        rows = await self._rows(
            accounts.select().where(accounts.c.workspace_id == workspace_id, accounts.c.login == login)
        )
        return _account(rows[0]) if rows else None

    async def find_accounts_by_login(self, login: str, *, limit: int) -> list[Account]:
        rows = await self._rows(
            accounts.select().where(accounts.c.login == login).order_by(accounts.c.workspace_id).limit(limit)
        )
        return [_account(r) for r in rows]

    async def find_accounts_by_email(
        self, email: str, *, workspace_id: uuid.UUID | None, limit: int
    ) -> list[Account]:
        query = accounts.select().where(accounts.c.email == email)
        if workspace_id is not None:
            query = query.where(accounts.c.workspace_id == workspace_id)
        rows = await self._rows(query.order_by(accounts.c.workspace_id).limit(limit))
        return [_account(r) for r in rows]

    async def set_account_email(self, member_id: uuid.UUID, email: str) -> None:
        account = await self.get_account(member_id)
        if account is None:
            return
        taken = await self.find_accounts_by_email(email, workspace_id=account.workspace_id, limit=1)
        if taken and taken[0].member_id != member_id:
            raise EmailTaken(email)
        try:
            await self._execute(
                accounts.update().where(accounts.c.member_id == member_id).values(email=email)
            )
        except sa.exc.IntegrityError:
            # Taken meanwhile by a concurrent transaction; this one is lost anyway.
            raise EmailTaken(email) from None

    async def set_password(self, member_id: uuid.UUID, password_hash: str, at: datetime) -> None:
        await self._execute(
            accounts.update()
            .where(accounts.c.member_id == member_id)
            .values(password_hash=password_hash, password_changed_at=at)
        )

    async def set_role(self, member_id: uuid.UUID, role: Role) -> None:
        await self._execute(members.update().where(members.c.id == member_id).values(role=role.value))

    # -- refresh tokens -------------------------------------------------------------

    async def add_refresh_token(self, token: RefreshToken) -> None:
        await self._execute(
            refresh_tokens.insert().values(
                id=token.id,
                family_id=token.family_id,
                member_id=token.member_id,
                token_hash=token.token_hash,
                created_at=token.created_at,
                expires_at=token.expires_at,
                used_at=token.used_at,
                revoked_at=token.revoked_at,
            )
        )

    async def find_refresh_token(self, token_hash: str) -> RefreshToken | None:
        rows = await self._rows(refresh_tokens.select().where(refresh_tokens.c.token_hash == token_hash))
        return _refresh_token(rows[0]) if rows else None

    async def use_refresh_token(self, token_id: uuid.UUID, at: datetime) -> bool:
        result = await self._execute(
            refresh_tokens.update()
            .where(
                refresh_tokens.c.id == token_id,
                refresh_tokens.c.used_at.is_(None),
                refresh_tokens.c.revoked_at.is_(None),
            )
            .values(used_at=at)
        )
        return bool(result.rowcount)

    async def revoke_refresh_family(self, family_id: uuid.UUID, at: datetime) -> None:
        await self._execute(
            refresh_tokens.update()
            .where(refresh_tokens.c.family_id == family_id, refresh_tokens.c.revoked_at.is_(None))
            .values(revoked_at=at)
        )

    async def revoke_refresh_tokens_of(self, member_id: uuid.UUID, at: datetime) -> None:
        await self._execute(
            refresh_tokens.update()
            .where(refresh_tokens.c.member_id == member_id, refresh_tokens.c.revoked_at.is_(None))
            .values(revoked_at=at)
        )

    # -- invites --------------------------------------------------------------------

    async def add_invite(self, invite: Invite) -> None:
        await self._execute(
            invites.insert().values(
                id=invite.id,
                workspace_id=invite.workspace_id,
                role=invite.role.value,
                secret_hash=invite.secret_hash,
                created_by=invite.created_by,
                created_at=invite.created_at,
                expires_at=invite.expires_at,
                used_at=invite.used_at,
                used_by=invite.used_by,
                email=invite.email,
            )
        )

    async def get_invite(self, invite_id: uuid.UUID) -> Invite | None:
        rows = await self._rows(invites.select().where(invites.c.id == invite_id))
        return _invite(rows[0]) if rows else None

    async def find_invite(self, secret_hash: str) -> Invite | None:
        rows = await self._rows(invites.select().where(invites.c.secret_hash == secret_hash))
        return _invite(rows[0]) if rows else None

    async def use_invite(self, invite_id: uuid.UUID, member_id: uuid.UUID, at: datetime) -> bool:
        result = await self._execute(
            invites.update()
            .where(invites.c.id == invite_id, invites.c.used_at.is_(None))
            .values(used_at=at, used_by=member_id)
        )
        return bool(result.rowcount)

    async def replace_invite_secret(self, invite_id: uuid.UUID, secret_hash: str) -> None:
        await self._execute(invites.update().where(invites.c.id == invite_id).values(secret_hash=secret_hash))

    # -- OpenID Connect ----------------------------------------------------------------

    async def use_oidc_nonce(self, nonce_hash: str, *, keep_until: datetime, now: datetime) -> bool:
        await self._execute(oidc_nonces.delete().where(oidc_nonces.c.expires_at < now))
        result = await self._execute(
            self._insert(oidc_nonces)
            .values(nonce_hash=nonce_hash, expires_at=keep_until)
            .on_conflict_do_nothing(index_elements=[oidc_nonces.c.nonce_hash])
        )
        return bool(result.rowcount)

    # -- personal access tokens ------------------------------------------------------

    async def add_personal_token(self, token: PersonalToken) -> None:
        await self._execute(
            personal_tokens.insert().values(
                id=token.id,
                member_id=token.member_id,
                workspace_id=token.workspace_id,
                name=token.name,
                scope=token.scope.value,
                secret_hash=token.secret_hash,
                created_at=token.created_at,
                expires_at=token.expires_at,
                last_used_at=token.last_used_at,
                revoked_at=token.revoked_at,
            )
        )

    async def get_personal_token(self, token_id: uuid.UUID) -> PersonalToken | None:
        rows = await self._rows(personal_tokens.select().where(personal_tokens.c.id == token_id))
        return _personal_token(rows[0]) if rows else None

    async def find_personal_token(self, secret_hash: str) -> PersonalToken | None:
        rows = await self._rows(personal_tokens.select().where(personal_tokens.c.secret_hash == secret_hash))
        return _personal_token(rows[0]) if rows else None

    async def list_personal_tokens(
        self, member_id: uuid.UUID, *, before: uuid.UUID | None, limit: int
    ) -> list[PersonalToken]:
        query = (
            personal_tokens.select()
            .where(personal_tokens.c.member_id == member_id)
            .order_by(personal_tokens.c.id.desc())
            .limit(limit)
        )
        if before is not None:
            query = query.where(personal_tokens.c.id < before)
        return [_personal_token(r) for r in await self._rows(query)]

    async def revoke_personal_token(self, token_id: uuid.UUID, at: datetime) -> None:
        await self._execute(
            personal_tokens.update()
            .where(personal_tokens.c.id == token_id, personal_tokens.c.revoked_at.is_(None))
            .values(revoked_at=at)
        )

    async def touch_personal_token(self, token_id: uuid.UUID, at: datetime) -> None:
        await self._execute(
            personal_tokens.update().where(personal_tokens.c.id == token_id).values(last_used_at=at)
        )

    async def replace_personal_token_secret(self, token_id: uuid.UUID, secret_hash: str) -> None:
        await self._execute(
            personal_tokens.update().where(personal_tokens.c.id == token_id).values(secret_hash=secret_hash)
        )

    # -- sign-in attempts ------------------------------------------------------------

    async def count_sign_in_attempt(
        self, workspace_id: uuid.UUID, login: str, *, at: datetime, window: timedelta
    ) -> SignInFailures:
        # One atomic statement: concurrent attempts each count.
        now = sa.literal(at, UtcDateTime)
        expired = sign_in_attempts.c.window_start <= sa.literal(at - window, UtcDateTime)
        statement = (
            self._insert(sign_in_attempts)
            .values(workspace_id=workspace_id, login=login, attempts=1, window_start=at)
            .on_conflict_do_update(
                index_elements=[sign_in_attempts.c.workspace_id, sign_in_attempts.c.login],
                set_={
                    "attempts": sa.case((expired, 1), else_=sign_in_attempts.c.attempts + 1),
                    "window_start": sa.case((expired, now), else_=sign_in_attempts.c.window_start),
                },
            )
            .returning(sign_in_attempts.c.attempts, sign_in_attempts.c.window_start)
        )
        row = (await self._execute(statement)).one()
        return SignInFailures(
            workspace_id=workspace_id, login=login, count=int(row.attempts), window_start=row.window_start
        )

    async def clear_sign_in_attempts(self, workspace_id: uuid.UUID, login: str) -> None:
        await self._execute(
            sign_in_attempts.delete().where(
                sign_in_attempts.c.workspace_id == workspace_id, sign_in_attempts.c.login == login
            )
        )
