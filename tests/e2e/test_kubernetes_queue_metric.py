"""The query the autoscaling example (deploy/kubernetes/components/
queue-depth-autoscaling) tells operators to export as the runtime's queue
depth, run against the runtime's real schema on PostgreSQL: it must name the
real table, columns and statuses, and count what a replica could run now.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from services.runtime.adapters.sql import Database
from services.runtime.adapters.tables import tasks
from services.runtime.domain.model import TaskStatus

from .test_kubernetes import AUTOSCALING, KUBERNETES

AUTOSCALER = KUBERNETES / "components" / AUTOSCALING / "hpa.yaml"


def _documented_query() -> str:
    """The comment's indented block: the query, however many lines it spans."""
    comment = [line.removeprefix("#") for line in AUTOSCALER.read_text().splitlines() if line.startswith("#")]
    query = [line.strip() for line in comment if line.startswith("   ")]
    assert query and query[0].startswith("SELECT "), f"no indented SELECT in the comment of {AUTOSCALER}"
    return " ".join(query)


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
async def test_the_autoscaling_query_counts_the_tasks_waiting_to_run(own_runtime_url: str) -> None:
    now = datetime.now(UTC)
    hour = timedelta(hours=1)
    # (status, retry_at, waiting to run now)
    cases = [
        (TaskStatus.QUEUED, None, True),
        (TaskStatus.QUEUED, None, True),
        (TaskStatus.FAILED, now - hour, True),
        # Backing off: no replica would run it yet.
        (TaskStatus.FAILED, now + hour, False),
        (TaskStatus.RUNNING, None, False),
        (TaskStatus.SUCCEEDED, None, False),
        (TaskStatus.CANCELLED, None, False),
        (TaskStatus.DEAD, None, False),
    ]
    agent_id, session_id = uuid.uuid4(), uuid.uuid4()
    rows = [
        {
            "id": uuid.uuid4(),
            "agent_id": agent_id,
            "session_id": session_id,
            "input": "work",
            "status": status.value,
            "priority": 0,
            "attempts": 0,
            "last_error": "",
            "result": "",
            "request_id": "",
            "created_at": now,
            "retry_at": retry_at,
        }
        for status, retry_at, _ in cases
    ]
    database = Database(own_runtime_url)
    try:
        async with database.engine.begin() as conn:
            await conn.execute(tasks.insert(), rows)
            counted = (await conn.execute(sa.text(_documented_query()))).scalar_one()
    finally:
        await database.aclose()
    assert counted == sum(waiting for _, _, waiting in cases)
