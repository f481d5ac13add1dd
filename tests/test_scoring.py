"""Scorers on hand-worked cases (expected values computed by hand in the comments)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import difflib

import pytest

from grkv_core.datasets import LONGBENCH_METRICS, SCORERS, EvalSample, score_prediction
from grkv_core.datasets.scoring import (
    classification_score,
    code_sim_score,
    count_score,
    first_code_line,
    fuzz_ratio,
    normalize_answer,
    qa_f1_score,
    retrieval_score,
    rouge_score,
    string_match_all,
    string_match_part,
)


def make_sample(task: str, metric: str, references: tuple[str, ...], **extra) -> EvalSample:
    return EvalSample(
        sample_id=f"test/{task}",
        task=task,
        context="context",
        questions=("question",),
        answer_prefix="Answer:",
        references=(references,),
        max_new_tokens=16,
        metric=metric,
        extra=extra,
    )


# --------------------------------------------------------------------------------------------------
# RULER
# --------------------------------------------------------------------------------------------------


def test_string_match_all_is_the_fraction_of_references_found():
    assert string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert string_match_all("The number is 1234567.", ["1234567", "7654321"]) == 0.5
    assert string_match_all("vars: abcde, FGHIJ", ["ABCDE", "fghij", "KLMNO", "PQRST"]) == 0.5
    assert string_match_all("nothing", ["1234567"]) == 0.0


def test_string_match_part_needs_any_one_reference():
    assert string_match_part("It is paris.", ["Paris", "City of Paris"]) == 1.0
    assert string_match_part("It is London.", ["Paris", "City of Paris"]) == 0.0
    with pytest.raises(ValueError):
        string_match_part("x", [])


# --------------------------------------------------------------------------------------------------
# LongBench
# --------------------------------------------------------------------------------------------------


def test_normalize_answer_drops_case_punctuation_articles_and_extra_spaces():
    assert normalize_answer("The  Cat, sat on a MAT!") == "cat sat on mat"


def test_qa_f1_by_hand():
    # "the cat sat" -> [cat, sat]; "cat sat on mat" -> [cat, sat, on, mat]:
    # 2 common tokens, precision 2/2, recall 2/4, F1 = 2 * 1 * 0.5 / 1.5 = 2/3.
    assert qa_f1_score("the cat sat", "cat sat on mat") == pytest.approx(2 / 3)
    # Multiset overlap: [cat, cat, dog] vs [cat, dog, dog] share one cat and one dog: P = R = 2/3.
    assert qa_f1_score("cat cat dog", "cat dog dog") == pytest.approx(2 / 3)
    assert qa_f1_score("The Eiffel Tower.", "eiffel tower") == 1.0
    assert qa_f1_score("London", "Paris") == 0.0


def test_rouge_l_as_the_rouge_package_computes_it():
    # One sentence each. Reference words {the, cat, is, on, mat} (5 distinct), prediction
    # {the, cat, sat, on, mat} (5 distinct); the LCS "the cat on the mat" has the 4 distinct words
    # {the, cat, on, mat}: R = P = 4/5, F = 0.8.
    assert rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8, abs=1e-6)
    # Two predicted sentences ("a b", "c d") against "a c d e": the LCS words {a} and {c, d} are
    # unioned, 3 of 4 distinct words each way: F = 0.75.
    assert rouge_score("a b. c d", "a c d e") == pytest.approx(0.75, abs=1e-6)
    # Distinct-word counting: "the the the" has 1 distinct word, "the cat" 2; overlap {the}:
    # P = 1, R = 1/2, F = 2/3 (textbook ROUGE-L would give P = 1/3 and F = 0.4).
    assert rouge_score("the the the", "the cat") == pytest.approx(2 / 3, abs=1e-6)
    # No lower-casing: "The" and "the" differ. Overlap {cat}: P = R = 1/2.
    assert rouge_score("The cat", "the cat") == pytest.approx(0.5, abs=1e-6)
    # Empty texts make the package raise; LongBench scores that 0.
    assert rouge_score("", "the cat") == 0.0
    assert rouge_score("...", "the cat") == 0.0
    assert rouge_score("same words here", "same words here") == pytest.approx(1.0, abs=1e-6)


def test_classification_score_as_longbench():
    classes = ["city", "capital city", "country"]
    # Matches [city, capital city]; "city" is part of the gold "capital city" and is dropped.
    assert classification_score("capital city", "capital city", classes) == 1.0
    # Matches [city, country]; neither is part of the gold "country": 1/2.
    assert classification_score("city or country", "country", classes) == 0.5
    assert classification_score("a capital city", "country", classes) == 0.0
    # LongBench removes from the list it iterates over, which skips the item after each removal:
    # matches [a, b, ab, abc] -> drop "a" (skips "b") -> drop "ab" -> [b, abc]: score 1/2.
    assert classification_score("abc", "abc", ["a", "b", "ab", "abc"]) == 0.5


def test_retrieval_and_count_scores():
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("Paragraph 12, maybe Paragraph 3", "Paragraph 12") == 0.5
    assert retrieval_score("Paragraph 120", "Paragraph 12") == 0.0
    assert retrieval_score("I do not know", "Paragraph 12") == 0.0
    with pytest.raises(ValueError):
        retrieval_score("1", "twelve")
    assert count_score("There are 7 unique paragraphs, not 8.", "7") == 0.5
    assert count_score("7", "7") == 1.0
    assert count_score("seven", "7") == 0.0


def test_code_similarity():
    # First line with no backtick, '#' or '//' anywhere (LongBench's rule).
    prediction = "\n```python\n# the next line\nx = 1  # inline comment\n// js comment\nresult = compute(a, b)\nmore()"
    assert first_code_line(prediction) == "result = compute(a, b)"
    assert first_code_line("# only a comment") == ""
    # difflib matches "itt" and "n": M = 4 characters, T = 6 + 7 = 13, round(100 * 8 / 13) = 62.
    assert fuzz_ratio("kitten", "sitting") == 62
    assert fuzz_ratio("kitten", "sitting") == round(100 * difflib.SequenceMatcher(None, "kitten", "sitting").ratio())
    assert fuzz_ratio("", "") == 100 and fuzz_ratio("", "x") == 0
    assert code_sim_score("kitten", "sitting") == 0.62
    assert code_sim_score("```\nreturn x\n```", "return x") == 1.0


# --------------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------------


def test_every_metric_used_has_a_scorer():
    assert set(LONGBENCH_METRICS.values()) | {"string_match_all", "string_match_part"} == set(SCORERS)


def test_score_prediction_keeps_the_best_reference_and_cuts_first_line_tasks():
    triviaqa = make_sample("triviaqa", "qa_f1_score", ("City of Light", "Paris"))
    assert score_prediction(triviaqa, 0, "\nParis\nQuestion: what else? City of Light") == 1.0
    # Not a first-line task: the whole prediction counts. [paris, is, answer] vs [paris]: P 1/3, R 1.
    hotpotqa = make_sample("hotpotqa", "qa_f1_score", ("Paris",))
    assert score_prediction(hotpotqa, 0, "Paris\nis the answer") == pytest.approx(0.5)
    trec = make_sample("trec", "classification_score", ("Location",), all_classes=["Location", "Entity"])
    assert score_prediction(trec, 0, "Location\nEntity") == 1.0
    assert score_prediction(trec, 0, "Location and Entity") == 0.5
    ruler_vt = make_sample("vt", "string_match_all", ("AAAAA", "BBBBB", "CCCCC", "DDDDD", "EEEEE"))
    assert score_prediction(ruler_vt, 0, "AAAAA, BBBBB, CCCCC") == pytest.approx(0.6)


def test_score_prediction_rejects_bad_input():
    with pytest.raises(ValueError, match="valid metrics"):
        score_prediction(make_sample("x", "bleu", ("a",)), 0, "a")
    with pytest.raises(ValueError, match="out of range"):
        score_prediction(make_sample("vt", "string_match_all", ("a",)), 1, "a")
    with pytest.raises(ValueError, match="all_classes"):
        score_prediction(make_sample("trec", "classification_score", ("Location",)), 0, "Location")
