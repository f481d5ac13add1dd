"""What the score measures: the score per needle depth, and the samples whose needle lies in the press's
always-kept window counted apart."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from tracking.mlflow_tracker import DEPTH_SAMPLES_PREFIX, DEPTH_SCORE_PREFIX
from tracking.reports.data import SweepRuns
from workers.names import FULL_STAGE, TEST_STAGE


@dataclass
class DepthWindow:
    """What the score measures: per configuration its score per needle depth, and apart the samples whose needle
    lies in the press's always-kept window (they score at any budget, so they say nothing about compression).

    Attributes
    ----------
    stage : str
        ``test`` (held-out samples) when the sweep has a test stage, else ``full``.
    table : pandas.DataFrame
        One row per run of that stage: ``configuration``, ``method``, ``budget``, ``mean_score``,
        ``mean_score_outside_window``, ``window_samples`` and one column per depth bin (``0.0-0.2``...: the bin's
        score, 0-100).
    bin_samples : dict[str, int]
        Scored samples per depth bin (the most any run had).
    """

    stage: str
    table: pd.DataFrame
    bin_samples: dict[str, int]


def depth_window(runs: SweepRuns) -> DepthWindow:
    """The ``score_depth.<bin>``, ``mean_score_outside_window`` and ``window_samples`` metrics of each run of the
    test stage (else the full stage); columns a sweep did not log read NaN."""
    stage, frame = (TEST_STAGE, runs.test_trials) if runs.has_test_stage else (FULL_STAGE, runs.trials)
    bins = sorted(column.removeprefix(DEPTH_SCORE_PREFIX) for column in frame if column.startswith(DEPTH_SCORE_PREFIX))
    columns = ["configuration", "method", "budget", "mean_score", "mean_score_outside_window", "window_samples"]
    table = frame.reindex(columns=columns + [DEPTH_SCORE_PREFIX + name for name in bins]).reset_index(drop=True)
    samples = {name: frame.get(DEPTH_SAMPLES_PREFIX + name, pd.Series(dtype=float)).max() for name in bins}
    return DepthWindow(
        stage,
        table.rename(columns=lambda column: column.removeprefix(DEPTH_SCORE_PREFIX)),
        {name: int(count) for name, count in samples.items() if pd.notna(count)},
    )
