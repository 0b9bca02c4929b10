"""Alembic environment for the IM's schema.

Migrations run on a connection handed in by `services.im.adapters.migrate`
(config.attributes["connection"]), so they work from async code, tests and
the command line alike.
"""

from __future__ import annotations

from alembic import context

from services.im.adapters.tables import SCHEMA, metadata

connection = context.config.attributes["connection"]
is_postgres = connection.dialect.name == "postgresql"
context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table="im_alembic_version",
    version_table_schema=SCHEMA if is_postgres else None,
    include_schemas=is_postgres,
    render_as_batch=not is_postgres,
)
with context.begin_transaction():
    context.run_migrations()
