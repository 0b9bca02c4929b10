"""What the model is shown: the window, fitting the steps into it, summaries, recall, the prompt."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence

from services.common import errors
from services.runtime.domain.context import (
    Fitted,
    answer_reserve,
    context_window,
    estimate_message,
    estimated_usage,
    fit_context,
    latest_summary,
    summary_request,
)
from services.runtime.domain.conversations import (
    TASKS,
    Conversation,
    conversation_line,
    in_conversation,
    origin_of_run,
    run_conversations,
)
from services.runtime.domain.errors import IMError, LLMError
from services.runtime.domain.etiquette import NO_REPLY
from services.runtime.domain.llm import (
    ChatMessage,
    Completion,
    CompletionAssembler,
    CompletionRequest,
    ContentDelta,
    Role,
    ToolSpec,
    Usage,
    storable_delta,
)
from services.runtime.domain.model import (
    Origin,
    Run,
    Step,
    StepAborted,
    StepDelta,
    StepKind,
    StepMetrics,
    StepStarted,
    Task,
)
from services.runtime.service_layer.im_port import IMMessage
from services.runtime.service_layer.memory_port import RecallQuery
from services.runtime.service_layer.runner.core import RunnerCore
from services.runtime.service_layer.runner.env import MAX_EXCLUDED_RUNS, SUMMARY_HEADROOM
from services.runtime.service_layer.tools import recalled_note

logger = logging.getLogger(__name__)


class Context(RunnerCore):
    """What the model is shown: the steps of the run's conversation within the
    model's window (older runs summarized as they leave), what memory
    recalls, and who the agent is."""

    async def _members(self, chat: uuid.UUID | None) -> tuple[uuid.UUID, ...] | None:
        """Who will see the answer in `chat` (read afresh: someone may have joined)."""
        if chat is None or self._env.memory is None:
            return ()
        try:
            return (await self._env.im.get_group(self.agent.member_id, chat)).member_ids
        except IMError as error:
            # Unknown audience: no recall in this run.
            logger.warning("agent %s: members of chat %s unknown: %s", self.agent.id, chat, error)
            return None

    async def _recall(self, run: Run, messages: list[IMMessage], task: Task | None) -> list[ChatMessage]:
        """The memories most related to the run's input, as an input step of
        the run (visible and editable like any step), each with its ref; none
        if memory is slow or away: the run goes on without."""
        env, audience = self._env, self._audience
        limit = self.agent.auto_recall if self.agent.auto_recall is not None else env.settings.auto_recall
        if env.memory is None or limit <= 0 or audience is None:
            return []
        query = task.input if task is not None else "\n".join(m.content for m in messages)
        if not query.strip():
            return []
        conversation: Conversation | None = (
            TASKS if task is not None else (messages[-1].group_id if messages else None)
        )
        shown = (run.id, *self._runs_in_context(conversation))
        try:
            found = await asyncio.wait_for(
                env.memory.recall(
                    self.agent,
                    audience,
                    RecallQuery(text=query[-2000:], limit=limit, exclude_run_ids=shown[:MAX_EXCLUDED_RUNS]),
                ),
                env.settings.recall_timeout_seconds,
            )
        except (TimeoutError, errors.ServiceError) as error:
            logger.warning("agent %s: recall skipped: %s", self.agent.id, error)
            return []
        relevant = [memory for memory in found if memory.score >= env.settings.recall_min_score]
        return [ChatMessage(role=Role.USER, content=recalled_note(relevant))] if relevant else []

    def _runs_in_context(self, conversation: Conversation | None) -> list[uuid.UUID]:
        """The runs the conversation's next request will show, newest first:
        recall need not bring them back."""
        if self._steps is None or conversation is None:
            return []
        steps = in_conversation(self._steps, conversation, run_conversations(self._steps))
        window, reserve = self._window()
        fitted = fit_context(
            system_prompt="",
            steps=steps,
            current_run=None,
            tools=(),
            budget=int((window - reserve) / self._calibration.ratio),
            sent=self._sent_steps,
        )
        left = {step.run_id for step in fitted.left_out}
        return sorted({step.run_id for step in steps} - left, reverse=True)

    def _window(self) -> tuple[int, int]:
        """The model's context window and the room kept for the answer."""
        model, settings = self.agent.model, self._env.settings
        name = model.model or (settings.default_model if model.base_url else settings.unconfigured_model)
        window = context_window(name, configured=model.context_tokens, fallback=settings.context_tokens)
        if self._calibration.window:
            window = min(window, self._calibration.window)  # the endpoint knows best
        return window, answer_reserve(window, model.max_tokens)

    def _conversation_steps(self, run: Run) -> list[Step]:
        assert self._steps is not None
        runs = run_conversations(self._steps)
        return in_conversation(self._steps, runs.get(run.id), runs)

    async def _fitted_context(self, run: Run, tools: Sequence[ToolSpec]) -> Fitted:
        """The request's messages within the budget; runs that must leave
        and no summary covers yet are summarized first (with room to spare,
        so that the next runs need no summary of their own)."""
        window, reserve = self._window()
        budget = int((window - reserve) / self._calibration.ratio)

        def fit(tokens: int) -> Fitted:
            return fit_context(
                system_prompt=self._system_prompt(origin_of_run(self._steps or [], run.id)),
                steps=self._conversation_steps(run),
                current_run=run.id,
                tools=tools,
                budget=tokens,
                sent=self._sent_steps,
            )

        fitted = fit(budget)
        if any(step.sequence > fitted.summary_through for step in fitted.left_out):
            roomy = fit(int(budget * SUMMARY_HEADROOM))
            leaving = [s for s in roomy.left_out if s.sequence > roomy.summary_through]
            if leaving and await self._summarize(run, leaving, budget):
                fitted = fit(budget)
        self._last_estimate = fitted.estimated
        self._sent_steps.forget_unused()
        return fitted

    async def _summarize(self, run: Run, leaving: list[Step], budget: int) -> bool:
        """The model writes the rolling summary: the one before and the steps
        leaving the context, in a SUMMARY step covering them. Whether it could."""
        assert self._steps is not None
        previous = latest_summary(self._conversation_steps(run))
        request = CompletionRequest(
            messages=summary_request((previous.message.content or "") if previous else "", leaving, budget),
            settings=self.agent.model,
        )
        sequence = self._next_sequence()
        self._emit(StepStarted(run.id, sequence, Role.SYSTEM))
        started, assembler = time.perf_counter(), CompletionAssembler()
        usage: Usage | None = None
        try:
            async for item in self._env.llm.stream(request):
                if isinstance(item, Completion):
                    usage = item.usage
                elif isinstance(item, ContentDelta):
                    delta = storable_delta(item)
                    assembler.add(delta)
                    self._emit(StepDelta(sequence, delta))
        except LLMError as error:
            logger.warning("agent %s: no summary of the runs leaving its context: %s", self.agent.id, error)
            self._emit(StepAborted(run.id, sequence, "the summary could not be written"))
            return False
        text = assembler.content.strip()
        if not text:
            self._emit(StepAborted(run.id, sequence, "the model wrote no summary"))
            return False
        if usage is None:
            prompt = self._calibration.tokens(sum(map(estimate_message, request.messages)))
            usage = estimated_usage(prompt, ChatMessage(role=Role.SYSTEM, content=text))
        metrics = StepMetrics(
            duration_ms=(time.perf_counter() - started) * 1000,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            model=self.agent.model.model,
            usage_estimated=usage.estimated,
        )
        await self._append(
            run,
            ChatMessage(role=Role.SYSTEM, content=text),
            metrics,
            sequence=sequence,
            kind=StepKind.SUMMARY,
            summary_through=max(step.sequence for step in leaving),
        )
        self._count_tokens(usage)
        return True

    def _system_prompt(self, origin: Origin | None = None) -> str:
        agent = self.agent
        identity = f"You are {agent.name}"
        if agent.role:
            identity += f", {agent.role}"
        identity += (
            ", a member of an instant-messaging workspace."
            " Your final answer is posted to the chat that woke you; use tools to write elsewhere."
            " In a group, @name a member to ask them; agents answer only those who @name them or"
            f" reply to them. If you have nothing to add, answer exactly {NO_REPLY} and nothing is posted."
        )
        where = conversation_line(origin)
        if where:
            identity += " " + where
        return f"{identity}\n\n{agent.system_prompt}".strip()
