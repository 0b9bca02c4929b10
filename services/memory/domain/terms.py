"""Lexical terms that work for Chinese and English alike.

Chinese has no spaces, so it is indexed as overlapping character bigrams (a
lone character stays a unigram); Latin text as lower-case words. An
identifier (`ERR_QUOTA_42`, `services/im/bootstrap.py`, `send_message`) is
kept whole and also split into its parts, so that an exact quote and a
partial one both match. The same function makes the terms of a segment and
of a query; both indexes (SQLite FTS5, PostgreSQL tsvector) store these
terms joined by spaces, so that neither database tokenises on its own.
"""

from __future__ import annotations

import re

# CJK unified ideographs (with extension A) and the compatibility block.
_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_RUN = re.compile(rf"[{_CJK}]+|[0-9A-Za-z_][0-9A-Za-z_./:\-]*")
_PART = re.compile(r"[0-9A-Za-z]+")
_CJK_CHAR = re.compile(rf"[{_CJK}]")
_NOT_LATIN = re.compile(r"[^A-Za-z]+")


def lexical_terms(text: str) -> list[str]:
    """The terms of `text`, in order, with repeats (term frequency matters)."""
    terms: list[str] = []
    for match in _RUN.finditer(text):
        run = match.group()
        if _CJK_CHAR.match(run):
            if len(run) == 1:
                terms.append(run)
            else:
                terms.extend(run[i : i + 2] for i in range(len(run) - 1))
            continue
        whole = run.rstrip("./:-").lower()
        if not whole:
            continue
        parts = _PART.findall(whole)
        if len(parts) == 1 and parts[0] == whole:
            terms.append(whole)
            continue
        # An identifier: the whole (for exact quotes) and its parts.
        terms.append(whole)
        terms.extend(parts)
    return terms


def language_of(text: str) -> str:
    """ "zh" when Chinese characters make up a fair share of the letters, else "en"."""
    cjk = len(_CJK_CHAR.findall(text))
    latin = len(_NOT_LATIN.sub("", text))
    # A Chinese character carries about as much as a short English word.
    return "zh" if cjk and cjk * 3 >= latin else "en"
