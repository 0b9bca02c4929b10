"""The live feeds of agents (WatchAgent, WatchAgents): what happened since a
step, then what happens, each event shown to those who may see it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from services.common.identity import Caller
from services.runtime.domain.access import Action, Verdict, Viewer, decide
from services.runtime.domain.errors import HubClosed, InvalidAgentRequest
from services.runtime.domain.model import (
    Agent,
    Emitted,
    MainSessionChanged,
    OwnerChanged,
    RunEnded,
    StateChanged,
    StepAborted,
    StepCompleted,
    StepDelta,
    StepsRewritten,
    StepStarted,
    merge_deltas,
)
from services.runtime.service_layer.access import AgentAccess
from services.runtime.service_layer.hub import AgentHub, InFlight, Watcher
from services.runtime.service_layer.runners import Runners
from services.runtime.service_layer.store import AgentStore


class AgentWatches:
    """Watches of agents' events, replayed from the store then live from the hub."""

    def __init__(self, *, store: AgentStore, runners: Runners, hub: AgentHub, access: AgentAccess) -> None:
        self._store = store
        self._runners = runners
        self._hub = hub
        self._access = access

    async def watch_agent(
        self, principal: Caller | None, agent_id: str, *, after_sequence: int, live_only: bool
    ) -> AsyncGenerator[Emitted, None]:
        """Snapshots of the steps after `after_sequence`, the step in flight so far, then live events."""
        agent = await self._access.controlled(principal, agent_id)
        if after_sequence < 0:
            raise InvalidAgentRequest("after_sequence must not be negative")
        watcher, flights = self._hub.watch([agent.id])
        return self._replay_then_live(agent, watcher, flights, after_sequence, live_only)

    async def _replay_then_live(
        self, agent: Agent, watcher: Watcher, flights: list[InFlight], after_sequence: int, live_only: bool
    ) -> AsyncGenerator[Emitted, None]:
        events = watcher.events()
        # The agent's runner may be in another replica, or move to one: its
        # events come from there once this follows them, before the replay
        # below, so that nothing falls between the two.
        feed = _Feed(self._store, agent, after=after_sequence, live_only=live_only)
        async with self._hub.following([agent.workspace_id]):
            try:
                if not live_only:
                    async for emitted in feed.stored_after():
                        yield emitted
                for flight in flights:
                    for emitted in feed.live(flight.started):
                        yield emitted
                    for delta in merge_deltas(flight.deltas):
                        for emitted in feed.live(delta):
                            yield emitted
                async for live in events:
                    # Steps this watch missed (their events were lost between
                    # replicas) come from the store first.
                    async for emitted in feed.missed_before(live):
                        yield emitted
                    for emitted in feed.live(live):
                        yield emitted
            except HubClosed:
                raise HubClosed(
                    f"the runtime is shutting down; watch again with after_sequence={feed.whole} to resume"
                    " with nothing missed"
                ) from None
            finally:
                await events.aclose()

    async def watch_agents(
        self, principal: Caller | None, *, agent_ids: Sequence[str], workspace_id: str
    ) -> AsyncGenerator[Emitted, None]:
        """Live events of some agents, or of the workspace's: all of them for
        the agents the caller controls, the changes of state for the others."""
        viewer = self._access.workspace(principal, workspace_id)
        if agent_ids:
            agents = [await self._access.visible(principal, a) for a in agent_ids]
            watcher, _ = self._hub.watch([a.id for a in agents])
            workspaces = {a.workspace_id for a in agents}
        else:
            watcher, _ = self._hub.watch(None)
            workspaces = {viewer.workspace_id}
        return self._filtered(watcher.events(), viewer, workspaces)

    async def _filtered(
        self, events: AsyncIterator[Emitted], viewer: Viewer, workspaces: set[uuid.UUID]
    ) -> AsyncGenerator[Emitted, None]:
        # Agents whose runners are in other replicas, as read once: their
        # workspace never changes (nor, for this watch, their owner).
        elsewhere: dict[uuid.UUID, Agent | None] = {}
        try:
            async with self._hub.following(workspaces):
                async for emitted in events:
                    if isinstance(emitted.event, OwnerChanged):
                        continue  # for watches of one agent's steps
                    agent = self._runners.live(emitted.agent_id)
                    if agent is None:
                        if emitted.agent_id not in elsewhere:
                            elsewhere[emitted.agent_id] = await self._store.get_agent(emitted.agent_id)
                        agent = elsewhere[emitted.agent_id]
                    if agent is None:
                        continue
                    verdict = decide(
                        viewer, Action.CONTROL, workspace_id=agent.workspace_id, owner_id=agent.owner_id
                    )
                    if verdict is Verdict.ALLOWED or (
                        verdict is Verdict.DENIED and isinstance(emitted.event, StateChanged)
                    ):
                        yield emitted
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()


_NEVER_COMPLETED = (
    "the step stopped before it completed (its runner stopped, or its agent moved to another replica);"
    " it starts again"
)


class _Feed:
    """What one WatchAgent sends of one agent: each step once, in order.

    `whole` is the last step sent whole: where the client resumes. Live
    events may repeat what the replay sent, come from two replicas across a
    handoff, or miss some (lost between replicas): a repeat is dropped, a
    completed step after a gap brings the missing ones from the store first,
    and a step started again before it completed (cut by a handoff) is said
    aborted first.
    """

    def __init__(self, store: AgentStore, agent: Agent, *, after: int, live_only: bool) -> None:
        self._store = store
        self._agent_id = agent.id
        self._session_id = agent.session_id
        self.whole = after
        # The step sequence a gap is measured from; unknown at the live end
        # and after a rewrite, until a step comes.
        self._known: int | None = None if live_only else after
        self._streaming: StepStarted | None = None

    async def stored_after(self, before: int | None = None) -> AsyncGenerator[Emitted, None]:
        """The stored steps after the last sent whole (and before `before`)."""
        while True:
            page = await self._store.list_steps(self._session_id, after_sequence=self.whole, limit=500)
            for step in page:
                if before is not None and step.sequence >= before:
                    return
                yield Emitted(self._agent_id, step.created_at, StepCompleted(step))
                self.whole = self._known = step.sequence
                self._streaming = None
            if len(page) < 500:
                return

    async def missed_before(self, emitted: Emitted) -> AsyncGenerator[Emitted, None]:
        """The stored steps a live step shows this watch missed: those before
        a completed step, or before one that starts (a step starts once the
        one before it is stored)."""
        event = emitted.event
        if isinstance(event, OwnerChanged):
            # Anything stored that this watch has not shown, up to now.
            async for missed in self.stored_after():
                yield missed
            return
        known = self._known
        if known is None:
            return
        if isinstance(event, StepCompleted) and event.step.session_id == self._session_id:
            sequence = event.step.sequence
        elif isinstance(event, StepStarted):
            sequence = event.sequence
        else:
            return
        if sequence > known + 1:
            async for missed in self.stored_after(sequence):
                yield missed

    def live(self, emitted: Emitted) -> list[Emitted]:
        """What to send of a live event: nothing, it, or an abort and it."""
        event = emitted.event
        sequence: int | None = None
        if isinstance(event, OwnerChanged):
            return []  # for the watch itself (see `missed_before`)
        if isinstance(event, StepsRewritten):
            # Retried or restored: the steps to come are numbered from there.
            self.whole = min(self.whole, event.after_sequence)
            self._known = None
        elif isinstance(event, MainSessionChanged):
            self.whole = event.session.forked_at_sequence
            self._session_id = event.session.id
            self._known = None
            self._streaming = None
        elif isinstance(event, StepCompleted):
            sequence = event.step.sequence
            if sequence <= self.whole:
                return []
            self.whole = sequence
            self._streaming = None
        elif isinstance(event, StepStarted):
            if event.sequence <= self.whole:
                return []
            # What is known is stored: the steps before this one, not this one.
            sequence = event.sequence - 1
            cut, self._streaming = self._streaming, event
            if cut is not None:
                aborted = StepAborted(cut.run_id, cut.sequence, _NEVER_COMPLETED)
                return [Emitted(emitted.agent_id, emitted.at, aborted), emitted]
        elif isinstance(event, StepDelta):
            streaming = self._streaming
            if streaming is None or event.sequence != streaming.sequence:
                return []  # a step this watch did not see start: it will come whole
        elif isinstance(event, StepAborted):
            streaming = self._streaming
            if streaming is None or event.sequence != streaming.sequence:
                return []  # said already
            self._streaming = None
        elif isinstance(event, RunEnded):
            self._streaming = None
        if sequence is not None:
            self._known = sequence if self._known is None else max(self._known, sequence)
        return [emitted]
