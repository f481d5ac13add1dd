"""RULER from the kvpress hub copy ``simonjegou/ruler``, pinned to a revision."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grkv_core.datasets.longbench import select_row_indices
from grkv_core.datasets.ruler.tasks import RULER_DEFAULT_CONTEXT_LENGTH, RULER_TASK_SPECS, validate_ruler_tasks
from grkv_core.datasets.schema import EvalSample

RULER_HUB_REPO = "simonjegou/ruler"
RULER_HUB_REVISION = "24adceac8a0e6532936e8d721cd9e9084d2e4686"
"""Pinned commit of ``simonjegou/ruler`` (the kvpress RULER copy): the revision the GRKV authors
list as their fixed RULER data (github.com/pjunjie/GRKV README). Not checked against the hub from
this (offline) machine; a wrong pin fails loudly at ``load_dataset`` time rather than loading other
data."""

_HUB_COLUMNS = ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")


def ruler_hub_row_to_sample(row: Mapping[str, Any], context_length: int, row_index: int) -> EvalSample:
    """Map one row of ``simonjegou/ruler`` (config ``str(context_length)``) to an :class:`EvalSample`.

    Parameters
    ----------
    row : Mapping[str, Any]
        The row: ``context``, ``question``, ``answer_prefix``, ``answer`` (list of str), ``task``,
        ``max_new_tokens``.
    context_length : int
        The config the row came from (part of the ``sample_id``).
    row_index : int
        Position of the row in the split.

    Raises
    ------
    ValueError
        Missing columns, unknown task or no answer.
    """
    missing = [column for column in _HUB_COLUMNS if column not in row]
    if missing:
        raise ValueError(f"{RULER_HUB_REPO} row {row_index} lacks column(s) {missing}")
    (task,) = validate_ruler_tasks(row["task"])
    answers = row["answer"]
    answers = (answers,) if isinstance(answers, str) else tuple(answers)
    if not answers:
        raise ValueError(f"{RULER_HUB_REPO} row {row_index} has no answer")
    return EvalSample(
        sample_id=f"ruler-hub/{task}/{context_length}/{row_index}",
        task=task,
        context=row["context"],
        questions=(row["question"],),
        answer_prefix=row["answer_prefix"],
        references=(answers,),
        max_new_tokens=int(row["max_new_tokens"]),
        metric=RULER_TASK_SPECS[task].metric,
        extra={
            "row_index": row_index,
            "context_length": context_length,
            "source": f"{RULER_HUB_REPO}@{RULER_HUB_REVISION}",
        },
    )


def load_ruler_hub_samples(
    tasks: Sequence[str] | str | None = None,
    context_length: int = RULER_DEFAULT_CONTEXT_LENGTH,
    samples_per_task: int | None = None,
    seed: int = 0,
) -> list[EvalSample]:
    """Load RULER from the pinned hub copy (needs the hub or a warm ``datasets`` cache).

    Parameters
    ----------
    tasks : sequence of str, str or None
        Tasks to keep; ``None`` keeps all 13.
    context_length : int
        Config of the hub dataset (4096, 8192, 16384, ...).
    samples_per_task : int or None
        Rows per task (a seeded subset in dataset order); ``None`` keeps every row.
    seed : int
        Seed of the subset draw.
    """
    selected = validate_ruler_tasks(tasks)
    if context_length <= 0:
        raise ValueError(f"context_length must be positive, got {context_length}")
    from datasets import load_dataset  # deferred: importing datasets costs seconds

    split = load_dataset(RULER_HUB_REPO, data_dir=str(context_length), split="test", revision=RULER_HUB_REVISION)
    rows_by_task: dict[str, list[int]] = {task: [] for task in selected}
    for row_index, task in enumerate(split["task"]):
        if task in rows_by_task:
            rows_by_task[task].append(row_index)
    samples = []
    for task in selected:
        rows = rows_by_task[task]
        for position in select_row_indices(len(rows), samples_per_task, seed):
            samples.append(ruler_hub_row_to_sample(split[rows[position]], context_length, rows[position]))
    return samples
