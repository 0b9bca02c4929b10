"""People's controls of an agent: start, pause, resume, interrupt, terminate, wake.

Each control is checked against the agent's live state and applied through
its runner (`Runners`); every change is an event on the agent's stream.

The runner applies a control outside any transaction of the store, so its
audit record is written right after the control took effect (a crash in
between loses the record, never the other way round).

Controls of one process are applied one at a time (`Control.lock`), so that
two people pausing and terminating at once see a consistent order.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from services.common.identity import Caller
from services.runtime.domain.commands import (
    InterruptAgent,
    PauseAgent,
    ResumeAgent,
    StartAgent,
    TerminateAgent,
    WakeAgent,
)
from services.runtime.domain.errors import AgentGone
from services.runtime.domain.lifecycle import Control as Transition
from services.runtime.domain.lifecycle import check_control
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
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


async def _checked(deps: Control, caller: Caller | None, agent_id: str, transition: Transition) -> Agent:
    """The live agent, if the caller may control it and `transition` may be applied now."""
    agent = await deps.access.controlled(caller, agent_id)
    live = deps.runners.live(agent.id)
    if live is None:
        raise AgentGone(f"agent {agent.id} was deleted")
    check_control(transition, live.state)
    return live


async def _apply(
    deps: Control,
    command: StartAgent | PauseAgent | ResumeAgent | InterruptAgent,
    transition: Transition,
    act: Callable[[uuid.UUID], Awaitable[Agent]],
) -> Agent:
    """Checks the caller and the transition, has the runner `act`, and records it (as the command's name)."""
    async with deps.lock:
        agent = await _checked(deps, command.caller, command.agent_id, transition)
        agent = await act(agent.id)
        await deps.audit.write(command.caller, agent, type(command).__name__)
        return agent


async def start_agent(command: StartAgent, deps: Control) -> Agent:
    return await _apply(deps, command, Transition.START, deps.runners.start_again)


async def pause_agent(command: PauseAgent, deps: Control) -> Agent:
    return await _apply(deps, command, Transition.PAUSE, deps.runners.pause)


async def resume_agent(command: ResumeAgent, deps: Control) -> Agent:
    return await _apply(deps, command, Transition.RESUME, deps.runners.resume)


async def interrupt_agent(command: InterruptAgent, deps: Control) -> Agent:
    return await _apply(deps, command, Transition.INTERRUPT, deps.runners.interrupt)


async def terminate_agent(command: TerminateAgent, deps: Control) -> Agent:
    async with deps.lock:
        agent = await _checked(deps, command.caller, command.agent_id, Transition.TERMINATE)
        agent = await deps.runners.terminate(agent.id)
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
