"""LongBench task table and hub row mapping (offline: no dataset is downloaded)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import re

import pytest

from grkv_core.datasets import LONGBENCH_TASKS, load_dataset_samples, score_prediction
from grkv_core.datasets.longbench import (
    LONGBENCH_HUB_REVISION,
    LONGBENCH_MAX_NEW_TOKENS,
    LONGBENCH_METRICS,
    longbench_row_to_sample,
    select_row_indices,
)


def trec_row(**overrides):
    row = {
        "context": "Please determine the type of the question below. Here are some examples of questions.\n\n...",
        "question": "Where is the Eiffel Tower?",
        "answer_prefix": "Type:",
        "answers": ["Other location"],
        "all_classes": ["Other location", "City", "Country", "Date"],
        "max_new_tokens": 84,
        "length": 5123,
        "_id": "0a1b2c",
        "task": "trec",
    }
    return {**row, **overrides}


def test_sixteen_english_tasks_with_longbench_metrics():
    assert len(LONGBENCH_TASKS) == 16 == len(set(LONGBENCH_TASKS))
    assert set(LONGBENCH_METRICS) == set(LONGBENCH_TASKS) == set(LONGBENCH_MAX_NEW_TOKENS)
    by_metric = {}
    for task, metric in LONGBENCH_METRICS.items():
        by_metric.setdefault(metric, set()).add(task)
    assert by_metric == {
        "qa_f1_score": {"narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"},
        "rouge_score": {"gov_report", "qmsum", "multi_news", "samsum"},
        "classification_score": {"trec"},
        "count_score": {"passage_count"},
        "retrieval_score": {"passage_retrieval_en"},
        "code_sim_score": {"lcc", "repobench-p"},
    }
    assert re.fullmatch(r"[0-9a-f]{40}", LONGBENCH_HUB_REVISION)


def test_row_maps_to_an_eval_sample():
    sample = longbench_row_to_sample(trec_row(), "trec", 41)
    assert sample.sample_id == "longbench/trec/41"
    assert (sample.task, sample.questions, sample.answer_prefix) == ("trec", ("Where is the Eiffel Tower?",), "Type:")
    assert sample.context.startswith("Please determine the type")
    assert sample.references == (("Other location",),)
    assert sample.max_new_tokens == 84 and sample.metric == "classification_score"
    assert sample.extra["all_classes"] == ["Other location", "City", "Country", "Date"]
    assert sample.extra["length"] == 5123 and sample.extra["longbench_id"] == "0a1b2c"
    assert score_prediction(sample, 0, "Other location\nCity") == 1.0


def test_row_without_budget_uses_longbench_budget_and_scores_with_the_task_metric():
    row = {
        "context": "Here are 30 paragraphs from Wikipedia...",
        "question": "The abstract.\n\nPlease enter the number of the paragraph...",
        "answer_prefix": "The answer is: ",
        "answers": ["Paragraph 3"],
        "all_classes": None,
    }
    sample = longbench_row_to_sample(row, "passage_retrieval_en", 0)
    assert sample.max_new_tokens == 32 and sample.metric == "retrieval_score"
    assert score_prediction(sample, 0, "Paragraph 3") == 1.0
    assert score_prediction(sample, 0, "Paragraph 3 or Paragraph 4") == 0.5


def test_bad_rows_and_names_raise():
    with pytest.raises(ValueError, match="all_classes"):
        longbench_row_to_sample(trec_row(all_classes=[]), "trec", 0)
    with pytest.raises(ValueError, match="answers"):
        longbench_row_to_sample({k: v for k, v in trec_row().items() if k != "answers"}, "trec", 0)
    with pytest.raises(ValueError, match="no gold answer"):
        longbench_row_to_sample(trec_row(answers=[]), "trec", 0)
    with pytest.raises(ValueError, match="valid tasks: narrativeqa"):
        longbench_row_to_sample(trec_row(), "lsht", 0)
    with pytest.raises(ValueError, match="valid tasks"):
        load_dataset_samples("longbench", tasks=["multifieldqa_zh"])
    with pytest.raises(ValueError, match="context_length"):
        load_dataset_samples("longbench", context_length=4096)


def test_row_subsets_are_seeded_and_ordered():
    assert select_row_indices(5, None, 0) == [0, 1, 2, 3, 4]
    assert select_row_indices(5, 10, 0) == [0, 1, 2, 3, 4]
    subset = select_row_indices(200, 10, 3)
    assert subset == sorted(subset) and len(set(subset)) == 10
    assert subset == select_row_indices(200, 10, 3) != select_row_indices(200, 10, 4)
    with pytest.raises(ValueError):
        select_row_indices(5, 0, 0)
