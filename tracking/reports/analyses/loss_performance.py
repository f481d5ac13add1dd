"""Reconstruction discrepancy against downstream performance (paper App. G), across configurations and within
each tuning sample."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from grkv_core.metrics import LOSS_METRICS
from tracking.reports.analyses.metrics import performance_metrics, sample_table
from tracking.reports.data import SweepRuns
from tracking.reports.stats import Correlation, WithinSampleCorrelation, correlate, within_sample_correlation


@dataclass
class LossPerformance:
    """Reconstruction discrepancy against downstream performance (paper App. G).

    Attributes
    ----------
    table : pandas.DataFrame
        One row per configuration: ``trial_number``, ``configuration``, ``method``, ``budget``, its searched
        options, the losses and the performance metrics (``score`` first).
    correlations : list[Correlation]
        Across configurations (each run's means): one per (metric, loss), metric-major.
    score : str
        The first performance metric of ``table``.
    within_sample : list[WithinSampleCorrelation]
        Within each tuning sample across configurations (ranks), one per (metric, loss); empty without per-sample
        rows.
    """

    table: pd.DataFrame
    correlations: list[Correlation]
    score: str
    within_sample: list[WithinSampleCorrelation] = field(default_factory=list)


def loss_performance(
    runs: SweepRuns, metrics: tuple[str, ...] | None = None, losses: tuple[str, ...] = LOSS_METRICS
) -> LossPerformance:
    """Correlate each reconstruction loss with each performance metric over the full-stage runs: across the
    configurations, and within each tuning sample (per-sample rows of ``SweepRuns.trial_predictions``).

    ``metrics`` defaults to the ``PERFORMANCE_METRICS`` the runs logged.
    """
    trials = runs.trials
    metrics = list(metrics or performance_metrics(trials) or ["mean_score"])
    present = [loss for loss in losses if loss in trials]
    shown = [
        "trial_number",
        "configuration",
        "method",
        "budget",
        *[name for name in ("lambda_k", "lambda_v", "window_size", "steps", "components") if name in trials],
        *present,
        *metrics,
    ]
    table = trials[[column for column in shown if column in trials]].reset_index(drop=True)
    correlations = [
        correlate(trials[loss], trials[metric], loss, metric)
        for metric in metrics
        if metric in trials
        for loss in present
    ]
    samples = sample_table(runs.trial_predictions)
    within = [
        within_sample_correlation(samples, loss, metric)
        for metric in metrics
        for loss in present
        if samples[[loss, metric]].notna().all(axis=1).any()
    ]
    return LossPerformance(table, correlations, metrics[0], within)
