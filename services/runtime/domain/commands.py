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
from services.runtime.domain.llm import Role
from services.runtime.domain.model import Agent, AgentDraft, Checkpoint, Placed, Session, Step

R_co = TypeVar("R_co", covariant=True)


class Command(Generic[R_co]):
    """A request to change something; handling it returns an `R_co`."""


# -- agents --------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateAgent(Command[Agent]):
    """Makes an agent as `draft` says, in the caller's workspace (which
    `workspace_id`, if given, must be), a child of `parent_id` if given, owned
    by the caller; the same agent again for a repeated `request_id`."""

    caller: Caller | None
    draft: AgentDraft
    workspace_id: str = ""
    parent_id: str = ""
    request_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateAgent(Command[Agent]):
    """Changes the agent's settings named in `fields` to `draft`'s."""

    caller: Caller | None
    agent_id: str
    draft: AgentDraft
    fields: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteAgent(Command[None]):
    """Stops the agent's runner and deletes the agent."""

    caller: Caller | None
    agent_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TellAgentOwners(Command[int]):
    """The runtime tells the IM who owns each agent it hosts (for agents made
    before the IM knew owners); returns how many the IM changed."""


# -- the people's controls of an agent ------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StartAgent(Command[Agent]):
    """A terminated agent works again."""

    caller: Caller | None
    agent_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PauseAgent(Command[Agent]):
    """PAUSED now if idle, else at the run's next step boundary."""

    caller: Caller | None
    agent_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeAgent(Command[Agent]):
    """Back to work: what was cut short goes on, then what waits."""

    caller: Caller | None
    agent_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class InterruptAgent(Command[Agent]):
    """Cuts the run in flight at once and pauses."""

    caller: Caller | None
    agent_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TerminateAgent(Command[Agent]):
    """Cuts the run in flight; nothing more until StartAgent. `clear_queue`
    also cancels the agent's waiting tasks."""

    caller: Caller | None
    agent_id: str
    clear_queue: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class WakeAgent(Command[Agent]):
    """The agent looks for work now, and retries a run that failed."""

    caller: Caller | None
    agent_id: str


# -- tasks ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
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


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelTask(Command[Placed]):
    """Cancels a waiting task at once; a running one is cut short by its runner."""

    caller: Caller | None
    task_id: str


# -- an agent's history ----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateStep(Command[Step]):
    """Replaces the content of step `sequence` of a paused agent's main session."""

    caller: Caller | None
    agent_id: str
    sequence: int
    content: str


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteStep(Command[list[int]]):
    """Removes step `sequence` of a paused agent (with the results of its tool
    calls); returns the sequence numbers removed."""

    caller: Caller | None
    agent_id: str
    sequence: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AddNote(Command[Step]):
    """Appends a system or user step to a paused agent's main session (`role`
    None: the caller sent neither)."""

    caller: Caller | None
    agent_id: str
    role: Role | None
    content: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateCheckpoint(Command[Checkpoint]):
    """Names the agent's main session up to its last step, and its settings."""

    caller: Caller | None
    agent_id: str
    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreCheckpoint(Command[Agent]):
    """Brings back a checkpoint's settings and position."""

    caller: Caller | None
    agent_id: str
    checkpoint_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SetMainSession(Command[Agent]):
    """Makes one of the agent's sessions its main one."""

    caller: Caller | None
    agent_id: str
    session_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryFromStep(Command[Agent]):
    """Removes step `sequence` and those after it, and continues from the step before."""

    caller: Caller | None
    agent_id: str
    sequence: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ForkFromStep(Command[tuple[Session, Agent]]):
    """Copies steps 1..`sequence` of the main session into a new main session
    of the agent, or of a new agent (`new_agent`, named `name` if given), and
    continues there; returns the session and the agent it is the main one of."""

    caller: Caller | None
    agent_id: str
    sequence: int
    new_agent: bool = False
    name: str = ""
