"""The runs every comparison is anchored on: eviction only at a budget, the paper default and the best trial,
and what each test-stage run scored on the tuning samples."""

from __future__ import annotations

import numpy as np
import pandas as pd

from tracking.reports.analyses.metrics import best_index
from tracking.reports.data import SweepRuns
from workers.names import EVICTION_ONLY, PAPER_DEFAULT


def eviction_rows(trials: pd.DataFrame, budget: float) -> pd.DataFrame:
    """The eviction-only runs among ``trials`` at ``budget`` (the one enqueued as the baseline where there is one)."""
    at_budget = trials[(trials["merge"] == "none") & np.isclose(trials["budget"], budget)]
    tagged = at_budget[at_budget["baseline"] == EVICTION_ONLY]
    return tagged if len(tagged) else at_budget


def default_and_best(merged: pd.DataFrame, score: str) -> list[tuple[str, pd.DataFrame]]:
    """The paper-default trial among ``merged`` and the best one on ``score``; one entry when they coincide."""
    if score not in merged:
        return []
    scored = merged.dropna(subset=[score])
    if scored.empty:
        return []
    default = scored[scored["baseline"] == PAPER_DEFAULT]
    best = scored.loc[[best_index(scored[score], score)]]
    if best["trial_number"].iloc[0] in set(default["trial_number"]):
        return [(f"paper default, best of {len(scored)}", default)]
    return ([("paper default", default)] if len(default) else []) + [(f"best of {len(scored)}", best)]


def representative_trials(
    runs: SweepRuns, score: str = "mean_score", budget: float | None = None
) -> list[tuple[str, pd.Series]]:
    """Merging configurations worth comparing: the paper default and the best (at ``budget``).

    Returns ``(label, trial)`` pairs. The best is chosen on the same data it is scored on, so its
    score (and any gain or p-value computed from it) is optimistic.
    """
    merged = runs.trials[runs.trials["merge"] != "none"]
    if budget is not None:
        merged = merged[np.isclose(merged["budget"], budget)]
    return [(label, rows.iloc[0]) for label, rows in default_and_best(merged, score)]


def tuning_scores(runs: SweepRuns, score: str = "mean_score") -> pd.Series:
    """For each test-stage run, the ``score`` of the full-stage trial it confirms (NaN where there is none)."""
    by_number = runs.trials.set_index("trial_number")[score] if score in runs.trials else pd.Series(dtype=float)
    return runs.test_trials["trial_number"].map(by_number).astype(float)
