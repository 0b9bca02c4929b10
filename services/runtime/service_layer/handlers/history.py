"""The history RPCs that change something (issue 5): steps edited, removed
or added while the agent is paused, checkpoints made and restored, the main
session chosen, retry from a step and fork (the reads are in `history_views`).

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

import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from typing import Any

from uuid_utils.compat import uuid7

from services.common import audit
from services.common.audit import AuditRecord
from services.common.identity import Caller
from services.runtime.domain.commands import (
    AddNote,
    CreateCheckpoint,
    DeleteStep,
    ForkFromStep,
    RestoreCheckpoint,
    RetryFromStep,
    SetMainSession,
    UpdateStep,
)
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
    AgentDraft,
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
from services.runtime.service_layer.access import AgentAccess, parse_id
from services.runtime.service_layer.agent_audit import AgentAudit
from services.runtime.service_layer.agent_factory import MAX_NAME_CHARS
from services.runtime.service_layer.handlers.agents import UPDATABLE, Agents, change_settings, create_clone
from services.runtime.service_layer.hub import AgentHub
from services.runtime.service_layer.messagebus import Handler
from services.runtime.service_layer.runners import Runners
from services.runtime.service_layer.store import AgentStore

MAX_NOTE_CHARS = 100_000
NOTE_ROLES = (Role.SYSTEM, Role.USER)
# The states in which retry and fork-into-a-session may continue the agent.
CONTINUABLE = frozenset({AgentState.IDLE, AgentState.PAUSED, AgentState.ERROR})
RESTORABLE = frozenset({AgentState.IDLE, AgentState.PAUSED})


@dataclass(frozen=True)
class History:
    """What the history handlers use (`agents`: for the settings a checkpoint
    brings back and the agent a fork makes)."""

    store: AgentStore
    runners: Runners
    hub: AgentHub
    access: AgentAccess
    audit: AgentAudit
    agents: Agents
    clock: Callable[[], datetime]


# -- steps of a paused agent ------------------------------------------------------


async def update_step(command: UpdateStep, deps: History) -> Step:
    """Replaces a step's content (the original is archived as "edited")."""
    principal, sequence, content = command.caller, command.sequence, command.content
    agent = await _agent(
        deps, principal, command.agent_id, allowed={AgentState.PAUSED}, doing="edit its steps"
    )
    step = _find(await _all_steps(deps, agent.session_id), sequence)
    if not content and not step.message.tool_calls:
        raise InvalidHistoryRequest("content must not be empty (only a step with tool calls may have none)")
    record = deps.audit.record(
        principal,
        agent,
        "UpdateStep",
        target=audit.Target("step", str(step.id)),
        details={"sequence": str(sequence), "session_id": str(agent.session_id)},
    )
    if not await deps.store.edit_step(step.id, content, at=deps.clock(), audit=record):
        raise StepNotFound(f"step {sequence} of agent {agent.id} not found")
    _rewritten(deps, agent, agent.session_id, sequence - 1)
    return replace(step, message=replace(step.message, content=content))


async def delete_step(command: DeleteStep, deps: History) -> list[int]:
    """Archives a step (reason "deleted"); an assistant step's tool results
    go with it. Returns the sequence numbers removed; later steps keep theirs."""
    principal, sequence = command.caller, command.sequence
    agent = await _agent(
        deps, principal, command.agent_id, allowed={AgentState.PAUSED}, doing="delete its steps"
    )
    history = await _all_steps(deps, agent.session_id)
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
    await deps.store.archive_steps(
        agent.session_id,
        reason="deleted",
        at=deps.clock(),
        sequences=sorted(doomed),
        audit=deps.audit.record(
            principal,
            agent,
            "DeleteStep",
            target=audit.Target("step", str(step.id)),
            details={"sequences": ",".join(map(str, sorted(doomed))), "session_id": str(agent.session_id)},
        ),
    )
    _rewritten(deps, agent, agent.session_id, sequence - 1)
    return sorted(doomed)


async def add_note(command: AddNote, deps: History) -> Step:
    """Appends a system or user step to the agent's context."""
    principal, role, content = command.caller, command.role, command.content
    if role not in NOTE_ROLES:
        raise InvalidHistoryRequest("role must be STEP_ROLE_SYSTEM or STEP_ROLE_USER")
    if not content.strip():
        raise InvalidHistoryRequest("content is required")
    if len(content) > MAX_NOTE_CHARS:
        raise InvalidHistoryRequest(f"content is {len(content)} characters; the limit is {MAX_NOTE_CHARS}")
    agent = await _agent(deps, principal, command.agent_id, allowed={AgentState.PAUSED}, doing="add notes")
    sequence = await deps.store.last_sequence(agent.session_id) + 1
    step = Step(
        id=uuid7(),
        agent_id=agent.id,
        session_id=agent.session_id,
        # A note belongs to no run of the agent: its own id.
        run_id=uuid7(),
        sequence=sequence,
        message=ChatMessage(role=role, content=content),
        metrics=StepMetrics(),
        created_at=deps.clock(),
    )
    try:
        await deps.store.append_step(step)
    except DuplicateStep:
        raise StepTaken(f"step {sequence} of agent {agent.id} was just written; try again") from None
    await deps.audit.write(
        principal,
        agent,
        "AddNote",
        target=audit.Target("step", str(step.id)),
        details={"sequence": str(sequence), "role": role.value if role else ""},
    )
    _rewritten(deps, agent, agent.session_id, sequence - 1)
    return step


# -- checkpoints ------------------------------------------------------------------


async def create_checkpoint(command: CreateCheckpoint, deps: History) -> Checkpoint:
    """The agent's main session up to its last step, and its settings, named."""
    principal = command.caller
    name = command.name.strip()
    if not name or len(name) > MAX_NAME_CHARS:
        raise InvalidHistoryRequest(f"name is required, up to {MAX_NAME_CHARS} characters")
    agent = await deps.access.controlled(principal, command.agent_id)
    checkpoint = Checkpoint(
        id=uuid7(),
        agent_id=agent.id,
        name=name,
        session_id=agent.session_id,
        sequence=await deps.store.last_sequence(agent.session_id),
        settings=agent,
        created_at=deps.clock(),
    )
    await deps.store.add_checkpoint(
        checkpoint,
        audit=deps.audit.record(
            principal,
            agent,
            "CreateCheckpoint",
            target=audit.Target("checkpoint", str(checkpoint.id)),
            details={"name": name, "sequence": str(checkpoint.sequence)},
        ),
    )
    return checkpoint


async def restore_checkpoint(command: RestoreCheckpoint, deps: History) -> Agent:
    """Settings back, steps after the checkpoint archived ("restored"), its session main."""
    principal = command.caller
    agent = await _agent(deps, principal, command.agent_id, allowed=RESTORABLE, doing="restore a checkpoint")
    wanted = parse_id(command.checkpoint_id, "checkpoint_id", InvalidHistoryRequest)
    checkpoint = await deps.store.get_checkpoint(wanted)
    if checkpoint is None or checkpoint.agent_id != agent.id:
        raise CheckpointNotFound(f"checkpoint {wanted} of agent {agent.id} not found")
    # As UpdateAgent changes them, on the agent as its runner has it now.
    await change_settings(
        deps.agents,
        principal,
        await deps.access.controlled(principal, str(agent.id)),
        AgentDraft.of(checkpoint.settings),
        sorted(UPDATABLE),
        action="RestoreCheckpoint",
        details={"checkpoint_id": str(checkpoint.id), "sequence": str(checkpoint.sequence)},
    )
    await deps.store.restore_checkpoint(checkpoint, at=deps.clock())
    session = await _session(deps, agent, checkpoint.session_id)
    await _adopt(deps, agent.id, session.id)
    _rewritten(deps, agent, session.id, checkpoint.sequence)
    if session.id != agent.session_id:
        _emit(deps, agent, MainSessionChanged(session))
    return await deps.access.visible(principal, str(agent.id))


# -- sessions ---------------------------------------------------------------------


async def set_main_session(command: SetMainSession, deps: History) -> Agent:
    """Makes one of the agent's sessions its main one; an event if it changes."""
    principal = command.caller
    agent = await _agent(
        deps,
        principal,
        command.agent_id,
        allowed={AgentState.IDLE, AgentState.PAUSED, AgentState.ERROR, AgentState.TERMINATED},
        doing="change its main session",
    )
    session = await _session(deps, agent, parse_id(command.session_id, "session_id", InvalidHistoryRequest))
    if session.id != agent.session_id:
        await _switch(
            deps,
            agent,
            session,
            audit=deps.audit.record(
                principal, agent, "SetMainSession", target=audit.Target("session", str(session.id))
            ),
        )
    return await deps.access.visible(principal, str(agent.id))


# -- retry and fork ---------------------------------------------------------------


async def retry_from_step(command: RetryFromStep, deps: History) -> Agent:
    """Archives step `sequence` on ("retried") and continues from the step before."""
    principal, sequence = command.caller, command.sequence
    agent = await _agent(deps, principal, command.agent_id, allowed=CONTINUABLE, doing="retry from a step")
    history = await _all_steps(deps, agent.session_id)
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
    await deps.store.archive_steps(
        agent.session_id,
        reason="retried",
        at=deps.clock(),
        after_sequence=sequence - 1,
        audit=deps.audit.record(
            principal,
            agent,
            "RetryFromStep",
            details={"sequence": str(sequence), "session_id": str(agent.session_id)},
        ),
    )
    _rewritten(deps, agent, agent.session_id, sequence - 1)
    await _continue(deps, agent.id)
    return await deps.access.visible(principal, str(agent.id))


async def fork_from_step(command: ForkFromStep, deps: History) -> tuple[Session, Agent]:
    """Copies steps 1..`sequence` of the main session into a new session made
    main (or into a clone agent's main session) and continues there."""
    principal, sequence, new_agent = command.caller, command.sequence, command.new_agent
    if command.name and not new_agent:
        raise InvalidHistoryRequest("name is for a fork into a new agent (new_agent)")
    allowed = set(AgentState) if new_agent else CONTINUABLE
    agent = await _agent(deps, principal, command.agent_id, allowed=allowed, doing="fork into a new session")
    history = await _all_steps(deps, agent.session_id)
    copied = [s for s in history if s.sequence <= sequence]
    last = history[-1].sequence if history else 0
    if sequence < 1 or sequence > last or not copied:
        raise InvalidHistoryRequest(f"sequence must be between 1 and the last step ({last}), got {sequence}")
    if new_agent:
        # A new agent with `agent`'s settings, parent and owner, and its own IM membership.
        name = command.name or f"{agent.name[: MAX_NAME_CHARS - len(' (fork)')]} (fork)"
        owner = await create_clone(deps.agents, principal, agent, replace(AgentDraft.of(agent), name=name))
        fork = Session(
            id=owner.session_id,
            agent_id=owner.id,
            created_at=owner.created_at,
            forked_from=agent.session_id,
            forked_at_sequence=sequence,
        )
        await deps.store.fork_session(fork)
        _rewritten(deps, owner, fork.id, 0)
    else:
        owner = agent
        fork = Session(
            id=uuid7(),
            agent_id=agent.id,
            created_at=deps.clock(),
            forked_from=agent.session_id,
            forked_at_sequence=sequence,
        )
        await deps.store.fork_session(
            fork,
            audit=deps.audit.record(
                principal,
                agent,
                "ForkFromStep",
                target=audit.Target("session", str(fork.id)),
                details={"sequence": str(sequence), "forked_from": str(agent.session_id)},
            ),
        )
        await _switch(deps, agent, fork)
    if resume_point(copied) is not Next.NOTHING:
        await _continue(deps, owner.id)
    return fork, await deps.access.visible(principal, str(owner.id))


# -- helpers ----------------------------------------------------------------------


async def _agent(
    deps: History, principal: Caller | None, agent_id: str, *, allowed: Collection[AgentState], doing: str
) -> Agent:
    """The visible agent as its runner has it, if its state allows `doing`."""
    agent = await deps.access.controlled(principal, agent_id)
    if agent.state not in allowed:
        names = ", ".join(s.value.upper() for s in AgentState if s in allowed)
        raise WrongAgentState(
            f"agent {agent.id} is {agent.state.value.upper()}: it may {doing} only when {names}"
        )
    return agent


async def _all_steps(deps: History, session_id: uuid.UUID) -> list[Step]:
    steps: list[Step] = []
    while True:
        after = steps[-1].sequence if steps else 0
        page = await deps.store.list_steps(session_id, after_sequence=after, limit=1000)
        steps.extend(page)
        if len(page) < 1000:
            return steps


async def _session(deps: History, agent: Agent, session_id: uuid.UUID) -> Session:
    session = await deps.store.get_session(session_id)
    if session is None and session_id == agent.session_id:
        session = Session(id=agent.session_id, agent_id=agent.id, created_at=agent.created_at)
    if session is None or session.agent_id != agent.id:
        raise SessionNotFound(f"session {session_id} of agent {agent.id} not found")
    return session


async def _switch(deps: History, agent: Agent, session: Session, *, audit: AuditRecord | None = None) -> None:
    """Makes `session` the agent's main one, in the store and its runner."""
    await deps.store.set_main_session(agent.id, session.id, audit=audit)
    await _adopt(deps, agent.id, session.id)
    _emit(deps, agent, MainSessionChanged(session))


async def _adopt(deps: History, agent_id: uuid.UUID, session_id: uuid.UUID) -> None:
    """The runner works in `session_id` from its next run (its cached history is another's)."""
    live = deps.runners.live(agent_id) or await deps.store.get_agent(agent_id)
    if live is not None:
        deps.runners.update(replace(live, session_id=session_id))
        deps.runners.forget_history(agent_id)


async def _continue(deps: History, agent_id: uuid.UUID) -> None:
    """Goes on from the last step; a PAUSED agent is resumed to do so."""
    await deps.runners.go_on(agent_id)


def _rewritten(deps: History, agent: Agent, session_id: uuid.UUID, after_sequence: int) -> None:
    deps.runners.forget_history(agent.id)
    _emit(deps, agent, StepsRewritten(session_id, max(after_sequence, 0)))


def _emit(deps: History, agent: Agent, event: AgentEvent) -> None:
    deps.hub.publish(Emitted(agent.id, deps.clock(), event), workspace_id=agent.workspace_id)


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


def handlers(deps: History) -> dict[type[Any], Handler]:
    """The history commands' handlers, bound to `deps`."""
    return {
        UpdateStep: partial(update_step, deps=deps),
        DeleteStep: partial(delete_step, deps=deps),
        AddNote: partial(add_note, deps=deps),
        CreateCheckpoint: partial(create_checkpoint, deps=deps),
        RestoreCheckpoint: partial(restore_checkpoint, deps=deps),
        SetMainSession: partial(set_main_session, deps=deps),
        RetryFromStep: partial(retry_from_step, deps=deps),
        ForkFromStep: partial(fork_from_step, deps=deps),
    }
