"""People's controls of an agent: start, pause, resume, interrupt, terminate, wake.

The caller is checked here (any replica); the control is checked against the
agent's live state and applied by its runner, wherever it runs
(`Runners.apply`); every change is an event on the agent's stream.

The runner applies a control outside any transaction of the store, so its
audit record is written right after the control took effect (a crash in
between loses the record, never the other way round).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from services.runtime.domain.commands import (
    InterruptAgent,
    PauseAgent,
    ResumeAgent,
    StartAgent,
    TerminateAgent,
    WakeAgent,
)
from services.runtime.domain.lifecycle import Control as Transition
from services.runtime.domain.model import Agent
from services.runtime.service_layer.access import AgentAccess
from services.runtime.service_layer.agent_audit import AgentAudit
from services.runtime.service_layer.messagebus import Handler
from services.runtime.service_layer.runners import Runners

# Cancels an agent's queued tasks; returns how many.
QueueClearer = Callable[[uuid.UUID], Awaitable[int]]


@dataclass(frozen=True)
class Control:
    """What the control handlers use."""

    access: AgentAccess
    audit: AgentAudit
    runners: Runners
    clear_queue: QueueClearer


async def _apply(
    deps: Control,
    command: StartAgent | PauseAgent | ResumeAgent | InterruptAgent,
    transition: Transition,
) -> Agent:
    """Checks the caller, has the runner apply `transition`, and records it (as the command's name)."""
    agent = await deps.access.controlled(command.caller, command.agent_id)
    agent = await deps.runners.apply(agent.id, transition)
    await deps.audit.write(command.caller, agent, type(command).__name__)
    return agent


async def start_agent(command: StartAgent, deps: Control) -> Agent:
    return await _apply(deps, command, Transition.START)


async def pause_agent(command: PauseAgent, deps: Control) -> Agent:
    return await _apply(deps, command, Transition.PAUSE)


async def resume_agent(command: ResumeAgent, deps: Control) -> Agent:
    return await _apply(deps, command, Transition.RESUME)


async def interrupt_agent(command: InterruptAgent, deps: Control) -> Agent:
    return await _apply(deps, command, Transition.INTERRUPT)


async def terminate_agent(command: TerminateAgent, deps: Control) -> Agent:
    agent = await deps.access.controlled(command.caller, command.agent_id)
    agent = await deps.runners.apply(agent.id, Transition.TERMINATE)
    cleared = await deps.clear_queue(agent.id) if command.clear_queue else 0
    await deps.audit.write(
        command.caller,
        agent,
        "TerminateAgent",
        details={"clear_queue": str(command.clear_queue).lower(), "tasks_cancelled": str(cleared)},
    )
    return agent


async def wake_agent(command: WakeAgent, deps: Control) -> Agent:
    """Wakes the agent's runner (a person's wake also retries a failed run)."""
    agent = await deps.access.controlled(command.caller, command.agent_id)
    deps.runners.wake(agent.id, retry=True)
    return agent


def handlers(deps: Control) -> dict[type[Any], Handler]:
    """The control commands' handlers, bound to `deps`."""
    return {
        StartAgent: partial(start_agent, deps=deps),
        PauseAgent: partial(pause_agent, deps=deps),
        ResumeAgent: partial(resume_agent, deps=deps),
        InterruptAgent: partial(interrupt_agent, deps=deps),
        TerminateAgent: partial(terminate_agent, deps=deps),
        WakeAgent: partial(wake_agent, deps=deps),
    }
