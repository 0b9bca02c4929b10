"""The runtime's tables (SQLAlchemy Core). On PostgreSQL they live in the
`runtime` schema; on SQLite the schema is translated away (see `sql.Database`),
so the names do not clash with the IM's when both share one file.
"""

from __future__ import annotations

import sqlalchemy as sa

from services.common.audit_sql import audit_table
from services.common.sql import UtcDateTime

SCHEMA = "runtime"

metadata = sa.MetaData(schema=SCHEMA)

agents = sa.Table(
    "agents",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("workspace_id", sa.Uuid, nullable=False),
    sa.Column("member_id", sa.Uuid, nullable=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("role", sa.Text, nullable=False),
    sa.Column("system_prompt", sa.Text, nullable=False),
    # ModelSettings, one column per field.
    sa.Column("model", sa.Text, nullable=False),
    sa.Column("base_url", sa.Text, nullable=False),
    sa.Column("temperature", sa.Float, nullable=True),
    sa.Column("max_tokens", sa.Integer, nullable=True),
    sa.Column("context_tokens", sa.Integer, nullable=True),
    sa.Column("tools", sa.JSON, nullable=False),
    sa.Column("parent_id", sa.Uuid, nullable=True),
    sa.Column("created_at", UtcDateTime, nullable=False),
    sa.Column("updated_at", UtcDateTime, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("last_error", sa.Text, nullable=False),
    sa.Column("tokens_used", sa.BigInteger, nullable=False),
    sa.Column("token_budget", sa.BigInteger, nullable=False),
    sa.Column("session_id", sa.Uuid, nullable=False),
    # Deleted agents keep their row so that their runs and steps stay readable.
    sa.Column("deleted", sa.Boolean, nullable=False),
    sa.Column("pause_pending", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("auto_recall", sa.Integer, nullable=True),
    sa.Column("state_version", sa.BigInteger, nullable=False, server_default="0"),
    # The member who owns it; NULL for agents made before owners were kept.
    sa.Column("owner_id", sa.Uuid, nullable=True),
    sa.Index("ix_agents_workspace", "workspace_id", "id"),
    sa.Index("ix_agents_parent", "parent_id", "id"),
)

# request_ids of CreateAgent calls, for idempotent retries.
agent_requests = sa.Table(
    "agent_requests",
    metadata,
    sa.Column("scope", sa.Uuid, primary_key=True),
    sa.Column("request_id", sa.String(128), primary_key=True),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("agent_id", sa.Uuid, nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
)

runs = sa.Table(
    "runs",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("agent_id", sa.Uuid, nullable=False),
    sa.Column("session_id", sa.Uuid, nullable=False),
    sa.Column("status", sa.String(32), nullable=False),
    sa.Column("trigger_message_ids", sa.JSON, nullable=False),
    sa.Column("started_at", UtcDateTime, nullable=False),
    sa.Column("iterations", sa.Integer, nullable=False),
    sa.Column("error", sa.Text, nullable=False),
    sa.Column("ended_at", UtcDateTime, nullable=True),
    # The chat the run answers; None for a task (and for runs from before 0006).
    sa.Column("group_id", sa.Uuid, nullable=True),
    # When the memory service got the run. The ended runs without it are the
    # memory outbox: ending a run queues it in the same write.
    sa.Column("archived_at", UtcDateTime, nullable=True),
    sa.Index("ix_runs_agent", "agent_id", "id"),
    sa.Index(
        "ix_runs_unarchived",
        "ended_at",
        sqlite_where=sa.text("archived_at IS NULL AND ended_at IS NOT NULL"),
        postgresql_where=sa.text("archived_at IS NULL AND ended_at IS NOT NULL"),
    ),
)

steps = sa.Table(
    "steps",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("agent_id", sa.Uuid, nullable=False),
    sa.Column("session_id", sa.Uuid, nullable=False),
    sa.Column("run_id", sa.Uuid, nullable=False),
    sa.Column("sequence", sa.BigInteger, nullable=False),
    # The native chat message.
    sa.Column("role", sa.String(16), nullable=False),
    sa.Column("content", sa.Text, nullable=True),
    sa.Column("reasoning", sa.Text, nullable=True),
    sa.Column("tool_calls", sa.JSON, nullable=False),
    sa.Column("tool_call_id", sa.Text, nullable=True),
    sa.Column("name", sa.Text, nullable=True),
    # StepMetrics, one column per field, so that usage can be summed in SQL.
    sa.Column("duration_ms", sa.Float, nullable=False),
    sa.Column("first_token_ms", sa.Float, nullable=False),
    sa.Column("input_tokens", sa.BigInteger, nullable=False),
    sa.Column("output_tokens", sa.BigInteger, nullable=False),
    sa.Column("cached_tokens", sa.BigInteger, nullable=False),
    sa.Column("model", sa.Text, nullable=False),
    sa.Column("tool_duration_ms", sa.Float, nullable=False),
    sa.Column("usage_estimated", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("created_at", UtcDateTime, nullable=False),
    sa.Column("interrupted", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("kind", sa.String(16), nullable=False, server_default="message"),
    sa.Column("summary_through", sa.BigInteger, nullable=False, server_default="0"),
    # Input steps: the message (sender, chat, their names) or task they came from.
    sa.Column("origin", sa.JSON, nullable=True),
    # A sequence number is written once: a second writer of it is stale. The
    # constraint's index also serves a session's reads in order.
    sa.UniqueConstraint("session_id", "sequence", name="uq_steps_session_sequence"),
    sa.Index("ix_steps_run", "run_id", "sequence"),
)

# How far the IM watch of each workspace got: a restart resumes from there and
# the IM replays what came since, so only the agents it concerns wake up. A
# cursor saved late only makes the replay longer; never is anything skipped.
watch_cursors = sa.Table(
    "watch_cursors",
    metadata,
    sa.Column("workspace_id", sa.Uuid, primary_key=True),
    sa.Column("cursor", sa.String(64), nullable=False),
    sa.Column("updated_at", UtcDateTime, nullable=False),
)

# How far each agent has taken each of its chats' messages as input: written
# with the steps they became, so that a message is input exactly once even if
# the IM's read mark (moved after) is lost to a crash.
read_marks = sa.Table(
    "read_marks",
    metadata,
    sa.Column("agent_id", sa.Uuid, primary_key=True),
    sa.Column("group_id", sa.Uuid, primary_key=True),
    sa.Column("message_id", sa.Uuid, nullable=False),
)

# The threads of an agent's steps; `agents.session_id` names the main one.
sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("agent_id", sa.Uuid, nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
    sa.Column("forked_from", sa.Uuid, nullable=True),
    sa.Column("forked_at_sequence", sa.BigInteger, nullable=False),
    sa.Index("ix_sessions_agent", "agent_id", "id"),
)

checkpoints = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("agent_id", sa.Uuid, nullable=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("session_id", sa.Uuid, nullable=False),
    sa.Column("sequence", sa.BigInteger, nullable=False),
    # The agent's settings then, as the agents table's columns.
    sa.Column("settings", sa.JSON, nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
    sa.Index("ix_checkpoints_agent", "agent_id", "id"),
)

# Steps taken out of a session (edited, deleted, retried from, restored
# past): kept whole, with when and why, so that nothing is lost.
step_archive = sa.Table(
    "step_archive",
    metadata,
    sa.Column("archive_id", sa.Uuid, primary_key=True),
    sa.Column("archived_at", UtcDateTime, nullable=False),
    sa.Column("reason", sa.String(32), nullable=False),
    *[sa.Column(c.name, c.type, nullable=c.nullable) for c in steps.columns],
    sa.Index("ix_step_archive_session", "session_id", "sequence"),
)

tasks = sa.Table(
    "tasks",
    metadata,
    sa.Column("id", sa.Uuid, primary_key=True),
    sa.Column("agent_id", sa.Uuid, nullable=False),
    sa.Column("session_id", sa.Uuid, nullable=False),
    sa.Column("input", sa.Text, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("priority", sa.Integer, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("last_error", sa.Text, nullable=False),
    sa.Column("result", sa.Text, nullable=False),
    # Empty when the submitter gave none; else unique per agent.
    sa.Column("request_id", sa.String(128), nullable=False),
    sa.Column("created_at", UtcDateTime, nullable=False),
    sa.Column("started_at", UtcDateTime, nullable=True),
    sa.Column("ended_at", UtcDateTime, nullable=True),
    sa.Column("retry_at", UtcDateTime, nullable=True),
    sa.Column("run_id", sa.Uuid, nullable=True),
    sa.Index("ix_tasks_agent", "agent_id", "id"),
    # The queue: per agent and status, by priority then arrival. The next
    # task is the first entry of an index range (see `SqlAgentStore.next_task`).
    sa.Index("ix_tasks_queue", "agent_id", "status", "priority", "created_at", "id"),
    # The tasks left running (crash recovery looks for them across all agents).
    sa.Index(
        "ix_tasks_running",
        "agent_id",
        sqlite_where=sa.text("status = 'running'"),
        postgresql_where=sa.text("status = 'running'"),
    ),
    # The agents with tasks waiting (every replica's reconcile looks for them
    # across all agents): the few waiting rows, not every task ever finished.
    # With the status, the index covers the look (else SQLite prefers to scan
    # all of ix_tasks_queue, which does).
    sa.Index(
        "ix_tasks_waiting",
        "agent_id",
        "status",
        sqlite_where=sa.text("status IN ('queued', 'failed')"),
        postgresql_where=sa.text("status IN ('queued', 'failed')"),
    ),
    sa.Index(
        "uq_tasks_agent_request",
        "agent_id",
        "request_id",
        unique=True,
        sqlite_where=sa.text("request_id != ''"),
        postgresql_where=sa.text("request_id != ''"),
    ),
)

# The runtime's audit log (services.common.audit): agents and what people did to them.
audit_events = audit_table(metadata, "agent_audit_events")

# Who owns each shard of agents (see services.runtime.domain.shards). Times are
# seconds since the epoch by the database's clock, never a replica's: a lease
# expires when the database says so, whatever the replicas' clocks say.
shard_leases = sa.Table(
    "shard_leases",
    metadata,
    sa.Column("shard", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("owner", sa.String(128), nullable=True),
    # Incremented by every take and release: a write fenced by an older epoch is refused.
    sa.Column("epoch", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("expires_at", sa.Float, nullable=False, server_default="0"),
)

# The live runtime replicas (a row each, kept alive by the lease renewal).
replicas = sa.Table(
    "replicas",
    metadata,
    sa.Column("id", sa.String(128), primary_key=True),
    sa.Column("address", sa.Text, nullable=False, server_default=""),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
    # Its last report of itself (JSON of `ReplicaStatus`), written with each renewal.
    sa.Column("reported_at", sa.Float, nullable=False, server_default="0"),
    sa.Column("report", sa.Text, nullable=False, server_default=""),
)
