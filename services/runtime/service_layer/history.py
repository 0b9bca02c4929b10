"""Human control of an agent's history: steps edited, removed or added while
it is paused, checkpoints, sessions, retry from a step and fork (issue 5).

Nothing is destroyed: a step edited, deleted, retried from or restored past
goes whole to the step archive, with why, in the same transaction as the
change. Each change of a session's steps is a `StepsRewritten` event (a
watcher reloads after its sequence number) and makes the agent's runner
reload its history before its next completion.

Rules that are ours to decide, kept in one place:

- A tool call and its result stand or fall together, so that the history
  stays valid for any OpenAI-compatible model: deleting an assistant step
  with tool calls also deletes (archives) their results; deleting a result
  alone is refused (FAILED_PRECONDITION).
- Retry from step N archives N and everything after it; N is at least 2, at
  most the last step, and the last step kept must leave something to do (a
  user, system or tool step, or tool calls without results): retrying after
  the agent's final answer is refused (INVALID_ARGUMENT).
- Retry, and fork into a new session of the agent, continue at once; an
  agent that was PAUSED is resumed by them (it runs).
- A checkpoint is a position (session, last sequence number) and the
  settings: restoring archives what came after that position and restores
  the settings; it does not continue by itself (the next message, task or
  ResumeAgent does). Edits made later to steps at or before the position
  stay.
- A change while the agent is RUNNING is refused, as is any change of an
  agent that is not PAUSED for edits and notes. A run that starts between
  the check and the change (a message arriving at that moment) may still
  see the old history; its steps come after the change.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Collection
from dataclasses import replace
from datetime import datetime

from uuid_utils.compat import uuid7

from services.common import audit
from services.common.audit import AuditRecord
from services.common.identity import Caller
from services.runtime.domain.errors import (
    BrokenToolCall,
    CheckpointNotFound,
    DuplicateStep,
    InvalidHistoryRequest,
    SessionNotFound,
    StepNotFound,
    StepTaken,
    WrongAgentState,
)
from services.runtime.domain.lifecycle import Next, resume_point
from services.runtime.domain.llm import ChatMessage, Role
from services.runtime.domain.model import (
    Agent,
    AgentEvent,
    AgentState,
    Checkpoint,
    Emitted,
    MainSessionChanged,
    Session,
    Step,
    StepMetrics,
    StepsRewritten,
)
from services.runtime.service_layer.agents import MAX_NAME_CHARS, UPDATABLE, AgentDraft, AgentService
from services.runtime.service_layer.hub import AgentHub
from services.runtime.service_layer.im_port import IMPort
from services.runtime.service_layer.runners import Runners
from services.runtime.service_layer.store import AgentStore

logger = logging.getLogger(__name__)

MAX_NOTE_CHARS = 100_000
NOTE_ROLES = (Role.SYSTEM, Role.USER)
# The states in which retry and fork-into-a-session may continue the agent.
CONTINUABLE = frozenset({AgentState.IDLE, AgentState.PAUSED, AgentState.ERROR})
RESTORABLE = frozenset({AgentState.IDLE, AgentState.PAUSED})


class HistoryService:
    """The use cases of UpdateStep, DeleteStep, AddNote, checkpoints, sessions, retry and fork."""

    def __init__(
        self,
        *,
        store: AgentStore,
        runners: Runners,
        hub: AgentHub,
        im: IMPort,
        agents: AgentService,
        clock: Callable[[], datetime],
        max_page_size: int = 200,
    ) -> None:
        self._store = store
        self._runners = runners
        self._hub = hub
        self._im = im
        self._agents = agents
        self._clock = clock
        self._max_page = max_page_size

    # -- steps of a paused agent ------------------------------------------------

    async def update_step(self, principal: Caller | None, agent_id: str, sequence: int, content: str) -> Step:
        """Replaces a step's content (the original is archived as "edited")."""
        agent = await self._agent(principal, agent_id, allowed={AgentState.PAUSED}, doing="edit its steps")
        step = _find(await self._all_steps(agent.session_id), sequence)
        if not content and not step.message.tool_calls:
            raise InvalidHistoryRequest(
                "content must not be empty (only a step with tool calls may have none)"
            )
        record = self._agents.audit_record(
            principal,
            agent,
            "UpdateStep",
            target=audit.Target("step", str(step.id)),
            details={"sequence": str(sequence), "session_id": str(agent.session_id)},
        )
        if not await self._store.edit_step(step.id, content, at=self._clock(), audit=record):
            raise StepNotFound(f"step {sequence} of agent {agent.id} not found")
        self._rewritten(agent, agent.session_id, sequence - 1)
        return replace(step, message=replace(step.message, content=content))

    async def delete_step(self, principal: Caller | None, agent_id: str, sequence: int) -> list[int]:
        """Archives a step (reason "deleted"); an assistant step's tool results
        go with it. Returns the sequence numbers removed; later steps keep theirs."""
        agent = await self._agent(principal, agent_id, allowed={AgentState.PAUSED}, doing="delete its steps")
        history = await self._all_steps(agent.session_id)
        step = _find(history, sequence)
        doomed = {step.sequence}
        if step.role is Role.TOOL:
            call = _call_of(history, step)
            if call is not None:
                raise BrokenToolCall(
                    f"step {sequence} is the result of a tool call of step {call.sequence}, which needs it;"
                    f" delete step {call.sequence} to remove the call together with its results"
                )
        ids = {c.id for c in step.message.tool_calls}
        doomed |= {s.sequence for s in history if s.role is Role.TOOL and s.message.tool_call_id in ids}
        await self._store.archive_steps(
            agent.session_id,
            reason="deleted",
            at=self._clock(),
            sequences=sorted(doomed),
            audit=self._agents.audit_record(
                principal,
                agent,
                "DeleteStep",
                target=audit.Target("step", str(step.id)),
                details={
                    "sequences": ",".join(map(str, sorted(doomed))),
                    "session_id": str(agent.session_id),
                },
            ),
        )
        self._rewritten(agent, agent.session_id, sequence - 1)
        return sorted(doomed)

    async def add_note(
        self, principal: Caller | None, agent_id: str, role: Role | None, content: str
    ) -> Step:
        """Appends a system or user step to the agent's context."""
        if role not in NOTE_ROLES:
            raise InvalidHistoryRequest("role must be STEP_ROLE_SYSTEM or STEP_ROLE_USER")
        if not content.strip():
            raise InvalidHistoryRequest("content is required")
        if len(content) > MAX_NOTE_CHARS:
            raise InvalidHistoryRequest(
                f"content is {len(content)} characters; the limit is {MAX_NOTE_CHARS}"
            )
        agent = await self._agent(principal, agent_id, allowed={AgentState.PAUSED}, doing="add notes")
        sequence = await self._store.last_sequence(agent.session_id) + 1
        step = Step(
            id=uuid7(),
            agent_id=agent.id,
            session_id=agent.session_id,
            # A note belongs to no run of the agent: its own id.
            run_id=uuid7(),
            sequence=sequence,
            message=ChatMessage(role=role, content=content),
            metrics=StepMetrics(),
            created_at=self._clock(),
        )
        try:
            await self._store.append_step(step)
        except DuplicateStep:
            raise StepTaken(f"step {sequence} of agent {agent.id} was just written; try again") from None
        await self._agents.recorded(
            principal,
            agent,
            "AddNote",
            target=audit.Target("step", str(step.id)),
            details={"sequence": str(sequence), "role": role.value if role else ""},
        )
        self._rewritten(agent, agent.session_id, sequence - 1)
        return step

    # -- checkpoints -------------------------------------------------------------

    async def create_checkpoint(self, principal: Caller | None, agent_id: str, name: str) -> Checkpoint:
        """The agent's main session up to its last step, and its settings, named."""
        name = name.strip()
        if not name or len(name) > MAX_NAME_CHARS:
            raise InvalidHistoryRequest(f"name is required, up to {MAX_NAME_CHARS} characters")
        agent = await self._agents.controlled(principal, agent_id)
        checkpoint = Checkpoint(
            id=uuid7(),
            agent_id=agent.id,
            name=name,
            session_id=agent.session_id,
            sequence=await self._store.last_sequence(agent.session_id),
            settings=agent,
            created_at=self._clock(),
        )
        await self._store.add_checkpoint(
            checkpoint,
            audit=self._agents.audit_record(
                principal,
                agent,
                "CreateCheckpoint",
                target=audit.Target("checkpoint", str(checkpoint.id)),
                details={"name": name, "sequence": str(checkpoint.sequence)},
            ),
        )
        return checkpoint

    async def list_checkpoints(
        self, principal: Caller | None, agent_id: str, *, page_size: int, page_token: str
    ) -> tuple[list[Checkpoint], str]:
        """Newest first; the token is the last checkpoint's id."""
        agent = await self._agents.controlled(principal, agent_id)
        if page_size < 0:
            raise InvalidHistoryRequest("page_size must not be negative")
        limit = min(page_size or 50, self._max_page)
        before = _parse_id(page_token, "page_token") if page_token else None
        found = await self._store.list_checkpoints(agent.id, before=before, limit=limit + 1)
        return found[:limit], str(found[limit - 1].id) if len(found) > limit else ""

    async def restore_checkpoint(self, principal: Caller | None, agent_id: str, checkpoint_id: str) -> Agent:
        """Settings back, steps after the checkpoint archived ("restored"), its session main."""
        agent = await self._agent(principal, agent_id, allowed=RESTORABLE, doing="restore a checkpoint")
        wanted = _parse_id(checkpoint_id, "checkpoint_id")
        checkpoint = await self._store.get_checkpoint(wanted)
        if checkpoint is None or checkpoint.agent_id != agent.id:
            raise CheckpointNotFound(f"checkpoint {wanted} of agent {agent.id} not found")
        saved = checkpoint.settings
        draft = AgentDraft(
            name=saved.name,
            role=saved.role,
            system_prompt=saved.system_prompt,
            model=saved.model,
            tools=saved.tools,
            token_budget=saved.token_budget,
            auto_recall=saved.auto_recall,
        )
        # Through AgentService: checked again, the IM name follows, the runner gets them.
        await self._agents.update_agent(
            principal,
            str(agent.id),
            draft,
            sorted(UPDATABLE),
            action="RestoreCheckpoint",
            details={"checkpoint_id": str(checkpoint.id), "sequence": str(checkpoint.sequence)},
        )
        await self._store.restore_checkpoint(checkpoint, at=self._clock())
        session = await self._session(agent, checkpoint.session_id)
        self._adopt(agent.id, session.id)
        self._rewritten(agent, session.id, checkpoint.sequence)
        if session.id != agent.session_id:
            self._emit(agent.id, MainSessionChanged(session))
        return await self._agents.get_agent(principal, str(agent.id))

    # -- sessions ----------------------------------------------------------------

    async def list_sessions(
        self, principal: Caller | None, agent_id: str
    ) -> tuple[Agent, list[tuple[Session, int]]]:
        """The agent and its sessions, oldest first, with their step counts."""
        agent = await self._agents.controlled(principal, agent_id)
        found = await self._store.list_sessions(agent.id)
        if all(s.id != agent.session_id for s, _ in found):
            # An agent stored without its session row (not made by `create_agent`).
            await self._store.add_session(
                Session(id=agent.session_id, agent_id=agent.id, created_at=agent.created_at)
            )
            found = await self._store.list_sessions(agent.id)
        return agent, found

    async def set_main_session(self, principal: Caller | None, agent_id: str, session_id: str) -> Agent:
        """Makes one of the agent's sessions its main one; an event if it changes."""
        agent = await self._agent(
            principal,
            agent_id,
            allowed={AgentState.IDLE, AgentState.PAUSED, AgentState.ERROR, AgentState.TERMINATED},
            doing="change its main session",
        )
        session = await self._session(agent, _parse_id(session_id, "session_id"))
        if session.id != agent.session_id:
            await self._switch(
                agent,
                session,
                audit=self._agents.audit_record(
                    principal, agent, "SetMainSession", target=audit.Target("session", str(session.id))
                ),
            )
        return await self._agents.get_agent(principal, str(agent.id))

    # -- retry and fork ----------------------------------------------------------

    async def retry_from_step(self, principal: Caller | None, agent_id: str, sequence: int) -> Agent:
        """Archives step `sequence` on ("retried") and continues from the step before."""
        agent = await self._agent(principal, agent_id, allowed=CONTINUABLE, doing="retry from a step")
        history = await self._all_steps(agent.session_id)
        last = history[-1].sequence if history else 0
        if not 2 <= sequence <= last:
            raise InvalidHistoryRequest(
                f"sequence must be between 2 and the last step ({last}), got {sequence}"
                if last >= 2
                else f"agent {agent.id} has no step to retry after"
            )
        kept = [s for s in history if s.sequence < sequence]
        if not kept or resume_point(kept) is Next.NOTHING:
            before = kept[-1].sequence if kept else 0
            raise InvalidHistoryRequest(
                f"step {before} is the agent's answer: nothing follows from it; retry from step {before}"
                " to have it answered again"
                if kept
                else f"no step before {sequence} is left to continue from"
            )
        await self._store.archive_steps(
            agent.session_id,
            reason="retried",
            at=self._clock(),
            after_sequence=sequence - 1,
            audit=self._agents.audit_record(
                principal,
                agent,
                "RetryFromStep",
                details={"sequence": str(sequence), "session_id": str(agent.session_id)},
            ),
        )
        self._rewritten(agent, agent.session_id, sequence - 1)
        await self._continue(agent.id)
        return await self._agents.get_agent(principal, str(agent.id))

    async def fork_from_step(
        self, principal: Caller | None, agent_id: str, sequence: int, *, new_agent: bool, name: str = ""
    ) -> tuple[Session, Agent]:
        """Copies steps 1..`sequence` of the main session into a new session made
        main (or into a clone agent's main session) and continues there."""
        if name and not new_agent:
            raise InvalidHistoryRequest("name is for a fork into a new agent (new_agent)")
        allowed = set(AgentState) if new_agent else CONTINUABLE
        agent = await self._agent(principal, agent_id, allowed=allowed, doing="fork into a new session")
        history = await self._all_steps(agent.session_id)
        copied = [s for s in history if s.sequence <= sequence]
        last = history[-1].sequence if history else 0
        if sequence < 1 or sequence > last or not copied:
            raise InvalidHistoryRequest(
                f"sequence must be between 1 and the last step ({last}), got {sequence}"
            )
        if new_agent:
            owner = await self._clone(principal, agent, name)
            fork = Session(
                id=owner.session_id,
                agent_id=owner.id,
                created_at=owner.created_at,
                forked_from=agent.session_id,
                forked_at_sequence=sequence,
            )
            await self._store.fork_session(fork)
            self._rewritten(owner, fork.id, 0)
        else:
            owner = agent
            fork = Session(
                id=uuid7(),
                agent_id=agent.id,
                created_at=self._clock(),
                forked_from=agent.session_id,
                forked_at_sequence=sequence,
            )
            await self._store.fork_session(
                fork,
                audit=self._agents.audit_record(
                    principal,
                    agent,
                    "ForkFromStep",
                    target=audit.Target("session", str(fork.id)),
                    details={"sequence": str(sequence), "forked_from": str(agent.session_id)},
                ),
            )
            await self._switch(agent, fork)
        if resume_point(copied) is not Next.NOTHING:
            await self._continue(owner.id)
        return fork, await self._agents.get_agent(principal, str(owner.id))

    async def _clone(self, principal: Caller | None, agent: Agent, name: str) -> Agent:
        """A new agent with `agent`'s settings, parent and owner, and its own IM membership."""
        draft = AgentDraft(
            name=name or f"{agent.name[: MAX_NAME_CHARS - len(' (fork)')]} (fork)",
            role=agent.role,
            system_prompt=agent.system_prompt,
            model=agent.model,
            tools=agent.tools,
            token_budget=agent.token_budget,
            auto_recall=agent.auto_recall,
        )
        return await self._agents.create_clone(principal, agent, draft)

    # -- helpers -----------------------------------------------------------------

    async def _agent(
        self, principal: Caller | None, agent_id: str, *, allowed: Collection[AgentState], doing: str
    ) -> Agent:
        """The visible agent as its runner has it, if its state allows `doing`."""
        agent = await self._agents.controlled(principal, agent_id)
        if agent.state not in allowed:
            names = ", ".join(s.value.upper() for s in AgentState if s in allowed)
            raise WrongAgentState(
                f"agent {agent.id} is {agent.state.value.upper()}: it may {doing} only when {names}"
            )
        return agent

    async def _all_steps(self, session_id: uuid.UUID) -> list[Step]:
        steps: list[Step] = []
        while True:
            after = steps[-1].sequence if steps else 0
            page = await self._store.list_steps(session_id, after_sequence=after, limit=1000)
            steps.extend(page)
            if len(page) < 1000:
                return steps

    async def _session(self, agent: Agent, session_id: uuid.UUID) -> Session:
        session = await self._store.get_session(session_id)
        if session is None and session_id == agent.session_id:
            session = Session(id=agent.session_id, agent_id=agent.id, created_at=agent.created_at)
        if session is None or session.agent_id != agent.id:
            raise SessionNotFound(f"session {session_id} of agent {agent.id} not found")
        return session

    async def _switch(self, agent: Agent, session: Session, *, audit: AuditRecord | None = None) -> None:
        """Makes `session` the agent's main one, in the store and its runner."""
        await self._store.set_main_session(agent.id, session.id, audit=audit)
        self._adopt(agent.id, session.id)
        self._emit(agent.id, MainSessionChanged(session))

    def _adopt(self, agent_id: uuid.UUID, session_id: uuid.UUID) -> None:
        """The runner works in `session_id` from its next run (its cached history is another's)."""
        live = self._runners.live(agent_id)
        if live is not None and live.session_id != session_id:
            self._runners.update(replace(live, session_id=session_id))
            self._runners.forget_history(agent_id)

    async def _continue(self, agent_id: uuid.UUID) -> None:
        """Goes on from the last step; a PAUSED agent is resumed to do so."""
        live = self._runners.live(agent_id)
        if live is None:
            return
        if live.state is AgentState.PAUSED:
            await self._runners.resume(agent_id)
        else:
            self._runners.continue_from_history(agent_id)

    def _rewritten(self, agent: Agent, session_id: uuid.UUID, after_sequence: int) -> None:
        self._runners.forget_history(agent.id)
        self._emit(agent.id, StepsRewritten(session_id, max(after_sequence, 0)))

    def _emit(self, agent_id: uuid.UUID, event: AgentEvent) -> None:
        self._hub.publish(Emitted(agent_id, self._clock(), event))


def _find(history: list[Step], sequence: int) -> Step:
    if sequence < 1:
        raise InvalidHistoryRequest(f"sequence must be at least 1, got {sequence}")
    for step in history:
        if step.sequence == sequence:
            return step
    raise StepNotFound(f"step {sequence} not found in the main session")


def _call_of(history: list[Step], result: Step) -> Step | None:
    """The assistant step whose tool call `result` answers, if any."""
    for step in history:
        if step.role is Role.ASSISTANT and any(
            c.id == result.message.tool_call_id for c in step.message.tool_calls
        ):
            return step
    return None


def _parse_id(value: str, field: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidHistoryRequest(f"{field} is not a valid id: {value[:64]!r}") from None
