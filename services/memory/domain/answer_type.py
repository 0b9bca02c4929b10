"""What kind of answer a question asks for: a "when" question wants a time.

Asked "Kai一般什么时候做代码评审?" ("when does Kai usually review code?"),
neither search finds "Kai喜欢上午看合并请求" ("Kai likes to look at merge
requests in the morning"): it shares only the name with the question, while
every "Kai正在评审search的合并请求" ("Kai is reviewing search's merge
request") shares the name and the verb, and the embedding agrees with the
words. What sets the answer apart is that it says when. Question answering
has long used this (the expected answer type): a question that asks when
prefers the candidates that name a time (a part of the day, a weekday, a
relative day or week, a clock time), and the others keep only part of their
score, as candidates without the query's bridges do (`ranking.hold_bridges`).

Both languages are covered either way round: an English "when" question
about a Chinese statement looks for its Chinese time words too.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Collection, Mapping, Sequence

from services.memory.domain.ranking import Hit

# The question's lexical terms (`domain.terms`) that ask when. "什么时候"
# gives the bigrams 什么, 么时 and 时候; 时候 alone also ends "那时候"
# (then) and "的时候" (at the time when), so it takes 么时 with it.
_WHEN_ZH = frozenset({"何时", "几时", "几点", "哪天"})
_WHEN_ZH_TOGETHER = frozenset({"么时", "时候"})
# English "when" asks only at the head of a question ("when does...", "so
# when is..."); in "what did Kai say when the build broke?" it does not.
_WHEN_EN_HEAD = 2
_WHEN_EN_PAIRS = frozenset({("what", "time"), ("which", "day"), ("what", "day"), ("how", "soon")})

# Terms (bigrams of Chinese, lower-case English words) that name a time.
_TIME_ZH = frozenset([
    "上午", "下午", "早上", "早晨", "晚上", "中午", "傍晚", "凌晨", "夜里", "今天", "明天",
    "昨天", "后天", "前天", "今晚", "明早", "周一", "周二", "周三", "周四", "周五", "周六",
    "周日", "周末", "星期", "礼拜", "上周", "下周", "本周", "这周", "上个", "下个", "个月",
    "月初", "月底", "月中", "年初", "年底", "季度", "点钟", "点半", "上旬", "中旬", "下旬",
])  # fmt: skip
_TIME_EN = frozenset([
    "morning", "mornings", "afternoon", "afternoons", "evening", "evenings", "night", "nights",
    "noon", "midnight", "today", "tomorrow", "yesterday", "tonight", "weekend", "weekends",
    "weekday", "weekdays", "daily", "weekly", "monday", "tuesday", "wednesday", "thursday",
    "friday", "saturday", "sunday", "mondays", "tuesdays", "wednesdays", "thursdays", "fridays",
    "saturdays", "sundays", "january", "february", "march", "april", "june", "july",
    "august", "september", "october", "november", "december", "week", "month", "quarter",
    "year", "sprint", "next", "last",
])  # fmt: skip
# A clock time ("10:30") or a date ("2026-11-29"), kept whole by `lexical_terms`.
_CLOCK_OR_DATE = re.compile(r"\d{1,2}:\d{2}|\d{4}-\d{1,2}-\d{1,2}")


def asks_when(terms: Sequence[str]) -> bool:
    """Whether a question with these lexical terms (in order) asks when."""
    held = set(terms)
    if _WHEN_ZH & held or held >= _WHEN_ZH_TOGETHER:
        return True
    latin = [term for term in terms if term.isascii()]
    return "when" in latin[:_WHEN_EN_HEAD] or any(
        pair in _WHEN_EN_PAIRS for pair in itertools.pairwise(latin)
    )


def names_time(terms: Collection[str]) -> bool:
    """Whether a segment with these lexical terms names a time."""
    return any(
        term in _TIME_ZH or term in _TIME_EN or _CLOCK_OR_DATE.fullmatch(term) is not None for term in terms
    )


def prefer_times(
    fused: Sequence[Hit], candidates: Mapping[int, Collection[str]], *, untimed_weight: float
) -> list[Hit]:
    """`fused` with the score of each candidate that names no time scaled by
    `1 - untimed_weight` (for a question that asks when)."""
    if untimed_weight <= 0:
        return list(fused)
    scaled = [
        hit if names_time(candidates.get(hit.key, ())) else Hit(hit.key, hit.score * (1 - untimed_weight))
        for hit in fused
    ]
    scaled.sort(key=lambda hit: (-hit.score, hit.key))
    return scaled
