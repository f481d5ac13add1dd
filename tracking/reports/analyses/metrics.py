"""Which metrics judge a configuration and in which direction, and the per-sample rows the paired tests and
within-sample correlations use."""

from __future__ import annotations

import numpy as np
import pandas as pd

from grkv_core.metrics import ANSWER_METRICS, HIGHER_IS_BETTER, STREAM_METRICS
from tracking.mlflow_tracker import SAMPLE_FIELDS
from tracking.reports.data import SCORE_PREFIX, SweepRuns

# What a configuration is judged by: the score (0-100), and the answer metrics, continuous and measured on every
# run without decoding; a bounded-cache sweep's streamed tokens' NLL.
PERFORMANCE_METRICS = ("mean_score", *ANSWER_METRICS, *STREAM_METRICS)


class BudgetFormat:
    """A budget as text: the fraction of the cache kept (``10%``) or a bounded cache's size in tokens (``512 tok``,
    always above 1); ``format`` as a format string's, so tables take it per column."""

    @staticmethod
    def format(budget: float) -> str:
        return f"{budget:.0%}" if budget <= 1 else f"{budget:.0f} tok"


def budget_text(budget: float) -> str:
    return BudgetFormat.format(budget)


def score_columns(runs: SweepRuns) -> list[str]:
    """The per-task score columns (``score.<task>``) of the sweep's tasks."""
    return [SCORE_PREFIX + task for task in runs.task_names]


def higher_is_better(metric: str) -> bool:
    """A metric's direction, from ``HIGHER_IS_BETTER`` (a per-task ``score.<task>`` is a score)."""
    return metric in HIGHER_IS_BETTER or metric.startswith(SCORE_PREFIX)


def performance_metrics(frame: pd.DataFrame) -> list[str]:
    """The ``PERFORMANCE_METRICS`` that ``frame`` holds a value of, the score first."""
    return [metric for metric in PERFORMANCE_METRICS if metric in frame and frame[metric].notna().any()]


def best_index(values: pd.Series, metric: str):
    """The index of the best of ``values`` in ``metric``'s direction (the first of ties; NaN never best unless
    all are)."""
    oriented = values.astype(float) if higher_is_better(metric) else -values.astype(float)
    return oriented.fillna(-np.inf).idxmax()


def sample_table(predictions: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, sample) of per-question rows (``SweepRuns.test_predictions`` or ``trial_predictions``).

    Returns
    -------
    pandas.DataFrame
        ``run_id``, ``sample`` (``<task>/<sample_id>``), ``mean_score`` (the mean score of the sample's questions in
        points, 0-100, the scale of ``score.<task>``; NaN where nothing was decoded) and the sample's
        ``SAMPLE_FIELDS`` (answer metrics, needle depth and window, losses).

    NOTE: questions that share a context are not independent, so a sample, not a question, is the unit the tests
    pair and resample and the within-sample correlations rank over.
    """
    numeric = ["mean_score", *(name for name in SAMPLE_FIELDS if name != "answer_in_window")]
    if predictions.empty:
        return pd.DataFrame(columns=["run_id", "sample", *numeric, "answer_in_window"])
    keys = predictions["task"].astype(str) + "/" + predictions["sample_id"].astype(str)
    rows = predictions.assign(sample=keys, mean_score=100 * predictions["score"].astype(float))
    grouped = rows.groupby(["run_id", "sample"], sort=False)
    table = grouped[numeric].mean()
    table["answer_in_window"] = grouped["answer_in_window"].first()
    return table.reset_index()
