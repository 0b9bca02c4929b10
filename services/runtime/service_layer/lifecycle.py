"""People's controls of an agent: start, pause, resume, interrupt, terminate."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

from services.common.identity import Caller
from services.runtime.domain.errors import AgentGone
from services.runtime.domain.lifecycle import Control, check_control
from services.runtime.domain.model import Agent
from services.runtime.service_layer.agents import AgentService
from services.runtime.service_layer.runners import Runners

# Cancels an agent's queued tasks; returns how many.
QueueClearer = Callable[[uuid.UUID], Awaitable[int]]


class LifecycleService:
    """Checks each control against the agent's live state and applies it
    through its runner; every change is an event on the agent's stream.

    The runner applies a control outside any transaction of the store, so its
    audit record is written right after the control took effect (a crash in
    between loses the record, never the other way round).

    Controls of one process are applied one at a time, so that two people
    pausing and terminating at once see a consistent order.
    """

    def __init__(
        self, *, agents: AgentService, runners: Runners, clear_queue: QueueClearer | None = None
    ) -> None:
        self._agents = agents
        self._runners = runners
        self._clear_queue = clear_queue
        self._lock = asyncio.Lock()

    async def _checked(self, principal: Caller | None, agent_id: str, control: Control) -> Agent:
        """The live agent, if the caller may control it and `control` may be applied now."""
        agent = await self._agents.controlled(principal, agent_id)
        live = self._runners.live(agent.id)
        if live is None:
            raise AgentGone(f"agent {agent.id} was deleted")
        check_control(control, live.state)
        return live

    async def start(self, principal: Caller | None, agent_id: str) -> Agent:
        async with self._lock:
            agent = await self._checked(principal, agent_id, Control.START)
            agent = await self._runners.start_again(agent.id)
            await self._agents.recorded(principal, agent, "StartAgent")
            return agent

    async def pause(self, principal: Caller | None, agent_id: str) -> Agent:
        async with self._lock:
            agent = await self._checked(principal, agent_id, Control.PAUSE)
            agent = await self._runners.pause(agent.id)
            await self._agents.recorded(principal, agent, "PauseAgent")
            return agent

    async def resume(self, principal: Caller | None, agent_id: str) -> Agent:
        async with self._lock:
            agent = await self._checked(principal, agent_id, Control.RESUME)
            agent = await self._runners.resume(agent.id)
            await self._agents.recorded(principal, agent, "ResumeAgent")
            return agent

    async def interrupt(self, principal: Caller | None, agent_id: str) -> Agent:
        async with self._lock:
            agent = await self._checked(principal, agent_id, Control.INTERRUPT)
            agent = await self._runners.interrupt(agent.id)
            await self._agents.recorded(principal, agent, "InterruptAgent")
            return agent

    async def terminate(self, principal: Caller | None, agent_id: str, *, clear_queue: bool) -> Agent:
        async with self._lock:
            agent = await self._checked(principal, agent_id, Control.TERMINATE)
            agent = await self._runners.terminate(agent.id)
            cleared = 0
            if clear_queue and self._clear_queue is not None:
                cleared = await self._clear_queue(agent.id)
            await self._agents.recorded(
                principal,
                agent,
                "TerminateAgent",
                details={"clear_queue": str(clear_queue).lower(), "tasks_cancelled": str(cleared)},
            )
            return agent
