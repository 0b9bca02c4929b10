"""Alembic environment for the memory's schema.

Migrations run on a connection handed in by `services.memory.adapters.migrate`
(config.attributes["connection"]). The version table is the memory's own, so
the memory can share one database with the IM and the runtime.
"""

from __future__ import annotations

from alembic import context

from services.memory.adapters.tables import SCHEMA, metadata

connection = context.config.attributes["connection"]
is_postgres = connection.dialect.name == "postgresql"
context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table="memory_alembic_version",
    version_table_schema=SCHEMA if is_postgres else None,
    include_schemas=is_postgres,
    render_as_batch=not is_postgres,
)
with context.begin_transaction():
    context.run_migrations()
