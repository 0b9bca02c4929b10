"""Pure rules of how agents speak in chats."""

from __future__ import annotations

import random
import uuid

import pytest

from services.runtime.domain.etiquette import (
    GroupPolicy,
    answer_metadata,
    ends_exchange,
    is_agent_answer,
    is_silence,
    mentioned,
    should_answer,
    split_reply,
)


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


ME, OTHER = uuid.uuid4(), uuid.uuid4()


@pytest.mark.parametrize(
    ("mentions", "from_person", "replies", "policy", "answered"),
    [
        ((), True, False, GroupPolicy.UNLESS_OTHERS_MENTIONED, True),
        ((OTHER,), True, False, GroupPolicy.UNLESS_OTHERS_MENTIONED, False),
        ((ME,), True, False, GroupPolicy.MENTIONED_ONLY, True),
        ((), True, True, GroupPolicy.MENTIONED_ONLY, True),
        ((), True, False, GroupPolicy.MENTIONED_ONLY, False),
        # Another agent's message: only when it names or replies to this one.
        ((), False, False, GroupPolicy.UNLESS_OTHERS_MENTIONED, False),
        ((), False, False, GroupPolicy.ALWAYS, False),
        ((ME,), False, False, GroupPolicy.MENTIONED_ONLY, True),
        ((), False, True, GroupPolicy.UNLESS_OTHERS_MENTIONED, True),
    ],
)
def test_who_is_answered_in_a_group(
    mentions: tuple[uuid.UUID, ...], from_person: bool, replies: bool, policy: GroupPolicy, answered: bool
) -> None:
    assert (
        should_answer(
            agent_member_id=ME,
            is_direct=False,
            mentions=set(mentions),
            policy=policy,
            from_person=from_person,
            replies_to_agent=replies,
        )
        is answered
    )
    # A direct chat is always answered, an agent's too.
    assert should_answer(agent_member_id=ME, is_direct=True, mentions=set(), policy=policy, from_person=False)


def test_an_answer_names_members_with_at_and_their_display_name() -> None:
    bea, bea_smith, ada = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    names = {bea: "Bea", bea_smith: "Bea Smith", ada: "ada", ME: "me"}
    assert mentioned("@bea smith, and @ADA: thoughts?", names, author=ME) == [bea_smith, ada]
    assert mentioned("@Bea! and @Bea Smith", names, author=ME) == [bea_smith, bea]
    # Not a mention: inside a word or an address, the author, a longer name.
    assert mentioned("mail bea@bea.com or @Beatrice, says @me", names, author=ME) == []


def test_nothing_to_say_is_said_with_no_reply() -> None:
    assert is_silence("NO_REPLY") and is_silence(" no_reply. ") and is_silence("")
    assert not is_silence("NO_REPLY, but here is why") and not is_silence("ok")


def test_an_answer_to_an_answer_ends_the_exchange_unless_it_names_someone() -> None:
    me = uuid.uuid4()
    closing = answer_metadata(uuid.uuid4(), to_an_answer=True)
    opening = answer_metadata(uuid.uuid4(), to_an_answer=False)
    assert ends_exchange(closing) and not ends_exchange(opening) and not ends_exchange(None)
    assert is_agent_answer(closing) and is_agent_answer(opening) and not is_agent_answer({"x": 1})

    def answers(mentions: set[uuid.UUID], ends: bool) -> bool:
        return should_answer(
            agent_member_id=me,
            is_direct=True,
            mentions=mentions,
            policy=GroupPolicy.ALWAYS,
            from_person=False,
            ends_exchange=ends,
        )

    assert not answers(set(), True) and answers({me}, True) and answers(set(), False)
