"""Paired tests of merging against the eviction-only base press (and the paper and library defaults), and the sweep's
headline: its tuned pick against eviction only on the held-out test samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from tracking.reports.analyses.anchors import eviction_rows, representative_trials, tuning_scores
from tracking.reports.analyses.metrics import budget_text, higher_is_better, sample_table, score_columns
from tracking.reports.data import BUDGET_SEPARATOR, SCORE_PREFIX, SweepRuns
from tracking.reports.stats import PairedComparison, compare_configs
from workers.names import EVICTION_ONLY, FULL_STAGE, LIBRARY_DEFAULT, PAPER_DEFAULT, TEST_STAGE

# The merging baselines a confirmed configuration is compared with, besides eviction only.
DEFAULT_BASELINES = (PAPER_DEFAULT, LIBRARY_DEFAULT)


def tidy_task_scores(runs: SweepRuns) -> pd.DataFrame:
    """Per-task scores of the full-stage runs as a tidy table ``config, seed, task, score, trial_number``.

    ``config`` is the baseline name for baseline trials (so tables from sweeps run with different data
    seeds line up) and ``trial N`` otherwise; ``seed`` is the sweep's ``data.seed``.
    """
    columns = [column for column in score_columns(runs) if column in runs.trials]
    long = runs.trials.melt(
        id_vars=["configuration", "trial_number"], value_vars=columns, var_name="task", value_name="score"
    ).dropna(subset=["score"])
    long["task"] = long["task"].str.removeprefix(SCORE_PREFIX)
    long["seed"] = runs.data_seed
    return long.rename(columns={"configuration": "config"})[["config", "seed", "task", "score", "trial_number"]]


def tidy_sample_scores(runs: SweepRuns, metric: str = "mean_score", stage: str = TEST_STAGE) -> pd.DataFrame:
    """Per-sample ``metric`` of the ``stage``'s runs (test or full) as a tidy table ``run_id, seed, sample, <metric>``
    (:func:`sample_table`: ``mean_score`` is the mean of the sample's questions in points, 0-100)."""
    predictions = runs.test_predictions if stage == TEST_STAGE else runs.trial_predictions
    return sample_table(predictions).assign(seed=runs.data_seed)[["run_id", "seed", "sample", metric]]


def trial_sample_scores(runs: SweepRuns, metric: str) -> pd.DataFrame:
    """:func:`tidy_sample_scores` of the full-stage trials that hold ``metric``, with each run's ``trial_number``."""
    samples = tidy_sample_scores(runs, metric, FULL_STAGE).dropna(subset=[metric])
    numbers = runs.trials.set_index("run_id")["trial_number"]
    samples = samples[samples["run_id"].isin(numbers.index)]
    return samples.assign(trial_number=samples["run_id"].map(numbers))


@dataclass
class Significance:
    """Paired tests of merging against the eviction-only base press (and the paper and library defaults).

    Attributes
    ----------
    metric : str
        What is compared: ``mean_score`` or an answer metric (direction from ``higher_is_better``).
    stage : str
        ``test``: every confirmed merging configuration against eviction only at its budget, the paper and library
        defaults at its budget and eviction only at every larger tested budget (which spends the memory the merge
        saves), paired per held-out test sample. ``full`` (no test stage): the paper default and the best trial at
        the base press's budget, on the tuning samples that also selected the best trial, paired per sample where the
        trials logged predictions, else per task.
    comparisons : list[PairedComparison]
    held_out : pandas.DataFrame
        Test stage only: per test run that confirms a full-stage trial, ``configuration``, ``method``,
        ``budget``, ``merge``, ``tuning_<metric>`` (full stage), ``test_<metric>`` and ``change`` (test minus
        tuning), best tuning value first.
    test_samples : int
        Distinct held-out samples in the test runs' predictions (0 without a test stage).
    notes : list[str]
    """

    metric: str
    stage: str
    comparisons: list[PairedComparison]
    held_out: pd.DataFrame
    test_samples: int
    notes: list[str] = field(default_factory=list)

    @property
    def tied(self) -> bool:
        """Every comparison ties on every paired unit: no CI or p-value here says anything."""
        return bool(self.comparisons) and all(comparison.tied for comparison in self.comparisons)

    @property
    def tuned_winners(self) -> pd.DataFrame:
        """Per budget, the confirmed merging configuration with the best tuning value (the pick there)."""
        if self.held_out.empty:
            return self.held_out
        merging = self.held_out[self.held_out["merge"] != "none"]
        # NOTE: held_out is sorted by tuning value, best first, so the first row per budget is its winner.
        return merging.drop_duplicates(subset="budget").sort_values("budget").reset_index(drop=True)


def significance(
    runs: SweepRuns, metric: str = "mean_score", n_resamples: int = 100_000, seed: int = 0
) -> Significance:
    """Paired bootstrap CI and sign-flip test of merging against the base press on ``metric`` (the score or an
    answer metric), on held-out samples when the sweep has a test stage.

    Without a test stage the tuning samples are paired: per sample where the trials logged per-sample predictions,
    else the score per task. With one data seed the standard deviations are NaN; pass several sweeps'
    :func:`tidy_task_scores` to :func:`compare_configs` for the paper's multi-seed version.
    """
    if runs.has_test_stage:
        return _test_significance(runs, metric, n_resamples, seed)
    return _tuning_significance(runs, metric, n_resamples, seed)


def _test_name(run: pd.Series) -> str:
    return f"{run['configuration']} ({run['method']}, {budget_text(run['budget'])})"


def _test_tidy(runs: SweepRuns, metric: str) -> pd.DataFrame:
    """:func:`tidy_sample_scores` with each test run's name (``_test_name``) as its ``config``."""
    samples = tidy_sample_scores(runs, metric)
    names = {run["run_id"]: _test_name(run) for _, run in runs.test_trials.iterrows()}
    return samples.assign(config=samples["run_id"].map(names))


def _test_comparison(
    tidy: pd.DataFrame, treatment: pd.Series, control: pd.Series, metric: str, n_resamples: int, seed: int
) -> PairedComparison:
    """Two test runs paired per held-out sample on ``metric``."""
    return compare_configs(
        tidy,
        _test_name(treatment),
        _test_name(control),
        unit="sample",
        metric=metric,
        higher_is_better=higher_is_better(metric),
        n_resamples=n_resamples,
        seed=seed,
    )


def _test_significance(runs: SweepRuns, metric: str, n_resamples: int, seed: int) -> Significance:
    test, notes = runs.test_trials, []
    tidy = _test_tidy(runs, metric)
    if tidy[metric].isna().all():
        return Significance(
            metric,
            TEST_STAGE,
            [],
            pd.DataFrame(),
            runs.test_sample_count,
            [f"no test-stage run logged a per-sample {metric} (its predictions.json predates it)"],
        )
    comparisons = []
    for _, treatment in test[test["merge"] != "none"].iterrows():
        same_budget = test[np.isclose(test["budget"], treatment["budget"])]
        eviction = eviction_rows(same_budget, treatment["budget"])
        merged_baselines = same_budget[
            (same_budget["merge"] != "none") & (same_budget["run_id"] != treatment["run_id"])
        ]
        # NOTE: a default is compared with the defaults before it (the library's with the paper's), not the reverse.
        defaults = DEFAULT_BASELINES
        if treatment["baseline"] in defaults:
            defaults = defaults[: defaults.index(treatment["baseline"])]
        at_budget = []
        for kind, controls in (
            ("eviction-only", eviction),
            *(
                (baseline.replace("_", "-"), merged_baselines[merged_baselines["baseline"] == baseline])
                for baseline in defaults
                if (test["baseline"] == baseline).any()
            ),
        ):
            if controls.empty:
                notes.append(
                    f"no {kind} test run at {budget_text(treatment['budget'])} to compare {_test_name(treatment)} with"
                )
                continue
            at_budget.append(controls.iloc[0])
        # NOTE: eviction at a larger budget keeps the memory the merge saves: the paired iso-memory question
        larger = test[(test["merge"] == "none") & (test["budget"] > treatment["budget"] + 1e-9)]
        for control in [*at_budget, *(row for _, row in larger.iterrows())]:
            try:
                comparisons.append(_test_comparison(tidy, treatment, control, metric, n_resamples, seed))
            except (KeyError, ValueError) as error:
                notes.append(f"{_test_name(treatment)} vs {_test_name(control)}: {error.args[0]}")
    held_out = pd.DataFrame(
        {
            "configuration": test["configuration"],
            "method": test["method"],
            "budget": test["budget"],
            "merge": test["merge"],
            f"tuning_{metric}": tuning_scores(runs, metric),
            f"test_{metric}": test.get(metric, np.nan),
        }
    )
    held_out = held_out.dropna(subset=[f"tuning_{metric}"]).assign(
        change=lambda frame: frame[f"test_{metric}"] - frame[f"tuning_{metric}"]
    )
    held_out = held_out.sort_values(
        f"tuning_{metric}", ascending=not higher_is_better(metric), kind="stable"
    ).reset_index(drop=True)
    return Significance(metric, TEST_STAGE, comparisons, held_out, runs.test_sample_count, notes)


def _tuning_significance(runs: SweepRuns, metric: str, n_resamples: int, seed: int) -> Significance:
    """Without a test stage: the paper default and the best trial at the base's budget against eviction only, on the
    tuning samples, paired per sample where the trials' predictions hold ``metric``, else (the score of runs whose
    predictions were not logged) per task."""

    def result(comparisons: list[PairedComparison], notes: list[str]) -> Significance:
        return Significance(metric, FULL_STAGE, comparisons, pd.DataFrame(), 0, notes)

    base = runs.baseline_trial(EVICTION_ONLY)
    if base is None:
        return result([], ["no eviction_only trial: nothing to test merging against"])
    samples = trial_sample_scores(runs, metric)
    if base["trial_number"] in set(samples["trial_number"]):
        tidy, unit, column = samples, "sample", metric
    elif metric == "mean_score" and runs.task_names:
        tidy, unit, column = tidy_task_scores(runs), "task", "score"
    else:
        return result([], [f"no test stage, and the trials logged no per-sample {metric} to pair"])
    treatments = representative_trials(runs, metric, base["budget"])
    if not treatments:
        return result([], [f"no merging trial at the eviction_only trial's budget ({budget_text(base['budget'])})"])
    control_name = f"{EVICTION_ONLY} (trial {int(base['trial_number'])})"
    names = {trial["trial_number"]: f"{label} (trial {int(trial['trial_number'])})" for label, trial in treatments}
    names[base["trial_number"]] = control_name
    tidy = tidy[tidy["trial_number"].isin(names)]
    tidy = tidy.assign(config=tidy["trial_number"].map(names))
    comparisons, notes = [], []
    for _, trial in treatments:
        try:
            comparisons.append(
                compare_configs(
                    tidy,
                    names[trial["trial_number"]],
                    control_name,
                    unit=unit,
                    metric=column,
                    higher_is_better=higher_is_better(metric),
                    n_resamples=n_resamples,
                    seed=seed,
                )
            )
        except (KeyError, ValueError) as error:
            notes.append(f"{names[trial['trial_number']]} vs {control_name}: {error.args[0]}")
    return result(comparisons, notes)


@dataclass
class HeldOutFinding:
    """The sweep's pick against eviction only at its budget on the held-out test samples, on one metric.

    ``comparison`` is None when there is nothing to compare, and ``reason`` then says why in words.
    """

    metric: str
    treatment: pd.Series | None
    control: pd.Series | None
    comparison: PairedComparison | None
    reason: str = ""


def tuned_winner(runs: SweepRuns, metric: str) -> pd.Series | None:
    """The sweep's pick on the test stage: of the merging test runs at the sweep's own budget that confirm a
    full-stage trial, the best on the tuning samples by the first objective, ties broken by ``metric`` (each in
    its direction), then by test-run order; None without such a run.

    NOTE: chosen on the tuning samples only, so its comparison on the held-out samples is free of selection bias.
    """
    test = runs.test_trials
    candidates = test[
        (test["merge"] != "none")
        & test["trial_number"].notna()
        & ~test["test_of"].astype(str).str.contains(BUDGET_SEPARATOR, regex=False)
    ]
    if candidates.empty:
        return None
    keys = [name for name in dict.fromkeys([runs.objectives[0].metric, metric]) if name in runs.trials]
    oriented = pd.DataFrame(
        {name: tuning_scores(runs, name)[candidates.index] * (1 if higher_is_better(name) else -1) for name in keys},
        index=candidates.index,
    ).fillna(-np.inf)
    order = oriented.sort_values(keys, ascending=False, kind="stable").index if keys else candidates.index
    return candidates.loc[order[0]]


def held_out_finding(runs: SweepRuns, metric: str, n_resamples: int = 100_000, seed: int = 0) -> HeldOutFinding:
    """:func:`tuned_winner` against the eviction-only test run at its budget, paired per held-out sample on
    ``metric``."""

    def nothing(reason: str, treatment: pd.Series | None = None) -> HeldOutFinding:
        return HeldOutFinding(metric, treatment, None, None, reason)

    if not runs.has_test_stage:
        return nothing("no held-out test stage")
    winner = tuned_winner(runs, metric)
    if winner is None:
        return nothing("no merging configuration was confirmed on the test stage at the sweep's budget")
    same_budget = runs.test_trials[np.isclose(runs.test_trials["budget"], winner["budget"])]
    eviction = eviction_rows(same_budget, winner["budget"])
    if eviction.empty:
        return nothing(f"no eviction-only test run at {budget_text(winner['budget'])}", winner)
    tidy = _test_tidy(runs, metric)
    try:
        comparison = _test_comparison(tidy, winner, eviction.iloc[0], metric, n_resamples, seed)
    except (KeyError, ValueError):
        return nothing(f"the test runs logged no per-sample {metric} to pair", winner)
    return HeldOutFinding(metric, winner, eviction.iloc[0], comparison)
