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
from services.runtime.service_layer.runner import AgentRunner
from services.runtime.service_layer.supervisor import Supervisor

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
        self, *, agents: AgentService, supervisor: Supervisor, clear_queue: QueueClearer | None = None
    ) -> None:
        self._agents = agents
        self._supervisor = supervisor
        self._clear_queue = clear_queue
        self._lock = asyncio.Lock()

    async def _runner(self, principal: Caller | None, agent_id: str) -> AgentRunner:
        agent = await self._agents.controlled(principal, agent_id)
        runner = self._supervisor.runner(agent.id)
        if runner is None:
            raise AgentGone(f"agent {agent.id} was deleted")
        return runner

    async def start(self, principal: Caller | None, agent_id: str) -> Agent:
        async with self._lock:
            runner = await self._runner(principal, agent_id)
            check_control(Control.START, runner.agent.state)
            await runner.start_again()
            await self._agents.recorded(principal, runner.agent, "StartAgent")
            return runner.agent

    async def pause(self, principal: Caller | None, agent_id: str) -> Agent:
        async with self._lock:
            runner = await self._runner(principal, agent_id)
            check_control(Control.PAUSE, runner.agent.state)
            await runner.pause()
            await self._agents.recorded(principal, runner.agent, "PauseAgent")
            return runner.agent

    async def resume(self, principal: Caller | None, agent_id: str) -> Agent:
        async with self._lock:
            runner = await self._runner(principal, agent_id)
            check_control(Control.RESUME, runner.agent.state)
            await runner.resume()
            await self._agents.recorded(principal, runner.agent, "ResumeAgent")
            return runner.agent

    async def interrupt(self, principal: Caller | None, agent_id: str) -> Agent:
        async with self._lock:
            runner = await self._runner(principal, agent_id)
            check_control(Control.INTERRUPT, runner.agent.state)
            await runner.interrupt()
            await self._agents.recorded(principal, runner.agent, "InterruptAgent")
            return runner.agent

    async def terminate(self, principal: Caller | None, agent_id: str, *, clear_queue: bool) -> Agent:
        async with self._lock:
            runner = await self._runner(principal, agent_id)
            check_control(Control.TERMINATE, runner.agent.state)
            await runner.terminate()
            cleared = 0
            if clear_queue and self._clear_queue is not None:
                cleared = await self._clear_queue(runner.agent.id)
            await self._agents.recorded(
                principal,
                runner.agent,
                "TerminateAgent",
                details={"clear_queue": str(clear_queue).lower(), "tasks_cancelled": str(cleared)},
            )
            return runner.agent
