"""The agents' runners, as the rest of the service layer reaches them.

The port is narrow and by agent id: nothing outside the runners holds a
runner. One process may host every runner (`Supervisor`); among replicas,
each call is forwarded to the replica that runs the agent
(`ReplicaRunners`).
"""

from __future__ import annotations

import abc
import uuid

from services.runtime.domain.lifecycle import Control
from services.runtime.domain.model import Agent


class Runners(abc.ABC):
    """Starts, stops, wakes and controls agents' runners, by agent id."""

    def replica_of(self, agent: Agent) -> str:
        """The replica that runs the agent now; empty where one process runs
        every agent (or, among replicas, while nobody holds its shard)."""
        return ""

    @abc.abstractmethod
    def live(self, agent_id: uuid.UUID) -> Agent | None:
        """The agent as its runner holds it (its live state and token use);
        None if no runner runs it."""

    @abc.abstractmethod
    def start_agent(self, agent: Agent) -> None:
        """Starts the agent's runner (nothing if it runs already)."""

    @abc.abstractmethod
    async def stop_agent(self, agent_id: uuid.UUID) -> None:
        """Stops the agent's runner, if any (the agent is being deleted)."""

    @abc.abstractmethod
    def update(self, agent: Agent) -> Agent | None:
        """New settings (or main session) for the agent's runner, from its next
        completion; returns the live agent, or None if no runner runs it."""

    @abc.abstractmethod
    def wake(self, agent_id: uuid.UUID, *, retry: bool = False) -> None:
        """Makes the runner look for work; `retry` also retries a failed run."""

    @abc.abstractmethod
    def forget_history(self, agent_id: uuid.UUID) -> None:
        """The agent's stored steps changed under its runner (a person edited
        them): its next run reads them again."""

    @abc.abstractmethod
    async def go_on(self, agent_id: uuid.UUID) -> None:
        """Makes the runner go on from the agent's last step (a PAUSED agent
        is resumed to do so)."""

    @abc.abstractmethod
    async def apply(self, agent_id: uuid.UUID, control: Control) -> Agent:
        """A person's control, checked against the agent's live state and
        applied by its runner, one control at a time per agent; returns the
        agent as the control leaves it.

        START: a terminated agent works again. PAUSE: PAUSED now if idle,
        else at the run's next step boundary. RESUME: what was cut short goes
        on, then what waits. INTERRUPT: cuts the run in flight at once and
        pauses. TERMINATE: cuts the run in flight; nothing more until START.

        Raises:
            InvalidTransition: the live state does not allow the control.
            AgentGone: no runner runs the agent (it was deleted meanwhile).
        """

    @abc.abstractmethod
    async def cancel_task(self, agent_id: uuid.UUID, task_id: uuid.UUID) -> bool:
        """Cuts the agent's run of that task short if it is the one in flight;
        False if not (or no runner runs the agent)."""
