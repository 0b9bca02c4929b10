"""prefer_recent: statements of one fact grouped, the newest first; and the hybrid ranking around it."""

from __future__ import annotations

from services.memory.domain import hybrid
from services.memory.domain.hybrid import Candidates, searchable_concepts
from services.memory.domain.lexicon import Concept
from services.memory.domain.ranking import Hit
from services.memory.domain.supersession import overlap, query_signature, supersede
from services.memory.domain.terms import lexical_terms

TEXTS = {
    1: "Ada is on call for billing from now on.",
    2: "Finn is on call for billing from now on.",
    3: "Bea is on call for search from now on.",
    4: "Gus is on call for billing from now on.",
    5: "The billing deploy failed on Monday.",
}
TERMS = {key: frozenset(lexical_terms(text)) for key, text in TEXTS.items()}
# Keys 1, 2, 4 are the same fact, stated in March, April, May.
TIMES = {1: 100.0, 2: 200.0, 3: 250.0, 4: 300.0, 5: 50.0}


def test_one_changed_value_keeps_most_terms_in_common() -> None:
    assert overlap(TERMS[1], TERMS[2]) == 7 / 9
    assert overlap(TERMS[1], TERMS[3]) == 6 / 10
    assert overlap(TERMS[1], TERMS[5]) < 0.3


def test_the_newest_statement_of_a_fact_takes_the_place_of_the_best_one() -> None:
    ranked = [Hit(1, 0.9), Hit(5, 0.8), Hit(2, 0.7), Hit(4, 0.6)]
    signature = {key: query_signature(TERMS[key], ["billing", "call"], []) for key in TERMS}
    result = supersede(ranked, terms=TERMS, times=TIMES, signature=signature)
    assert [(h.key, h.score) for h in result] == [(4, 0.9), (2, 0.9), (1, 0.9), (5, 0.8)]


def test_statements_that_hold_different_parts_of_the_query_stay_apart() -> None:
    # "search" and "billing" differ in one term, but the question names billing.
    ranked = [Hit(1, 0.9), Hit(3, 0.8)]
    signature = {key: query_signature(TERMS[key], ["billing"], []) for key in TERMS}
    assert [h.key for h in supersede(ranked, terms=TERMS, times=TIMES, signature=signature)] == [1, 3]
    # Asked about neither, the two look like one fact restated.
    blind = {key: query_signature(TERMS[key], ["call"], []) for key in TERMS}
    assert [h.key for h in supersede(ranked, terms=TERMS, times=TIMES, signature=blind)] == [3, 1]


def test_the_signature_counts_a_concept_held_in_either_language() -> None:
    concept = Concept("billing", (("billing",), ("账单",)))
    assert query_signature({"账单", "x"}, ["billing"], [concept]) == (frozenset(), (True,))
    assert query_signature({"billing"}, ["billing"], [concept]) == (frozenset({"billing"}), (True,))


def test_concepts_keep_only_alternatives_whose_terms_were_searched() -> None:
    concepts = [Concept("a", (("x",), ("y", "z"))), Concept("b", (("w",),))]
    assert searchable_concepts(concepts, {"x", "y"}) == [Concept("a", (("x",),))]


def test_every_candidate_is_credited_for_the_terms_it_holds_whichever_search_found_it() -> None:
    # Lexical search brought only short segments naming billing; the fact came by vector.
    terms = lexical_terms("billing deploy failed")
    weights = dict.fromkeys(terms, 1.0)
    candidates = Candidates(
        vector=[Hit(3, 0.80), Hit(5, 0.78), Hit(1, 0.70)],
        lexical=[Hit(1, 9.0), Hit(2, 8.5)],
        terms=TERMS,
        times=TIMES,
    )
    ranked = hybrid.rank(terms, [], candidates, weights, limit=5)
    assert ranked[0].key == 5
    assert {h.key for h in ranked} == {1, 2, 3, 5}


def test_prefer_recent_puts_the_newest_statement_first_and_moves_nothing_else() -> None:
    terms = lexical_terms("who is on call for billing?")
    weights = dict.fromkeys(terms, 1.0)
    candidates = Candidates(
        vector=[Hit(1, 0.9), Hit(5, 0.2), Hit(2, 0.85), Hit(4, 0.8)], lexical=[], terms=TERMS, times=TIMES
    )
    plain = hybrid.rank(terms, [], candidates, weights, limit=4)
    recent = hybrid.rank(terms, [], candidates, weights, limit=4, prefer_recent=True)
    assert [h.key for h in plain] == [1, 2, 4, 5]
    assert [h.key for h in recent] == [4, 2, 1, 5]
