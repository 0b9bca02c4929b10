"""What the IM's identity handlers need from the outside world.

`AuthRecords` is the part of the unit of work (`ports.Transaction`) that
keeps accounts and credentials, so that a workspace, its owner and the
owner's account commit together. `Passwords` hashes and checks passwords.
`IdTokens` checks the OpenID Connect provider's ID tokens, with the keys
`ProviderKeys` fetches.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from services.im.domain.accounts import Account, Invite, PersonalToken, RefreshToken, SignInFailures
from services.im.domain.model import Role
from services.im.domain.oidc import VerifiedIdentity


class LoginTaken(Exception):
    """The workspace already has an account with this login."""


class EmailTaken(Exception):
    """The workspace already has an account with this email."""


class AuthRecords(abc.ABC):
    """Accounts, refresh tokens, invites, personal tokens and sign-in attempts.

    Secrets are looked up by their hash only. Conditional changes
    (`use_*`) return whether they happened, so that two concurrent uses of
    one secret cannot both succeed.
    """

    # Accounts and roles
    @abc.abstractmethod
    async def add_account(self, account: Account) -> None:
        """Stores an account; raises LoginTaken or EmailTaken if its workspace has the login or email."""

    @abc.abstractmethod
    async def get_account(self, member_id: uuid.UUID) -> Account | None: ...

    @abc.abstractmethod
    async def find_account(self, workspace_id: uuid.UUID, login: str) -> Account | None: ...

    @abc.abstractmethod
    async def find_accounts_by_login(self, login: str, *, limit: int) -> list[Account]:
        """Accounts with the login in any workspace, at most `limit`, ordered by workspace."""

    @abc.abstractmethod
    async def find_accounts_by_email(
        self, email: str, *, workspace_id: uuid.UUID | None, limit: int
    ) -> list[Account]:
        """Accounts with the (normalized) email, in one workspace or in any; at most `limit`."""

    @abc.abstractmethod
    async def set_account_email(self, member_id: uuid.UUID, email: str) -> None:
        """Gives an account an email; raises EmailTaken if another account of its workspace has it."""

    @abc.abstractmethod
    async def set_password(self, member_id: uuid.UUID, password_hash: str, at: datetime) -> None: ...

    @abc.abstractmethod
    async def set_role(self, member_id: uuid.UUID, role: Role) -> None: ...

    # Refresh tokens
    @abc.abstractmethod
    async def add_refresh_token(self, token: RefreshToken) -> None: ...

    @abc.abstractmethod
    async def find_refresh_token(self, token_hash: str) -> RefreshToken | None: ...

    @abc.abstractmethod
    async def use_refresh_token(self, token_id: uuid.UUID, at: datetime) -> bool:
        """Marks a token used if it is neither used nor revoked; True if this call did."""

    @abc.abstractmethod
    async def revoke_refresh_family(self, family_id: uuid.UUID, at: datetime) -> None:
        """Revokes every token of a session that is not revoked yet."""

    @abc.abstractmethod
    async def revoke_refresh_tokens_of(self, member_id: uuid.UUID, at: datetime) -> None:
        """Revokes every session of a member."""

    # Invites
    @abc.abstractmethod
    async def add_invite(self, invite: Invite) -> None: ...

    @abc.abstractmethod
    async def get_invite(self, invite_id: uuid.UUID) -> Invite | None: ...

    @abc.abstractmethod
    async def find_invite(self, secret_hash: str) -> Invite | None: ...

    @abc.abstractmethod
    async def use_invite(self, invite_id: uuid.UUID, member_id: uuid.UUID, at: datetime) -> bool:
        """Marks an unused invite used by the member; True if this call did."""

    @abc.abstractmethod
    async def replace_invite_secret(self, invite_id: uuid.UUID, secret_hash: str) -> None: ...

    # OpenID Connect
    @abc.abstractmethod
    async def use_oidc_nonce(self, nonce_hash: str, *, keep_until: datetime, now: datetime) -> bool:
        """Records a sign-in's nonce as used, until `keep_until` (forgetting
        those kept until before `now`); False if it was used already."""

    # Personal access tokens
    @abc.abstractmethod
    async def add_personal_token(self, token: PersonalToken) -> None: ...

    @abc.abstractmethod
    async def get_personal_token(self, token_id: uuid.UUID) -> PersonalToken | None: ...

    @abc.abstractmethod
    async def find_personal_token(self, secret_hash: str) -> PersonalToken | None: ...

    @abc.abstractmethod
    async def list_personal_tokens(
        self, member_id: uuid.UUID, *, before: uuid.UUID | None, limit: int
    ) -> list[PersonalToken]:
        """The member's tokens, newest (highest id) first, with ids below `before`."""

    @abc.abstractmethod
    async def revoke_personal_token(self, token_id: uuid.UUID, at: datetime) -> None:
        """Revokes the token unless it is revoked already."""

    @abc.abstractmethod
    async def touch_personal_token(self, token_id: uuid.UUID, at: datetime) -> None:
        """Records a use."""

    @abc.abstractmethod
    async def replace_personal_token_secret(self, token_id: uuid.UUID, secret_hash: str) -> None: ...

    # Sign-in attempts
    @abc.abstractmethod
    async def count_sign_in_attempt(
        self, workspace_id: uuid.UUID, login: str, *, at: datetime, window: timedelta
    ) -> SignInFailures:
        """Counts one attempt for the login, atomically: starts a new window of
        one if there is none or the last began `window` or longer before `at`."""

    @abc.abstractmethod
    async def clear_sign_in_attempts(self, workspace_id: uuid.UUID, login: str) -> None: ...


class Passwords(abc.ABC):
    """Hashes and checks passwords (slow on purpose: off the event loop)."""

    @abc.abstractmethod
    async def hash(self, password: str) -> str: ...

    @abc.abstractmethod
    async def verify(self, password_hash: str, password: str) -> bool:
        """Whether the password matches; False (never an error) for a bad or foreign hash."""

    @abc.abstractmethod
    async def waste_time(self, password: str) -> None:
        """Takes as long as a verify, for a login with no account (no timing difference)."""


class ProviderKeys(abc.ABC):
    """The OpenID Connect provider's signing keys (its JWKS, found through its discovery document)."""

    @abc.abstractmethod
    async def fetch(self) -> Mapping[str, Any]:
        """The provider's JWKS, fetched now.

        Raises:
            ProviderUnavailable: the provider cannot be reached or answers nonsense.
        """


class IdTokens(abc.ABC):
    """Checks the ID tokens of the OpenID Connect provider."""

    @abc.abstractmethod
    async def verify(self, id_token: str, nonce: str) -> VerifiedIdentity:
        """Who the token proves signed in, for the sign-in that sent `nonce`.

        Raises:
            InvalidRequest: no token or no nonce.
            Unauthenticated: a token that is not the provider's, or not for us, or not now.
            NotAllowed: genuine, but without a verified email.
            ProviderUnavailable: the provider's keys cannot be had.
        """
