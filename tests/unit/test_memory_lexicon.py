"""Cross-language lexical search: the dictionary, the query's words as concepts, and their terms."""

# Chinese text is written with its own (full-width) punctuation.
# ruff: noqa: RUF001

from __future__ import annotations

from services.memory.domain.lexicon import (
    Concept,
    base_forms,
    chinese_words,
    inflections,
    parse_cedict,
    translate,
    translated_terms,
)

# A few entries in CC-CEDICT's own format (traditional, simplified, pinyin, senses).
SAMPLE = """\
# CC-CEDICT sample
#! version=1
配額 配额 [pei4 e2] /quota/ration/
部署 部署 [bu4 shu3] /to dispose/to deploy/deployment/
失敗 失败 [shi1 bai4] /to be defeated/to lose/to fail (e.g. experiments)/failure/defeat/CL:次[ci4]/
遷移 迁移 [qian1 yi2] /to migrate/to move/
值班 值班 [zhi2 ban1] /to work a shift/on duty/
合作方 合作方 [he2 zuo4 fang1] /(business) partner/
名額 名额 [ming2 e2] /number of places/quota/
貓 猫 [mao1] /cat/
什麼 什么 [shen2 me5] /what?/
""".splitlines()

LEXICON = parse_cedict(SAMPLE)


def test_the_dictionary_keeps_one_word_senses_of_words_of_two_to_four_characters() -> None:
    assert LEXICON.chinese["失败"] == ("defeated", "lose", "fail", "failure", "defeat")
    assert LEXICON.chinese["值班"] == ("duty",)  # "to work a shift" is a phrase
    assert LEXICON.chinese["合作方"] == ("partner",)  # the parenthesis is left out
    assert "猫" not in LEXICON.chinese  # one character: the index holds bigrams
    assert "什么" not in LEXICON.chinese  # "what" carries no fact


def test_english_words_lead_to_headwords_that_have_them_as_an_earlier_sense_first() -> None:
    assert LEXICON.english["quota"] == ("配额", "名额")
    assert LEXICON.english["deploy"] == ("部署",)


def test_english_words_are_looked_up_by_their_base_forms_and_found_in_their_inflections() -> None:
    assert {"review"} <= set(base_forms("reviews"))
    assert {"migrate"} <= set(base_forms("migration"))
    assert {"fail"} <= set(base_forms("failed"))
    assert {"fails", "failed", "failing"} <= set(inflections("fail"))
    assert {"migrated", "migrating", "migration"} <= set(inflections("migrate"))
    assert {"policies", "policied"} <= set(inflections("policy"))
    assert inflections("deployment") == ["deployments"] and inflections("failed") == []


def test_chinese_words_are_found_by_longest_match() -> None:
    assert chinese_words("billing迁移什么时候做？给合作方的配额", LEXICON) == ["迁移", "合作方", "配额"]


def test_a_chinese_query_becomes_english_words_and_keeps_its_names() -> None:
    concepts = translate("payments的配额迁移了吗", LEXICON)
    by_word = {concept.word: concept.alternatives for concept in concepts}
    assert set(by_word) == {"配额", "迁移", "payments"}
    assert by_word["配额"][:2] == (("quota",), ("ration",))
    assert ("migration",) in by_word["迁移"] and ("migrated",) in by_word["迁移"]
    assert by_word["payments"] == (("payments",),)


def test_an_english_query_becomes_chinese_bigrams_and_keeps_its_words() -> None:
    concepts = translate("Who is on duty for the partner quota?", LEXICON)
    by_word = {concept.word: concept.alternatives for concept in concepts}
    assert set(by_word) == {"duty", "partner", "quota"}  # stop words left out
    assert by_word["quota"] == (("quota",), ("配额",), ("名额",))
    assert by_word["partner"] == (("partner",), ("合作", "作方"))  # a three-character word: its bigrams
    assert by_word["duty"] == (("duty",), ("值班",))


def test_each_concept_gets_its_first_terms_before_any_gets_more() -> None:
    concepts = [
        Concept("a", (("a1",), ("a2",), ("a3",))),
        Concept("b", (("b1", "b2"), ("b3",))),
    ]
    assert translated_terms(concepts, leave_out=set(), limit=3) == ["a1", "b1", "a2"]
    assert translated_terms(concepts, leave_out={"a1"}, limit=10) == ["b1", "a2", "b2", "a3", "b3"]
