"""How the screening stage's ranking held up: the promoted configurations' screening losses against their
full-stage score."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from grkv_core.metrics import SCREENING_METRICS
from tracking.reports.analyses.loss_performance import LossPerformance
from tracking.reports.data import SweepRuns
from tracking.reports.stats import correlate
from workers.names import PROMOTED_FROM_TAG, SAMPLER_PREFIX

SCREEN_PREFIX = "screen_"  # a promoted configuration's loss as its screening run measured it
# NOTE: the loader keeps every tag as a ``tag.<key>`` column.
PROMOTED_FROM_COLUMN = f"tag.{PROMOTED_FROM_TAG}"


@dataclass
class Screening:
    """What the screening stage ranked and how its ranking held up once the promoted configurations were scored.

    Attributes
    ----------
    screened : int
        Finished screening runs (configurations whose losses were measured without decoding).
    promoted : LossPerformance
        One row per full-stage run whose sampler proposals equal a screening run's: ``trial_number``
        (full stage), ``screen_trial``, ``configuration``, ``method``, ``budget``, the screening run's losses
        as ``screen_<loss>`` and the full-stage score; one correlation per screening loss against that score.
    unscreened : int
        Full-stage runs with no screening run (e.g. baselines enqueued directly, or a sweep without screening).
    notes : list[str]
    """

    screened: int
    promoted: LossPerformance
    unscreened: int
    notes: list[str] = field(default_factory=list)


def _proposal(row: pd.Series, columns: list[str]) -> tuple:
    """The sampler's proposals of a run as a hashable key (``optuna.<name>`` columns it has values for).

    NOTE: MLflow params round-trip through ``str()``, so equal proposals parse to equal values; a column with
    missing values holds 32 as 32.0, which compares and hashes equal to 32.
    """
    return tuple((column, row[column]) for column in columns if pd.notna(row.get(column)))


def screening(runs: SweepRuns, score: str = "mean_score", losses: tuple[str, ...] = SCREENING_METRICS) -> Screening:
    """Match full-stage runs to the screening runs they were promoted from, and correlate screening loss
    with the full-stage score over them.

    A full-stage run names the screening trial it was promoted from in its ``grkv.promoted_from`` tag; a run
    without the tag is matched to the screening run with the same sampler proposals (``optuna.<name>`` params).
    The losses ``losses`` are the screening run's own measurements.
    """
    screen, trials, notes = runs.screen_trials, runs.trials, []
    columns = sorted({c for frame in (screen, trials) for c in frame.columns if c.startswith(SAMPLER_PREFIX)})
    present = [loss for loss in losses if loss in screen]
    by_number = {int(run["trial_number"]): run for _, run in screen.iterrows()}
    by_proposal: dict[tuple, pd.Series] = {}
    for number, run in by_number.items():
        key = _proposal(run, columns)
        if key in by_proposal:
            notes.append(
                f"screening trials {int(by_proposal[key]['trial_number'])} and {number} proposed the same "
                "configuration; a full run without a promoted_from tag is matched to the first"
            )
        else:
            by_proposal[key] = run
    rows = []
    for _, trial in trials.iterrows():
        tagged = trial.get(PROMOTED_FROM_COLUMN)
        source = by_number.get(int(tagged)) if isinstance(tagged, str) else by_proposal.get(_proposal(trial, columns))
        if source is not None:
            rows.append(
                {
                    "trial_number": trial["trial_number"],
                    "screen_trial": source["trial_number"],
                    "configuration": trial["configuration"],
                    "method": trial["method"],
                    "budget": trial["budget"],
                    **{SCREEN_PREFIX + loss: source[loss] for loss in present},
                    score: trial.get(score, np.nan),
                }
            )
    table = pd.DataFrame(
        rows,
        columns=[
            "trial_number",
            "screen_trial",
            "configuration",
            "method",
            "budget",
            *[SCREEN_PREFIX + loss for loss in present],
            score,
        ],
    )
    correlations = [
        correlate(table[SCREEN_PREFIX + loss], table[score], SCREEN_PREFIX + loss, score) for loss in present
    ]
    if len(screen) and not present:
        notes.append(f"the screening runs logged none of {', '.join(losses)}")
    return Screening(len(screen), LossPerformance(table, correlations, score), len(trials) - len(table), notes)
