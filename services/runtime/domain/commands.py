"""What callers ask the runtime to do, as commands: one dataclass per request.

A command names what to change and who asks (`caller`, None for the runtime
itself); `Command[R_co]` says what handling it returns. Each is handled by one
function of `services.runtime.service_layer.handlers`, through the message
bus (`services.runtime.service_layer.messagebus`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from services.common.identity import Caller
from services.runtime.domain.model import Agent, Placed

R_co = TypeVar("R_co", covariant=True)


class Command(Generic[R_co]):
    """A request to change something; handling it returns an `R_co`."""


# -- the people's controls of an agent ------------------------------------------


@dataclass(frozen=True, slots=True)
class StartAgent(Command[Agent]):
    """A terminated agent works again."""

    caller: Caller | None
    agent_id: str


@dataclass(frozen=True, slots=True)
class PauseAgent(Command[Agent]):
    """PAUSED now if idle, else at the run's next step boundary."""

    caller: Caller | None
    agent_id: str


@dataclass(frozen=True, slots=True)
class ResumeAgent(Command[Agent]):
    """Back to work: what was cut short goes on, then what waits."""

    caller: Caller | None
    agent_id: str


@dataclass(frozen=True, slots=True)
class InterruptAgent(Command[Agent]):
    """Cuts the run in flight at once and pauses."""

    caller: Caller | None
    agent_id: str


@dataclass(frozen=True, slots=True)
class TerminateAgent(Command[Agent]):
    """Cuts the run in flight; nothing more until StartAgent. `clear_queue`
    also cancels the agent's waiting tasks."""

    caller: Caller | None
    agent_id: str
    clear_queue: bool = False


@dataclass(frozen=True, slots=True)
class WakeAgent(Command[Agent]):
    """The agent looks for work now, and retries a run that failed."""

    caller: Caller | None
    agent_id: str


# -- tasks ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubmitTask(Command[Placed]):
    """Queues a task for the agent (the same one again for a repeated
    `request_id`), in its main session unless `session_id` names another;
    a higher `priority` runs first."""

    caller: Caller | None
    agent_id: str
    text: str
    request_id: str = ""
    session_id: str = ""
    priority: int = 0


@dataclass(frozen=True, slots=True)
class CancelTask(Command[Placed]):
    """Cancels a waiting task at once; a running one is cut short by its runner."""

    caller: Caller | None
    task_id: str
