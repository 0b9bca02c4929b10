"""The IM's tables (SQLAlchemy Core). On PostgreSQL they live in the `im`
schema; on SQLite the schema is translated away (see `sql.create_engine`).
"""

from __future__ import annotations

import sqlalchemy as sa

from services.common.audit_sql import audit_table
from services.common.sql import UtcDateTime

SCHEMA = "im"
NIL_UUID = "00000000-0000-0000-0000-000000000000"

metadata = sa.MetaData(schema=SCHEMA)


workspaces = sa.Table(
    "workspaces",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
)

# One row per workspace: the last event sequence number handed out. Taking it
# with UPDATE ... RETURNING at the end of a transaction makes sequence order
# equal commit order, so a reader that has seen N has seen everything before N.
event_counters = sa.Table(
    "event_counters",
    metadata,
    sa.Column("workspace_id", sa.Uuid, primary_key=True),
    sa.Column("last_sequence", sa.BigInteger, nullable=False),
)

members = sa.Table(
    "members",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("workspace_id", sa.Uuid, nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("display_name", sa.Text, nullable=False),
    sa.Column("avatar", sa.Text, nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
    # owner, admin or member (services.im.domain.model.Role).
    sa.Column("role", sa.String(16), nullable=False, server_default="member"),
    # For an agent: the service that hosts it.
    sa.Column("host", sa.String(64), nullable=True),
    # For an agent: the person who owns it, as its host says.
    sa.Column("owner_id", sa.Uuid, nullable=True),
    sa.Index("ix_members_workspace", "workspace_id", "id"),
)

groups = sa.Table(
    "groups",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("workspace_id", sa.Uuid, nullable=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("creator_id", sa.Uuid, nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
    sa.Column("direct_key", sa.String(80), nullable=True),
    sa.UniqueConstraint("workspace_id", "direct_key", name="uq_groups_direct_key"),
    # Counting a workspace's groups against its quota.
    sa.Index("ix_groups_workspace_kind", "workspace_id", "kind"),
)

memberships = sa.Table(
    "memberships",
    metadata,
    sa.Column("group_id", sa.Uuid, primary_key=True),
    sa.Column("member_id", sa.Uuid, primary_key=True),
    sa.Column("last_read_message_id", sa.Uuid, nullable=False),
    sa.Column("joined_at", UtcDateTime, nullable=False),
    sa.Index("ix_memberships_member", "member_id", "group_id"),
)

messages = sa.Table(
    "messages",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("workspace_id", sa.Uuid, nullable=False),
    sa.Column("group_id", sa.Uuid, nullable=False),
    sa.Column("sender_id", sa.Uuid, nullable=False),
    sa.Column("content_type", sa.String(16), nullable=False),
    sa.Column("content", sa.Text, nullable=False),
    sa.Column("mentions", sa.JSON, nullable=False),
    sa.Column("reply_to", sa.Uuid, nullable=True),
    sa.Column("metadata", sa.JSON, nullable=False),
    sa.Column("sent_at", UtcDateTime, nullable=False),
    sa.Column("edited_at", UtcDateTime, nullable=True),
    sa.Column("request_id", sa.String(128), nullable=True),
    sa.Column("request_hash", sa.String(64), nullable=True),
    # History, unread and last-message queries all walk one group's ids in order.
    sa.Index("ix_messages_group_id", "group_id", "id"),
    sa.UniqueConstraint("sender_id", "request_id", name="uq_messages_sender_request"),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("workspace_id", sa.Uuid, primary_key=True),
    sa.Column("sequence", sa.BigInteger, primary_key=True),
    sa.Column("group_id", sa.Uuid, nullable=True),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column("recorded_at", UtcDateTime, nullable=False),
)

# request_ids of creates other than messages (whose ids live on the message).
requests = sa.Table(
    "requests",
    metadata,
    sa.Column("scope", sa.Uuid, primary_key=True),
    sa.Column("request_id", sa.String(128), primary_key=True),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("resource_id", sa.Uuid, nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
)


# Identity (services.im.domain.accounts). No secret is stored in clear:
# passwords as argon2id hashes, the random secrets as SHA-256 hex.

accounts = sa.Table(
    "accounts",
    metadata,
    sa.Column("member_id", sa.Uuid, primary_key=True),
    sa.Column("workspace_id", sa.Uuid, nullable=False),
    # Normalized (case-folded); unique in its workspace. None (and no
    # password) for a person who joined through OpenID Connect.
    sa.Column("login", sa.String(64), nullable=True),
    sa.Column("password_hash", sa.Text, nullable=True),
    sa.Column("created_at", UtcDateTime, nullable=False),
    sa.Column("password_changed_at", UtcDateTime, nullable=False),
    # Normalized (lower case); unique in its workspace: the OpenID Connect
    # provider's verified email signs its person in.
    sa.Column("email", sa.String(320), nullable=True),
    sa.UniqueConstraint("workspace_id", "login", name="uq_accounts_login"),
    sa.UniqueConstraint("workspace_id", "email", name="uq_accounts_email"),
    # Signing in without a workspace finds accounts by login or email alone.
    sa.Index("ix_accounts_login", "login"),
    sa.Index("ix_accounts_email", "email"),
)

# Each row is one refresh token; a session (sign-in) is the family of
# tokens that rotated out of one another.
refresh_tokens = sa.Table(
    "refresh_tokens",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("family_id", sa.Uuid, nullable=False),
    sa.Column("member_id", sa.Uuid, nullable=False),
    sa.Column("token_hash", sa.String(64), nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
    sa.Column("expires_at", UtcDateTime, nullable=False),
    sa.Column("used_at", UtcDateTime, nullable=True),
    sa.Column("revoked_at", UtcDateTime, nullable=True),
    sa.UniqueConstraint("token_hash", name="uq_refresh_tokens_hash"),
    sa.Index("ix_refresh_tokens_family", "family_id"),
    sa.Index("ix_refresh_tokens_member", "member_id"),
)

invites = sa.Table(
    "invites",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("workspace_id", sa.Uuid, nullable=False),
    sa.Column("role", sa.String(16), nullable=False),
    sa.Column("secret_hash", sa.String(64), nullable=False),
    sa.Column("created_by", sa.Uuid, nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
    sa.Column("expires_at", UtcDateTime, nullable=False),
    sa.Column("used_at", UtcDateTime, nullable=True),
    sa.Column("used_by", sa.Uuid, nullable=True),
    # Bound to one (normalized) email, if set.
    sa.Column("email", sa.String(320), nullable=True),
    sa.UniqueConstraint("secret_hash", name="uq_invites_secret_hash"),
)

# The nonces of OpenID Connect sign-ins already made (SHA-256), kept while
# their ID token could still be used: a replayed token is refused.
oidc_nonces = sa.Table(
    "oidc_nonces",
    metadata,
    sa.Column("nonce_hash", sa.String(64), primary_key=True),
    sa.Column("expires_at", UtcDateTime, nullable=False),
    sa.Index("ix_oidc_nonces_expires", "expires_at"),
)

personal_tokens = sa.Table(
    "personal_tokens",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("member_id", sa.Uuid, nullable=False),
    sa.Column("workspace_id", sa.Uuid, nullable=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("scope", sa.String(8), nullable=False),
    sa.Column("secret_hash", sa.String(64), nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
    sa.Column("expires_at", UtcDateTime, nullable=False),
    sa.Column("last_used_at", UtcDateTime, nullable=True),
    sa.Column("revoked_at", UtcDateTime, nullable=True),
    sa.UniqueConstraint("secret_hash", name="uq_personal_tokens_secret_hash"),
    sa.Index("ix_personal_tokens_member", "member_id", "id"),
)

# Sign-in attempts per login of a workspace in the current window (also for
# logins with no account: a refusal must not tell whether one exists).
sign_in_attempts = sa.Table(
    "sign_in_attempts",
    metadata,
    sa.Column("workspace_id", sa.Uuid, primary_key=True),
    sa.Column("login", sa.String(64), primary_key=True),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("window_start", UtcDateTime, nullable=False),
)

# The IM's audit log (services.common.audit): sign-ins, tokens, invites, roles, members.
audit_events = audit_table(metadata)
