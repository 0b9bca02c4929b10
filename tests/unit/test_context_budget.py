"""The context budget's pure rules: windows, the estimate and its correction,
and which steps are sent when they do not all fit."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import replace
from datetime import UTC, datetime

from services.runtime.domain.context import (
    DEFAULT_WINDOW,
    SUMMARY_HEADER,
    Calibration,
    SentSteps,
    answer_reserve,
    context_window,
    estimate_message,
    estimate_text,
    fit_context,
    summary_request,
)
from services.runtime.domain.llm import ChatMessage, Role, ToolCall
from services.runtime.domain.model import Step, StepKind, StepMetrics

_sequences = itertools.count(1)


def step(run: uuid.UUID, role: Role, text: str = "", **fields: object) -> Step:
    calls = fields.pop("calls", ())
    kind = fields.pop("kind", StepKind.MESSAGE)
    message = ChatMessage(role=role, content=text, tool_calls=calls, **fields)  # type: ignore[arg-type]
    return Step(
        id=uuid.uuid4(),
        agent_id=uuid.UUID(int=1),
        session_id=uuid.UUID(int=2),
        run_id=run,
        sequence=next(_sequences),
        message=message,
        metrics=StepMetrics(),
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        kind=kind,  # type: ignore[arg-type]
    )


def chat_run(words: int = 50) -> tuple[uuid.UUID, list[Step]]:
    run = uuid.uuid4()
    return run, [step(run, Role.USER, "word " * words), step(run, Role.ASSISTANT, "answer " * words)]


def tool_run(words: int = 50) -> tuple[uuid.UUID, list[Step]]:
    run = uuid.uuid4()
    call = ToolCall("c1", "read_history", "{}")
    return run, [
        step(run, Role.USER, f"{run}: " + "look it up " * words),
        step(run, Role.ASSISTANT, "", calls=(call,)),
        step(run, Role.TOOL, "result " * words, tool_call_id="c1", name="read_history"),
        step(run, Role.ASSISTANT, "found " * words),
    ]


def sent(fitted_messages: list[ChatMessage]) -> list[str]:
    return [m.content or "" for m in fitted_messages]


def test_the_window_comes_from_the_agent_then_the_model_name_then_the_runtime() -> None:
    assert context_window("gpt-4o-mini", configured=4096, fallback=None) == 4096
    assert context_window("gpt-4o-mini", configured=None, fallback=2048) == 128_000
    assert context_window("openai/GPT-4.1-mini", configured=None, fallback=None) == 1_047_576
    assert context_window("gpt-4", configured=None, fallback=None) == 8_192  # the longest prefix wins
    assert context_window("my-local-model", configured=None, fallback=32_000) == 32_000
    assert context_window("my-local-model", configured=None, fallback=None) == DEFAULT_WINDOW
    assert answer_reserve(4096, None) == 1024 and answer_reserve(200_000, None) == 4096
    assert answer_reserve(4096, 300) == 300 and answer_reserve(4096, 4000) == 2048


def test_the_estimate_counts_chinese_per_character_and_the_rest_per_three_bytes() -> None:
    assert estimate_text("") == 0
    assert estimate_text("你好世界") == 4
    assert estimate_text("abcdef") == 2
    call = ToolCall("c1", "send_message", '{"content": "hi"}')
    assert estimate_message(ChatMessage(role=Role.ASSISTANT, tool_calls=(call,))) > estimate_message(
        ChatMessage(role=Role.ASSISTANT)
    )


def test_the_correction_rises_at_once_and_falls_slowly() -> None:
    calibration = Calibration()
    calibration.observe(estimated=100, reported=150)
    assert calibration.ratio >= 1.5
    for _ in range(5):
        calibration.observe(estimated=100, reported=80)
    assert 0.8 < calibration.ratio < 1.5
    for _ in range(200):
        calibration.observe(estimated=100, reported=10)
    assert calibration.ratio == calibration.floor
    calibration.too_long(1000, reported=3000)
    assert calibration.ratio >= 3.0
    before = calibration.ratio
    calibration.too_long(1000, reported=None)
    assert calibration.ratio > before


def test_everything_that_fits_is_sent_as_it_is() -> None:
    _, a = chat_run()
    second, b = tool_run()
    fitted = fit_context(system_prompt="be kind", steps=a + b, current_run=second, tools=(), budget=10_000)
    assert [m.role for m in fitted.messages] == [Role.SYSTEM] + [s.role for s in a + b]
    assert fitted.left_out == [] and fitted.summary_through == 0


def test_the_oldest_whole_runs_leave_first_and_a_tool_call_keeps_its_result() -> None:
    runs = [tool_run() for _ in range(6)]
    steps = [s for _, run in runs for s in run]
    current = runs[-1][0]
    per_run = sum(estimate_message(s.message) for s in runs[0][1])
    fitted = fit_context(
        system_prompt="sys", steps=steps, current_run=current, tools=(), budget=per_run * 3 + 50
    )
    kept = {s.run_id for s in steps if any(s.message is m for m in fitted.messages)}
    assert kept == {run for run, _ in runs[-3:]}
    assert {s.run_id for s in fitted.left_out} == {run for run, _ in runs[:3]}
    roles = [m.role for m in fitted.messages[1:]]
    for index, role in enumerate(roles):
        if role is Role.TOOL:
            assert roles[index - 1] is Role.ASSISTANT
    assert roles[0] is Role.USER  # a run starts with its input


def test_the_current_run_stays_even_alone_over_budget_its_oldest_exchanges_go_then_texts_are_cut() -> None:
    run = uuid.uuid4()
    calls = [ToolCall(f"c{i}", "read_history", "{}") for i in range(4)]
    steps = [step(run, Role.USER, "please look")]
    for call in calls:
        steps.append(step(run, Role.ASSISTANT, "", calls=(call,)))
        steps.append(step(run, Role.TOOL, "row " * 400, tool_call_id=call.id, name="read_history"))
    fitted = fit_context(system_prompt="sys", steps=steps, current_run=run, tools=(), budget=400)
    bodies = fitted.messages[1:]
    assert bodies[0].content == "please look"
    assert [m.tool_call_id for m in bodies if m.role is Role.TOOL] == ["c3"]  # the newest exchange only
    assert fitted.estimated <= 400
    assert "characters cut to fit the context window" in (bodies[-1].content or "")


def test_a_summary_replaces_the_steps_it_covers_inside_the_system_prompt() -> None:
    _, a = chat_run()
    new, b = chat_run()
    summary = step(new, Role.SYSTEM, "Alice's locker is 4711.", kind=StepKind.SUMMARY)
    summary = Step(**{**{f: getattr(summary, f) for f in Step.__slots__}, "summary_through": a[-1].sequence})
    recall = step(new, Role.USER, "[memory] recalled", kind=StepKind.RECALL)
    fitted = fit_context(
        system_prompt="sys",
        steps=[*a, summary, recall, *b],
        current_run=new,
        tools=(),
        budget=10_000,
        extra=[ChatMessage(role=Role.USER, content="extra context")],
    )
    texts = sent(fitted.messages)
    assert texts[0] == f"sys\n\n{SUMMARY_HEADER}\nAlice's locker is 4711."
    assert texts[1] == "extra context"
    assert texts[2:] == ["[memory] recalled", *(s.message.content for s in b)]
    assert fitted.summary_through == a[-1].sequence and [s.sequence for s in fitted.left_out] == [
        s.sequence for s in a
    ]
    assert sum(1 for m in fitted.messages if m.role is Role.SYSTEM) == 1


def test_a_summary_request_keeps_the_newest_steps_when_not_all_fit() -> None:
    run = uuid.uuid4()
    leaving = [step(run, Role.USER, f"message {i} " + "x" * 300) for i in range(50)]
    messages = summary_request("earlier: nothing much", leaving, budget=1000)
    body = messages[1].content or ""
    assert "earlier: nothing much" in body and "message 49" in body and "message 0 " not in body
    assert estimate_text(body) <= 1000


def test_remembered_estimates_fit_as_fresh_ones_and_an_edited_step_is_worked_out_again() -> None:
    runs = [chat_run(words=30 + i)[1] for i in range(6)] + [tool_run(words=40)[1]]
    steps = [s for run in runs for s in run]
    current = steps[-1].run_id
    remembered = SentSteps()
    for budget in (10_000, 600, 300, 120):
        fresh = fit_context(system_prompt="sys", steps=steps, current_run=current, tools=(), budget=budget)
        again = fit_context(
            system_prompt="sys", steps=steps, current_run=current, tools=(), budget=budget, sent=remembered
        )
        assert (again.messages, again.estimated, again.left_out) == (
            fresh.messages,
            fresh.estimated,
            fresh.left_out,
        )
    # An edited step is another object: its new text is what is counted and sent.
    edited = list(steps)
    last = edited[-1]
    edited[-1] = replace(last, message=replace(last.message, content="short"))
    fitted = fit_context(
        system_prompt="sys", steps=edited, current_run=current, tools=(), budget=10_000, sent=remembered
    )
    assert fitted.messages[-1].content == "short"
    assert (
        fitted.estimated
        == fit_context(
            system_prompt="sys", steps=edited, current_run=current, tools=(), budget=10_000
        ).estimated
    )


def test_remembered_estimates_of_steps_no_longer_fitted_are_let_go() -> None:
    kept, unbounded = SentSteps(), SentSteps()
    for _ in range(100):
        run, steps = chat_run()
        for remembered in (kept, unbounded):
            fit_context(
                system_prompt="", steps=steps, current_run=run, tools=(), budget=10_000, sent=remembered
            )
        kept.forget_unused()
    # A hundred fittings of two new steps each: without letting go, 200 kept.
    assert unbounded.remembered() == 200
    assert kept.remembered() <= 2 * 2 + 64
