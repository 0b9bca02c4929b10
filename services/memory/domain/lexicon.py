"""Cross-language lexical search: a question in one language, the fact in the other.

Vectors bridge Chinese and English only roughly (multilingual-e5-small finds
the kind of fact, seldom which service or person it is about), and lexical
search by itself cannot cross at all: a Chinese question shares no term with
an English statement. Classic dictionary-based cross-language retrieval
fills the gap: each word of the query becomes a `Concept`, the word's
translations through a bilingual dictionary (CC-CEDICT), and a segment
holds the concept when it holds any of them. Names stay as they are (a
Chinese message writes `billing` or `Ada` in Latin letters), so a Latin word
of the query is also looked for as itself.

Chinese words are found in the query by longest match against the
dictionary's headwords of two to four characters (a single character says
too little, and the index holds bigrams). English words are looked up by
their base form (`reviews`, `migration` -> `review`, `migrate`), and English
translations are looked for in their inflected forms too (`fail` ->
`failed`): the index has no stemming.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from services.memory.domain.terms import language_of, lexical_terms

_CJK_RUN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")
_LATIN_WORD = re.compile(r"[A-Za-z]+")
_ENGLISH_WORD = re.compile(r"[a-z]+(?:-[a-z]+)?")
_PARENTHESES = re.compile(r"\([^)]*\)|\[[^\]]*\]")
# Words that carry no fact: neither translated nor looked for.
_STOP_WORDS = """a an the of to be is are was were am do does did done been being and or but if in on
    at for by
    with from as into it its this that these those there here sth sb one's oneself someone something
    what who whom whose which when where why how not no yes i you he she we they me us them my your
    our their his her can could will would shall should may might must have has had"""
STOP_WORDS = frozenset(_STOP_WORDS.split())
SHORTEST_WORD = 2
LONGEST_WORD = 4


@dataclass(frozen=True, slots=True)
class Lexicon:
    """A bilingual dictionary reduced to what lexical search can use.

    Attributes:
        chinese: a headword (simplified, 2-4 characters) -> the English words
            it translates to (its one-word senses), in the dictionary's order.
        english: an English word -> the headwords with it as a one-word
            sense, those with it as an earlier sense first.
    """

    chinese: Mapping[str, tuple[str, ...]]
    english: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class Concept:
    """One word of a query with its translations: a segment holds the
    concept when it holds every term of any one alternative."""

    word: str
    alternatives: tuple[tuple[str, ...], ...]


def parse_cedict(lines: Iterable[str]) -> Lexicon:
    """The `Lexicon` of CC-CEDICT's text format (`TRAD SIMP [pin1 yin1] /sense/sense/`)."""
    chinese: dict[str, list[str]] = {}
    ranked: dict[str, list[tuple[int, int, str]]] = {}
    order = 0
    for line in lines:
        if line.startswith("#"):
            continue
        first = line.find(" ")
        second = line.find(" ", first + 1)
        slash = line.find("/", second)
        if first < 0 or second < 0 or slash < 0:
            continue
        headword = line[first + 1 : second]
        if not SHORTEST_WORD <= len(headword) <= LONGEST_WORD or not _CJK_RUN.fullmatch(headword):
            continue
        words = _one_word_senses(line[slash + 1 :])
        if not words:
            continue
        known = chinese.setdefault(headword, [])
        for position, word in enumerate(words):
            if word not in known:
                known.append(word)
            ranked.setdefault(word, []).append((position, order, headword))
        order += 1
    english = {
        word: tuple(dict.fromkeys(headword for _, _, headword in sorted(entries)))
        for word, entries in ranked.items()
    }
    return Lexicon(chinese={k: tuple(v) for k, v in chinese.items()}, english=english)


def _one_word_senses(senses: str) -> list[str]:
    """The senses of an entry that are one English word (`to fail`, `quota`), lower-case."""
    words: list[str] = []
    for raw in senses.rstrip().rstrip("/").replace("; ", "/").split("/"):
        if not raw or raw.startswith(("CL:", "see ", "also ")) or "variant of" in raw:
            continue
        if "surname" in raw or "abbr." in raw:
            continue
        sense = _PARENTHESES.sub(" ", raw) if "(" in raw or "[" in raw else raw
        word = sense.strip().lower().removeprefix("to ").removeprefix("be ")
        if " " in word:
            if word.count(" ") > 3:
                continue  # a phrase: no one word stands for it
            kept = [part for part in word.split() if part not in STOP_WORDS]
            if len(kept) != 1:
                continue
            word = kept[0]
        if _ENGLISH_WORD.fullmatch(word):
            words.append(word)
    return words


def base_forms(word: str) -> list[str]:
    """`word` and what it may be an inflection or derivation of (a rough
    English stemmer for looking words up: the wrong guesses find nothing)."""
    forms = [word]
    if word.endswith("ies"):
        forms.append(word[:-3] + "y")
    if word.endswith("es"):
        forms.append(word[:-2])
    if word.endswith("s") and not word.endswith("ss"):
        forms.append(word[:-1])
    if word.endswith("ed"):
        forms += [word[:-2], word[:-1]]
    if word.endswith("ing"):
        forms += [word[:-3], word[:-3] + "e"]
    if word.endswith("er"):
        forms.append(word[:-2])
    if word.endswith("ion"):
        forms += [word[:-3] + "e", word[:-3]]
    if word.endswith("ment"):
        forms.append(word[:-4])
    return list(dict.fromkeys(form for form in forms if len(form) > 1))


def inflections(word: str) -> list[str]:
    """Forms an English text may hold `word` in besides itself (a wrong
    guess costs little: no segment holds it, and lexical search leaves it out)."""
    if word.endswith(("ed", "ing", "ly")):
        return []  # inflected already, or an adverb
    if word.endswith(("ment", "tion", "sion", "ness", "ity", "ure", "ship")):
        return [word + "s"]  # a noun
    stem = word[:-1] if word.endswith("e") else word
    if word.endswith("y") and len(word) > 2 and word[-2] not in "aeiou":
        forms = [word[:-1] + "ies", word[:-1] + "ied", word + "ing"]
    else:
        plural = word + "es" if word.endswith(("s", "x", "ch", "sh")) else word + "s"
        forms = [plural, stem + "ed", stem + "ing"]
    if word.endswith("te"):
        forms.append(stem + "ion")  # migrate -> migration
    return forms


def chinese_words(text: str, lexicon: Lexicon) -> list[str]:
    """The dictionary's words in the Chinese runs of `text`, longest match first."""
    found: list[str] = []
    for run in _CJK_RUN.findall(text):
        start = 0
        while start < len(run):
            for length in range(min(LONGEST_WORD, len(run) - start), SHORTEST_WORD - 1, -1):
                word = run[start : start + length]
                if word in lexicon.chinese:
                    found.append(word)
                    start += length
                    break
            else:
                start += 1
    return found


def translate(query: str, lexicon: Lexicon, *, max_alternatives: int = 50) -> list[Concept]:
    """The query's words as concepts to look for in the other language.

    A Chinese query's words become their English translations (inflected),
    and its Latin words (names, in a Chinese sentence) stay themselves. An
    English query's words become themselves and the Chinese headwords they
    translate to (as the index's terms: bigrams). At most
    `max_alternatives` translations a word.
    """
    concepts: list[Concept] = []
    if language_of(query) == "zh":
        for word in chinese_words(query, lexicon):
            meanings = lexicon.chinese[word][:max_alternatives]
            # Every meaning before any inflection: the searched terms are capped.
            forms = [*meanings, *(form for meaning in meanings for form in inflections(meaning))]
            concepts.append(Concept(word, tuple((form,) for form in dict.fromkeys(forms))))
        for match in _LATIN_WORD.finditer(query):
            name = match.group().lower()
            concepts.append(Concept(name, ((name,),)))
        return concepts
    for match in _LATIN_WORD.finditer(query):
        word = match.group().lower()
        if word in STOP_WORDS:
            continue
        alternatives: list[tuple[str, ...]] = [(word,)]
        for form in base_forms(word):
            for headword in lexicon.english.get(form, ())[:max_alternatives]:
                alternatives.append(tuple(lexical_terms(headword)))
        concepts.append(Concept(word, tuple(dict.fromkeys(alternatives))))
    return concepts


def translated_terms(concepts: Sequence[Concept], *, leave_out: Collection[str], limit: int) -> list[str]:
    """The terms to search for the concepts, at most `limit`: each concept's
    first alternatives before any concept's later ones, so that a word with
    many translations cannot crowd the others out."""
    queues = [[term for alt in concept.alternatives for term in alt] for concept in concepts]
    chosen: dict[str, None] = {}
    depth = 0
    while len(chosen) < limit and any(depth < len(queue) for queue in queues):
        for queue in queues:
            if depth < len(queue) and queue[depth] not in leave_out:
                chosen.setdefault(queue[depth])
                if len(chosen) >= limit:
                    break
        depth += 1
    return list(chosen)
