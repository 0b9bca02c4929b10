"""Sends every ended run to long-term memory, never holding an agent up.

The outbox is the runs table itself: ending a run leaves it without
`archived_at` in the same write, and changing its steps later clears that
again. The archiver wakes when a run ends (and once at start), sends what
waits, oldest first, and records each run the memory service took. A memory
that cannot be reached is tried again after a wait that doubles up to a
limit (a timer, not a poll); a run the memory refuses is skipped until the
next wake, so that one bad run never blocks the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from datetime import datetime

from services.common import errors
from services.runtime.domain.conversations import step_chats
from services.runtime.domain.errors import IMError, MemoryRefused, MemoryUnavailable
from services.runtime.domain.model import Run, StepKind
from services.runtime.service_layer.im_port import IMPort
from services.runtime.service_layer.memory_port import Conversation, MemoryPort, RunRecord
from services.runtime.service_layer.store import AgentStore

logger = logging.getLogger(__name__)

# More steps than any run is allowed to have (iterations are limited).
_MAX_RUN_STEPS = 100_000


class Archiver:
    def __init__(
        self,
        store: AgentStore,
        memory: MemoryPort,
        im: IMPort,
        *,
        clock: Callable[[], datetime],
        batch: int = 50,
        retry_initial_seconds: float = 0.5,
        retry_max_seconds: float = 60.0,
    ) -> None:
        self._store, self._memory, self._im, self._clock = store, memory, im, clock
        self._batch = batch
        self._retry_initial, self._retry_max = retry_initial_seconds, retry_max_seconds
        self._due = asyncio.Event()
        self._due.set()  # what an earlier process left waits from the start
        self._failures = 0
        self._task: asyncio.Task[None] | None = None
        self.archived = 0  # runs sent, for tests and stats
        self.idle = asyncio.Event()

    def notify(self) -> None:
        """A run ended (or its steps changed): send what waits."""
        self._due.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="memory-archiver")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            if not self._due.is_set():
                self.idle.set()
            await self._due.wait()
            self.idle.clear()
            self._due.clear()
            try:
                await self._send_waiting()
                self._failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the memory or the database is away: later
                self._failures += 1
                delay = min(self._retry_max, self._retry_initial * 2 ** (self._failures - 1))
                logger.warning("memory archive paused: %s; trying again in %.1f s", error, delay)
                asyncio.get_running_loop().call_later(delay, self._due.set)

    async def _send_waiting(self) -> None:
        refused: set[uuid.UUID] = set()
        while True:
            waiting = await self._store.unarchived_runs(limit=self._batch + len(refused))
            todo = [run for run in waiting if run.id not in refused]
            if not todo:
                return
            for run in todo:
                try:
                    await self.send(run)
                except MemoryUnavailable:
                    raise
                except MemoryRefused as error:
                    logger.error("memory refused run %s: %s", run.id, error)
                    refused.add(run.id)

    async def send(self, run: Run) -> None:
        """Archives one ended run and records it."""
        agent = await self._store.get_agent(run.agent_id)
        if agent is not None:
            stored = await self._store.list_steps(
                run.session_id, after_sequence=0, limit=_MAX_RUN_STEPS, run_id=run.id
            )
            # Recalled memories are copies of what memory has: not remembered
            # again; nor what a broken stream had said (its retry follows).
            steps = [step for step in stored if step.kind not in (StepKind.RECALL, StepKind.CUT)]
            paired = step_chats(steps, run.group_id)
            chats = sorted({chat for _, chat in paired if chat is not None})
            conversations = [await self._conversation(agent.member_id, chat) for chat in chats]
            await self._memory.archive(RunRecord(agent, run, paired, conversations))
        # A deleted agent's runs are not remembered (nothing could recall them).
        await self._store.mark_archived(run.id, at=self._clock())
        self.archived += 1

    async def _conversation(self, agent_member: uuid.UUID, chat: uuid.UUID) -> Conversation:
        try:
            group = await self._im.get_group(agent_member, chat)
        except errors.Unavailable:
            raise
        except IMError:
            # The agent left the chat or it is gone: its members cannot be
            # known, so only the agent may see what came from it.
            return Conversation(chat, (agent_member,))
        return Conversation(chat, group.member_ids)
