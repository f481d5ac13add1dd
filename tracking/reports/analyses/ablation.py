"""The paper's ablation table: merging trials grouped by one hyperparameter at a time, the others held at the
paper default's."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from grkv_core.metrics import ANSWER_METRICS
from grkv_core.options import OPTION_SYMBOLS
from tracking.reports.analyses.anchors import eviction_rows
from tracking.reports.analyses.metrics import higher_is_better, score_columns
from tracking.reports.analyses.significance import trial_sample_scores
from tracking.reports.data import SCORE_PREFIX, SweepRuns
from tracking.reports.stats import compare_configs
from workers.names import BUDGET_PARAMS, PAPER_DEFAULT

COMPONENT_NAMES = {"kv": "GRKV", "k": "GRK", "v": "GRV"}


def _param_text(param: str, value) -> str:
    if param == "beta":
        return f"{float(value):.0%}"
    if param == "components":
        return COMPONENT_NAMES.get(value, str(value))
    return _short(value)


@dataclass(frozen=True)
class AblationFactor:
    """One row group of the paper's ablation table: the hyperparameter(s) varied and how to label them."""

    title: str
    params: tuple[str, ...]

    def label(self, values: tuple) -> str:
        if self.params == ("components",):
            return _param_text("components", values[0])
        if self.params == ("lambda_k", "lambda_v") and _same(*values):
            return f"λ={_short(values[0])}"  # the paper's λ = λ_k = λ_v
        return ", ".join(f"{OPTION_SYMBOLS.get(p, p)}={_param_text(p, v)}" for p, v in zip(self.params, values))

    def range_label(self, values: pd.Series) -> str:
        """A binned setting, named by the range of its first param's values."""
        param = self.params[0]
        return (
            f"{OPTION_SYMBOLS.get(param, param)} ∈ [{_param_text(param, values.min())}, "
            f"{_param_text(param, values.max())}]"
        )

    def restricted_to(self, params: list[str]) -> "AblationFactor":
        """The same factor over only the params this sweep searched (e.g. λ_k alone)."""
        return AblationFactor(self.title, tuple(p for p in self.params if p in params))


ABLATION_FACTORS = (
    AblationFactor("Regularization strength (λ = λ_k = λ_v)", ("lambda_k", "lambda_v")),
    AblationFactor("Fixed retained-token ratio (β)", ("beta",)),
    AblationFactor("Update steps (S)", ("steps",)),
    AblationFactor("Surrogate window size (m)", ("window_size",)),
    AblationFactor("Fixed sink tokens (n_sink)", ("n_sink",)),
    AblationFactor("Fixed window tokens (fix_window)", ("fix_window",)),
    AblationFactor("Optimized cache components", ("components",)),
)


def _short(value) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        if value.is_integer() and abs(value) < 1e4:
            return str(int(value))
        return f"{value:.2g}"
    return str(value)


def _same(left, right) -> bool:
    if isinstance(left, (float, int, np.floating, np.integer)) and isinstance(
        right, (float, int, np.floating, np.integer)
    ):
        # MLflow params round-trip through str(), which keeps floats exact; the tolerance only absorbs
        # values written by hand.
        return bool(np.isclose(float(left), float(right), rtol=1e-6, atol=0.0))
    return left == right


@dataclass
class AblationTable:
    """The paper's ablation table over this sweep's trials.

    ``table`` has one row per (factor, setting): ``factor``, ``setting``, ``default`` (the paper
    default's setting), ``held`` ("at defaults" when every other hyperparameter equals the paper
    default's, "varied" when no such trials exist and the row averages over the others), ``n``
    (trials averaged), ``trials``, one column per task, ``avg`` (the mean of ``score``), one column per answer
    metric the trials logged besides it (``metrics``), ``better`` (tasks where the row beats the eviction-only
    base press; NaN without one) and, for a row of one trial held at the defaults other than the paper default's,
    its ``paired_metric`` (the answer NLL where the trials logged it: the score ties on most samples; else
    ``score``) paired per sample against the paper default's on the samples both scored (from the runs'
    ``predictions.json``): ``vs_default`` (the mean difference, row minus default), ``vs_default_low`` and
    ``vs_default_high`` (its 95% bootstrap CI), ``vs_default_p`` (sign-flip p) and ``vs_default_samples``; and
    every one-trial row at the defaults (the default's included) the same against the eviction-only base press
    (``vs_base``, ``vs_base_low``, …); NaN elsewhere.
    """

    table: pd.DataFrame
    reference_trial: int | None
    base_trial: int | None
    notes: list[str] = field(default_factory=list)
    score: str = "mean_score"
    metrics: list[str] = field(default_factory=list)
    paired_metric: str = "mean_score"


def ablation_table(
    runs: SweepRuns,
    factors: tuple[AblationFactor, ...] = ABLATION_FACTORS,
    score: str = "mean_score",
    max_levels: int = 6,
) -> AblationTable:
    """Group merging trials by one hyperparameter at a time, the others held at the paper defaults.

    The reference is the ``paper_default`` baseline trial: the other searched hyperparameters are held
    at its values and its budget. When no trial varies a factor alone, the factor's settings average
    over whatever else varied (marked ``held = varied``); continuous settings are then binned into at
    most ``max_levels`` quantile bins.
    """
    trials = runs.trials
    notes: list[str] = []
    reference = trials[trials["baseline"] == PAPER_DEFAULT]
    if reference.empty:
        return AblationTable(
            pd.DataFrame(),
            None,
            None,
            ["no paper_default trial in this sweep: nothing to hold the other hyperparameters at"],
        )
    reference = reference.iloc[0]
    merged = trials[(trials["merge"] == reference["merge"]) & np.isclose(trials["budget"], reference["budget"])]
    tunable = [name for name in runs.search_space if name not in BUDGET_PARAMS and name in trials]
    base = eviction_rows(trials, reference["budget"])
    task_columns = score_columns(runs)
    metrics = [
        metric for metric in ANSWER_METRICS if metric != score and metric in trials and trials[metric].notna().any()
    ]
    base_scores = base[task_columns].mean() if len(base) else None
    if base_scores is None:
        notes.append("no eviction-only trial at the paper default's budget: the Better column is empty")
    paired_metric = PAIRED_METRIC if PAIRED_METRIC in metrics else score
    per_sample = _per_sample(runs, paired_metric)
    rows = []
    for factor in factors:
        factor = factor.restricted_to(tunable)
        if not factor.params:
            continue
        held = [p for p in tunable if p not in factor.params and pd.notna(reference.get(p))]
        holds = np.array(
            [all(_same(trial[p], reference[p]) for p in held) for _, trial in merged.iterrows()], dtype=bool
        )
        at_defaults = merged.loc[holds]
        settings, held_label = _settings(at_defaults, factor, reference), "at defaults"
        if len(settings) < 2:
            settings, held_label = _settings(merged, factor, reference, max_levels), "varied"
            notes.append(f"{factor.title}: no trials vary it alone; rows average over the other hyperparameters")
        for label, is_default, group in settings:
            task_means = group[task_columns].mean()
            paired = {}
            if held_label == "at defaults" and not is_default:
                paired |= _paired(per_sample, group, reference["trial_number"], paired_metric, "vs_default")
            if held_label == "at defaults" and len(base):
                paired |= _paired(per_sample, group, base.iloc[0]["trial_number"], paired_metric, "vs_base")
            rows.append(
                {
                    "factor": factor.title,
                    "setting": label,
                    "default": is_default,
                    "held": held_label,
                    "n": len(group),
                    "trials": ", ".join(str(n) for n in group["trial_number"]),
                    **task_means.rename(lambda c: c.removeprefix(SCORE_PREFIX)).to_dict(),
                    "avg": group[score].mean(),
                    **{metric: group[metric].mean() for metric in metrics},
                    "better": int((task_means > base_scores).sum()) if base_scores is not None else np.nan,
                    **{column: paired.get(column, np.nan) for column in PAIRED_COLUMNS},
                }
            )
    return AblationTable(
        pd.DataFrame(rows),
        int(reference["trial_number"]),
        int(base.iloc[0]["trial_number"]) if len(base) else None,
        notes,
        score,
        metrics,
        paired_metric,
    )


PAIRED_METRIC = "answer_nll"
PAIRED_COLUMNS = tuple(
    f"{control}{suffix}" for control in ("vs_default", "vs_base") for suffix in ("", "_low", "_high", "_p", "_samples")
)


def _per_sample(runs: SweepRuns, metric: str) -> pd.DataFrame:
    """:func:`trial_sample_scores` with each trial's number (as text) as its ``config``."""
    samples = trial_sample_scores(runs, metric)
    return samples.assign(config=samples["trial_number"].astype(int).astype(str))


def _paired(per_sample: pd.DataFrame, group: pd.DataFrame, control_trial, metric: str, name: str) -> dict:
    """A one-trial row against ``control_trial``, paired per sample: ``name`` (the mean difference, row minus
    control), ``name_low``/``name_high`` (95% bootstrap CI), ``name_p`` and ``name_samples``; {} where either has no
    per-sample scores."""
    if len(group) != 1:
        return {}
    treatment, control = str(int(group.iloc[0]["trial_number"])), str(int(control_trial))
    try:
        comparison = compare_configs(
            per_sample, treatment, control, unit="sample", metric=metric, higher_is_better=higher_is_better(metric)
        )
    except (KeyError, ValueError):  # NOTE: a trial without predictions, or none shared: the row stays unpaired
        return {}
    return {
        name: comparison.gain,
        f"{name}_low": comparison.ci.low,
        f"{name}_high": comparison.ci.high,
        f"{name}_p": comparison.p_value,
        f"{name}_samples": len(comparison.units),
    }


def _settings(
    trials: pd.DataFrame, factor: AblationFactor, reference: pd.Series, max_levels: int | None = None
) -> list[tuple[str, bool, pd.DataFrame]]:
    """``(label, holds the paper default, trials)`` per setting of ``factor``, in setting order.

    With ``max_levels``, a factor with more distinct numeric settings is binned on its first param
    into that many quantile bins (a sweep's continuous values are all distinct).
    """
    if trials.empty:
        return []
    values = trials[list(factor.params)]
    first = values[factor.params[0]]
    if max_levels is not None and len(values.drop_duplicates()) > max_levels and pd.api.types.is_numeric_dtype(first):
        bins = pd.qcut(first.astype(float), q=max_levels, duplicates="drop")
        return [
            (
                factor.range_label(group[factor.params[0]]),
                bool(interval.left < reference[factor.params[0]] <= interval.right),
                group,
            )
            for interval, group in trials.groupby(bins, observed=True, sort=True)
        ]
    default = tuple(reference[p] for p in factor.params)
    keyed = trials.assign(_setting=[tuple(row) for row in values.itertuples(index=False)])
    ordered = sorted(keyed.groupby("_setting", sort=False), key=lambda item: _sort_key(item[0]))
    return [
        (factor.label(setting), all(_same(a, b) for a, b in zip(setting, default)), group.drop(columns="_setting"))
        for setting, group in ordered
    ]


def _sort_key(setting: tuple) -> tuple:
    return tuple(
        (0, float(v)) if isinstance(v, (int, float, np.number)) and not isinstance(v, bool) else (1, str(v))
        for v in setting
    )
