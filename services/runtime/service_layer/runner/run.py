"""One run: begin it, iterate completions and tool calls, end it, settle its task, tell its chat."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace

from uuid_utils.compat import uuid7

from services.common import errors
from services.runtime.domain.context import estimated_usage
from services.runtime.domain.errors import ContextTooLong, IMError, LLMError, LLMRejected
from services.runtime.domain.etiquette import (
    Trouble,
    answer_metadata,
    failure_notice,
    is_agent_answer,
    is_silence,
    mentioned,
    split_reply,
)
from services.runtime.domain.intents import answer_request_id, failure_request_id, tool_request_id
from services.runtime.domain.lifecycle import (
    CANCELLED_RESULT,
    Next,
    interrupted_message,
    resume_point,
    unanswered_calls,
)
from services.runtime.domain.llm import (
    ChatMessage,
    Completion,
    CompletionAssembler,
    CompletionRequest,
    Role,
    ToolCall,
    storable_delta,
    storable_message,
    storable_text,
)
from services.runtime.domain.model import (
    AgentState,
    Origin,
    Run,
    RunEnded,
    RunStarted,
    RunStatus,
    Step,
    StepDelta,
    StepKind,
    StepMetrics,
    StepStarted,
    Task,
    TaskStatus,
)
from services.runtime.service_layer.leases import LeaseLost
from services.runtime.service_layer.runner.context import Context
from services.runtime.service_layer.runner.core import (
    _last_assistant,
    _NotStarted,
    _PausedAtBoundary,
    _StreamCut,
    _Taken,
    _TaskGone,
    _Terminated,
)
from services.runtime.service_layer.runner.inbox import Inbox
from services.runtime.service_layer.tools import ToolContext, ToolOutcome

logger = logging.getLogger(__name__)


class OneRun(Inbox, Context):
    """A run from its beginning (the input stored) through completions and
    tool calls to its end (stored with the agent's state), its task settled
    and its chat answered or told why not."""

    async def _run(
        self,
        taken: _Taken,
        *,
        task: Task | None = None,
        resumed: bool = False,
        going_on: Run | None = None,
    ) -> None:
        """A run: a new one (`_begin`), or `going_on` with a stored one."""
        started = await self._start(taken, task=task, resumed=resumed, going_on=going_on)
        if started is None:
            return
        run, reply_group = started
        reading = asyncio.create_task(self._mark_read())
        status, error, answer = RunStatus.ITERATION_LIMIT, "", ""
        failure: Exception | None = None
        # Why no answer came, for the people waiting for it.
        cause: Exception | None = None
        try:
            if task is not None and self._running_task is None:
                raise _TaskGone
            run, status, answer = await self._iterate(run, reply_group, resumed=resumed, chat=task is None)
        except _TaskGone:
            status, error = RunStatus.INTERRUPTED, "its task was cancelled"
        except asyncio.CancelledError:
            cut = self._cut
            if cut is None:
                raise  # the runtime is stopping
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            status, error = RunStatus.INTERRUPTED, cut.reason
            if cut.state is AgentState.TERMINATED:
                cause = _Terminated(cut.reason)  # the people waiting are told; a pause needs no word
            await self._record_cut(run)
        except _PausedAtBoundary:
            status, error = RunStatus.INTERRUPTED, "paused by a person"
        except ContextTooLong as too_long:
            # Even shrunk, the endpoint would not take it: this run fails, but
            # the next one starts from a smaller context (the estimate learnt).
            failure = cause = too_long
            status, error = RunStatus.FAILED, str(too_long)
        except LLMError as llm_failure:
            cause = llm_failure
            status, error = RunStatus.FAILED, str(llm_failure)
        except (errors.Unavailable, LeaseLost):
            # The database or the IM is away: nothing is wrong with the agent
            # or the run, which stays as stored (RUNNING) and goes on once the
            # dependency is back (see `_loop`), with the same keys. Or another
            # replica took the agent: it goes on from what is stored.
            self._abort_streaming("the step could not be stored; it starts again when the run goes on")
            raise
        except Exception as other:
            # The IM refused or lost the answer, a tool's port broke...: the
            # run ends FAILED, never left RUNNING.
            failure = cause = other
            status, error = RunStatus.FAILED, str(other) or type(other).__name__
        finally:
            await reading
        # An error's text may quote the endpoint's answer: stored like a step's.
        ended = replace(run, status=status, error=storable_text(error), ended_at=self._env.clock())
        chat = reply_group if task is None else None
        await self._finish(ended, answer, failure=failure, cause=cause, chat=chat)

    async def _finish(
        self,
        ended: Run,
        answer: str,
        *,
        failure: Exception | None,
        cause: Exception | None,
        chat: uuid.UUID | None,
    ) -> None:
        """Stores the end of a run, settles its task and tells its chat if no answer came."""
        try:
            await self._end_run(ended, failure)
        except BaseException:
            # Stored at the next cycle, before anything else (see `_end_unended`).
            self._unended = (ended, answer)
            raise
        self._env.run_ended()
        await self._settle_task(ended, answer)
        await self._tell_chat(ended, cause, chat)

    async def _tell_chat(self, run: Run, cause: Exception | None, chat: uuid.UUID | None) -> None:
        """Tells the people waiting for an answer in `chat` that none is coming,
        why, and how to retry (the notice names the run: a client offers
        `WakeAgent`), if the run ended so. Posted once per run (keyed by it);
        lost if the IM is away meanwhile."""
        trouble = _trouble(run.status, cause)
        self._failed = trouble is not None and trouble is not Trouble.TERMINATED
        if trouble is None or chat is None:
            return
        notice = failure_notice(trouble, run.error)
        about = {
            "agent_id": str(self.agent.id),
            "run_id": str(run.id),
            "status": run.status.value,
            "trouble": trouble.value,
        }
        if self._failed:
            about["retry"] = "WakeAgent"
        try:
            await self._env.im.send_message(
                self.agent.member_id,
                chat,
                notice,
                content_type="system",
                metadata={"agent_failure": about},
                request_id=failure_request_id(run.id),
            )
        except IMError as error:
            logger.warning(
                "agent %s: the notice of run %s's failure was not posted: %s", self.agent.id, run.id, error
            )

    async def _start(
        self, taken: _Taken, *, task: Task | None, resumed: bool, going_on: Run | None
    ) -> tuple[Run, uuid.UUID | None] | None:
        """The run to work in and the chat to answer; None if the work is not to be done."""
        try:
            if going_on is not None:
                chat = None if task is not None else (going_on.group_id or self._last_group())
                self._audience = await self._members(chat)
                self._begun.set()
                return going_on, chat
            return await self._begin(taken, task, resumed=resumed)
        except _NotStarted:
            self._pending_reads = {}  # what was read stays unread for later
            return None
        except (errors.Unavailable, LeaseLost):
            # Not begun (nothing stored): what was read stays unread for later,
            # and a task marked RUNNING meanwhile is settled once the runner is idle.
            self._pending_reads = {}
            self._running_task = None
            raise

    async def _begin(
        self, taken: _Taken, task: Task | None, *, resumed: bool
    ) -> tuple[Run, uuid.UUID | None]:
        """Stores the new run with its input; returns it and the chat to answer.

        Raises:
            _NotStarted: a person paused the agent, or cancelled the task,
                since the work was chosen.
        """
        env = self._env
        if self._held_back():
            raise _NotStarted
        messages = taken.messages
        # Answering another agent's answer: this answer ends the exchange.
        self._to_an_answer = any(is_agent_answer(m.metadata) for m in messages)
        await self._open_session(task.session_id if task is not None else self.agent.session_id)
        run = Run(
            id=uuid7(),
            agent_id=self.agent.id,
            session_id=self._session_id,
            status=RunStatus.RUNNING,
            trigger_message_ids=tuple(m.id for m in messages),
            started_at=env.clock(),
            group_id=messages[-1].group_id if messages else None,
        )
        inputs = [await self._incoming(m) for m in messages]
        reply_group = messages[-1].group_id if messages else (None if task else self._last_group())
        self._audience = await self._members(reply_group)
        # Before the input: the model reads what it remembers, then what it is asked.
        recalled = await self._recall(run, messages, task) if not resumed else []
        if task is not None:
            # Known as running before it is marked so, for a cancel meanwhile.
            self._running_task = task
            if env.tasks is not None and not resumed:
                inputs.append((ChatMessage(role=Role.USER, content=task.input), Origin(task_id=task.id)))
                task = await env.tasks.started(task, run_id=run.id, at=env.clock(), fence=self._fence())
                if task.status is not TaskStatus.RUNNING:
                    self._running_task = None
                    raise _NotStarted
            self._running_task = task
        # The way to the first completion is short: one write stores the run,
        # the agent's state, the input and how far it was read; the IM's read
        # positions move while the model is already working.
        if self._held_back():
            # A person paused or terminated it while the work was being chosen.
            if task is not None and env.tasks is not None and not resumed:
                await env.tasks.put_back(task, fence=self._fence())
            self._running_task = None
            raise _NotStarted
        # RUNNING here before the write (with nothing awaited since the check),
        # so that a control applied meanwhile sees a run in flight; back as it
        # was if the write fails.
        before = self.agent
        self.agent = self.agent.with_state(AgentState.RUNNING, "")
        incoming = [self._step(run, m, StepMetrics(), kind=StepKind.RECALL) for m in recalled]
        incoming += [self._step(run, message, StepMetrics(), origin=origin) for message, origin in inputs]
        try:
            await env.store.begin_run(run, self.agent, incoming, read_marks=taken.marks, fence=self._fence())
        except BaseException:
            self.agent = self._restored_state(before)
            raise
        self._advance_marks(taken.marks)
        self._emit(RunStarted(run))
        if self.agent.state_version != before.state_version:
            self._emit_state()
        for step in incoming:
            self._remember(step)
        if task is not None and resumed and env.tasks is not None:
            # Moved to this run only now that it is stored: a restart in
            # between still finds the task (the agent's RUNNING one) and goes on.
            task = await env.tasks.continued(task, run_id=run.id, fence=self._fence())
            if task.status is not TaskStatus.RUNNING:
                self._running_task = None  # a person cancelled it meanwhile: `_run` ends here
        self._begun.set()
        return run, reply_group

    async def _iterate(
        self, run: Run, reply_group: uuid.UUID | None, *, resumed: bool, chat: bool
    ) -> tuple[Run, RunStatus, str]:
        """Completions and tool calls until the model answers; returns the run,
        how it ended and the answer."""
        steps = self._steps or []
        if resumed and resume_point(steps) is Next.RUN_TOOLS:
            await self._call_tools(run, _last_assistant(steps), unanswered_calls(steps), reply_group)
        for _ in range(self._env.settings.max_iterations):
            self._pause_point()
            if self._over_budget():
                return run, RunStatus.BUDGET_EXHAUSTED, ""
            run = replace(run, iterations=run.iterations + 1)
            completion, said = await self._complete_within_window(run)
            if completion.message.tool_calls:
                await self._call_tools(run, said, completion.message.tool_calls, reply_group)
                self._pause_point()
                taken = await self._take_unread(reply_group) if chat and reply_group else _Taken()
                if taken.messages:
                    arrived = taken.messages
                    run = replace(
                        run, trigger_message_ids=run.trigger_message_ids + tuple(m.id for m in arrived)
                    )
                    reply_group = arrived[-1].group_id
                    await self._read_in(run, taken)
                continue
            answer = completion.message.content or ""
            await self._deliver(said, reply_group)
            return run, RunStatus.COMPLETED, answer
        return run, RunStatus.ITERATION_LIMIT, ""

    async def _record_cut(self, run: Run) -> None:
        """Keeps what the cut run had: the step being streamed, marked
        interrupted, and a result for every tool call (cancelled where none)."""
        # The store is the truth: a write may have landed as the run was cut.
        self._steps = await self._load_steps(self._session_id)
        self._unstored = 0
        streaming, self._streaming = self._streaming, None
        if streaming is not None:
            _, sequence, assembler = streaming
            if not self._steps or self._steps[-1].sequence < sequence:
                partial = interrupted_message(assembler.message())
                await self._append(run, partial, StepMetrics(), interrupted=True)
        outcomes, self._tool_outcomes = self._tool_outcomes, {}
        for call in unanswered_calls(self._steps):
            outcome = outcomes.get(call.id)
            await self._append(
                run,
                ChatMessage(
                    role=Role.TOOL,
                    content=outcome.content if outcome is not None else CANCELLED_RESULT,
                    tool_call_id=call.id,
                    name=call.name,
                ),
                StepMetrics(tool_duration_ms=outcome.duration_ms if outcome is not None else 0.0),
            )

    async def _settle_task(self, run: Run, answer: str) -> None:
        task, self._running_task = self._running_task, None
        tasks = self._env.tasks
        if task is None or tasks is None:
            return
        at = self._env.clock()
        if run.status is RunStatus.COMPLETED:
            await tasks.succeeded(task, result=answer, at=at, fence=self._fence())
        elif run.status is RunStatus.INTERRUPTED and self.agent.state is AgentState.PAUSED:
            pass  # it stays RUNNING: resuming goes on with it where it was cut
        elif run.status is RunStatus.INTERRUPTED and self.agent.state is AgentState.TERMINATED:
            await tasks.put_back(task, fence=self._fence())
        elif run.status is RunStatus.INTERRUPTED:
            await tasks.cancelled(task, at=at, fence=self._fence())
        else:
            await tasks.failed(task, error=run.error or run.status.value, at=at, fence=self._fence())

    async def _end_run(self, run: Run, failure: Exception | None) -> None:
        agent, error = self.agent, run.error
        if isinstance(failure, IMError) and not isinstance(failure, errors.Unavailable):
            # Refused (the group is gone, the agent was removed from it): the
            # answer cannot be given, but nothing is wrong with the agent.
            logger.warning("agent %s: the IM refused its answer: %s", agent.id, error)
            state, error = AgentState.IDLE, ""
        elif isinstance(failure, ContextTooLong):
            state, error = AgentState.IDLE, ""  # not the agent's fault; the run says why
        elif run.status is RunStatus.FAILED:
            if failure is not None and not isinstance(failure, errors.ServiceError):
                logger.error("agent %s: run %s failed", agent.id, run.id, exc_info=failure)
            state = AgentState.ERROR
        elif run.status is RunStatus.INTERRUPTED:
            cut = self._cut
            if cut is not None and cut.state is not None:
                state, error = cut.state, ""
            elif cut is None:
                state, error = AgentState.PAUSED, ""  # paused at a step boundary
            else:
                state, error = AgentState.IDLE, ""
        else:
            state, error = AgentState.IDLE, ""
        if agent.pause_pending and state is not AgentState.TERMINATED:
            # Asked to pause during the run, and no step boundary came: it
            # takes effect as the run ends (why a failed run failed stays on the run).
            state, error = AgentState.PAUSED, ""
        self.agent = agent.with_state(state, error)
        # One write for the run's end and the agent's new state.
        await self._env.store.end_run(run, self.agent, fence=self._fence())
        self._emit(RunEnded(run))
        if self.agent.state_version != agent.state_version:
            self._emit_state()

    async def _end_unended(self) -> None:
        """Stores the end of a run that could not be stored when it ended."""
        assert self._unended is not None
        run, answer = self._unended
        await self._env.store.end_run(run, self.agent, fence=self._fence())
        self._unended = None
        self._emit(RunEnded(run))
        await self._settle_task(run, answer)

    async def _deliver(self, said: Step, group_id: uuid.UUID | None) -> None:
        """Posts an answer step to the chat, in several messages if it is longer
        than one may be; each part keyed by the step, so that it arrives once
        however often this runs."""
        content = said.message.content or ""
        if is_silence(content) or group_id is None:
            return
        names = await self._names(group_id) if "@" in content else {}
        for index, part in enumerate(split_reply(content, self._env.settings.max_reply_bytes)):
            try:
                await self._env.im.send_message(
                    self.agent.member_id,
                    group_id,
                    part,
                    mentions=mentioned(part, names, author=self.agent.member_id) if "@" in part else (),
                    metadata=answer_metadata(said.run_id, to_an_answer=self._to_an_answer),
                    request_id=answer_request_id(said.id, index),
                )
            except IMError as refused:
                if refused.relayed_status != "ALREADY_EXISTS":
                    raise
                # Sent before under this step's key, by a runner (maybe another
                # replica's, before a handoff) that knew the chat a little
                # differently (mentions, metadata): it went out once, and stays so.
                logger.info(
                    "agent %s: part %d of step %d's answer was sent before",
                    self.agent.id,
                    index,
                    said.sequence,
                )

    async def _names(self, group_id: uuid.UUID) -> dict[uuid.UUID, str]:
        """The display names of the chat's members, to find whom an answer @names."""
        member_ids = self._audience
        if not member_ids:
            member_ids = (await self._env.im.get_group(self.agent.member_id, group_id)).member_ids
        names: dict[uuid.UUID, str] = {}
        for member_id in member_ids:
            try:
                names[member_id] = await self._env.directory.name(self.agent.member_id, member_id)
            except IMError as error:
                if isinstance(error, errors.Unavailable):
                    raise
                # A member the IM no longer shows is mentioned by no one.
        return names

    async def _complete_within_window(self, run: Run) -> tuple[Completion, Step]:
        """A completion whose request fits the model's window. An endpoint
        that still says "too long" teaches the estimate, and the request is
        made once more, shorter."""
        try:
            return await self._complete(run)
        except ContextTooLong as refused:
            logger.warning("agent %s: %s; shrinking the context and trying again", self.agent.id, refused)
            self._calibration.too_long(self._last_estimate, reported=refused.requested, window=refused.window)
            return await self._complete(run)

    async def _complete(self, run: Run) -> tuple[Completion, Step]:
        """A completion; a stream that breaks off midway is kept as a CUT step
        and asked for again (as the LLM adapter does with the requests that
        fail before their first delta), unless no retry could help."""
        settings = self._env.settings
        for attempt in range(settings.stream_cut_retries + 1):
            try:
                return await self._complete_once(run)
            except _StreamCut as cut:
                error = cut.error
                if attempt == settings.stream_cut_retries or isinstance(error, LLMRejected):
                    raise error from None
                delay = min(8.0, settings.stream_cut_backoff_seconds * 2**attempt)
                logger.warning(
                    "agent %s: the model's stream broke off (%s); asking again in %.1f s",
                    self.agent.id,
                    error,
                    delay,
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _complete_once(self, run: Run) -> tuple[Completion, Step]:
        env, agent = self._env, self.agent
        tools = env.tools.specs(agent.tools)
        fitted = await self._fitted_context(run, tools)
        request = CompletionRequest(messages=fitted.messages, tools=tools, settings=agent.model)
        sequence = self._next_sequence()
        self._emit(StepStarted(run.id, sequence, Role.ASSISTANT))
        started = time.perf_counter()
        first_token_ms = 0.0
        completion: Completion | None = None
        # What has streamed so far, kept should a person cut the step short.
        assembler = CompletionAssembler()
        self._streaming = (run.id, sequence, assembler)
        try:
            async for item in env.llm.stream(request):
                if isinstance(item, Completion):
                    completion = item
                    continue
                if not first_token_ms:
                    first_token_ms = (time.perf_counter() - started) * 1000
                # Watchers see what the stored step will hold.
                delta = storable_delta(item)
                assembler.add(delta)
                self._emit(StepDelta(sequence, delta))
        except LLMError as error:
            if not first_token_ms:
                raise
            await self._keep_cut(run, sequence, assembler, started, error)
            raise _StreamCut(error) from None
        if completion is None:
            raise LLMError("the model's stream ended without a completion")
        # What the model said is stored, answered and reused as it is stored.
        completion = replace(
            completion, message=storable_message(completion.message), model=storable_text(completion.model)
        )
        usage = completion.usage
        if usage is not None:
            self._calibration.observe(fitted.estimated, usage.input_tokens)
        else:
            usage = estimated_usage(self._calibration.tokens(fitted.estimated), completion.message)
        metrics = StepMetrics(
            duration_ms=(time.perf_counter() - started) * 1000,
            first_token_ms=first_token_ms,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_tokens=usage.cached_tokens,
            model=completion.model,
            usage_estimated=usage.estimated,
        )
        said = await self._append(run, completion.message, metrics, sequence=sequence)
        self._streaming = None
        self._count_tokens(usage)
        return completion, said

    async def _keep_cut(
        self, run: Run, sequence: int, assembler: CompletionAssembler, started: float, error: LLMError
    ) -> None:
        """Stores what a broken-off stream had said (people saw it stream) as a CUT step."""
        self._streaming = None
        partial = assembler.message()
        kept = ChatMessage(role=Role.ASSISTANT, content=partial.content, reasoning=partial.reasoning)
        logger.info("agent %s: stream of step %d broke off: %s", self.agent.id, sequence, error)
        await self._append(
            run,
            kept,
            StepMetrics(duration_ms=(time.perf_counter() - started) * 1000),
            sequence=sequence,
            kind=StepKind.CUT,
        )

    async def _call_tools(
        self, run: Run, said: Step, calls: tuple[ToolCall, ...], reply_group: uuid.UUID | None
    ) -> None:
        """Runs the tool calls of the assistant step `said`, each keyed by that step and its call id."""
        env = self._env
        context = ToolContext(
            agent=self.agent,
            im=env.im,
            trigger_group_id=reply_group,
            create_sub_agent=env.create_sub_agent,
            wait_for_reply=self._wait_for_reply,
            memory=env.memory if self._audience is not None else None,
            audience=self._audience or (),
        )

        async def execute(call: ToolCall) -> ToolOutcome:
            keyed = replace(context, request_id=tool_request_id(said.id, call.id))
            outcome = await env.tools.execute(keyed, call)
            # Kept should the run be cut before the results are stored.
            self._tool_outcomes[call.id] = outcome
            return outcome

        outcomes = await asyncio.gather(*[execute(call) for call in calls], return_exceptions=True)
        self._tool_outcomes = {}
        away: BaseException | None = None
        for call, outcome in zip(calls, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                # The IM or the database is away: the call stays unanswered and
                # runs again (same key) when the run goes on; the others' results are kept.
                away = away or outcome
                continue
            await self._append(
                run,
                ChatMessage(role=Role.TOOL, content=outcome.content, tool_call_id=call.id, name=call.name),
                StepMetrics(duration_ms=outcome.duration_ms, tool_duration_ms=outcome.duration_ms),
            )
        if away is not None:
            raise away


def _trouble(status: RunStatus, cause: Exception | None) -> Trouble | None:
    """Why a run that ended so owes the chat a notice; None if it does not
    (it answered, a person stopped it, or the IM refused the answer and would
    refuse a notice too)."""
    if status is RunStatus.BUDGET_EXHAUSTED:
        return Trouble.BUDGET
    if isinstance(cause, _Terminated):
        return Trouble.TERMINATED
    if status is not RunStatus.FAILED or isinstance(cause, IMError):
        return None
    if isinstance(cause, ContextTooLong):
        return Trouble.CONTEXT
    if isinstance(cause, LLMRejected):
        return Trouble.MODEL_REFUSED
    if isinstance(cause, LLMError):
        return Trouble.MODEL_DOWN
    return Trouble.OTHER
