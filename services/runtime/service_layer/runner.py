"""The resident loop of one agent.

An idle runner awaits an event and costs nothing. Woken (by a message in one
of its groups, or by a Wake call), it reads all its unread messages, and if
any calls for an answer it starts a run: stream a completion, execute the
tool calls it asks for (concurrently, results in call order), read what
arrived meanwhile, and call the model again, until the model stops; then it
answers in the chat that woke it. Every step is stored the moment it
completes and streamed live while it forms.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime

from uuid_utils.compat import uuid7

from services.common import errors
from services.runtime.domain.etiquette import (
    ChatterGuard,
    GroupPolicy,
    incoming_message,
    should_answer,
    split_reply,
)
from services.runtime.domain.llm import (
    ChatMessage,
    Completion,
    CompletionRequest,
    LLMError,
    Role,
)
from services.runtime.domain.model import (
    Agent,
    AgentEvent,
    AgentState,
    Emitted,
    Run,
    RunEnded,
    RunStarted,
    RunStatus,
    StateChanged,
    Step,
    StepCompleted,
    StepDelta,
    StepMetrics,
    StepStarted,
)
from services.runtime.service_layer.hub import AgentHub
from services.runtime.service_layer.im_port import IMError, IMMessage, IMPort
from services.runtime.service_layer.llm_port import LLM
from services.runtime.service_layer.store import AgentStore
from services.runtime.service_layer.tools import SubAgentFactory, ToolContext, ToolRegistry

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """Limits of the loop; all configurable."""

    max_iterations: int = 10
    group_policy: GroupPolicy = GroupPolicy.UNLESS_OTHERS_MENTIONED
    default_token_budget: int = 1_000_000
    unread_batch: int = 200
    # An answer longer than this is sent as several messages (the IM's limit).
    max_reply_bytes: int = 64 * 1024


class Directory:
    """Names and kinds of members and groups, cached (they rarely change)."""

    def __init__(self, im: IMPort) -> None:
        self._im = im
        self._names: dict[uuid.UUID, str] = {}
        self._direct: dict[uuid.UUID, bool] = {}
        self._labels: dict[uuid.UUID, str] = {}

    async def name(self, as_member: uuid.UUID, member_id: uuid.UUID) -> str:
        if member_id not in self._names:
            self._names[member_id] = (await self._im.get_member(as_member, member_id)).display_name
        return self._names[member_id]

    async def group(self, as_member: uuid.UUID, group_id: uuid.UUID) -> tuple[bool, str]:
        """(is it a direct chat, a label for it)."""
        if group_id not in self._direct:
            group = await self._im.get_group(as_member, group_id)
            self._direct[group_id] = group.kind == "direct"
            self._labels[group_id] = "direct chat" if group.kind == "direct" else f"group {group.name}"
        return self._direct[group_id], self._labels[group_id]


class HistoryCache:
    """The steps of recently active agents, kept between their runs.

    An agent woken again soon (as in a conversation) then skips reloading its
    history; the least recently used are dropped once all of them hold more
    than `max_steps` steps, so idle agents cost no memory. Only an agent's
    own runner changes its steps, which keeps the copy right.
    """

    def __init__(self, max_steps: int = 20_000) -> None:
        self.max_steps = max_steps
        self._steps: OrderedDict[uuid.UUID, list[Step]] = OrderedDict()
        self._total = 0

    def take(self, agent_id: uuid.UUID) -> list[Step] | None:
        steps = self._steps.pop(agent_id, None)
        if steps is not None:
            self._total -= len(steps)
        return steps

    def keep(self, agent_id: uuid.UUID, steps: list[Step]) -> None:
        self.take(agent_id)
        if len(steps) > self.max_steps:
            return
        self._steps[agent_id] = steps
        self._total += len(steps)
        while self._total > self.max_steps:
            _, dropped = self._steps.popitem(last=False)
            self._total -= len(dropped)

    def __len__(self) -> int:
        return len(self._steps)


@dataclass(frozen=True, slots=True)
class RunnerEnv:
    """What every runner shares."""

    store: AgentStore
    im: IMPort
    llm: LLM
    tools: ToolRegistry
    hub: AgentHub
    guard: ChatterGuard
    directory: Directory
    settings: LoopSettings
    create_sub_agent: SubAgentFactory
    clock: Callable[[], datetime]
    # How many runners may ask the IM for their unread messages at once.
    reads: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(32))
    history: HistoryCache = field(default_factory=HistoryCache)


class AgentRunner:
    """One agent's serial loop. `start()` it, `wake()` it, `stop()` it."""

    def __init__(self, agent: Agent, env: RunnerEnv) -> None:
        self.agent = agent
        self._env = env
        self._wake = asyncio.Event()
        self._steps: list[Step] | None = None
        # Read positions to move once the messages read are stored as steps.
        self._pending_reads: dict[uuid.UUID, uuid.UUID] = {}
        self._task: asyncio.Task[None] | None = None
        self._retry = False
        self._unreachable = 0
        # Steps made but not yet stored (numbered after the last stored one).
        self._unstored = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def start(self, *, look: bool = True) -> None:
        """Starts the loop; `look` makes it read its unread messages at once
        (which may have arrived while the runtime was down)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"agent-{self.agent.id}")
            if look:
                self.wake()

    def wake(self, *, retry: bool = False) -> None:
        """Makes the runner read its unread messages; `retry` also retries a
        failed run (an agent in ERROR), which new messages alone do too."""
        self._retry = self._retry or retry
        self.idle.clear()
        self._wake.set()

    def update(self, agent: Agent) -> None:
        """New settings take effect from the next completion."""
        self.agent = replace(
            agent,
            state=self.agent.state,
            last_error=self.agent.last_error,
            tokens_used=self.agent.tokens_used,
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._env.history.take(self.agent.id)

    # -- the loop -------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if not self._wake.is_set():
                self.idle.set()
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._cycle()
                self._unreachable = 0
            except asyncio.CancelledError:
                raise
            except errors.Unavailable as error:
                # A dependency (the IM, the database) is away: not the agent's
                # fault. Look again later; the wait doubles up to a minute.
                self._unreachable += 1
                delay = min(60.0, 0.5 * 2 ** (self._unreachable - 1))
                logger.warning("agent %s: %s; trying again in %.1f s", self.agent.id, error, delay)
                asyncio.get_running_loop().call_later(delay, self.wake)
            except Exception as error:
                logger.exception("agent %s failed", self.agent.id)
                await self._set_state(AgentState.ERROR, f"internal error: {error}")

    async def _cycle(self) -> None:
        resume, self._retry = self._retry and self.agent.state is AgentState.ERROR, False
        # One run per cycle: whatever arrives meanwhile wakes the runner again
        # (the loop then comes straight back), so no second look is needed.
        try:
            messages = await self._take_unread()
            if messages or resume:
                if self._steps is None:
                    self._steps = self._env.history.take(self.agent.id) or await self._load_steps()
                await self._run(messages)
            else:
                await self._mark_read()  # nothing to answer: they are read all the same
        except BaseException:
            self._steps = None  # what failed may have left them behind the store
            raise
        # Idle, the runner itself holds no history; the shared cache may.
        if self._steps is not None:
            self._env.history.keep(self.agent.id, self._steps)
            self._steps = None

    async def _load_steps(self) -> list[Step]:
        steps: list[Step] = []
        while True:
            after = steps[-1].sequence if steps else 0
            page = await self._env.store.list_steps(self.agent.session_id, after_sequence=after, limit=1000)
            steps.extend(page)
            if len(page) < 1000:
                return steps

    async def _take_unread(self) -> list[IMMessage]:
        """The unread messages that call for an answer; all unread are marked read."""
        member = self.agent.member_id
        # Bounded: after a restart every agent looks at once, and the IM must not drown.
        async with self._env.reads:
            unread = await self._env.im.get_all_unread(member, limit=self._env.settings.unread_batch)
        if not unread:
            return []
        if len(unread) >= self._env.settings.unread_batch:
            self.wake()  # a full page: there may be more after it
        latest: dict[uuid.UUID, uuid.UUID] = {}
        relevant: list[IMMessage] = []
        for message in unread:
            latest[message.group_id] = message.id
            if message.sender_id == member or not self._env.guard.allows(message.group_id):
                continue
            is_direct, _ = await self._env.directory.group(member, message.group_id)
            if should_answer(
                agent_member_id=member,
                is_direct=is_direct,
                mentions=set(message.mentions),
                policy=self._env.settings.group_policy,
            ):
                relevant.append(message)
        self._pending_reads.update(latest)
        return relevant

    async def _mark_read(self) -> None:
        pending, self._pending_reads = self._pending_reads, {}
        outcomes = await asyncio.gather(
            *[self._env.im.mark_read(self.agent.member_id, group, up_to) for group, up_to in pending.items()],
            return_exceptions=True,
        )
        for (group, up_to), outcome in zip(pending.items(), outcomes, strict=True):
            if isinstance(outcome, Exception):
                # Kept for the next try; meanwhile those messages stay unread.
                logger.warning("agent %s: marking group %s read failed: %s", self.agent.id, group, outcome)
                self._pending_reads.setdefault(group, up_to)
            elif isinstance(outcome, BaseException):
                raise outcome

    async def _run(self, messages: list[IMMessage]) -> None:
        env, agent = self._env, self.agent
        run = Run(
            id=uuid7(),
            agent_id=agent.id,
            session_id=agent.session_id,
            status=RunStatus.RUNNING,
            trigger_message_ids=tuple(m.id for m in messages),
            started_at=env.clock(),
        )
        # The way to the first completion is short: one write stores the run,
        # the agent's state and the messages read; read positions move while
        # the model is already working.
        was = self.agent.state
        self.agent = replace(self.agent, state=AgentState.RUNNING, last_error="")
        incoming = [self._step(run, await self._incoming(m), StepMetrics()) for m in messages]
        await env.store.begin_run(run, self.agent, incoming)
        self._emit(RunStarted(run))
        if was is not AgentState.RUNNING:
            self._emit(StateChanged(AgentState.RUNNING, ""))
        for step in incoming:
            self._remember(step)
        reading = asyncio.create_task(self._mark_read())
        reply_group = messages[-1].group_id if messages else self._last_group()
        status, error = RunStatus.ITERATION_LIMIT, ""
        failure: Exception | None = None
        try:
            for _ in range(env.settings.max_iterations):
                if self._over_budget():
                    status = RunStatus.BUDGET_EXHAUSTED
                    break
                run = replace(run, iterations=run.iterations + 1)
                completion = await self._complete(run)
                if completion.message.tool_calls:
                    await self._call_tools(run, completion, reply_group)
                    arrived = await self._take_unread()
                    if arrived:
                        run = replace(
                            run, trigger_message_ids=run.trigger_message_ids + tuple(m.id for m in arrived)
                        )
                        reply_group = arrived[-1].group_id
                        await self._read_in(run, arrived)
                    continue
                if completion.message.content and reply_group is not None:
                    await self._answer(run, reply_group, completion.message.content)
                status = RunStatus.COMPLETED
                break
        except LLMError as llm_failure:
            status, error = RunStatus.FAILED, str(llm_failure)
        except Exception as other:
            # The IM refused or lost the answer, a tool's port broke...: the
            # run ends FAILED, never left RUNNING.
            failure = other
            status, error = RunStatus.FAILED, str(other) or type(other).__name__
        finally:
            await reading
        await self._end_run(replace(run, status=status, error=error, ended_at=env.clock()), failure)

    async def _end_run(self, run: Run, failure: Exception | None) -> None:
        agent, error = self.agent, run.error
        if isinstance(failure, IMError) and not isinstance(failure, errors.Unavailable):
            # Refused (the group is gone, the agent was removed from it): the
            # answer cannot be given, but nothing is wrong with the agent.
            logger.warning("agent %s: the IM refused its answer: %s", agent.id, error)
            state, error = AgentState.IDLE, ""
        elif run.status is RunStatus.FAILED:
            if failure is not None and not isinstance(failure, errors.ServiceError):
                logger.error("agent %s: run %s failed", agent.id, run.id, exc_info=failure)
            state = AgentState.ERROR
        else:
            state, error = AgentState.IDLE, ""
        changed = (state, error) != (agent.state, agent.last_error)
        self.agent = replace(agent, state=state, last_error=error)
        # One write for the run's end and the agent's new state.
        await self._env.store.end_run(run, self.agent)
        self._emit(RunEnded(run))
        if changed:
            self._emit(StateChanged(state, error))

    async def _answer(self, run: Run, group_id: uuid.UUID, content: str) -> None:
        """Posts the answer, in several messages if it is longer than one may be."""
        for index, part in enumerate(split_reply(content, self._env.settings.max_reply_bytes)):
            # Idempotent per part: a send retried after a lost response posts nothing twice.
            await self._env.im.send_message(
                self.agent.member_id, group_id, part, request_id=f"answer/{run.id}/{index}"
            )

    def _last_group(self) -> uuid.UUID | None:
        # Resuming after an error: answer where the last message came from.
        for step in reversed(self._steps or []):
            content = step.message.content or ""
            if step.role is Role.USER and "group_id=" in content:
                with contextlib.suppress(ValueError):
                    return uuid.UUID(content.split("group_id=", 1)[1][:36])
        return None

    def _over_budget(self) -> bool:
        budget = self.agent.token_budget or self._env.settings.default_token_budget
        return self.agent.tokens_used >= budget

    async def _incoming(self, message: IMMessage) -> ChatMessage:
        member = self.agent.member_id
        _, label = await self._env.directory.group(member, message.group_id)
        sender = await self._env.directory.name(member, message.sender_id)
        return incoming_message(
            group_label=label,
            group_id=message.group_id,
            sender_name=sender,
            sender_id=message.sender_id,
            content=message.content,
        )

    async def _read_in(self, run: Run, messages: list[IMMessage]) -> None:
        """Adds messages to the context as user steps, then marks them read."""
        for message in messages:
            await self._append(run, await self._incoming(message), StepMetrics())
        await self._mark_read()

    async def _complete(self, run: Run) -> Completion:
        env, agent = self._env, self.agent
        assert self._steps is not None
        context = [ChatMessage(role=Role.SYSTEM, content=self._system_prompt())]
        context += [step.message for step in self._steps]
        request = CompletionRequest(
            messages=context, tools=env.tools.specs(agent.tools), settings=agent.model
        )
        sequence = self._next_sequence()
        self._emit(StepStarted(run.id, sequence, Role.ASSISTANT))
        started = time.perf_counter()
        first_token_ms = 0.0
        completion: Completion | None = None
        async for item in env.llm.stream(request):
            if isinstance(item, Completion):
                completion = item
                continue
            if not first_token_ms:
                first_token_ms = (time.perf_counter() - started) * 1000
            self._emit(StepDelta(sequence, item))
        if completion is None:
            raise LLMError("the model's stream ended without a completion")
        usage = completion.usage
        metrics = StepMetrics(
            duration_ms=(time.perf_counter() - started) * 1000,
            first_token_ms=first_token_ms,
            input_tokens=usage.input_tokens if usage else 0,
            output_tokens=usage.output_tokens if usage else 0,
            cached_tokens=usage.cached_tokens if usage else 0,
            model=completion.model,
        )
        await self._append(run, completion.message, metrics, sequence=sequence)
        if usage is not None:
            self.agent = replace(
                self.agent, tokens_used=self.agent.tokens_used + usage.input_tokens + usage.output_tokens
            )
        return completion

    def _system_prompt(self) -> str:
        agent = self.agent
        identity = f"You are {agent.name}"
        if agent.role:
            identity += f", {agent.role}"
        identity += (
            f", a member of an instant-messaging workspace (your member_id is {agent.member_id})."
            " Messages reach you as '[chat | group_id=...] sender (member_id=...): text'."
            " Your final answer is posted to the chat that woke you; use tools to write elsewhere."
        )
        return f"{identity}\n\n{agent.system_prompt}".strip()

    async def _call_tools(self, run: Run, completion: Completion, reply_group: uuid.UUID | None) -> None:
        env = self._env
        context = ToolContext(
            agent=self.agent, im=env.im, trigger_group_id=reply_group, create_sub_agent=env.create_sub_agent
        )
        calls = completion.message.tool_calls
        outcomes = await asyncio.gather(*[env.tools.execute(context, call) for call in calls])
        for call, outcome in zip(calls, outcomes, strict=True):
            await self._append(
                run,
                ChatMessage(role=Role.TOOL, content=outcome.content, tool_call_id=call.id, name=call.name),
                StepMetrics(duration_ms=outcome.duration_ms, tool_duration_ms=outcome.duration_ms),
            )

    def _next_sequence(self) -> int:
        assert self._steps is not None
        return self._steps[-1].sequence + 1 if self._steps else 1

    def _step(self, run: Run, message: ChatMessage, metrics: StepMetrics, *, sequence: int = 0) -> Step:
        """A new step after the last one (or at `sequence`); not stored yet."""
        if not sequence:
            sequence = self._next_sequence() + self._unstored
            self._unstored += 1
        return Step(
            id=uuid7(),
            agent_id=self.agent.id,
            session_id=self.agent.session_id,
            run_id=run.id,
            sequence=sequence,
            message=message,
            metrics=metrics,
            created_at=self._env.clock(),
        )

    def _remember(self, step: Step) -> None:
        """Adds a stored step to the context and tells the watchers."""
        assert self._steps is not None
        self._steps.append(step)
        self._unstored = 0
        self._emit(StepCompleted(step))

    async def _append(
        self, run: Run, message: ChatMessage, metrics: StepMetrics, *, sequence: int = 0
    ) -> Step:
        step = self._step(run, message, metrics, sequence=sequence)
        await self._env.store.append_step(step)
        self._remember(step)
        return step

    async def _set_state(self, state: AgentState, error: str) -> None:
        if self.agent.state is state and self.agent.last_error == error:
            await self._env.store.save_progress(self.agent)
            return
        self.agent = replace(self.agent, state=state, last_error=error)
        await self._env.store.save_progress(self.agent)
        self._emit(StateChanged(state, error))

    def _emit(self, event: AgentEvent) -> None:
        self._env.hub.publish(Emitted(self.agent.id, self._env.clock(), event))
