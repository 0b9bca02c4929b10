"""The resident loop of one agent.

An idle runner awaits an event and costs nothing. Woken (by a message in one
of its groups, a task, or a Wake call), it takes the oldest work waiting:
its unread messages or its next queued task. A run streams a completion,
executes the tool calls it asks for (concurrently, results in call order),
reads what arrived meanwhile, and calls the model again, until the model
stops; then it answers in the chat that woke it (or finishes the task).
Every step is stored the moment it completes and streamed live while it forms.

People stay in charge: a paused agent finishes its step and waits; an
interrupt cuts the run at once, keeping what was streamed as an interrupted
step and answering every tool call (a cancelled result where it never ran),
so that the history stays valid for any model; resuming goes on from the
last step."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Coroutine
from dataclasses import replace

from services.common import errors
from services.runtime.domain.lifecycle import Next, resume_point
from services.runtime.domain.model import Agent, AgentState, Run, RunStatus, Task, shown_to_model
from services.runtime.service_layer.im_port import IMMessage
from services.runtime.service_layer.leases import LeaseLost
from services.runtime.service_layer.runner.core import _Cut, _is_answer, _Taken
from services.runtime.service_layer.runner.run import OneRun

logger = logging.getLogger(__name__)


class AgentRunner(OneRun):
    """One agent's serial loop. `start()` it, `wake()` it, `stop()` it; the
    lifecycle methods (`pause`, `resume`, `interrupt`, `terminate`,
    `start_again`) are the people's controls."""

    def start(self, *, look: bool = True) -> None:
        """Starts the loop; `look` makes it read its unread messages at once
        (which may have arrived while the runtime was down)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"agent-{self.agent.id}")
            if self.agent.state is AgentState.RUNNING:
                # The runtime stopped during a run: go on from its last step.
                self._continue = True
                look = True
            if look:
                self.catch_up()

    @property
    def in_run(self) -> bool:
        """Whether a run is in flight (from its start until it has ended)."""
        return self._current is not None

    def update(self, agent: Agent) -> None:
        """New settings (or a new main session) take effect from the next completion."""
        self.agent = replace(
            agent,
            state=self.agent.state,
            last_error=self.agent.last_error,
            tokens_used=self.agent.tokens_used,
            pause_pending=self.agent.pause_pending,
            state_version=self.agent.state_version,
        )

    def forget_history(self) -> None:
        """The stored steps changed under the runner (a person edited them):
        the next run reads them again."""
        self._env.history.take(self.agent.id)
        if self._current is None:
            self._steps = None

    def continue_from_history(self) -> None:
        """Makes the runner go on from its last step: call the model after
        input, or run the tool calls still without results."""
        self._continue = True
        self.wake()

    async def stop(self) -> None:
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._abort_streaming("the runner stopped mid-step; the step starts again where the agent runs next")
        self._env.history.take(self.agent.id)

    # -- the people's controls (the caller checks the transition) --------------

    async def pause(self) -> None:
        """PAUSED now if idle; a run goes on to its next step boundary (or its
        end, if no boundary comes) first, with the pause pending meanwhile."""
        current = self._current
        if current is None:
            await self._set_state(AgentState.PAUSED, "")
            return
        if not self.agent.pause_pending:
            self.agent = self.agent.with_state(self.agent.state, self.agent.last_error, pause_pending=True)
            await self._env.store.save_progress(self.agent, fence=self._fence())
            self._emit_state()
        # Answer with the state the request leaves: a run that begins is
        # RUNNING until its boundary; work that does not start is PAUSED now.
        begun = asyncio.ensure_future(self._begun.wait())
        await asyncio.wait([current, begun], return_when=asyncio.FIRST_COMPLETED)
        begun.cancel()
        if current.done():
            await self._apply_pending_pause()

    async def _apply_pending_pause(self) -> None:
        """A pause asked for during work that has ended takes effect now."""
        if self.agent.pause_pending and (self._current is None or self._current.done()):
            await self._set_state(AgentState.PAUSED, "")

    async def resume(self) -> None:
        """Back to work: what was cut short goes on, then what waits."""
        await self._set_state(AgentState.IDLE, "")
        self.continue_from_history()

    async def interrupt(self) -> None:
        """Cuts the run in flight at once and pauses."""
        await self._cut_run(_Cut("interrupted by a person", AgentState.PAUSED))
        if self.agent.state is not AgentState.PAUSED:
            await self._set_state(AgentState.PAUSED, "")

    async def terminate(self) -> None:
        """Cuts the run in flight; nothing more until `start_again`. A task
        left RUNNING by a pause goes back to the queue, as a cut one does."""
        await self._cut_run(_Cut("terminated by a person", AgentState.TERMINATED))
        if self.agent.state is not AgentState.TERMINATED:
            await self._set_state(AgentState.TERMINATED, "")
            tasks = self._env.tasks
            found = await tasks.running_task(self.agent.id) if tasks is not None else None
            if found is not None and tasks is not None:
                await tasks.put_back(found.task, fence=self._fence())

    async def start_again(self) -> None:
        await self._set_state(AgentState.IDLE, "")
        self.wake()

    async def cancel_task(self, task_id: uuid.UUID) -> bool:
        """Cuts the run of that task if it is the one in flight; False if not."""
        if self._running_task is None or self._running_task.id != task_id:
            return False
        await self._cut_run(_Cut("its task was cancelled", None))
        return True

    async def _cut_run(self, cut: _Cut) -> None:
        current = self._current
        if current is None or current.done():
            return
        # A run is cut once it has begun (its run and input stored): the
        # beginning is one short write, and cutting into it would leave a run
        # stored as running with nobody to end it.
        begun = asyncio.ensure_future(self._begun.wait())
        await asyncio.wait([current, begun], return_when=asyncio.FIRST_COMPLETED)
        begun.cancel()
        if current.done():
            return
        self._cut = cut
        current.cancel()
        # The run records what it had and ends itself; wait for that.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(current)

    # -- the loop -------------------------------------------------------------

    async def _loop(self) -> None:
        try:
            await self._cycles()
        except LeaseLost as lost:
            # Another replica runs the agent now, or this one can no longer
            # prove it may: what is stored stays for the owner to go on with.
            logger.info("agent %s stops here: %s", self.agent.id, lost)
            self.idle.set()

    async def _cycles(self) -> None:
        while True:
            if not self._wake.is_set():
                self.idle.set()
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._cycle()
                self._unreachable = 0
            except (asyncio.CancelledError, LeaseLost):
                raise
            except errors.Unavailable as error:
                # A dependency (the IM, the database) is away: not the agent's
                # fault. Look again later; the wait doubles up to a minute. A
                # run it cut short stays as stored and goes on then, as after
                # a restart.
                if self.agent.state is AgentState.RUNNING:
                    self._continue = True
                self._unreachable += 1
                delay = min(60.0, 0.5 * 2 ** (self._unreachable - 1))
                logger.warning("agent %s: %s; trying again in %.1f s", self.agent.id, error, delay)
                asyncio.get_running_loop().call_later(delay, self.wake)
            except Exception as error:
                logger.exception("agent %s failed", self.agent.id)
                # A pause asked for meanwhile still takes effect.
                state = AgentState.PAUSED if self.agent.pause_pending else AgentState.ERROR
                await self._set_state(state, f"internal error: {error}")

    async def _cycle(self) -> None:
        if self._unended is not None:
            await self._end_unended()
        # A person's wake retries a run that failed (its input is still unanswered).
        resume = self._continue or (
            self._retry and (self.agent.state is AgentState.ERROR or (self._failed and not self._paused()))
        )
        if not resume:
            # (A run cut by a restart applies its pending pause as it ends: see `_resume`.)
            await self._apply_pending_pause()
        if self.agent.state in (AgentState.PAUSED, AgentState.TERMINATED):
            return  # what arrives waits for a person
        self._retry = self._continue = False
        # One run per cycle: whatever arrives meanwhile wakes the runner again
        # (the loop then comes straight back), so no second look is needed.
        try:
            if resume:
                try:
                    await self._resume()
                except BaseException:
                    self._continue = True  # what was pending still is: the next cycle tries again
                    raise
                self.wake()  # then what waits
                return
            taken = await self._take_unread()
            task = await self._next_task(taken.messages)
            if task is not None:
                self._pending_reads = {}  # the messages stay unread for the next cycle
                self.wake()  # then the next task, or the messages
                await self._in_flight(self._run(_Taken(), task=task))
            elif taken.messages:
                await self._in_flight(self._run(taken))
            else:
                # Nothing to answer: read all the same (no step keeps them, so
                # reading them again after a crash costs nothing but the look).
                self._advance_marks(taken.marks)
                await self._mark_read()
        except BaseException:
            self._steps = None  # what failed may have left them behind the store
            raise
        finally:
            await self._schedule_retry()
            if self._env.tasks is not None and not self._paused():
                # Idle now: a task this process left RUNNING (a write lost to
                # a fault) is settled as its run ended.
                await self._env.tasks.settle_orphans(self.agent.id, fence=self._fence())
        self._keep_history()

    def _keep_history(self) -> None:
        # Idle, the runner itself holds no history; the shared cache may.
        if self._steps is not None and self._session_id == self.agent.session_id:
            self._env.history.keep(self.agent.id, self._steps)
        self._steps = None

    async def _in_flight(self, run: Coroutine[object, object, None]) -> None:
        """Runs a run as its own task, so that a person can cut it short."""
        self._begun.clear()
        self._current = asyncio.create_task(run, name=f"agent-run-{self.agent.id}")
        try:
            await asyncio.shield(self._current)
        except asyncio.CancelledError:
            if not self._current.done():  # the runner itself is stopping
                self._current.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._current
            raise
        finally:
            self._current = None
            self._cut = None
        # Asked for when no step boundary came (the work did not start, or ended first).
        await self._apply_pending_pause()

    async def _next_task(self, messages: list[IMMessage]) -> Task | None:
        """The next task if it came before the oldest unread message."""
        if self._env.tasks is None:
            return None
        task = await self._env.tasks.next_task(self.agent.id, now=self._env.clock())
        if task is None:
            return None
        if messages and messages[0].sent_at < task.created_at:
            self.wake()  # its turn comes after these messages: nothing else will wake the runner
            return None
        return task

    async def _schedule_retry(self) -> None:
        if self._env.tasks is None or self.agent.state in (AgentState.PAUSED, AgentState.TERMINATED):
            return
        due = await self._env.tasks.next_retry_at(self.agent.id)
        if self._retry_timer is not None:
            self._retry_timer.cancel()
            self._retry_timer = None
        if due is not None:
            delay = max(0.0, (due - self._env.clock()).total_seconds())
            self._retry_timer = asyncio.get_running_loop().call_later(delay, self.wake)

    async def _resume(self) -> None:
        """Goes on from the last step of the main session, if anything is pending:
        the run the runtime stopped in, or what a pause or interrupt cut short
        (with its task, if it was a task's)."""
        await self._open_session(self.agent.session_id)
        assert self._steps is not None
        tasks = self._env.tasks
        found = await tasks.running_task(self.agent.id) if tasks is not None else None
        stale = await self._env.store.running_run(self.agent.id)
        if stale is not None:
            await self._go_on_after_restart(stale, found.task if found is not None else None)
            return
        task: Task | None = None
        if found is not None and tasks is not None:
            if found.run is not None and found.run.status is RunStatus.INTERRUPTED:
                task = found.task  # paused or interrupted: it goes on below
            else:
                # Its run ended (or never began) and the task was not settled.
                await tasks.settle_as_run_ended(found, fence=self._fence())
        if resume_point(self._steps) is Next.NOTHING:
            if self.agent.state is AgentState.RUNNING:
                await self._set_state(AgentState.IDLE, "")
            if task is not None and tasks is not None:
                await tasks.put_back(task, fence=self._fence())
            return
        await self._in_flight(self._run(_Taken(), task=task, resumed=True))

    async def _go_on_after_restart(self, run: Run, task: Task | None) -> None:
        """The runtime stopped during `run`: it goes on, in the same run and with
        its task, from its last stored step. Recorded tool calls never run
        again; those cut short run again with the same keys, so their effects
        happen once."""
        self._running_task = task
        shown = shown_to_model(self._steps or [])
        last = shown[-1] if shown else None
        if self.agent.pause_pending:
            # Asked to pause before the runtime stopped: the pause takes effect now.
            ended = replace(run, status=RunStatus.INTERRUPTED, error="paused by a person")
            await self._end_run(replace(ended, ended_at=self._env.clock()), None)
            await self._settle_task(ended, "")
            return
        if last is not None and last.run_id == run.id and _is_answer(last):
            # It had its answer: what may be missing is its delivery (sent
            # again with the same key, it arrives once) and its end.
            await self._deliver(last, None if task is not None else (run.group_id or self._last_group()))
            completed = replace(run, status=RunStatus.COMPLETED, ended_at=self._env.clock())
            await self._end_run(completed, None)
            await self._settle_task(completed, last.message.content or "")
            return
        await self._in_flight(self._run(_Taken(), task=task, resumed=True, going_on=run))
