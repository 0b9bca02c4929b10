"""What a runner asks of the task queue: the port between `AgentRunner` and
`TaskService`, so that the runner runs tasks in turn with its messages."""

from __future__ import annotations

import abc
import uuid
from datetime import datetime

from services.runtime.domain.model import Task


class TaskQueue(abc.ABC):
    """An agent's queued tasks, as its runner takes them one at a time."""

    @abc.abstractmethod
    async def next_task(self, agent_id: uuid.UUID, *, now: datetime) -> Task | None:
        """The task to run next, without starting it: among the QUEUED ones
        and the FAILED ones whose retry is due, the highest priority, then
        the oldest."""

    @abc.abstractmethod
    async def next_retry_at(self, agent_id: uuid.UUID) -> datetime | None:
        """When the agent's earliest pending retry is due (None: none)."""

    @abc.abstractmethod
    async def started(self, task: Task, *, run_id: uuid.UUID, at: datetime) -> Task:
        """Marks it RUNNING (one more attempt) and tells the watchers; returns it so."""

    @abc.abstractmethod
    async def succeeded(self, task: Task, *, result: str, at: datetime) -> None:
        """Marks it SUCCEEDED with the agent's final answer."""

    @abc.abstractmethod
    async def failed(self, task: Task, *, error: str, at: datetime) -> None:
        """Marks it FAILED with a retry due after a backoff, or DEAD once
        out of attempts; the runner wakes itself when the retry is due."""

    @abc.abstractmethod
    async def put_back(self, task: Task) -> None:
        """Its run was interrupted (pause, terminate, restart): QUEUED again,
        this attempt not counted, to run again when the agent resumes."""

    @abc.abstractmethod
    async def running_task(self, agent_id: uuid.UUID, run_id: uuid.UUID) -> Task | None:
        """The agent's RUNNING task that the run works on, if any."""

    @abc.abstractmethod
    async def continued(self, task: Task, *, run_id: uuid.UUID) -> Task:
        """A RUNNING task goes on in another run (the one it ran in was cut by a
        restart), its attempt not counted again; returns it as stored (not
        RUNNING if a person cancelled it meanwhile: then it must not run)."""

    @abc.abstractmethod
    async def settle_orphans(self, agent_id: uuid.UUID | None = None) -> list[Task]:
        """Settles the RUNNING tasks (of one agent, or of every agent) whose run
        is gone or ended, as a crash between the two writes leaves them: one
        whose run was never stored goes back to the queue, its attempt not
        counted; one whose run ended ends as that run did. Tasks whose run is
        still RUNNING are its runner's. For one agent this costs nothing
        unless this process may have left one behind. Returns those settled."""

    @abc.abstractmethod
    async def cancelled(self, task: Task, *, at: datetime) -> None:
        """Its run was cut short because a person cancelled it: CANCELLED."""
