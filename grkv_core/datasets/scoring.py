"""Scorers for RULER and LongBench predictions.

Every scorer returns a value in [0, 1] for one prediction; benchmark scores are means of these
(RULER and LongBench report them ×100).

RULER (Hsieh et al., 2024, arXiv:2404.06654) scores by case-insensitive substring match:
``string_match_all`` (fraction of the references found, used by the NIAH, VT, CWE and FWE tasks) and
``string_match_part`` (1 if any reference is found, used by the QA tasks).

The LongBench metrics (Bai et al., 2023) are reimplemented from the definitions in LongBench's
``metrics.py`` (the copy kvpress evaluates with), including their quirks, so that scores are comparable
with published numbers:

- ``qa_f1_score``: SQuAD-style normalisation, then token-level F1.
- ``rouge_score``: ROUGE-L F exactly as the ``rouge`` package (1.0.1) computes it, which LongBench
  calls; see :func:`rouge_score` for what that means.
- ``classification_score``, ``retrieval_score``, ``count_score``: as LongBench.
- ``code_sim_score``: first code line of the prediction, then fuzzywuzzy's ``fuzz.ratio`` on its
  pure-Python path (``difflib.SequenceMatcher``), which is what kvpress's evaluation extra installs.

A LongBench prediction is scored against each gold answer and the best score is kept; for ``trec``,
``triviaqa``, ``samsum`` and ``lsht`` only the prediction's first line is scored.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grkv_core.datasets.schema import EvalSample

ScoreFunction = Callable[[str, Sequence[str], Mapping[str, Any]], float]
"""``(prediction, references, sample_extra) -> score in [0, 1]``."""

LONGBENCH_FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
"""LongBench tasks whose prediction is cut at its first line before scoring (few-shot tasks, where
models tend to continue with further made-up examples)."""

_PUNCTUATION = frozenset(string.punctuation)


# --------------------------------------------------------------------------------------------------
# RULER
# --------------------------------------------------------------------------------------------------


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of the references that occur in the prediction (case-insensitive substring match).

    Parameters
    ----------
    prediction : str
        Generated answer.
    references : Sequence[str]
        All values the answer must contain (e.g. the four values of ``niah_multivalue``).

    Returns
    -------
    float
        ``#{r : r.lower() in prediction.lower()} / len(references)``.
    """
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    lowered = prediction.lower()
    return sum(reference.lower() in lowered for reference in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any reference occurs in the prediction (case-insensitive substring match), else 0.0.

    Parameters
    ----------
    prediction : str
        Generated answer.
    references : Sequence[str]
        Acceptable answers (e.g. the SQuAD answer variants of ``qa_1``).
    """
    if not references:
        raise ValueError("string_match_part needs at least one reference")
    lowered = prediction.lower()
    return float(any(reference.lower() in lowered for reference in references))


# --------------------------------------------------------------------------------------------------
# LongBench, one gold answer at a time
# --------------------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation, drop articles, collapse whitespace."""
    text = text.lower()
    text = "".join(character for character in text if character not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction_tokens: Sequence[str], ground_truth_tokens: Sequence[str]) -> float:
    """F1 between two token multisets (0 when they share no token)."""
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """Token F1 after :func:`normalize_answer` (LongBench's QA metric)."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _rouge_sentences(text: str) -> list[str]:
    # The rouge package splits on "." and keeps every non-empty piece, even one that is only spaces
    # (it then becomes a sentence holding the single empty word "").
    return [" ".join(piece.split()) for piece in text.split(".") if len(piece) > 0]


def _lcs_word_set(reference_words: Sequence[str], evaluated_words: Sequence[str]) -> set[str]:
    """Distinct words of one longest common subsequence, chosen with the rouge package's tie rule."""
    rows, columns = len(reference_words), len(evaluated_words)
    table = [[0] * (columns + 1) for _ in range(rows + 1)]
    for i in range(1, rows + 1):
        for j in range(1, columns + 1):
            if reference_words[i - 1] == evaluated_words[j - 1]:
                table[i][j] = table[i - 1][j - 1] + 1
            else:
                table[i][j] = max(table[i - 1][j], table[i][j - 1])
    words: set[str] = set()
    i, j = rows, columns
    while i > 0 and j > 0:
        if reference_words[i - 1] == evaluated_words[j - 1]:
            words.add(reference_words[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_score(prediction: str, ground_truth: str) -> float:
    """ROUGE-L F as LongBench computes it with ``rouge.Rouge().get_scores(...)["rouge-l"]["f"]``.

    The ``rouge`` package (1.0.1) computes a summary-level ROUGE-L in "exclusive" mode, which differs
    from the textbook definition; this reproduces it:

    - sentences are split on ``"."``, words on single spaces after whitespace collapsing; no lower
      casing, no stemming, punctuation other than ``"."`` stays attached to words;
    - for every (reference sentence, predicted sentence) pair one LCS is traced back, and the *set*
      of words on it is added to a running union; the overlap is the size of that union;
    - recall and precision divide the overlap by the number of *distinct* words of the reference and
      of the prediction; F = 2PR / (P + R + 1e-8) (beta = 1).

    An empty prediction or reference makes the package raise, which LongBench maps to 0.0; so does
    this function. (The package also fails, hence 0.0, when one sentence pair exceeds Python's
    recursion limit of ~1000 words; that artefact is not reproduced.)
    """
    predicted_sentences = _rouge_sentences(prediction)
    reference_sentences = _rouge_sentences(ground_truth)
    if not predicted_sentences or not reference_sentences:
        return 0.0
    predicted_words = [sentence.split(" ") for sentence in predicted_sentences]
    reference_words = [sentence.split(" ") for sentence in reference_sentences]
    num_reference_words = len({word for words in reference_words for word in words})
    num_predicted_words = len({word for words in predicted_words for word in words})
    lcs_union: set[str] = set()
    for reference in reference_words:
        for predicted in predicted_words:
            lcs_union |= _lcs_word_set(reference, predicted)
    recall = len(lcs_union) / num_reference_words
    precision = len(lcs_union) / num_predicted_words
    return 2.0 * precision * recall / (precision + recall + 1e-8)


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str]) -> float:
    """LongBench's classification score (``trec``).

    Every class name found as a substring of the prediction is a match; matches that are substrings
    of the gold class (but not the gold class itself) are then dropped, so "location" does not count
    against "city" style overlaps. The score is ``1 / #matches`` if the gold class is matched, else 0.
    """
    matches = [class_name for class_name in all_classes if class_name in prediction]
    # LongBench removes items from the list while iterating over it, which skips the element after
    # each removal; the same loop is kept so scores match LongBench's exactly.
    for match in matches:
        if match in ground_truth and match != ground_truth:
            matches.remove(match)
    if ground_truth in matches:
        return 1.0 / len(matches)
    return 0.0


def retrieval_score(prediction: str, ground_truth: str) -> float:
    """Share of the numbers in the prediction equal to the gold paragraph number (``Paragraph N``)."""
    gold_ids = re.findall(r"Paragraph (\d+)", ground_truth)
    if not gold_ids:
        raise ValueError(f"retrieval ground truth {ground_truth!r} has no 'Paragraph <n>'")
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(number == gold_ids[0] for number in numbers) / len(numbers)


def count_score(prediction: str, ground_truth: str) -> float:
    """Share of the numbers in the prediction equal to the gold count."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(number == str(ground_truth) for number in numbers) / len(numbers)


def fuzz_ratio(first: str, second: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` on its pure-Python path: ``round(100 * 2M / T)``.

    ``M`` is the number of matching characters found by ``difflib.SequenceMatcher`` and ``T`` the
    total length. Identical strings give 100 (even two empty ones), one empty string gives 0.
    (With python-Levenshtein installed fuzzywuzzy switches to an edit-distance ratio that can differ
    by a point or two; kvpress's evaluation extra does not install it.)
    """
    if first == second:
        return 100
    if not first or not second:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, first, second).ratio()))


def first_code_line(prediction: str) -> str:
    """The first line with no backtick, ``#`` or ``//`` anywhere in it (LongBench's rule), or ""."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim_score(prediction: str, ground_truth: str) -> float:
    """Similarity of the first code line of the prediction to the gold next line (``lcc``,
    ``repobench-p``)."""
    return fuzz_ratio(first_code_line(prediction), ground_truth) / 100


# --------------------------------------------------------------------------------------------------
# Uniform interface
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _BestOverReferences:
    """Scores against each gold answer and keeps the best, as LongBench does."""

    pairwise: Callable[[str, str], float]

    def __call__(self, prediction: str, references: Sequence[str], extra: Mapping[str, Any]) -> float:
        return max((self.pairwise(prediction, reference) for reference in references), default=0.0)


def _string_match_all_scorer(prediction: str, references: Sequence[str], extra: Mapping[str, Any]) -> float:
    return string_match_all(prediction, references)


def _string_match_part_scorer(prediction: str, references: Sequence[str], extra: Mapping[str, Any]) -> float:
    return string_match_part(prediction, references)


def _classification_over_references(prediction: str, references: Sequence[str], extra: Mapping[str, Any]) -> float:
    all_classes = extra.get("all_classes")
    if not all_classes:
        raise ValueError("classification_score needs the sample's extra['all_classes']")
    return max(
        (classification_score(prediction, reference, all_classes) for reference in references),
        default=0.0,
    )


SCORERS: dict[str, ScoreFunction] = {
    "string_match_all": _string_match_all_scorer,
    "string_match_part": _string_match_part_scorer,
    "qa_f1_score": _BestOverReferences(qa_f1_score),
    "rouge_score": _BestOverReferences(rouge_score),
    "classification_score": _classification_over_references,
    "retrieval_score": _BestOverReferences(retrieval_score),
    "count_score": _BestOverReferences(count_score),
    "code_sim_score": _BestOverReferences(code_sim_score),
}
"""Metric name (``EvalSample.metric``) -> ``(prediction, references, extra) -> score in [0, 1]``."""


def score_prediction(sample: EvalSample, question_index: int, prediction: str) -> float:
    """Score one generated answer of a sample with the sample's metric.

    Parameters
    ----------
    sample : EvalSample
        The evaluated item; ``sample.metric`` selects the scorer.
    question_index : int
        Which of ``sample.questions`` the prediction answers.
    prediction : str
        Generated text (without the answer prefix).

    Returns
    -------
    float
        Score in [0, 1].
    """
    if sample.metric not in SCORERS:
        raise ValueError(
            f"sample {sample.sample_id!r} has unknown metric {sample.metric!r}; "
            f"valid metrics: {', '.join(sorted(SCORERS))}"
        )
    if not 0 <= question_index < len(sample.questions):
        raise ValueError(
            f"question_index {question_index} out of range for sample {sample.sample_id!r} "
            f"with {len(sample.questions)} question(s)"
        )
    if sample.task in LONGBENCH_FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    return float(SCORERS[sample.metric](prediction, sample.references[question_index], sample.extra))
