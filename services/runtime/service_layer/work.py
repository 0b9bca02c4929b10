"""What a runner asks of the task queue: the port between `AgentRunner` and
`StoredTaskQueue`, so that the runner runs tasks in turn with its messages.

A runner's changes of its tasks carry its `fence` (see
`services.runtime.service_layer.leases`): refused with `LeaseLost` once
another replica runs the agent."""

from __future__ import annotations

import abc
import uuid
from collections.abc import Collection
from datetime import datetime

from services.runtime.domain.model import Task
from services.runtime.service_layer.leases import Fence
from services.runtime.service_layer.store import TaskInFlight


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
    async def started(
        self, task: Task, *, run_id: uuid.UUID, at: datetime, fence: Fence | None = None
    ) -> Task:
        """Marks it RUNNING (one more attempt) and tells the watchers; returns it so."""

    @abc.abstractmethod
    async def succeeded(self, task: Task, *, result: str, at: datetime, fence: Fence | None = None) -> None:
        """Marks it SUCCEEDED with the agent's final answer."""

    @abc.abstractmethod
    async def failed(self, task: Task, *, error: str, at: datetime, fence: Fence | None = None) -> None:
        """Marks it FAILED with a retry due after a backoff, or DEAD once
        out of attempts; the runner wakes itself when the retry is due."""

    @abc.abstractmethod
    async def put_back(self, task: Task, *, fence: Fence | None = None) -> None:
        """Its run was interrupted (pause, terminate, restart): QUEUED again,
        this attempt not counted, to run again when the agent resumes."""

    @abc.abstractmethod
    async def running_task(self, agent_id: uuid.UUID) -> TaskInFlight | None:
        """The agent's RUNNING task (at most one: an agent works on one thing
        at a time), with the run it was last in: the task a run cut by a
        restart, a pause or an interrupt goes on with."""

    @abc.abstractmethod
    async def continued(self, task: Task, *, run_id: uuid.UUID, fence: Fence | None = None) -> Task:
        """A RUNNING task goes on in another run (the one it was in was paused
        or interrupted), its attempt not counted again; returns it as stored
        (not RUNNING if a person cancelled it meanwhile: then it must not run)."""

    @abc.abstractmethod
    async def settle_as_run_ended(self, found: TaskInFlight, *, fence: Fence | None = None) -> bool:
        """Ends a RUNNING task as the run it was in ended (SUCCEEDED with its
        answer, FAILED or DEAD with its error; back in the queue, its attempt
        not counted, if the run was never stored or was interrupted). False
        if its run is still RUNNING (then nothing changes) or the task is no
        longer RUNNING."""

    @abc.abstractmethod
    async def settle_orphans(
        self, agent_id: uuid.UUID | None = None, *, fence: Fence | None = None
    ) -> list[Task]:
        """Settles (`settle_as_run_ended`) the RUNNING tasks of one agent, or
        of every agent, that nobody goes on with, as a crash between two
        writes leaves them: those of agents neither RUNNING (a restart goes on
        with their run) nor PAUSED (resuming goes on with it). For one agent
        this costs nothing unless this process may have left one behind.
        Returns those settled."""

    @abc.abstractmethod
    def may_have_changed(self, agent_id: uuid.UUID) -> None:
        """The agent's tasks may have changed unseen (elsewhere, or by a
        write whose answer was lost): they are read again when next needed."""

    @abc.abstractmethod
    def adopt(self, agent_ids: Collection[uuid.UUID]) -> None:
        """These agents' tasks are this process's to run from now on (another
        replica ran them): what it knew of them is read again, and a task
        left RUNNING is settled by their runners (`settle_orphans`)."""

    @abc.abstractmethod
    def let_go(self, agent_ids: Collection[uuid.UUID]) -> None:
        """Another replica runs these agents' tasks from now on: forgets them."""

    @abc.abstractmethod
    async def cancelled(self, task: Task, *, at: datetime, fence: Fence | None = None) -> None:
        """Its run was cut short because a person cancelled it: CANCELLED."""
