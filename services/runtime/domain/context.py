"""The context budget: what of a session is sent to the model, within its window.

Every request must fit the model's context window with room for the answer.
Tokens are estimated conservatively (no tokenizer with its vocabulary
installs offline) and the estimate is corrected by what the endpoint reports
it counted. When the session's steps do not fit, the oldest whole runs leave
the context (they stay stored, and in long-term memory); what stays is the
system prompt with the rolling summary of what left, the recalled memories,
and the most recent runs. An assistant step is never sent without the
results of its tool calls.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from services.runtime.domain.conversations import as_sent
from services.runtime.domain.llm import ChatMessage, Role, ToolSpec, Usage
from services.runtime.domain.model import Step, StepKind, shown_to_model

# Context windows of well-known models, by name prefix (longest prefix wins).
KNOWN_WINDOWS: dict[str, int] = {
    "gpt-4.1": 1_047_576,
    "gpt-4o": 128_000,
    "gpt-4-turbo": 128_000,
    "gpt-4": 8_192,
    "gpt-3.5-turbo": 16_385,
    "gpt-5": 400_000,
    "o1": 200_000,
    "o3": 200_000,
    "o4-mini": 200_000,
    "claude": 200_000,
    "gemini": 1_048_576,
    "deepseek": 65_536,
    "qwen2.5": 32_768,
    "qwen3": 32_768,
    "llama-3.1": 131_072,
    "llama3.1": 131_072,
    "llama-3": 8_192,
    "llama3": 8_192,
    "mistral": 32_768,
    "offline": 1_000_000,
}
DEFAULT_WINDOW = 8_192
# The answer's room when the agent sets no max_tokens: a quarter of the window, at most this.
MAX_ANSWER_RESERVE = 4_096
# Tokens added per message by chat templates (role markers, separators).
MESSAGE_OVERHEAD = 8

# Chinese, Japanese and Korean characters, and full-width forms: a token or more each.
_CJK = re.compile(
    r"[\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]"
)


def context_window(model: str, *, configured: int | None, fallback: int | None) -> int:
    """The agent's own setting, else the known window of its model, else the
    runtime's fallback (OPENAI_CONTEXT_TOKENS), else a conservative default."""
    if configured:
        return configured
    name = model.lower().rsplit("/", 1)[-1]
    matches = [prefix for prefix in KNOWN_WINDOWS if name.startswith(prefix)]
    if matches:
        return KNOWN_WINDOWS[max(matches, key=len)]
    return fallback or DEFAULT_WINDOW


def answer_reserve(window: int, max_tokens: int | None) -> int:
    """Room kept for the answer."""
    if max_tokens:
        return min(max_tokens, window // 2)
    return min(window // 4, MAX_ANSWER_RESERVE)


def estimate_text(text: str) -> int:
    """Tokens of `text`, counted high: one per CJK character, one per three
    bytes of anything else (BPE tokenizers average about four)."""
    if not text:
        return 0
    cjk = len(_CJK.findall(text))
    rest = len(text.encode()) - cjk * 3
    return cjk + (max(0, rest) + 2) // 3


def estimate_message(message: ChatMessage) -> int:
    tokens = MESSAGE_OVERHEAD + estimate_text(message.prefix + (message.content or ""))
    for call in message.tool_calls:
        tokens += MESSAGE_OVERHEAD + sum(map(estimate_text, (call.id, call.name, call.arguments)))
    return tokens + estimate_text(message.tool_call_id or "") + estimate_text(message.name or "")


def estimate_tools(tools: Sequence[ToolSpec]) -> int:
    return sum(estimate_text(json.dumps(tool.to_openai(), ensure_ascii=False)) for tool in tools)


@dataclass
class Calibration:
    """How the endpoint's own count compares with the estimate.

    Raised at once when the endpoint counts more (the estimate was low and a
    request may not fit); lowered slowly when it counts less, never below
    half (a request that fits by our count then fits by its).
    """

    ratio: float = 1.0
    floor: float = 0.5
    ceiling: float = 8.0
    # The window the endpoint said it has, when smaller than configured.
    window: int | None = None

    def observe(self, estimated: int, reported: int) -> None:
        if estimated <= 0 or reported <= 0:
            return
        seen = reported / estimated
        if seen > self.ratio:
            self.ratio = min(self.ceiling, seen * 1.05)
        else:
            self.ratio = max(self.floor, 0.9 * self.ratio + 0.1 * seen)

    def too_long(self, estimated: int, *, reported: int | None, window: int | None = None) -> None:
        """The endpoint refused a request estimated at `estimated` as too long
        (`reported`: its count of the request; `window`: its window, if said)."""
        if window:
            self.window = min(window, self.window or window)
        if reported and estimated > 0:
            self.ratio = min(self.ceiling, max(self.ratio * 1.1, reported / estimated * 1.1))
        else:
            self.ratio = min(self.ceiling, self.ratio * 1.5)

    def tokens(self, estimated: int) -> int:
        return int(estimated * self.ratio) + 1


def estimated_usage(prompt_tokens: int, answer: ChatMessage) -> Usage:
    """Usage counted here, for an endpoint that reports none: the request's
    tokens as counted for the context budget, and the answer's (its text,
    thinking and tool calls), both counted high (see `estimate_text`)."""
    output = estimate_message(answer) - MESSAGE_OVERHEAD + estimate_text(answer.reasoning or "")
    return Usage(input_tokens=prompt_tokens, output_tokens=max(0, output), estimated=True)


@dataclass(frozen=True, slots=True)
class Fitted:
    """What to send, and what of the candidates was left out."""

    messages: list[ChatMessage]
    estimated: int
    left_out: list[Step] = field(default_factory=list)
    # The summary in use, and the last sequence it covers (0: none).
    summary_through: int = 0


SUMMARY_HEADER = "Summary of the earlier conversation (those steps are no longer shown; recall finds them):"


def latest_summary(steps: Sequence[Step]) -> Step | None:
    return next((s for s in reversed(steps) if s.kind is StepKind.SUMMARY), None)


class SentSteps:
    """Each step's message as sent (`as_sent`) and its estimate, worked out
    once per step: a resident agent fits its whole conversation into the
    window before every completion, and most of it is the same each time.

    Steps are immutable, so an entry is good for as long as it is the very
    same step object (an edited step is a new one); entries of steps no
    longer passed are dropped once they outnumber the live ones.
    """

    def __init__(self) -> None:
        self._known: dict[int, tuple[Step, ChatMessage, int]] = {}
        self._used: set[int] = set()

    def __call__(self, step: Step) -> tuple[ChatMessage, int]:
        key = id(step)
        self._used.add(key)
        known = self._known.get(key)
        if known is not None and known[0] is step:
            return known[1], known[2]
        message = as_sent(step)
        worked_out = (step, message, estimate_message(message))
        self._known[key] = worked_out
        return message, worked_out[2]

    def remembered(self) -> int:
        """How many steps' results are kept."""
        return len(self._known)

    def forget_unused(self) -> None:
        """Drops the steps not asked for since the last call, when they are
        more than those that were (called after each fitting)."""
        if len(self._known) > 2 * len(self._used) + 64:
            self._known = {key: value for key, value in self._known.items() if key in self._used}
        self._used = set()


def _worked_out(step: Step) -> tuple[ChatMessage, int]:
    message = as_sent(step)
    return message, estimate_message(message)


Sent = Callable[[Step], tuple[ChatMessage, int]]


def fit_context(
    *,
    system_prompt: str,
    steps: Sequence[Step],
    current_run: uuid.UUID | None,
    tools: Sequence[ToolSpec],
    budget: int,
    extra: Sequence[ChatMessage] = (),
    sent: Sent = _worked_out,
) -> Fitted:
    """The request's messages: the system prompt (with the latest summary
    merged in, replacing the steps it covers), `extra` (recalled memories),
    then the most recent whole runs of `steps` whose estimate fits in
    `budget`. The current run is always kept; if it alone is too long, the
    oldest tool exchanges after its input go, then the longest texts are cut.
    `sent` gives a step's message as sent and its estimate (`SentSteps`
    remembers them).
    """
    steps = shown_to_model(steps)
    summary = latest_summary(steps)
    covered = summary.summary_through if summary is not None else 0
    system = system_prompt
    if summary is not None and summary.message.content:
        # Merged into the one system message: some chat templates (llama.cpp's
        # among them) refuse a system message anywhere but first.
        system = f"{system_prompt}\n\n{SUMMARY_HEADER}\n{summary.message.content}".strip()
    head = [ChatMessage(role=Role.SYSTEM, content=system), *extra]
    used = sum(estimate_message(m) for m in head) + estimate_tools(tools)
    # Summaries are sent only in the system prompt; recalled memories in place.
    candidates = [s for s in steps if s.sequence > covered and s.kind is not StepKind.SUMMARY]
    runs = _runs(candidates)
    kept: list[list[Step]] = []
    first_kept = len(runs)
    for index in range(len(runs) - 1, -1, -1):
        run = runs[index]
        cost = _cost(run, sent)
        if used + cost <= budget:
            kept.append(run)
            used += cost
            first_kept = index
            continue
        if index == len(runs) - 1 and run[0].run_id == current_run:
            run = _shrink_run(run, budget - used, sent)
            kept.append(run)
            used += _cost(run, sent)
            first_kept = index
            continue
        break
    kept.reverse()
    left_out = [s for s in steps if s.sequence <= covered and s.kind is not StepKind.SUMMARY]
    left_out += [s for run in runs[:first_kept] for s in run]
    messages = head + [sent(s)[0] for run in kept for s in run]
    return Fitted(messages, used, left_out, covered)


def _cost(steps: Sequence[Step], sent: Sent = _worked_out) -> int:
    return sum(sent(s)[1] for s in steps)


def _runs(steps: Sequence[Step]) -> list[list[Step]]:
    """Steps grouped by run, in order (a run's steps are contiguous in a conversation)."""
    grouped: list[list[Step]] = []
    for step in steps:
        if grouped and grouped[-1][0].run_id == step.run_id:
            grouped[-1].append(step)
        else:
            grouped.append([step])
    return grouped


def _exchanges(run: Sequence[Step]) -> list[list[Step]]:
    """A run as units that must stay together: an assistant step with the
    tool results after it; any other step alone."""
    units: list[list[Step]] = []
    for step in run:
        if step.role is Role.TOOL and units and units[-1][0].role is Role.ASSISTANT:
            units[-1].append(step)
        else:
            units.append([step])
    return units


# A text is never cut shorter than this many tokens.
_MIN_KEPT_TOKENS = 32


def _shrink_run(run: list[Step], room: int, sent: Sent) -> list[Step]:
    """The current run made to fit `room`: its input stays, the oldest
    exchanges after it go (the last one stays), then the longest texts are cut."""
    units = _exchanges(run)
    first_reply = next((i for i, u in enumerate(units) if u[0].role is Role.ASSISTANT), len(units))
    inputs, rest = units[:first_reply], units[first_reply:]
    while len(rest) > 1 and _cost([s for u in (*inputs, *rest) for s in u], sent) > room:
        rest.pop(0)
    steps = [s for unit in (*inputs, *rest) for s in unit]
    while (over := _cost(steps, sent) - room) > 0:
        longest = max(range(len(steps)), key=lambda i: estimate_text(steps[i].message.content or ""))
        text = steps[longest].message.content or ""
        target = estimate_text(text) - over
        if estimate_text(text) <= _MIN_KEPT_TOKENS or target < _MIN_KEPT_TOKENS:
            target = _MIN_KEPT_TOKENS
        cut = cut_text(text, target)
        if estimate_text(cut) >= estimate_text(text):
            break  # nothing more to cut: sent as it is, the endpoint decides
        steps[longest] = replace(steps[longest], message=replace(steps[longest].message, content=cut))
    return steps


def cut_text(text: str, tokens: int) -> str:
    """The start of `text` within about `tokens`, saying how much was cut."""
    if estimate_text(text) <= tokens:
        return text
    note = f"\n[… {len(text)} characters cut to fit the context window …]"
    room = max(0, tokens - estimate_text(note))
    head = text.encode()[: room * 3].decode(errors="ignore")
    while head and estimate_text(head) > room:
        head = head[: len(head) * 9 // 10]
    return f"{head}\n[… {len(text) - len(head)} characters cut to fit the context window …]"


# What the model is asked when runs leave the context.
SUMMARY_INSTRUCTIONS = (
    "You keep the running summary of a conversation for yourself: the steps below are leaving your"
    " context window. Write the new summary: the previous summary merged with what matters in these"
    " steps (facts, decisions, names, numbers, identifiers, open questions, promises made), in the"
    " language of the conversation, as short notes. Say nothing else."
)
# Of a summary request, at most this share of the budget is the transcript.
_TRANSCRIPT_SHARE = 0.7
_STEP_CHARS = 2_000


def summary_request(previous: str, leaving: Sequence[Step], budget: int) -> list[ChatMessage]:
    """The messages that ask for the new rolling summary, within `budget`."""
    lines = []
    for step in leaving:
        message = as_sent(step)
        text = (message.prefix + (message.content or ""))[:_STEP_CHARS]
        calls = "; ".join(f"called {c.name}({c.arguments[:200]})" for c in message.tool_calls)
        lines.append(f"{message.role.value}: {' '.join(part for part in (text, calls) if part)}")
    transcript = "\n".join(lines)
    room = int(budget * _TRANSCRIPT_SHARE) - estimate_text(previous) - estimate_text(SUMMARY_INSTRUCTIONS)
    # The newest steps matter most when not all fit: the oldest are cut.
    while transcript and estimate_text(transcript) > max(room, 0):
        transcript = transcript[len(transcript) // 5 :]
    body = f"Previous summary:\n{previous or '(none)'}\n\nLeaving steps:\n{transcript}"
    return [
        ChatMessage(role=Role.SYSTEM, content=SUMMARY_INSTRUCTIONS),
        ChatMessage(role=Role.USER, content=body),
    ]
