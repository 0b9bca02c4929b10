"""A question that asks when prefers the candidates that name a time."""

# Chinese punctuation in Chinese text is what users write.
# ruff: noqa: RUF001

from __future__ import annotations

import pytest

from services.memory.domain import hybrid
from services.memory.domain.answer_type import asks_when, names_time, prefer_times
from services.memory.domain.hybrid import Candidates
from services.memory.domain.ranking import FusionSettings, Hit
from services.memory.domain.terms import lexical_terms


@pytest.mark.parametrize(
    ("question", "when"),
    [
        ("Kai一般什么时候做代码评审？", True),
        ("这个版本何时发布？", True),
        ("站会几点开始？", True),
        ("When does Kai like to do code reviews?", True),
        ("so when is the billing release?", True),
        ("What time is the standup?", True),
        ("what did Kai say when the build broke?", False),
        ("Kai当时说了什么？", False),
        ("Kai那时候在评审什么？", False),  # 那时候 is "then", not a question of when
        ("部署失败的时候谁在值班？", False),
        ("Kai在评审什么？", False),
        ("what took billing down?", False),
    ],
)
def test_a_question_asks_when_by_its_words_in_either_language(question: str, when: bool) -> None:
    assert asks_when(lexical_terms(question)) is when


@pytest.mark.parametrize(
    ("text", "timed"),
    [
        ("Kai喜欢上午看合并请求，而且希望描述写得简短。", True),
        ("我们决定把迁移推迟到下个迭代。", True),
        ("billing 2.0 的发布时间现在定在周四。", True),
        ("The standup moved to 10:30 today.", True),
        ("The freeze starts on 2026-12-18.", True),
        ("Kai prefers reviewing pull requests in the morning.", True),
        ("Kai正在评审search的合并请求。", False),
        ("Kai is reviewing the search pull request.", False),
        ("Error E1234 means the token has expired.", False),
    ],
)
def test_a_segment_names_a_time_by_its_words_in_either_language(text: str, timed: bool) -> None:
    assert names_time(lexical_terms(text)) is timed


def test_candidates_naming_no_time_keep_only_part_of_their_score() -> None:
    candidates = {1: {"kai", "正在", "评审"}, 2: {"kai", "上午"}, 3: {"kai", "monday"}}
    fused = [Hit(1, 0.9), Hit(2, 0.6), Hit(3, 0.3)]
    scaled = prefer_times(fused, candidates, untimed_weight=0.5)
    assert [(h.key, round(h.score, 3)) for h in scaled] == [(2, 0.6), (1, 0.45), (3, 0.3)]
    assert prefer_times(fused, candidates, untimed_weight=0.0) == fused


TEXTS = {
    1: "Kai正在评审search的合并请求。",
    2: "Kai正在评审billing的合并请求。",
    3: "Kai喜欢上午看合并请求，而且希望描述写得简短。",
    4: "今天的站会改到十点半了。",
    5: "谢谢，这很有帮助。",
}
TERMS = {key: frozenset(lexical_terms(text)) for key, text in TEXTS.items()}


def _rank(question: str, settings: FusionSettings) -> list[int]:
    terms = lexical_terms(question)
    weights = dict.fromkeys(terms, 1.0)
    # The embedding, too, puts the statements that Kai is reviewing first;
    # a day's chatter that names a time but not Kai comes last.
    vector = [Hit(1, 0.82), Hit(2, 0.81), Hit(3, 0.74), Hit(5, 0.60), Hit(4, 0.55)]
    candidates = Candidates(vector=vector, lexical=[], terms=TERMS, times={})
    return [hit.key for hit in hybrid.rank(terms, [], candidates, weights, limit=3, fusion=settings)]


def test_asked_when_the_statement_that_says_when_comes_first() -> None:
    assert _rank("Kai一般什么时候做代码评审？", FusionSettings()) == [3, 1, 2]
    assert _rank("when does Kai like to do code reviews?", FusionSettings()) == [3, 1, 2]
    # Without the preference, or asked something else, the order stands.
    assert _rank("Kai一般什么时候做代码评审？", FusionSettings(untimed_weight=0.0)) == [1, 2, 3]
    assert _rank("Kai在评审什么？", FusionSettings()) == [1, 2, 3]
