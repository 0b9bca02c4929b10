"""In-memory fakes of the runtime's ports: the IM, the LLM, the store, memory and the runners."""

from __future__ import annotations

import asyncio
import collections
import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from services.common.audit import AuditRecord
from services.common.outages import DATABASE, DependencyUnavailable
from services.runtime.domain.errors import (
    AgentGone,
    DuplicateAgentRequest,
    DuplicateStep,
    IMError,
    MemoryRefused,
    MemoryUnavailable,
)
from services.runtime.domain.lifecycle import Control, check_control
from services.runtime.domain.llm import (
    ChatMessage,
    Completion,
    CompletionAssembler,
    CompletionRequest,
    ContentDelta,
    Delta,
    FinishReason,
    ReasoningDelta,
    Role,
    ToolCallDelta,
    Usage,
)
from services.runtime.domain.model import (
    Agent,
    AgentState,
    Checkpoint,
    Run,
    RunStatus,
    Session,
    Step,
    Task,
    TaskStatus,
)
from services.runtime.service_layer.im_port import IMEvent, IMGroup, IMMember, IMMessage, IMPort
from services.runtime.service_layer.leases import Fence, LeaseLost
from services.runtime.service_layer.llm_port import LLM
from services.runtime.service_layer.memory_port import Expanded, Memory, MemoryPort, RecallQuery, RunRecord
from services.runtime.service_layer.runners import Runners
from services.runtime.service_layer.store import AgentStore, TaskInFlight


class FakeClock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.now += timedelta(milliseconds=1)
        return self.now


class Refused(IMError):
    """The fake IM's refusal, as the real client raises `IMError` for the IM's."""


class FakeIM(IMPort):
    """An IM in memory: members, groups, messages, read positions, a live feed."""

    def __init__(self, *, max_content_bytes: int = 64 * 1024) -> None:
        self.max_content_bytes = max_content_bytes
        # Raised (once each, in order) by the next SendMessage calls.
        self.send_failures: list[Exception] = []
        self._sent_requests: dict[str, IMMessage] = {}
        self._created_groups: dict[str, IMGroup] = {}
        self.unread_reads: collections.Counter[uuid.UUID] = collections.Counter()  # by member
        self.members: dict[uuid.UUID, IMMember] = {}
        # Agent member -> its owner, as the runtime told the IM.
        self.owners: dict[uuid.UUID, uuid.UUID] = {}
        self.groups: dict[uuid.UUID, IMGroup] = {}
        self.messages: list[IMMessage] = []
        self.read: dict[tuple[uuid.UUID, uuid.UUID], uuid.UUID] = {}
        self.clock = FakeClock()
        # Each watch: the members it watches, its queue, and the number of
        # the last event put on it (a list, to be changed in place).
        self._feeds: list[tuple[set[uuid.UUID], asyncio.Queue[IMEvent], list[int]]] = []
        self.workspace = uuid.uuid4()

    # helpers for tests
    def human(self, name: str) -> IMMember:
        member = IMMember(uuid.uuid4(), self.workspace, "human", name)
        self.members[member.id] = member
        return member

    def group(self, name: str, *members: uuid.UUID, direct: bool = False) -> IMGroup:
        group = IMGroup(uuid.uuid4(), name, "direct" if direct else "group", tuple(members))
        self.groups[group.id] = group
        return group

    def post(
        self,
        sender: uuid.UUID,
        group_id: uuid.UUID,
        content: str,
        mentions: Sequence[uuid.UUID] = (),
        reply_to: uuid.UUID | None = None,
        *,
        content_type: str = "text",
        metadata: Mapping[str, Any] | None = None,
    ) -> IMMessage:
        message = IMMessage(
            id=uuid.UUID(int=len(self.messages) + 1),
            group_id=group_id,
            sender_id=sender,
            content_type=content_type,
            content=content,
            mentions=tuple(mentions),
            sent_at=self.clock(),
            reply_to=reply_to,
            metadata=metadata,
        )
        self.messages.append(message)
        concerned = tuple(m for m in self.groups[group_id].member_ids)
        for watched, queue, last in self._feeds:
            hits = tuple(m for m in concerned if m in watched)
            if hits:
                queue.put_nowait(self._event(len(self.messages), message, hits, last))
        return message

    @staticmethod
    def _event(number: int, message: IMMessage, hits: tuple[uuid.UUID, ...], last: list[int]) -> IMEvent:
        """The event of the `number`th message (its cursor and sequence) on a
        watch whose last event was `last[0]`, as the IM numbers them."""
        event = IMEvent(
            cursor=str(number), message=message, member_ids=hits, sequence=number, previous_sequence=last[0]
        )
        last[0] = number
        return event

    def in_group(self, group_id: uuid.UUID) -> list[IMMessage]:
        return [m for m in self.messages if m.group_id == group_id]

    def _check_member(self, member: uuid.UUID, group_id: uuid.UUID) -> IMGroup:
        group = self.groups.get(group_id)
        if group is None:
            raise Refused(f"group {group_id} not found")
        if member not in group.member_ids:
            raise Refused(f"member {member} is not in group {group_id}")
        return group

    # the port
    async def create_agent_member(
        self,
        workspace_id: uuid.UUID,
        display_name: str,
        *,
        avatar: str = "",
        request_id: str = "",
        owner_id: uuid.UUID | None = None,
    ) -> IMMember:
        member = IMMember(uuid.uuid4(), workspace_id, "agent", display_name)
        self.members[member.id] = member
        if owner_id is not None:
            self.owners[member.id] = owner_id
        return member

    async def set_agent_owners(self, owners: dict[uuid.UUID, uuid.UUID]) -> int:
        changed = {a: o for a, o in owners.items() if self.owners.get(a) != o}
        self.owners.update(changed)
        return len(changed)

    async def rename_member(self, member_id: uuid.UUID, display_name: str) -> IMMember:
        self.members[member_id] = replace(self.members[member_id], display_name=display_name)
        return self.members[member_id]

    async def get_member(self, as_member: uuid.UUID, member_id: uuid.UUID) -> IMMember:
        if member_id not in self.members:
            raise Refused(f"member {member_id} not found")
        return self.members[member_id]

    async def list_members(self, as_member: uuid.UUID) -> list[IMMember]:
        return list(self.members.values())

    async def get_all_unread(self, as_member: uuid.UUID, *, limit: int = 200) -> list[IMMessage]:
        self.unread_reads[as_member] += 1
        nil = uuid.UUID(int=0)
        unread = [
            m
            for m in self.messages
            if as_member in self.groups[m.group_id].member_ids
            and m.sender_id != as_member
            and m.id > self.read.get((as_member, m.group_id), nil)
        ]
        return unread[:limit]

    async def mark_read(self, as_member: uuid.UUID, group_id: uuid.UUID, up_to: uuid.UUID) -> None:
        key = (as_member, group_id)
        if up_to > self.read.get(key, uuid.UUID(int=0)):
            self.read[key] = up_to

    async def send_message(
        self,
        as_member: uuid.UUID,
        group_id: uuid.UUID,
        content: str,
        *,
        mentions: Sequence[uuid.UUID] = (),
        reply_to: uuid.UUID | None = None,
        request_id: str = "",
        content_type: str = "text",
        metadata: Mapping[str, Any] | None = None,
    ) -> IMMessage:
        if self.send_failures:
            raise self.send_failures.pop(0)
        self._check_member(as_member, group_id)
        if len(content.encode()) > self.max_content_bytes:
            raise Refused(f"content is {len(content.encode())} bytes; the limit is {self.max_content_bytes}")
        if request_id and request_id in self._sent_requests:
            return self._sent_requests[request_id]
        message = self.post(
            as_member, group_id, content, mentions, reply_to, content_type=content_type, metadata=metadata
        )
        if request_id:
            self._sent_requests[request_id] = message
        return message

    async def get_message(self, as_member: uuid.UUID, message_id: uuid.UUID) -> IMMessage:
        for message in self.messages:
            if message.id == message_id:
                self._check_member(as_member, message.group_id)
                return message
        raise Refused(f"message {message_id} not found")

    async def get_or_create_direct_group(self, as_member: uuid.UUID, peer_id: uuid.UUID) -> IMGroup:
        for group in self.groups.values():
            if group.kind == "direct" and set(group.member_ids) == {as_member, peer_id}:
                return group
        return self.group("", as_member, peer_id, direct=True)

    async def get_group(self, as_member: uuid.UUID, group_id: uuid.UUID) -> IMGroup:
        return self._check_member(as_member, group_id)

    async def list_groups(self, as_member: uuid.UUID) -> list[IMGroup]:
        return [g for g in self.groups.values() if as_member in g.member_ids]

    async def create_group(
        self, as_member: uuid.UUID, name: str, member_ids: Sequence[uuid.UUID], *, request_id: str = ""
    ) -> IMGroup:
        if request_id and request_id in self._created_groups:
            return self._created_groups[request_id]
        group = self.group(name, as_member, *member_ids)
        if request_id:
            self._created_groups[request_id] = group
        return group

    async def list_messages(
        self, as_member: uuid.UUID, group_id: uuid.UUID, *, limit: int = 50, before: uuid.UUID | None = None
    ) -> list[IMMessage]:
        self._check_member(as_member, group_id)
        found = [m for m in self.in_group(group_id) if before is None or m.id < before]
        return found[-limit:]

    async def watch(
        self,
        workspace_id: uuid.UUID,
        *,
        member_ids: Sequence[uuid.UUID] = (),
        after_cursor: str = "",
        on_subscribed: Callable[[str], object] | None = None,
    ) -> AsyncIterator[IMEvent]:
        queue: asyncio.Queue[IMEvent] = asyncio.Queue()
        watched = set(member_ids)
        # A cursor is a message count; none starts at the live end, as the IM does.
        start = int(after_cursor) if after_cursor else len(self.messages)
        last = [start]
        entry = (watched, queue, last)
        self._feeds.append(entry)
        # Resuming: what came after the cursor first.
        for index, message in enumerate(self.messages[start:], start=start):
            hits = tuple(m for m in self.groups[message.group_id].member_ids if m in watched)
            if hits:
                queue.put_nowait(self._event(index + 1, message, hits, last))
        if on_subscribed is not None:
            on_subscribed(str(start))
        try:
            while True:
                yield await queue.get()
        finally:
            self._feeds.remove(entry)


@dataclass
class Script:
    """What the scripted model says on one call."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, JSON arguments)
    fail: Exception | None = None
    before: Callable[[], Awaitable[None]] | None = None
    # After this many deltas, waits until `gate` is set (a model mid-stream).
    hold_after: int = -1
    gate: asyncio.Event | None = None
    # Set when the stream reaches `hold_after`.
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    # What the endpoint reports; None: no usage (as some servers stream).
    usage: Usage | None = field(default_factory=lambda: Usage(10, 5, 0))
    # After this many deltas the stream breaks off with this error (an LLMError).
    cut_after: int = -1
    cut: Exception | None = None


class ScriptedLLM(LLM):
    """Answers each call with the next script (the last one repeats); records requests."""

    def __init__(self, *scripts: Script) -> None:
        self.scripts = list(scripts) or [Script(content="ok")]
        self.requests: list[CompletionRequest] = []

    async def stream(self, request: CompletionRequest) -> AsyncIterator[Delta | Completion]:
        self.requests.append(request)
        script = self.scripts[min(len(self.requests), len(self.scripts)) - 1]
        if script.before is not None:
            await script.before()
        if script.fail is not None:
            raise script.fail
        deltas: list[Delta] = []
        if script.reasoning:
            deltas.append(ReasoningDelta(script.reasoning))
        for piece in [script.content[i : i + 4] for i in range(0, len(script.content), 4)]:
            deltas.append(ContentDelta(piece))
        for index, (name, arguments) in enumerate(script.tool_calls):
            deltas.append(ToolCallDelta(index=index, id=f"call_{len(self.requests)}_{index}", name=name))
            half = len(arguments) // 2
            deltas += [
                ToolCallDelta(index=index, arguments=arguments[:half]),
                ToolCallDelta(index, arguments=arguments[half:]),
            ]
        assembler = CompletionAssembler()
        for index, delta in enumerate(deltas):
            if index == script.cut_after and script.cut is not None:
                raise script.cut
            if index == script.hold_after and script.gate is not None:
                script.reached.set()
                await script.gate.wait()
            assembler.add(delta)
            yield delta
            await asyncio.sleep(0)
        reason = FinishReason.TOOL_CALLS if script.tool_calls else FinishReason.STOP
        yield Completion(assembler.message(), reason, script.usage, "scripted")

    def last_messages(self) -> list[ChatMessage]:
        return list(self.requests[-1].messages)


class InMemoryAgentStore(AgentStore):
    def __init__(self) -> None:
        # Method name -> how many of its next calls find the database down.
        self.outages: collections.Counter[str] = collections.Counter()
        self.agents: dict[uuid.UUID, Agent] = {}
        self.deleted: set[uuid.UUID] = set()
        self.requests: dict[tuple[uuid.UUID, str], tuple[str, uuid.UUID]] = {}
        self.runs: dict[uuid.UUID, Run] = {}
        self.steps: dict[uuid.UUID, list[Step]] = {}
        self.cursors: dict[uuid.UUID, str] = {}
        self.marks: dict[tuple[uuid.UUID, uuid.UUID], uuid.UUID] = {}  # (agent, group) -> message
        self.archived_runs: dict[uuid.UUID, datetime] = {}  # what the memory service has
        self.audit: list[AuditRecord] = []
        # The lease table: shard -> (replica, epoch). A fenced write is
        # refused unless its fence is the shard's lease, as the database does.
        self.leases: dict[int, tuple[str, int]] = {}
        self._refused_fenced_writes = 0
        self._history = _History()

    @property
    def refused_fenced_writes(self) -> int:
        return self._refused_fenced_writes

    def _fenced(self, fence: Fence | None) -> None:
        if fence is not None and self.leases.get(fence.shard) != (fence.replica, fence.epoch):
            self._refused_fenced_writes += 1
            raise LeaseLost.of(fence)

    def _audited(self, record: AuditRecord | None) -> None:
        if record is not None:
            self.audit.append(record)

    async def record_audit(self, record: AuditRecord) -> None:
        self.audit.append(record)

    async def add_agent(
        self,
        agent: Agent,
        *,
        request: tuple[uuid.UUID, str, str] | None = None,
        audit: AuditRecord | None = None,
    ) -> None:
        if request is not None:
            scope, request_id, fingerprint = request
            if (scope, request_id) in self.requests:
                raise DuplicateAgentRequest(request_id)
            self.requests[(scope, request_id)] = (fingerprint, agent.id)
        self.agents[agent.id] = agent
        self._audited(audit)

    async def find_request(self, scope: uuid.UUID, request_id: str) -> tuple[str, uuid.UUID] | None:
        return self.requests.get((scope, request_id))

    async def get_agent(self, agent_id: uuid.UUID) -> Agent | None:
        return None if agent_id in self.deleted else self.agents.get(agent_id)

    async def list_agents(
        self, workspace_id: uuid.UUID, *, parent_id: uuid.UUID | None, after: uuid.UUID | None, limit: int
    ) -> list[Agent]:
        found = sorted(
            (
                a
                for a in self.agents.values()
                if a.workspace_id == workspace_id
                and a.id not in self.deleted
                and (parent_id is None or a.parent_id == parent_id)
                and (after is None or a.id > after)
            ),
            key=lambda a: a.id,
        )
        return found[:limit]

    async def all_agents(self) -> list[Agent]:
        return [a for a in self.agents.values() if a.id not in self.deleted]

    async def agent_places(self) -> dict[uuid.UUID, uuid.UUID]:
        return {a.id: a.workspace_id for a in await self.all_agents()}

    async def get_agents(self, agent_ids: Collection[uuid.UUID]) -> list[Agent]:
        return [a for i in agent_ids if (a := await self.get_agent(i)) is not None]

    async def update_agent(self, agent: Agent, *, audit: AuditRecord | None = None) -> None:
        self._audited(audit)
        self.agents[agent.id] = agent

    # -- History: sessions, checkpoints, the step archive (the history handlers) --

    @property
    def sessions(self) -> dict[uuid.UUID, Session]:
        return self._history.sessions

    @property
    def archive(self) -> list[tuple[str, datetime, Step]]:
        """(reason, when, step) of every archived step, in the order archived."""
        return self._history.archive

    async def add_session(self, session: Session) -> None:
        self.sessions.setdefault(session.id, session)

    async def get_session(self, session_id: uuid.UUID) -> Session | None:
        return self.sessions.get(session_id)

    async def list_sessions(self, agent_id: uuid.UUID) -> list[tuple[Session, int]]:
        found = sorted(
            (s for s in self.sessions.values() if s.agent_id == agent_id), key=lambda s: (s.created_at, s.id)
        )
        return [(s, len(self.steps.get(s.id, []))) for s in found]

    async def set_main_session(
        self, agent_id: uuid.UUID, session_id: uuid.UUID, *, audit: AuditRecord | None = None
    ) -> None:
        self._audited(audit)
        self.agents[agent_id] = replace(self.agents[agent_id], session_id=session_id)

    async def fork_session(self, session: Session, *, audit: AuditRecord | None = None) -> int:
        self._audited(audit)
        origin = session.forked_from
        assert origin is not None
        if session.id in self.sessions:
            session = replace(
                self.sessions[session.id],
                forked_from=session.forked_from,
                forked_at_sequence=session.forked_at_sequence,
            )
        self.sessions[session.id] = session
        source = [s for s in self.steps.get(origin, []) if s.sequence <= session.forked_at_sequence]
        copies = [
            replace(s, id=uuid.uuid4(), session_id=session.id, agent_id=session.agent_id) for s in source
        ]
        self.steps.setdefault(session.id, []).extend(copies)
        return len(copies)

    async def edit_step(
        self, step_id: uuid.UUID, content: str, *, at: datetime, audit: AuditRecord | None = None
    ) -> bool:
        self._audited(audit)
        for session_steps in self.steps.values():
            for index, step in enumerate(session_steps):
                if step.id == step_id:
                    self.archive.append(("edited", at, step))
                    self.archived_runs.pop(step.run_id, None)
                    session_steps[index] = replace(step, message=replace(step.message, content=content))
                    return True
        return False

    async def archive_steps(
        self,
        session_id: uuid.UUID,
        *,
        reason: str,
        at: datetime,
        sequences: Sequence[int] = (),
        after_sequence: int | None = None,
        audit: AuditRecord | None = None,
    ) -> int:
        kept: list[Step] = []
        moved = 0
        for step in sorted(self.steps.get(session_id, []), key=lambda s: s.sequence):
            if step.sequence in sequences or (after_sequence is not None and step.sequence > after_sequence):
                self.archive.append((reason, at, step))
                self.archived_runs.pop(step.run_id, None)
                moved += 1
            else:
                kept.append(step)
        self.steps[session_id] = kept
        if moved:
            self._audited(audit)
        return moved

    async def archived_steps(self, session_id: uuid.UUID) -> list[tuple[str, Step]]:
        return [(reason, step) for reason, _, step in self.archive if step.session_id == session_id]

    async def add_checkpoint(self, checkpoint: Checkpoint, *, audit: AuditRecord | None = None) -> None:
        self._audited(audit)
        self._history.checkpoints[checkpoint.id] = checkpoint

    def _checkpoint(self, checkpoint: Checkpoint) -> Checkpoint | None:
        agent, saved = self.agents.get(checkpoint.agent_id), checkpoint.settings
        if agent is None:
            return None
        settings = replace(
            agent,
            name=saved.name,
            role=saved.role,
            system_prompt=saved.system_prompt,
            model=saved.model,
            tools=saved.tools,
            token_budget=saved.token_budget,
        )
        return replace(checkpoint, settings=settings)

    async def get_checkpoint(self, checkpoint_id: uuid.UUID) -> Checkpoint | None:
        found = self._history.checkpoints.get(checkpoint_id)
        return self._checkpoint(found) if found is not None else None

    async def list_checkpoints(
        self, agent_id: uuid.UUID, *, before: uuid.UUID | None, limit: int
    ) -> list[Checkpoint]:
        found = sorted(
            (
                c
                for c in self._history.checkpoints.values()
                if c.agent_id == agent_id and (before is None or c.id < before)
            ),
            key=lambda c: c.id,
            reverse=True,
        )
        return [c for c in map(self._checkpoint, found[:limit]) if c is not None]

    async def restore_checkpoint(self, checkpoint: Checkpoint, *, at: datetime) -> int:
        archived = await self.archive_steps(
            checkpoint.session_id, reason="restored", at=at, after_sequence=checkpoint.sequence
        )
        await self.set_main_session(checkpoint.agent_id, checkpoint.session_id)
        return archived

    # -- Tasks (TaskService) --

    @functools.cached_property
    def tasks(self) -> dict[uuid.UUID, Task]:
        return {}

    def _task_request(self, agent_id: uuid.UUID, request_id: str) -> Task | None:
        return next(
            (t for t in self.tasks.values() if t.agent_id == agent_id and t.request_id == request_id), None
        )

    def _waiting_tasks(self, agent_id: uuid.UUID, now: datetime) -> list[Task]:
        """The queue in the order it is served."""
        return sorted(
            (
                t
                for t in self.tasks.values()
                if t.agent_id == agent_id
                and (
                    t.status is TaskStatus.QUEUED
                    or (t.status is TaskStatus.FAILED and t.retry_at is not None and t.retry_at <= now)
                )
            ),
            key=_queue_order,
        )

    async def add_task(self, task: Task, *, audit: AuditRecord | None = None) -> Task:
        # A database round trip: concurrent submissions interleave here.
        await asyncio.sleep(0)
        if task.request_id:
            found = self._task_request(task.agent_id, task.request_id)
            if found is not None:
                return found
        self.tasks[task.id] = task
        self._audited(audit)
        return task

    async def get_task(self, task_id: uuid.UUID) -> Task | None:
        return self.tasks.get(task_id)

    async def find_task(self, agent_id: uuid.UUID, request_id: str) -> Task | None:
        await asyncio.sleep(0)
        return self._task_request(agent_id, request_id)

    async def list_tasks(self, agent_id: uuid.UUID, *, before: uuid.UUID | None, limit: int) -> list[Task]:
        found = sorted(
            (t for t in self.tasks.values() if t.agent_id == agent_id and (before is None or t.id < before)),
            key=lambda t: t.id,
            reverse=True,
        )
        return found[:limit]

    async def next_task(self, agent_id: uuid.UUID, *, now: datetime) -> Task | None:
        waiting = self._waiting_tasks(agent_id, now)
        return waiting[0] if waiting else None

    async def agents_with_waiting_tasks(self) -> set[uuid.UUID]:
        waiting = (TaskStatus.QUEUED, TaskStatus.FAILED)
        return {t.agent_id for t in self.tasks.values() if t.status in waiting}

    async def waiting_tasks(self, agent_id: uuid.UUID) -> list[Task]:
        waiting = (TaskStatus.QUEUED, TaskStatus.FAILED)
        return [t for t in self.tasks.values() if t.agent_id == agent_id and t.status in waiting]

    async def tasks_ahead(self, task: Task, *, now: datetime) -> int:
        return sum(1 for t in self._waiting_tasks(task.agent_id, now) if _queue_order(t) < _queue_order(task))

    async def next_retry_at(self, agent_id: uuid.UUID) -> datetime | None:
        return min(
            (
                t.retry_at
                for t in self.tasks.values()
                if t.agent_id == agent_id and t.status is TaskStatus.FAILED and t.retry_at is not None
            ),
            default=None,
        )

    async def update_task(
        self, task: Task, *, expected: Collection[TaskStatus], fence: Fence | None = None
    ) -> bool:
        self._fenced(fence)
        stored = self.tasks.get(task.id)
        if stored is None or stored.status not in expected:
            return False
        self.tasks[task.id] = replace(
            stored,
            status=task.status,
            attempts=task.attempts,
            last_error=task.last_error,
            result=task.result,
            started_at=task.started_at,
            ended_at=task.ended_at,
            retry_at=task.retry_at,
            run_id=task.run_id,
        )
        return True

    async def cancel_waiting_tasks(self, agent_id: uuid.UUID, *, at: datetime) -> list[Task]:
        cancelled = [
            replace(t, status=TaskStatus.CANCELLED, ended_at=at, retry_at=None)
            for t in self.tasks.values()
            if t.agent_id == agent_id and t.status in (TaskStatus.QUEUED, TaskStatus.FAILED)
        ]
        self.tasks.update((t.id, t) for t in cancelled)
        return cancelled

    async def running_tasks(self, agent_id: uuid.UUID | None = None) -> list[TaskInFlight]:
        return [
            TaskInFlight(
                t,
                self.runs.get(t.run_id) if t.run_id is not None else None,
                self.agents[t.agent_id].state
                if t.agent_id in self.agents and t.agent_id not in self.deleted
                else None,
            )
            for t in sorted(self.tasks.values(), key=lambda t: t.id)
            if t.status is TaskStatus.RUNNING and (agent_id is None or t.agent_id == agent_id)
        ]

    async def unarchived_runs(self, *, limit: int) -> list[Run]:
        ended = [r for r in self.runs.values() if r.ended_at is not None and r.id not in self.archived_runs]
        return sorted(ended, key=lambda r: (r.ended_at or r.started_at, r.id))[:limit]

    async def mark_archived(self, run_id: uuid.UUID, *, at: datetime) -> None:
        self._database("mark_archived")
        self.archived_runs[run_id] = at

    async def end_stale_runs(
        self, *, error: str, at: datetime, agent_ids: Collection[uuid.UUID] | None = None
    ) -> int:
        stale = [
            r
            for r in self.runs.values()
            if r.status is RunStatus.RUNNING
            and self.agents[r.agent_id].state is not AgentState.RUNNING
            and (agent_ids is None or r.agent_id in agent_ids)
        ]
        for run in stale:
            self.runs[run.id] = replace(run, status=RunStatus.INTERRUPTED, error=error, ended_at=at)
        return len(stale)

    async def queue_stats(self, agent_id: uuid.UUID) -> tuple[int, int, float]:
        mine = [t for t in self.tasks.values() if t.agent_id == agent_id]
        waits = [(t.started_at - t.created_at).total_seconds() * 1000 for t in mine if t.started_at]
        return (
            sum(1 for t in mine if t.status in (TaskStatus.QUEUED, TaskStatus.FAILED)),
            sum(1 for t in mine if t.status is TaskStatus.RUNNING),
            sum(waits) / len(waits) if waits else 0.0,
        )

    async def watch_cursors(self) -> dict[uuid.UUID, str]:
        return dict(self.cursors)

    async def save_watch_cursors(
        self, cursors: dict[uuid.UUID, str], *, fences: Sequence[Fence] = ()
    ) -> None:
        for fence in fences:
            self._fenced(fence)
        self.cursors.update(cursors)

    def _database(self, method: str) -> None:
        if self.outages[method] > 0:
            self.outages[method] -= 1
            raise DependencyUnavailable(DATABASE, "connection lost", connection_lost=True)

    async def save_progress(self, agent: Agent, *, fence: Fence | None = None) -> None:
        self._database("save_progress")
        self._fenced(fence)
        stored = self.agents[agent.id]
        self.agents[agent.id] = replace(
            stored,
            state=agent.state,
            last_error=agent.last_error,
            tokens_used=agent.tokens_used,
            pause_pending=agent.pause_pending,
            state_version=agent.state_version,
        )

    async def delete_agent(self, agent_id: uuid.UUID, *, audit: AuditRecord | None = None) -> None:
        self.deleted.add(agent_id)
        self._audited(audit)

    async def add_run(self, run: Run) -> None:
        self._database("add_run")
        self.runs[run.id] = run

    async def update_run(self, run: Run) -> None:
        self._database("update_run")
        self.runs[run.id] = run

    async def list_runs(self, agent_id: uuid.UUID, *, before: uuid.UUID | None, limit: int) -> list[Run]:
        found = sorted(
            (r for r in self.runs.values() if r.agent_id == agent_id and (before is None or r.id < before)),
            key=lambda r: r.id,
            reverse=True,
        )
        return found[:limit]

    async def running_run(self, agent_id: uuid.UUID) -> Run | None:
        running = [r for r in self.runs.values() if r.agent_id == agent_id and r.status is RunStatus.RUNNING]
        return max(running, key=lambda r: r.id, default=None)

    async def append_step(self, step: Step, *, fence: Fence | None = None) -> None:
        self._database("append_step")
        self._fenced(fence)
        await self.append_input(step.agent_id, [step], {})

    async def begin_run(
        self,
        run: Run,
        agent: Agent,
        steps: Sequence[Step],
        *,
        read_marks: Mapping[uuid.UUID, uuid.UUID] | None = None,
        fence: Fence | None = None,
    ) -> None:
        self._fenced(fence)
        self._check_new(steps)
        await self.add_run(run)
        await self.save_progress(agent)
        await self.append_input(agent.id, steps, read_marks or {})

    async def append_input(
        self,
        agent_id: uuid.UUID,
        steps: Sequence[Step],
        read_marks: Mapping[uuid.UUID, uuid.UUID],
        *,
        fence: Fence | None = None,
    ) -> None:
        self._fenced(fence)
        self._check_new(steps)
        for step in steps:
            self.steps.setdefault(step.session_id, []).append(step)
        for group_id, message_id in read_marks.items():
            key = (agent_id, group_id)
            if message_id > self.marks.get(key, uuid.UUID(int=0)):
                self.marks[key] = message_id

    def _check_new(self, steps: Sequence[Step]) -> None:
        for step in steps:
            if any(s.sequence == step.sequence for s in self.steps.get(step.session_id, [])):
                raise DuplicateStep(str(step.sequence))

    async def read_marks(self, agent_id: uuid.UUID) -> dict[uuid.UUID, uuid.UUID]:
        return {group: message for (agent, group), message in self.marks.items() if agent == agent_id}

    async def list_steps(
        self, session_id: uuid.UUID, *, after_sequence: int, limit: int, run_id: uuid.UUID | None = None
    ) -> list[Step]:
        found = [
            s
            for s in sorted(self.steps.get(session_id, []), key=lambda s: s.sequence)
            if s.sequence > after_sequence and (run_id is None or s.run_id == run_id)
        ]
        return found[:limit]

    async def last_sequence(self, session_id: uuid.UUID) -> int:
        return max((s.sequence for s in self.steps.get(session_id, [])), default=0)


@dataclass
class _History:
    """`InMemoryAgentStore`'s sessions, checkpoints and step archive."""

    sessions: dict[uuid.UUID, Session] = field(default_factory=dict)
    checkpoints: dict[uuid.UUID, Checkpoint] = field(default_factory=dict)
    archive: list[tuple[str, datetime, Step]] = field(default_factory=list)


def _queue_order(task: Task) -> tuple[int, datetime, uuid.UUID]:
    """Higher priority first, then arrival."""
    return (-task.priority, task.created_at, task.id)


class FakeMemory(MemoryPort):
    """Long-term memory in a dict: each archived step's text is one memory,
    found by any word of the query; the audience rule as the service applies it."""

    def __init__(self) -> None:
        self.records: dict[uuid.UUID, RunRecord] = {}
        self.archive_calls = 0
        self.down = False
        self.refused: set[uuid.UUID] = set()
        self.recalls: list[tuple[uuid.UUID, tuple[uuid.UUID, ...], RecallQuery]] = []
        self.score = 1.0  # of every memory found
        self.changed = asyncio.Event()

    async def archive(self, record: RunRecord) -> None:
        self.archive_calls += 1
        if self.down:
            raise MemoryUnavailable("memory is down")
        if record.run.id in self.refused:
            raise MemoryRefused("run refused")
        self.records[record.run.id] = record
        self.changed.set()

    def _visible(self, record: RunRecord, chat: uuid.UUID | None, audience: Sequence[uuid.UUID]) -> bool:
        if chat is None:
            return True  # a task's: the agent's own
        members = next((c.member_ids for c in record.conversations if c.group_id == chat), ())
        return set(audience) <= set(members)

    def _memories(self, agent: Agent, audience: Sequence[uuid.UUID]) -> list[Memory]:
        found = []
        for record in self.records.values():
            if record.agent.id != agent.id:
                continue
            for step, chat in record.steps:
                if self._visible(record, chat, audience) and step.message.content:
                    found.append(
                        Memory(
                            ref=f"{record.run.id}/{step.sequence}/0",
                            type="response" if step.role is Role.ASSISTANT else "user_message",
                            text=step.message.content,
                            score=self.score,
                            created_at=step.created_at,
                            group_id=chat,
                        )
                    )
        return found

    async def recall(self, agent: Agent, audience: Sequence[uuid.UUID], query: RecallQuery) -> list[Memory]:
        self.recalls.append((agent.id, tuple(audience), query))
        if self.down:
            raise MemoryUnavailable("memory is down")
        words = {w.lower() for w in query.text.split() if len(w) > 3}
        excluded = {str(r) for r in query.exclude_run_ids}
        return [
            m
            for m in self._memories(agent, audience)
            if m.ref.split("/")[0] not in excluded and words & {w.lower() for w in m.text.split()}
        ][: query.limit]

    async def expand(
        self, agent: Agent, audience: Sequence[uuid.UUID], ref: str, *, before: int, after: int
    ) -> Expanded:
        memories = [
            m for m in self._memories(agent, audience) if m.ref.split("/")[0] == ref.split("/", maxsplit=1)[0]
        ]
        at = next((i for i, m in enumerate(memories) if m.ref == ref), None)
        if at is None:
            raise MemoryRefused(f"no memory {ref}")
        return Expanded(
            memories[at], memories[max(0, at - before) : at], memories[at + 1 : at + 1 + after], None
        )


class FakeRunners(Runners):
    """Runners that run nothing: they keep the agents started and record what
    they are asked. A task is being run only while a test says so
    (`running`); cancelling it then does what `on_cancel` does, as a runner
    cutting the run short would."""

    def __init__(self) -> None:
        self.agents: dict[uuid.UUID, Agent] = {}
        self.woken: list[uuid.UUID] = []
        self.cancels: list[uuid.UUID] = []
        self.running: set[uuid.UUID] = set()
        self.on_cancel: Callable[[uuid.UUID], Awaitable[None]] | None = None

    def live(self, agent_id: uuid.UUID) -> Agent | None:
        return self.agents.get(agent_id)

    def start_agent(self, agent: Agent) -> None:
        self.agents.setdefault(agent.id, agent)

    async def stop_agent(self, agent_id: uuid.UUID) -> None:
        self.agents.pop(agent_id, None)

    def update(self, agent: Agent) -> Agent | None:
        if agent.id not in self.agents:
            return None
        self.agents[agent.id] = agent
        return agent

    def wake(self, agent_id: uuid.UUID, *, retry: bool = False) -> None:
        self.woken.append(agent_id)

    def forget_history(self, agent_id: uuid.UUID) -> None:
        pass

    async def go_on(self, agent_id: uuid.UUID) -> None:
        self.woken.append(agent_id)

    async def apply(self, agent_id: uuid.UUID, control: Control) -> Agent:
        agent = self.agents.get(agent_id)
        if agent is None:
            raise AgentGone(f"agent {agent_id} was deleted")
        check_control(control, agent.state)
        state = {
            Control.START: AgentState.IDLE,
            Control.PAUSE: AgentState.PAUSED,
            Control.RESUME: AgentState.IDLE,
            Control.INTERRUPT: AgentState.PAUSED,
            Control.TERMINATE: AgentState.TERMINATED,
        }[control]
        agent = agent.with_state(state, "")
        self.agents[agent_id] = agent
        return agent

    async def cancel_task(self, agent_id: uuid.UUID, task_id: uuid.UUID) -> bool:
        self.cancels.append(task_id)
        if agent_id not in self.agents or task_id not in self.running:
            return False
        if self.on_cancel is not None:
            await self.on_cancel(task_id)
        return True
