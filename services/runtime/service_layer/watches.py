"""The live feeds of agents (WatchAgent, WatchAgents): what happened since a
step, then what happens, each event shown to those who may see it."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from services.common.identity import Caller
from services.runtime.domain.access import Action, Verdict, Viewer, decide
from services.runtime.domain.errors import HubClosed, InvalidAgentRequest
from services.runtime.domain.model import (
    Agent,
    Emitted,
    MainSessionChanged,
    StateChanged,
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
        sent = after_sequence
        # The last step this watch delivered whole: where its client resumes.
        whole = after_sequence
        events = watcher.events()
        try:
            if not live_only:
                while True:
                    page = await self._store.list_steps(agent.session_id, after_sequence=sent, limit=500)
                    for step in page:
                        yield Emitted(agent.id, step.created_at, StepCompleted(step))
                        sent = whole = step.sequence
                    if len(page) < 500:
                        break
            for flight in flights:
                started = flight.started.event
                assert isinstance(started, StepStarted)
                if started.sequence > sent:
                    yield flight.started
                    for delta in merge_deltas(flight.deltas):
                        yield delta
            async for emitted in events:
                event = emitted.event
                # Steps rewritten (retry, restore) or another main session:
                # the steps to come are numbered from there, not after `sent`.
                if isinstance(event, StepsRewritten):
                    sent = min(sent, event.after_sequence)
                    whole = min(whole, event.after_sequence)
                elif isinstance(event, MainSessionChanged):
                    sent = whole = event.session.forked_at_sequence
                if isinstance(event, StepCompleted) and event.step.sequence <= sent:
                    continue
                if isinstance(event, StepDelta | StepStarted) and event.sequence <= sent:
                    continue
                yield emitted
                if isinstance(event, StepCompleted):
                    whole = event.step.sequence
        except HubClosed:
            raise HubClosed(
                f"the runtime is shutting down; watch again with after_sequence={whole} to resume"
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
            ids = [(await self._access.visible(principal, a)).id for a in agent_ids]
            watcher, _ = self._hub.watch(ids)
        else:
            watcher, _ = self._hub.watch(None)
        return self._filtered(watcher.events(), viewer)

    async def _filtered(
        self, events: AsyncIterator[Emitted], viewer: Viewer
    ) -> AsyncGenerator[Emitted, None]:
        try:
            async for emitted in events:
                agent = self._runners.live(emitted.agent_id)
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
