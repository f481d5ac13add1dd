"""LongBench (16 English tasks) from the kvpress-formatted hub copy ``Xnhyacinth/LongBench``.

Each row of that copy already splits LongBench's prompt the kvpress way: ``context`` (task
instruction + long text), ``question`` (the query and any closing instruction), ``answer_prefix``,
``answers`` (gold answers), ``all_classes`` (class names, ``trec`` only), ``max_new_tokens``
(LongBench's generation budget + 20) and ``length``. Loading needs the hub (or a warm ``datasets``
cache); :func:`longbench_row_to_sample` is the pure mapping and works offline.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from grkv_core.datasets.schema import EvalSample, validate_task_selection

LONGBENCH_HUB_REPO = "Xnhyacinth/LongBench"
LONGBENCH_HUB_REVISION = "2e9ade51ebf45d98942056c0716234f9d5d257d5"
"""Pinned commit of ``Xnhyacinth/LongBench``: the revision the GRKV authors list as their fixed
LongBench data (github.com/pjunjie/GRKV README). Not checked against the hub from this (offline)
machine; a wrong pin fails loudly at ``load_dataset`` time rather than loading other data."""

LONGBENCH_TASKS: tuple[str, ...] = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
"""The 16 English LongBench tasks, in LongBench's order."""

LONGBENCH_METRICS: dict[str, str] = {
    "narrativeqa": "qa_f1_score",
    "qasper": "qa_f1_score",
    "multifieldqa_en": "qa_f1_score",
    "hotpotqa": "qa_f1_score",
    "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score",
    "gov_report": "rouge_score",
    "qmsum": "rouge_score",
    "multi_news": "rouge_score",
    "trec": "classification_score",
    "triviaqa": "qa_f1_score",
    "samsum": "rouge_score",
    "passage_count": "count_score",
    "passage_retrieval_en": "retrieval_score",
    "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
}
"""LongBench's task -> metric map (``dataset2metric``), as names in ``scoring.SCORERS``."""

LONGBENCH_MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "lcc": 64,
    "repobench-p": 64,
}
"""LongBench's generation budgets (``dataset2maxlen``); used only when a row has no
``max_new_tokens`` column (the hub copy stores these + 20)."""

_REQUIRED_COLUMNS = ("context", "question", "answer_prefix", "answers")


def validate_longbench_tasks(tasks: Sequence[str] | str | None) -> tuple[str, ...]:
    """Normalise a LongBench task selection; see :func:`validate_task_selection`."""
    return validate_task_selection(tasks, LONGBENCH_TASKS, "LongBench")


def longbench_row_to_sample(row: Mapping[str, Any], task: str, row_index: int) -> EvalSample:
    """Map one row of ``Xnhyacinth/LongBench`` (config ``task``) to an :class:`EvalSample`.

    Parameters
    ----------
    row : Mapping[str, Any]
        The row: ``context``, ``question``, ``answer_prefix``, ``answers`` (list of str), and
        optionally ``all_classes``, ``max_new_tokens``, ``length``, ``_id``.
    task : str
        LongBench task (the dataset config the row came from).
    row_index : int
        Position of the row in the task's split; part of the stable ``sample_id``.

    Raises
    ------
    ValueError
        Unknown task, missing columns, no gold answer, or ``trec`` without ``all_classes``.
    """
    validate_longbench_tasks(task)
    missing = [column for column in _REQUIRED_COLUMNS if column not in row]
    if missing:
        raise ValueError(f"LongBench {task} row {row_index} lacks column(s) {missing}")
    answers = row["answers"]
    answers = (answers,) if isinstance(answers, str) else tuple(answers)
    if not answers:
        raise ValueError(f"LongBench {task} row {row_index} has no gold answer")
    all_classes = list(row.get("all_classes") or ())
    metric = LONGBENCH_METRICS[task]
    if metric == "classification_score" and not all_classes:
        raise ValueError(f"LongBench {task} row {row_index} needs 'all_classes' for {metric}")
    max_new_tokens = row.get("max_new_tokens")
    return EvalSample(
        sample_id=f"longbench/{task}/{row_index}",
        task=task,
        context=row["context"],
        questions=(row["question"],),
        answer_prefix=row["answer_prefix"],
        references=(answers,),
        max_new_tokens=int(max_new_tokens) if max_new_tokens else LONGBENCH_MAX_NEW_TOKENS[task],
        metric=metric,
        extra={
            "all_classes": all_classes,
            "length": row.get("length"),
            "longbench_id": row.get("_id"),
            "row_index": row_index,
            "source": f"{LONGBENCH_HUB_REPO}@{LONGBENCH_HUB_REVISION}",
        },
    )


def select_row_indices(num_rows: int, samples_per_task: int | None, seed: int) -> list[int]:
    """Rows to evaluate: all of them, or a seeded random subset kept in dataset order.

    Parameters
    ----------
    num_rows : int
        Rows available for the task.
    samples_per_task : int or None
        How many to keep; ``None`` (or more than available) keeps every row.
    seed : int
        Seed of the subset draw, so that two runs evaluate the same rows.
    """
    if samples_per_task is not None and samples_per_task <= 0:
        raise ValueError(f"samples_per_task must be positive, got {samples_per_task}")
    if samples_per_task is None or samples_per_task >= num_rows:
        return list(range(num_rows))
    return sorted(random.Random(seed).sample(range(num_rows), samples_per_task))


def load_longbench_samples(
    tasks: Sequence[str] | str | None = None,
    samples_per_task: int | None = None,
    seed: int = 0,
) -> list[EvalSample]:
    """Load LongBench tasks from the pinned hub copy.

    Parameters
    ----------
    tasks : sequence of str, str or None
        Tasks to load; ``None`` loads all 16.
    samples_per_task : int or None
        Rows per task (a seeded subset); ``None`` loads every row.
    seed : int
        Seed of the subset draw.

    Returns
    -------
    list[EvalSample]
        One sample per row, tasks in the requested order.
    """
    selected = validate_longbench_tasks(tasks)
    from datasets import load_dataset  # deferred: importing datasets costs seconds

    samples: list[EvalSample] = []
    for task in selected:
        split = load_dataset(LONGBENCH_HUB_REPO, task, split="test", revision=LONGBENCH_HUB_REVISION)
        for row_index in select_row_indices(len(split), samples_per_task, seed):
            samples.append(longbench_row_to_sample(split[row_index], task, row_index))
    return samples
