"""Where the runtime keeps agents, runs and steps: the storage port.

Every method is atomic on its own; the runner appends a step the moment it
completes, so a crash loses at most the step in flight.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from services.common.audit import AuditRecord
from services.runtime.domain.model import Agent, AgentState, Checkpoint, Run, Session, Step, Task, TaskStatus
from services.runtime.service_layer.leases import Fence


@dataclass(frozen=True, slots=True)
class TaskInFlight:
    """A RUNNING task, the run it was last in (None: never stored) and its
    agent's state (None: the agent was deleted)."""

    task: Task
    run: Run | None
    agent_state: AgentState | None


class AgentStore(abc.ABC):
    """Storage of the runtime's agents, runs and steps."""

    # Agents

    @abc.abstractmethod
    async def add_agent(
        self,
        agent: Agent,
        *,
        request: tuple[uuid.UUID, str, str] | None = None,
        audit: AuditRecord | None = None,
    ) -> None:
        """Stores a new agent; with `request` = (scope, request_id, fingerprint) records the request too.

        Every change below that takes `audit` stores that audit record in the
        same transaction, and only if the change was made.

        Raises:
            DuplicateAgentRequest: that (scope, request_id) was recorded first.
        """

    @abc.abstractmethod
    async def find_request(self, scope: uuid.UUID, request_id: str) -> tuple[str, uuid.UUID] | None:
        """The (fingerprint, agent id) a request_id was used for, if any."""

    @abc.abstractmethod
    async def get_agent(self, agent_id: uuid.UUID) -> Agent | None:
        """The agent, unless it does not exist or was deleted."""

    @abc.abstractmethod
    async def list_agents(
        self, workspace_id: uuid.UUID, *, parent_id: uuid.UUID | None, after: uuid.UUID | None, limit: int
    ) -> list[Agent]:
        """A workspace's agents (optionally one agent's children) in id order."""

    @abc.abstractmethod
    async def all_agents(self) -> list[Agent]:
        """Every agent that was not deleted (to start their runners)."""

    @abc.abstractmethod
    async def agent_places(self) -> dict[uuid.UUID, uuid.UUID]:
        """Every agent that was not deleted, by id, with its workspace: what
        a replica needs to tell which agents it runs, without reading them."""

    @abc.abstractmethod
    async def get_agents(self, agent_ids: Collection[uuid.UUID]) -> list[Agent]:
        """Those of the agents that exist and were not deleted."""

    @abc.abstractmethod
    async def update_agent(self, agent: Agent, *, audit: AuditRecord | None = None) -> None:
        """Replaces the stored agent's settings, state, error and token count."""

    @abc.abstractmethod
    async def save_progress(self, agent: Agent, *, fence: Fence | None = None) -> None:
        """Stores what the agent's runner owns: its state, last error and
        tokens used (never its settings, which may change meanwhile).

        A runner's writes carry its `fence` and raise `LeaseLost` when it is
        no longer the lease of the agent's shard (then nothing is stored)."""

    @abc.abstractmethod
    async def delete_agent(self, agent_id: uuid.UUID, *, audit: AuditRecord | None = None) -> None:
        """Marks the agent deleted; its runs and steps stay."""

    # Runs

    @abc.abstractmethod
    async def add_run(self, run: Run) -> None: ...

    @abc.abstractmethod
    async def begin_run(
        self,
        run: Run,
        agent: Agent,
        steps: Sequence[Step],
        *,
        read_marks: Mapping[uuid.UUID, uuid.UUID] | None = None,
        fence: Fence | None = None,
    ) -> None:
        """Stores a new run, the agent's progress, the run's first steps and
        the read marks of the messages they came from, in one transaction.

        Raises:
            DuplicateStep: a step's (session, sequence) is taken (then nothing is stored).
        """

    @abc.abstractmethod
    async def update_run(self, run: Run) -> None: ...

    async def end_run(self, run: Run, agent: Agent, *, fence: Fence | None = None) -> None:
        """Stores how a run ended and the agent's progress, together.

        This default makes separate calls; an adapter may use one transaction.
        """
        await self.update_run(run)
        await self.save_progress(agent, fence=fence)

    @abc.abstractmethod
    async def list_runs(self, agent_id: uuid.UUID, *, before: uuid.UUID | None, limit: int) -> list[Run]:
        """An agent's runs, newest first, older than a run id."""

    @abc.abstractmethod
    async def running_run(self, agent_id: uuid.UUID) -> Run | None:
        """The agent's run stored as RUNNING (one a runtime stopped in), if any.

        Found by its status, not as the newest: run ids carry the clock of the
        replica that began the run, and replicas' clocks may disagree.
        """

    # Steps

    @abc.abstractmethod
    async def append_step(self, step: Step, *, fence: Fence | None = None) -> None:
        """Stores a completed step.

        Raises:
            DuplicateStep: its (session, sequence) is taken.
        """

    @abc.abstractmethod
    async def append_input(
        self,
        agent_id: uuid.UUID,
        steps: Sequence[Step],
        read_marks: Mapping[uuid.UUID, uuid.UUID],
        *,
        fence: Fence | None = None,
    ) -> None:
        """Stores steps made of messages the agent read, and moves its read
        marks (group id -> message id) forward to them, in one transaction.

        Raises:
            DuplicateStep: a step's (session, sequence) is taken (then nothing is stored).
        """

    @abc.abstractmethod
    async def read_marks(self, agent_id: uuid.UUID) -> dict[uuid.UUID, uuid.UUID]:
        """How far the agent has taken each group's messages as input (group id -> message id)."""

    @abc.abstractmethod
    async def list_steps(
        self, session_id: uuid.UUID, *, after_sequence: int, limit: int, run_id: uuid.UUID | None = None
    ) -> list[Step]:
        """A session's steps after a sequence number, in order."""

    @abc.abstractmethod
    async def last_sequence(self, session_id: uuid.UUID) -> int:
        """The sequence number of the session's last step (0 if none)."""

    # -- History: sessions, checkpoints, the step archive (the history handlers) --

    @abc.abstractmethod
    async def add_session(self, session: Session) -> None:
        """Stores a new (empty) session; one already stored is left as it is."""

    @abc.abstractmethod
    async def get_session(self, session_id: uuid.UUID) -> Session | None: ...

    @abc.abstractmethod
    async def list_sessions(self, agent_id: uuid.UUID) -> list[tuple[Session, int]]:
        """An agent's sessions, oldest first, each with its number of steps."""

    @abc.abstractmethod
    async def set_main_session(
        self, agent_id: uuid.UUID, session_id: uuid.UUID, *, audit: AuditRecord | None = None
    ) -> None:
        """Makes the session the agent's main one (`Agent.session_id`)."""

    @abc.abstractmethod
    async def fork_session(self, session: Session, *, audit: AuditRecord | None = None) -> int:
        """Stores `session` (or, stored already and empty, marks it forked)
        with copies of the steps of `session.forked_from` up to
        `session.forked_at_sequence`, together; returns how many were copied.

        The copies get new ids and the new session's agent; they keep their
        sequence numbers, runs, times and everything else.
        """

    @abc.abstractmethod
    async def edit_step(
        self, step_id: uuid.UUID, content: str, *, at: datetime, audit: AuditRecord | None = None
    ) -> bool:
        """Archives the step as it is (reason "edited") and replaces its
        content, together; False if there is no such step."""

    @abc.abstractmethod
    async def archive_steps(
        self,
        session_id: uuid.UUID,
        *,
        reason: str,
        at: datetime,
        sequences: Sequence[int] = (),
        after_sequence: int | None = None,
        audit: AuditRecord | None = None,
    ) -> int:
        """Moves steps of a session to the archive (with `reason`) together:
        those numbered `sequences`, and every one after `after_sequence` if
        given. Returns how many moved."""

    @abc.abstractmethod
    async def archived_steps(self, session_id: uuid.UUID) -> list[tuple[str, Step]]:
        """A session's archived steps with why they were archived, in the order archived."""

    @abc.abstractmethod
    async def add_checkpoint(self, checkpoint: Checkpoint, *, audit: AuditRecord | None = None) -> None:
        """Stores a checkpoint with its agent's settings (name, role, system
        prompt, model, tools, token budget)."""

    @abc.abstractmethod
    async def get_checkpoint(self, checkpoint_id: uuid.UUID) -> Checkpoint | None:
        """The checkpoint; its `settings` are its agent as stored now with the
        checkpoint's settings in place (None if the agent is gone)."""

    @abc.abstractmethod
    async def list_checkpoints(
        self, agent_id: uuid.UUID, *, before: uuid.UUID | None, limit: int
    ) -> list[Checkpoint]:
        """An agent's checkpoints, newest first, older than a checkpoint id."""

    @abc.abstractmethod
    async def restore_checkpoint(self, checkpoint: Checkpoint, *, at: datetime) -> int:
        """Archives (reason "restored") the steps of the checkpoint's session
        after its sequence number and makes that session the agent's main
        one, together; returns how many steps were archived. (The settings
        go back through `update_agent`.)"""

    # -- Tasks (TaskService) --

    @abc.abstractmethod
    async def add_task(self, task: Task, *, audit: AuditRecord | None = None) -> Task:
        """Stores a new task, unless its agent has one with the same non-empty
        request_id: returns the stored task, `task` or the one recorded first
        (also when concurrent calls race)."""

    @abc.abstractmethod
    async def get_task(self, task_id: uuid.UUID) -> Task | None: ...

    @abc.abstractmethod
    async def find_task(self, agent_id: uuid.UUID, request_id: str) -> Task | None:
        """The agent's task submitted with that (non-empty) request_id, if any."""

    @abc.abstractmethod
    async def list_tasks(self, agent_id: uuid.UUID, *, before: uuid.UUID | None, limit: int) -> list[Task]:
        """An agent's tasks, newest first, older than a task id."""

    @abc.abstractmethod
    async def next_task(self, agent_id: uuid.UUID, *, now: datetime) -> Task | None:
        """The head of the agent's queue: among its QUEUED tasks and the FAILED
        ones whose retry is due by `now`, the highest priority, then the oldest
        (by created_at, then id)."""

    @abc.abstractmethod
    async def agents_with_waiting_tasks(self) -> set[uuid.UUID]:
        """The agents with a QUEUED or FAILED task."""

    @abc.abstractmethod
    async def waiting_tasks(self, agent_id: uuid.UUID) -> list[Task]:
        """The agent's QUEUED and FAILED tasks (those awaiting a retry too)."""

    @abc.abstractmethod
    async def tasks_ahead(self, task: Task, *, now: datetime) -> int:
        """How many tasks `next_task` would serve before `task`."""

    @abc.abstractmethod
    async def next_retry_at(self, agent_id: uuid.UUID) -> datetime | None:
        """The earliest retry_at of the agent's FAILED tasks (None: none)."""

    @abc.abstractmethod
    async def update_task(
        self, task: Task, *, expected: Collection[TaskStatus], fence: Fence | None = None
    ) -> bool:
        """Stores the task's progress (status, attempts, last error, result,
        times, run) if its stored status is still one of `expected`: a
        compare-and-set, so that of two racing changes one wins. Returns
        whether it was stored."""

    @abc.abstractmethod
    async def cancel_waiting_tasks(self, agent_id: uuid.UUID, *, at: datetime) -> list[Task]:
        """Marks every QUEUED or FAILED task of the agent CANCELLED (ended
        `at`), together; returns them as now stored."""

    @abc.abstractmethod
    async def running_tasks(self, agent_id: uuid.UUID | None = None) -> list[TaskInFlight]:
        """The RUNNING tasks (of one agent, or of all), with their runs and agents' states."""

    # The memory outbox: ended runs not yet archived (ending a run queues it;
    # changing its steps queues it again).

    @abc.abstractmethod
    async def unarchived_runs(self, *, limit: int) -> list[Run]:
        """Ended runs the memory service does not have yet, oldest end first."""

    @abc.abstractmethod
    async def mark_archived(self, run_id: uuid.UUID, *, at: datetime) -> None:
        """Records that the memory service has the run as it is now."""

    @abc.abstractmethod
    async def end_stale_runs(
        self, *, error: str, at: datetime, agent_ids: Collection[uuid.UUID] | None = None
    ) -> int:
        """Ends INTERRUPTED (with `error`) every run still RUNNING whose agent
        is not (of `agent_ids` only, if given): nobody will go on with those.
        Returns how many."""

    @abc.abstractmethod
    async def queue_stats(self, agent_id: uuid.UUID) -> tuple[int, int, float]:
        """(tasks QUEUED or FAILED, tasks RUNNING, the mean of started_at -
        created_at in milliseconds over the tasks that started, 0 if none)."""

    # The audit log

    @abc.abstractmethod
    async def record_audit(self, record: AuditRecord) -> None:
        """Stores an audit record on its own: for changes the agent's runner
        applies (controls), which have no transaction of the store's."""

    # IM watch cursors

    @abc.abstractmethod
    async def watch_cursors(self) -> dict[uuid.UUID, str]:
        """The saved cursor of each workspace's IM watch."""

    @abc.abstractmethod
    async def save_watch_cursors(
        self, cursors: dict[uuid.UUID, str], *, fences: Sequence[Fence] = ()
    ) -> None:
        """Saves (replacing) the cursors of these workspaces' IM watches,
        unless one of `fences` (of the workspaces' shards) is lost (`LeaseLost`)."""

    @property
    def refused_fenced_writes(self) -> int:
        """How many writes carrying a fence were refused (`LeaseLost`) since
        the store opened: attempts of a stale owner, none of them stored."""
        return 0

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Releases connections. Idempotent."""
