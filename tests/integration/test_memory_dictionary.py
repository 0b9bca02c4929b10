"""CC-CEDICT from its PyPI package: pinned, parsed, loaded off the request path."""

# Chinese text is written with its own (full-width) punctuation.
# ruff: noqa: RUF001

from __future__ import annotations

from services.memory.adapters.dictionary import BackgroundDictionary, load_cedict
from services.memory.domain.lexicon import Lexicon, translate


async def test_cc_cedict_loads_in_the_background_and_translates_both_ways() -> None:
    dictionary = BackgroundDictionary()
    assert dictionary.lexicon() is None  # nothing happens before start
    dictionary.start()
    lexicon = await dictionary.loaded()
    assert lexicon is not None and dictionary.lexicon() is lexicon
    assert len(lexicon.chinese) > 40_000 and len(lexicon.english) > 20_000
    assert {"quota", "ration"} <= set(lexicon.chinese["配额"])
    assert "部署" in lexicon.english["deploy"]
    words = {concept.word for concept in translate("payments接口现在给合作方的配额是多少？", lexicon)}
    assert {"配额", "合作方", "payments"} <= words
    await dictionary.aclose()
    await dictionary.aclose()


async def test_a_dictionary_that_fails_to_load_leaves_search_without_translations() -> None:
    def broken() -> Lexicon:
        raise OSError("no such file")

    dictionary = BackgroundDictionary(broken)
    dictionary.start()
    assert await dictionary.loaded() is None
    await dictionary.aclose()


def test_the_pinned_file_is_the_one_installed() -> None:
    assert load_cedict().chinese["值班"] == ("duty",)
