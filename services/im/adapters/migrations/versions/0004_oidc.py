"""OpenID Connect sign-in: accounts get an email (unique in their workspace)
and may have no login and password; invites may be bound to an email; the
nonces of sign-ins made are kept while their ID token could be replayed.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from services.common.sql import UtcDateTime

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return "im" if op.get_bind().dialect.name == "postgresql" else None


def upgrade() -> None:
    schema = _schema()
    # Batch mode: SQLite changes nullability only by copying the table.
    with op.batch_alter_table("accounts", schema=schema) as batch:
        batch.alter_column("login", existing_type=sa.String(64), nullable=True)
        batch.alter_column("password_hash", existing_type=sa.Text, nullable=True)
        batch.add_column(sa.Column("email", sa.String(320), nullable=True))
        batch.create_unique_constraint("uq_accounts_email", ["workspace_id", "email"])
    op.create_index("ix_accounts_login", "accounts", ["login"], schema=schema)
    op.create_index("ix_accounts_email", "accounts", ["email"], schema=schema)
    op.add_column("invites", sa.Column("email", sa.String(320), nullable=True), schema=schema)
    op.create_table(
        "oidc_nonces",
        sa.Column("nonce_hash", sa.String(64), primary_key=True),
        sa.Column("expires_at", UtcDateTime, nullable=False),
        schema=schema,
    )
    op.create_index("ix_oidc_nonces_expires", "oidc_nonces", ["expires_at"], schema=schema)


def downgrade() -> None:
    schema = _schema()
    op.drop_table("oidc_nonces", schema=schema)
    with op.batch_alter_table("invites", schema=schema) as batch:
        batch.drop_column("email")
    op.drop_index("ix_accounts_email", "accounts", schema=schema)
    op.drop_index("ix_accounts_login", "accounts", schema=schema)
    # Accounts with no password (made through OpenID Connect) cannot exist before 0003.
    accounts = f"{schema}.accounts" if schema else "accounts"
    op.execute(f"DELETE FROM {accounts} WHERE login IS NULL OR password_hash IS NULL")
    with op.batch_alter_table("accounts", schema=schema) as batch:
        batch.drop_constraint("uq_accounts_email", type_="unique")
        batch.drop_column("email")
        batch.alter_column("password_hash", existing_type=sa.Text, nullable=False)
        batch.alter_column("login", existing_type=sa.String(64), nullable=False)
