"""Pure rules of how agents speak in chats."""

from __future__ import annotations

import random

import pytest

from services.runtime.domain.etiquette import split_reply


def test_a_short_reply_is_one_message() -> None:
    assert split_reply("hello", 64) == ["hello"]
    assert split_reply("", 64) == [""]


def test_a_long_reply_is_cut_at_paragraphs_then_lines_then_spaces() -> None:
    paragraph = "word " * 10
    text = f"{paragraph}\n\n{paragraph}\n\n{paragraph}"
    parts = split_reply(text, 120)
    assert "".join(parts) == text
    assert parts[0].endswith("\n\n")
    assert all(len(p.encode()) <= 120 for p in parts)
    assert split_reply("aaaa bbbb cccc", 10) == ["aaaa bbbb ", "cccc"]


@pytest.mark.parametrize("seed", range(20))
def test_parts_fit_and_rejoin_whatever_the_characters(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = ["a", " ", "\n", "é", "中", "😀"]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 400)))
    limit = rng.randrange(4, 60)
    parts = split_reply(text, limit)
    assert "".join(parts) == text
    assert all(0 < len(p.encode()) <= limit for p in parts) or parts == [""]


def test_the_limit_must_hold_any_character() -> None:
    with pytest.raises(ValueError):
        split_reply("x", 3)
