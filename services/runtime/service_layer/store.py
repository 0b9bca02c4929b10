"""Where the runtime keeps agents, runs and steps: the storage port.

Every method is atomic on its own; the runner appends a step the moment it
completes, so a crash loses at most the step in flight.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Sequence

from services.runtime.domain.model import Agent, Run, Step


class DuplicateStep(Exception):
    """A step with that (session, sequence) exists: another writer got there first."""


class DuplicateAgentRequest(Exception):
    """The request_id was recorded first by a concurrent call."""


class AgentStore(abc.ABC):
    """Storage of the runtime's agents, runs and steps."""

    # Agents

    @abc.abstractmethod
    async def add_agent(self, agent: Agent, *, request: tuple[uuid.UUID, str, str] | None = None) -> None:
        """Stores a new agent; with `request` = (scope, request_id, fingerprint) records the request too.

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
    async def update_agent(self, agent: Agent) -> None:
        """Replaces the stored agent's settings, state, error and token count."""

    @abc.abstractmethod
    async def save_progress(self, agent: Agent) -> None:
        """Stores what the agent's runner owns: its state, last error and
        tokens used (never its settings, which may change meanwhile)."""

    @abc.abstractmethod
    async def delete_agent(self, agent_id: uuid.UUID) -> None:
        """Marks the agent deleted; its runs and steps stay."""

    # Runs

    @abc.abstractmethod
    async def add_run(self, run: Run) -> None: ...

    async def begin_run(self, run: Run, agent: Agent, steps: Sequence[Step]) -> None:
        """Stores a new run, the agent's progress and the run's first steps, together.

        This default makes separate calls; an adapter may use one transaction.

        Raises:
            DuplicateStep: a step's (session, sequence) is taken.
        """
        await self.add_run(run)
        await self.save_progress(agent)
        for step in steps:
            await self.append_step(step)

    @abc.abstractmethod
    async def update_run(self, run: Run) -> None: ...

    async def end_run(self, run: Run, agent: Agent) -> None:
        """Stores how a run ended and the agent's progress, together.

        This default makes separate calls; an adapter may use one transaction.
        """
        await self.update_run(run)
        await self.save_progress(agent)

    @abc.abstractmethod
    async def list_runs(self, agent_id: uuid.UUID, *, before: uuid.UUID | None, limit: int) -> list[Run]:
        """An agent's runs, newest first, older than a run id."""

    # Steps

    @abc.abstractmethod
    async def append_step(self, step: Step) -> None:
        """Stores a completed step.

        Raises:
            DuplicateStep: its (session, sequence) is taken.
        """

    @abc.abstractmethod
    async def list_steps(
        self, session_id: uuid.UUID, *, after_sequence: int, limit: int, run_id: uuid.UUID | None = None
    ) -> list[Step]:
        """A session's steps after a sequence number, in order."""

    @abc.abstractmethod
    async def last_sequence(self, session_id: uuid.UUID) -> int:
        """The sequence number of the session's last step (0 if none)."""

    # IM watch cursors

    @abc.abstractmethod
    async def watch_cursors(self) -> dict[uuid.UUID, str]:
        """The saved cursor of each workspace's IM watch."""

    @abc.abstractmethod
    async def save_watch_cursors(self, cursors: dict[uuid.UUID, str]) -> None:
        """Saves (replacing) the cursors of these workspaces' IM watches."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Releases connections. Idempotent."""
