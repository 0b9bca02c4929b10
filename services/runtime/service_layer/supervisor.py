"""Keeps one runner per agent and wakes them from the IM's event stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from services.runtime.domain.errors import AgentGone
from services.runtime.domain.lifecycle import Control, check_control
from services.runtime.domain.model import Agent, AgentState, Emitted, OwnerChanged
from services.runtime.domain.shards import shard_of
from services.runtime.service_layer.im_port import IMEvent
from services.runtime.service_layer.runner import STOPPED_DURING_RUN, AgentRunner, RunnerEnv
from services.runtime.service_layer.runners import Runners

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sharding:
    """Which agents this replica runs, among several: those of the shards it
    holds (`holds`), a shard being a workspace's hash among `shard_count`."""

    shard_count: int
    holds: Callable[[int], bool]

    def runs_here(self, workspace_id: uuid.UUID) -> bool:
        return self.holds(self.shard(workspace_id))

    def shard(self, workspace_id: uuid.UUID) -> int:
        return shard_of(workspace_id, self.shard_count)


class Supervisor(Runners):
    """Starts, updates and stops runners; routes IM messages to the agents they concern.

    Per workspace with agents it holds one IM watch for those agents'
    members; when the set changes the watch restarts from its last cursor,
    so no message is missed.

    A workspace's cursor is saved once every event up to it has been dealt
    with (its runners are all idle again), so that after a restart the watch
    resumes from there: the IM replays what came since and wakes just the
    agents it concerns, instead of every agent asking for its unread messages.

    Each message reaches its agents' runners with the event (one push per
    wake): they ask the IM for their unread messages only to catch up, when
    nothing tells what they missed: at their start, when the first watch of
    a workspace starts at the live end, and when the events' sequence
    numbers show a gap (an event lost on the way). An event that comes
    again, or late, is not passed on twice.

    Among several replicas (`sharding`), it runs the agents of the shards its
    replica holds: their runners start as a shard is gained
    (`shards_gained`) and stop, where they are, as it is lost (`shards_lost`);
    the next owner goes on from what is stored.

    Args:
        cursor_save_delay: seconds of events gathered into one cursor write.
        sharding: the shards this replica runs; None: every agent.
    """

    def __init__(
        self, env: RunnerEnv, *, cursor_save_delay: float = 1.0, sharding: Sharding | None = None
    ) -> None:
        self._sharding = sharding
        # An agent's create_sub_agent tool makes the child (`env.create_sub_agent`)
        # and the supervisor starts the child's runner.
        self._make_child = env.create_sub_agent
        self._env = replace(env, create_sub_agent=self._create_sub_agent)
        self._runners: dict[uuid.UUID, AgentRunner] = {}
        self._by_member: dict[uuid.UUID, AgentRunner] = {}
        self._watches: dict[uuid.UUID, asyncio.Task[None]] = {}
        self._cursors: dict[uuid.UUID, str] = {}
        # The sequence number of the last message event routed, per workspace.
        self._sequences: dict[uuid.UUID, int] = {}
        self._save_delay = cursor_save_delay
        self._savers: dict[uuid.UUID, asyncio.Task[None]] = {}
        self._controls = asyncio.Lock()

    async def _create_sub_agent(
        self, parent: Agent, name: str, role: str, system_prompt: str, request_id: str
    ) -> Agent:
        child = await self._make_child(parent, name, role, system_prompt, request_id)
        self.start_agent(child)
        return child

    async def start(self) -> int:
        """Starts a runner for every stored agent; returns how many.

        First it settles what the last process may have left half-done: runs
        left RUNNING by an agent that is not (nobody goes on with them) end
        INTERRUPTED, and tasks left RUNNING by a run that is gone or ended are
        settled (`TaskQueue.settle_orphans`); runs of RUNNING agents are their
        runners' to go on with.
        """
        store = self._env.store
        self._cursors = await store.watch_cursors()
        if self._sharding is not None:
            return 0  # the agents of each shard start as it is gained
        stale = await store.end_stale_runs(error=STOPPED_DURING_RUN, at=self._env.clock())
        orphans = await self._env.tasks.settle_orphans() if self._env.tasks is not None else []
        if stale or orphans:
            logger.info("settled %d runs and %d tasks left running by the last process", stale, len(orphans))
        agents = await store.all_agents()
        self._start_all(agents)
        return len(agents)

    def _start_all(self, agents: Iterable[Agent]) -> None:
        started = []
        for agent in agents:
            if agent.id in self._runners:
                continue
            # An idle agent of a workspace with a saved cursor waits for the
            # replay to wake it; one that was busy or failing looks at once.
            replayed = agent.workspace_id in self._cursors and agent.state is AgentState.IDLE
            self._add(agent, look=not replayed)
            started.append(agent)
        for workspace_id in {a.workspace_id for a in started}:
            self._restart_watch(workspace_id)

    async def shards_gained(self, shards: frozenset[int]) -> None:
        """Starts the runners of the agents of `shards`, which this replica now holds.

        Runs their last owner left RUNNING for agents that are not end (as
        at a start); tasks it left RUNNING are settled by the runners.
        """
        sharding = self._sharding
        assert sharding is not None
        store = self._env.store
        places = await store.agent_places()
        mine = await store.get_agents([a for a, w in places.items() if sharding.shard(w) in shards])
        if not mine:
            return
        ids = [a.id for a in mine]
        await store.end_stale_runs(error=STOPPED_DURING_RUN, at=self._env.clock(), agent_ids=ids)
        if self._env.tasks is not None:
            self._env.tasks.adopt(ids)
            # A task the last owner marked RUNNING before it died with the
            # run unstored has an idle agent that nothing wakes: settled now
            # (put back in the queue), it is taken below with the waiting ones.
            workspaces = {a.id: a.workspace_id for a in mine}
            for agent_id in {f.task.agent_id for f in await store.running_tasks()} & workspaces.keys():
                fence = self._env.fences.fence_for(workspaces[agent_id])
                await self._env.tasks.settle_orphans(agent_id, fence=fence)
        # The cursors as the last owner saved them: its watches' replay starts there.
        self._cursors.update(await store.watch_cursors())
        self._start_all(mine)
        # Watches elsewhere read the stored steps again: the last owner may
        # have stored steps it never announced.
        now = self._env.clock()
        for agent in mine:
            self._env.hub.publish(
                Emitted(agent.id, now, OwnerChanged()), workspace_id=agent.workspace_id, from_runner=True
            )
        # A task queued while the shard moved (its word went to the last
        # owner, or nowhere) is taken now, not at the next reconcile.
        for agent_id in await store.agents_with_waiting_tasks() & set(ids):
            self.look_again(agent_id)
        logger.info("shards gained: %d, with %d agents", len(shards), len(mine))

    async def shards_lost(self, shards: frozenset[int]) -> None:
        """Stops, where they are, the runners of the agents of `shards`, which
        another replica runs from now on (or this one can no longer prove it holds)."""
        sharding = self._sharding
        assert sharding is not None
        leaving = [r for r in self._runners.values() if sharding.shard(r.agent.workspace_id) in shards]
        for runner in leaving:
            del self._runners[runner.agent.id]
            self._by_member.pop(runner.agent.member_id, None)
        # The runners stop first and all at once: a task cancelled in a
        # database call can take seconds to end (its connection closed
        # gracefully, or not heard from at all across a partition), and the
        # lease may already be another replica's.
        stopping = [asyncio.ensure_future(runner.stop()) for runner in leaving]
        workspaces = {r.agent.workspace_id for r in leaving}
        savers = [saver for w in workspaces if (saver := self._savers.pop(w, None)) is not None]
        for saver in savers:
            saver.cancel()
        for workspace_id in workspaces:
            self._restart_watch(workspace_id)
            # The next owner starts from the cursor it finds saved.
            self._cursors.pop(workspace_id, None)
            self._sequences.pop(workspace_id, None)
        await asyncio.gather(*stopping)
        for saver in savers:
            with contextlib.suppress(asyncio.CancelledError):
                await saver
        if self._env.tasks is not None:
            self._env.tasks.let_go([r.agent.id for r in leaving])
        if leaving:
            logger.info("shards lost: %d, with %d agents", len(shards), len(leaving))

    def busy(self, shard: int) -> bool:
        """Whether an agent of `shard` is at work here (a run, or reading what came)."""
        sharding = self._sharding
        if sharding is None:
            return False
        return any(
            not r.idle.is_set() and sharding.shard(r.agent.workspace_id) == shard
            for r in self._runners.values()
        )

    @property
    def agent_count(self) -> int:
        """How many agents run here."""
        return len(self._runners)

    @property
    def runs_in_flight(self) -> int:
        """How many of the agents that run here are in a run now."""
        return sum(1 for runner in self._runners.values() if runner.in_run)

    def runner(self, agent_id: uuid.UUID) -> AgentRunner | None:
        """The agent's runner in this process (for tests and the runtime's own wiring)."""
        return self._runners.get(agent_id)

    def _running(self, agent_id: uuid.UUID) -> AgentRunner:
        runner = self._runners.get(agent_id)
        if runner is None:
            raise AgentGone(f"agent {agent_id} was deleted")
        return runner

    def start_agent(self, agent: Agent) -> None:
        if agent.id in self._runners:
            return
        if self._sharding is not None and not self._sharding.runs_here(agent.workspace_id):
            return  # its shard's owner runs it
        self._add(agent)
        self._restart_watch(agent.workspace_id)

    def _add(self, agent: Agent, *, look: bool = True) -> AgentRunner:
        runner = AgentRunner(agent, self._env)
        self._runners[agent.id] = runner
        self._by_member[agent.member_id] = runner
        runner.start(look=look)
        return runner

    async def stop_agent(self, agent_id: uuid.UUID) -> None:
        runner = self._runners.pop(agent_id, None)
        if runner is None:
            return
        self._by_member.pop(runner.agent.member_id, None)
        await runner.stop()
        self._restart_watch(runner.agent.workspace_id)

    # -- the port's calls of one runner -------------------------------------------

    def live(self, agent_id: uuid.UUID) -> Agent | None:
        runner = self._runners.get(agent_id)
        return runner.agent if runner is not None else None

    def update(self, agent: Agent) -> Agent | None:
        runner = self._runners.get(agent.id)
        if runner is None:
            return None
        runner.update(agent)
        return runner.agent

    def wake(self, agent_id: uuid.UUID, *, retry: bool = False) -> None:
        runner = self._runners.get(agent_id)
        if runner is not None:
            runner.wake(retry=retry)

    def look_again(self, agent_id: uuid.UUID, *, retry: bool = False) -> None:
        """Wakes the runner after a change made elsewhere (another replica
        queued a task): what it knows of the agent's tasks is read again."""
        if self._env.tasks is not None:
            self._env.tasks.may_have_changed(agent_id)
        self.wake(agent_id, retry=retry)

    async def reconcile(self) -> None:
        """Reads again what other replicas may have changed while their word
        could not reach this one: agents created or deleted in the shards it
        holds, and tasks queued for its agents."""
        sharding = self._sharding
        if sharding is None:
            return
        # Ids and workspaces only: at every interval, reading whole agents
        # (thousands of them, idle) would cost a replica more than the rest.
        store = self._env.store
        present = {
            a for a, workspace in (await store.agent_places()).items() if sharding.runs_here(workspace)
        }
        for agent_id in [a for a in self._runners if a not in present]:
            await self.stop_agent(agent_id)  # deleted meanwhile
        created = await store.get_agents([a for a in present if a not in self._runners])
        self._start_all(a for a in created if sharding.runs_here(a.workspace_id))
        for agent_id in await store.agents_with_waiting_tasks():
            if agent_id in self._runners:
                self.look_again(agent_id)

    def forget_history(self, agent_id: uuid.UUID) -> None:
        runner = self._runners.get(agent_id)
        if runner is not None:
            runner.forget_history()

    async def go_on(self, agent_id: uuid.UUID) -> None:
        runner = self._runners.get(agent_id)
        if runner is None:
            return
        if runner.agent.state is AgentState.PAUSED:
            await self.apply(agent_id, Control.RESUME)
        else:
            runner.continue_from_history()

    async def apply(self, agent_id: uuid.UUID, control: Control) -> Agent:
        # One control at a time, so that two people pausing and terminating
        # at once see a consistent order.
        async with self._controls:
            runner = self._running(agent_id)
            check_control(control, runner.agent.state)
            act = {
                Control.START: runner.start_again,
                Control.PAUSE: runner.pause,
                Control.RESUME: runner.resume,
                Control.INTERRUPT: runner.interrupt,
                Control.TERMINATE: runner.terminate,
            }[control]
            await act()
            return runner.agent

    async def cancel_task(self, agent_id: uuid.UUID, task_id: uuid.UUID) -> bool:
        runner = self._runners.get(agent_id)
        return runner is not None and await runner.cancel_task(task_id)

    # -- routing the IM's events ------------------------------------------------

    def is_agent(self, member_id: uuid.UUID) -> bool:
        return member_id in self._by_member

    def _restart_watch(self, workspace_id: uuid.UUID) -> None:
        task = self._watches.pop(workspace_id, None)
        if task is not None:
            task.cancel()
        members = [r.agent.member_id for r in self._runners.values() if r.agent.workspace_id == workspace_id]
        if members:
            self._watches[workspace_id] = asyncio.create_task(
                self._watch(workspace_id, members), name=f"im-watch-{workspace_id}"
            )

    async def _watch(self, workspace_id: uuid.UUID, members: list[uuid.UUID]) -> None:
        cursor = self._cursors.get(workspace_id, "")

        def subscribed(start: str) -> None:
            # A later watch (when the agents change) resumes from here, and the
            # IM replays what came since; only the first one, started from
            # "now", has to look for what was sent while no watch was in place.
            if workspace_id not in self._cursors:
                self._cursors[workspace_id] = start
                self._save_cursor_soon(workspace_id)
            if workspace_id not in self._sequences and start.isascii() and start.isdigit():
                self._sequences[workspace_id] = int(start)
            if cursor:
                return
            self._catch_up(workspace_id)

        try:
            stream = self._env.im.watch(
                workspace_id, member_ids=members, after_cursor=cursor, on_subscribed=subscribed
            )
            async for event in stream:
                last = self._sequences.get(workspace_id)
                if last is not None and event.sequence <= last:
                    continue  # passed on already (or caught up with, when it came late)
                if last is None or event.previous_sequence != last:
                    # Events went missing in between: ask the IM what they were.
                    self._catch_up(workspace_id)
                self._sequences[workspace_id] = event.sequence
                self._cursors[workspace_id] = event.cursor
                self._route(event)
                self._save_cursor_soon(workspace_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("the IM watch of workspace %s failed", workspace_id)

    def _catch_up(self, workspace_id: uuid.UUID) -> None:
        for runner in self._runners.values():
            if runner.agent.workspace_id == workspace_id:
                runner.catch_up()

    def _route(self, event: IMEvent) -> None:
        message = event.message
        self._env.guard.observe(message.group_id, from_agent=self.is_agent(message.sender_id))
        from_person = not self.is_agent(message.sender_id)
        for member_id in event.member_ids:
            runner = self._by_member.get(member_id)
            if runner is not None and member_id != message.sender_id:
                runner.on_message(message, from_person=from_person)
                runner.deliver(message)

    def _save_cursor_soon(self, workspace_id: uuid.UUID) -> None:
        saver = self._savers.get(workspace_id)
        if saver is None or saver.done():
            self._savers[workspace_id] = asyncio.create_task(
                self._save_cursor_when_settled(workspace_id), name=f"cursor-saver-{workspace_id}"
            )

    async def _save_cursor_when_settled(self, workspace_id: uuid.UUID) -> None:
        await asyncio.sleep(self._save_delay)
        while busy := [
            r.idle.wait()
            for r in self._runners.values()
            if r.agent.workspace_id == workspace_id and not r.idle.is_set()
        ]:
            await asyncio.gather(*busy)
        # No await since the check: every event routed so far has been dealt
        # with, unless an idle agent still owes input (it met the database or
        # the IM away and waits to try again). Its next start would look for
        # unread messages only if it were not idle, so the cursor stays: the
        # next event saves it again.
        cursor = self._cursors.get(workspace_id)
        if cursor is None or any(
            r.owes_input and r.agent.state is AgentState.IDLE
            for r in self._runners.values()
            if r.agent.workspace_id == workspace_id
        ):
            return
        try:
            fence = self._env.fences.fence_for(workspace_id)
            await self._env.store.save_watch_cursors(
                {workspace_id: cursor}, fences=[fence] if fence is not None else []
            )
        except Exception as error:
            # Only makes a restart replay more; the next event tries again.
            logger.warning("saving the IM cursor of workspace %s failed: %s", workspace_id, error)

    async def drain(self, seconds: float) -> None:
        """Takes no more messages and gives the runs in flight up to
        `seconds` to end, so that a replica stopping on purpose hands its
        agents over idle (what is still running then is cut, and its next
        owner goes on from the last stored step)."""
        for task in self._watches.values():
            task.cancel()
        await asyncio.gather(*self._watches.values(), return_exceptions=True)
        self._watches.clear()
        busy = [r.idle.wait() for r in self._runners.values() if not r.idle.is_set()]
        if not busy:
            return
        try:
            async with asyncio.timeout(seconds):
                await asyncio.gather(*busy)
        except TimeoutError:
            left = sum(not r.idle.is_set() for r in self._runners.values())
            logger.info(
                "%d runs were still going after %.1f s of draining; their next owner goes on", left, seconds
            )

    async def aclose(self) -> None:
        """Stops every watch and runner."""
        for task in self._watches.values():
            task.cancel()
        for task in self._watches.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._watches.clear()
        for saver in self._savers.values():
            saver.cancel()
        for saver in self._savers.values():
            with contextlib.suppress(asyncio.CancelledError):
                await saver
        self._savers.clear()
        await asyncio.gather(*[runner.stop() for runner in self._runners.values()])
