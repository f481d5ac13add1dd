"""Evaluation datasets: RULER (offline generator and hub copy), LongBench (hub copy), the sample schema and the scorers.

Every loader returns :class:`EvalSample` rows; :func:`score_prediction` scores a generated answer
with the metric named in the sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grkv_core.config import DATASETS
from grkv_core.datasets.longbench import LONGBENCH_METRICS, LONGBENCH_TASKS, load_longbench_samples
from grkv_core.datasets.ruler import (
    RULER_DEFAULT_CONTEXT_LENGTH,
    RULER_DEFAULT_SAMPLES_PER_TASK,
    RULER_TASKS,
    DataDir,
    find_data_dir,
    generate_ruler_sample,
    generate_ruler_samples,
    load_ruler_hub_samples,
)
from grkv_core.datasets.schema import EvalSample
from grkv_core.datasets.scoring import SCORERS, score_prediction

__all__ = [
    "DATASETS",
    "EvalSample",
    "LONGBENCH_METRICS",
    "LONGBENCH_TASKS",
    "RULER_TASKS",
    "SCORERS",
    "find_data_dir",
    "generate_ruler_sample",
    "generate_ruler_samples",
    "load_dataset_samples",
    "score_prediction",
]


def load_dataset_samples(
    name: str,
    tasks: Sequence[str] | str | None = None,
    context_length: int | None = None,
    samples_per_task: int | None = None,
    seed: int = 0,
    data_dir: DataDir = None,
    tokenizer: Any | None = None,
) -> list[EvalSample]:
    """Load or generate a benchmark as :class:`EvalSample` rows.

    Parameters
    ----------
    name : {"ruler", "ruler-hub", "longbench"}
        Dataset.
    tasks : sequence of str, str or None
        Tasks to include (``None``: all of the dataset's tasks, :data:`RULER_TASKS` or
        :data:`LONGBENCH_TASKS`).
    context_length : int or None
        RULER only: token budget of the generated prompts (``"ruler"``) or the hub config to load
        (``"ruler-hub"``); ``None`` means 4096. LongBench has fixed lengths and rejects a value.
    samples_per_task : int or None
        ``"ruler"``: samples generated per task (``None``: RULER's 500). Hub datasets: a seeded
        subset of rows per task (``None``: every row).
    seed : int
        Generator seed (``"ruler"``) or subset seed (hub datasets).
    data_dir : path, optional
        ``"ruler"`` only: folder with the essay / SQuAD / HotpotQA files (see :func:`find_data_dir`).
    tokenizer : object with ``encode(text)``, optional
        ``"ruler"`` only: measures ``context_length``; without it tokens are estimated from words.
        Hub datasets come with fixed texts and ignore it.

    Raises
    ------
    ValueError
        Unknown dataset or task names (the message lists the valid ones), or a ``context_length``
        given for LongBench.
    """
    if name == "ruler":
        return generate_ruler_samples(
            tasks,
            context_length=RULER_DEFAULT_CONTEXT_LENGTH if context_length is None else context_length,
            samples_per_task=RULER_DEFAULT_SAMPLES_PER_TASK if samples_per_task is None else samples_per_task,
            seed=seed,
            data_dir=data_dir,
            tokenizer=tokenizer,
        )
    if name == "ruler-hub":
        return load_ruler_hub_samples(
            tasks,
            context_length=RULER_DEFAULT_CONTEXT_LENGTH if context_length is None else context_length,
            samples_per_task=samples_per_task,
            seed=seed,
        )
    if name == "longbench":
        if context_length is not None:
            raise ValueError("LongBench samples have fixed lengths; leave context_length as None")
        return load_longbench_samples(tasks, samples_per_task=samples_per_task, seed=seed)
    raise ValueError(f"unknown dataset {name!r}; valid datasets: {', '.join(DATASETS)}")
