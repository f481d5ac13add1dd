"""The paper's analyses over a sweep's finished trials: loss vs score, iso-resource comparisons, ablations.

Each function takes a :class:`~tracking.reports.data.SweepRuns` and returns tables (pandas) plus the
numbers the summary quotes; figures and files are made elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from grkv_core.config import EVICTION_ONLY, PAPER_DEFAULT
from tracking.reports.data import SCORE_PREFIX, SweepRuns
from tracking.reports.stats import Correlation, PairedComparison, compare_configs, correlate, pareto_front

MIB = 2**20
LOSS_METRICS = ("window_loss", "heldout_loss")


def _score_columns(runs: SweepRuns) -> list[str]:
    return [SCORE_PREFIX + task for task in runs.task_names]


# ---- loss vs performance ------------------------------------------------------------------------------
@dataclass
class LossPerformance:
    """Reconstruction discrepancy against downstream score, per configuration (paper App. G).

    ``table`` has one row per finished trial; ``correlations`` one entry per loss metric.
    """

    table: pd.DataFrame
    correlations: list[Correlation]
    score: str


def loss_performance(runs: SweepRuns, score: str = "mean_score",
                     losses: tuple[str, ...] = LOSS_METRICS) -> LossPerformance:
    """Correlate each reconstruction discrepancy metric with ``score`` across all finished trials."""
    trials = runs.trials
    present = [loss for loss in losses if loss in trials]
    shown = ["trial_number", "configuration", "method", "budget",
             *[name for name in ("lambda_k", "lambda_v", "window_size", "steps", "components") if name in trials],
             *present, score]
    table = trials[[column for column in shown if column in trials]].reset_index(drop=True)
    correlations = [correlate(trials[loss], trials[score], loss, score) for loss in present]
    return LossPerformance(table, correlations, score)


# ---- iso-memory and iso-prefill ------------------------------------------------------------------------
def _eviction_rows(trials: pd.DataFrame, compression_ratio: float) -> pd.DataFrame:
    at_budget = trials[(trials["merge"] == "none") & np.isclose(trials["compression_ratio"], compression_ratio)]
    tagged = at_budget[at_budget["baseline"] == EVICTION_ONLY]
    return tagged if len(tagged) else at_budget


def _cost(row: pd.Series, name: str) -> float:
    return float(row.get(name, np.nan))


def _iso_row(budget: float, label: str, method: str, rows: pd.DataFrame, score: str) -> dict:
    return {"budget": budget, "method": method, "configuration": label,
            "trials": ", ".join(str(n) for n in rows["trial_number"]),
            "kv_mib": rows["kv_bytes"].mean() / MIB if "kv_bytes" in rows else np.nan,
            "ttft_s": rows["ttft_s"].mean() if "ttft_s" in rows else np.nan,
            score: rows[score].mean()}


def _default_and_best(merged: pd.DataFrame, score: str) -> list[tuple[str, pd.DataFrame]]:
    """The paper-default trial among ``merged`` and the best-scoring one; one entry when they coincide."""
    scored = merged.dropna(subset=[score])
    if scored.empty:
        return []
    default = scored[scored["baseline"] == PAPER_DEFAULT]
    best = scored.loc[[scored[score].idxmax()]]
    if best["trial_number"].iloc[0] in set(default["trial_number"]):
        return [(f"paper default, best of {len(scored)}", default)]
    return ([("paper default", default)] if len(default) else []) + [(f"best of {len(scored)}", best)]


def representative_trials(runs: SweepRuns, score: str = "mean_score",
                          compression_ratio: float | None = None) -> list[tuple[str, pd.Series]]:
    """Merging configurations worth comparing: the paper default and the best (at ``compression_ratio``).

    Returns ``(label, trial)`` pairs. The best is chosen on the same data it is scored on, so its
    score (and any gain or p-value computed from it) is optimistic.
    """
    merged = runs.trials[runs.trials["merge"] != "none"]
    if compression_ratio is not None:
        merged = merged[np.isclose(merged["compression_ratio"], compression_ratio)]
    return [(label, rows.iloc[0]) for label, rows in _default_and_best(merged, score)]


@dataclass
class IsoResource:
    """Iso-memory (same persistent KV budget) and approximate iso-prefill (TTFT within tolerance) tables."""

    iso_memory: pd.DataFrame
    iso_prefill: pd.DataFrame
    ttft_tolerance: float
    notes: list[str] = field(default_factory=list)


def iso_resource(runs: SweepRuns, score: str = "mean_score", ttft_tolerance: float = 0.10) -> IsoResource:
    """Compare methods at equal persistent KV memory, and merging at budget b with eviction at b' > b.

    Parameters
    ----------
    runs : SweepRuns
    score : str
        The metric compared (higher is better).
    ttft_tolerance : float
        Relative TTFT difference still counted as "approximately equal prefill" (0.10 = within 10%).
    """
    trials, notes = runs.trials, []
    memory_rows = []
    for budget, at_budget in trials.groupby("budget", sort=True):
        ratio = at_budget["compression_ratio"].iloc[0]
        if "kv_bytes" in at_budget and at_budget["kv_bytes"].notna().any():
            kv = at_budget["kv_bytes"]
            spread = (kv.max() - kv.min()) / kv.max() if kv.max() > 0 else 0.0
            if spread > 0.01:
                notes.append(f"budget {budget:.0%}: persistent KV bytes differ by {spread:.1%} across trials")
        eviction = _eviction_rows(at_budget, ratio)
        budget_rows = [_iso_row(budget, "eviction only", runs.press_name, eviction, score)] if len(eviction) else []
        for merge, merged in at_budget[at_budget["merge"] != "none"].groupby("merge"):
            budget_rows += [_iso_row(budget, label, f"{runs.press_name}+{merge}", rows, score)
                            for label, rows in _default_and_best(merged, score)]
        eviction_score = eviction[score].mean() if len(eviction) else np.nan
        memory_rows += [{**row, "gain_vs_eviction": np.nan if row["configuration"] == "eviction only"
                         else row[score] - eviction_score} for row in budget_rows]
    iso_memory = pd.DataFrame(memory_rows)

    prefill_rows = []
    evictions = trials[trials["merge"] == "none"]
    for label, merged in representative_trials(runs, score):
        ttft = _cost(merged, "ttft_s")
        larger = evictions[evictions["compression_ratio"] < merged["compression_ratio"] - 1e-12]
        close = larger[(larger["ttft_s"] - ttft).abs() <= ttft_tolerance * ttft] if "ttft_s" in larger else larger[:0]
        row = {"merging": f"{merged['method']} {label}", "merging_trial": int(merged["trial_number"]),
               "merging_budget": merged["budget"], "merging_ttft_s": ttft,
               "merging_kv_mib": _cost(merged, "kv_bytes") / MIB, f"merging_{score}": merged[score]}
        if len(close):
            match = close.loc[(close["ttft_s"] - ttft).abs().idxmin()]
            row.update({"eviction_trial": int(match["trial_number"]), "eviction_budget": match["budget"],
                        "eviction_ttft_s": match["ttft_s"], "eviction_kv_mib": _cost(match, "kv_bytes") / MIB,
                        f"eviction_{score}": match[score], "eviction_minus_merging": match[score] - merged[score],
                        "kv_ratio": _cost(match, "kv_bytes") / _cost(merged, "kv_bytes")})
        else:
            hint = "" if "compression_ratio" in runs.search_space else (
                "; search compression_ratio (with merge 'none') to get eviction runs at other budgets")
            notes.append(f"iso-prefill: no eviction-only trial at a budget above {merged['budget']:.0%} has a TTFT "
                         f"within {ttft_tolerance:.0%} of trial {int(merged['trial_number'])} ({ttft:.3g} s){hint}")
        prefill_rows.append(row)
    return IsoResource(iso_memory, pd.DataFrame(prefill_rows), ttft_tolerance, notes)


@dataclass
class TradeOff:
    """Score against one cost over all finished trials, with the Pareto-optimal trials flagged."""

    cost: str
    cost_label: str
    points: pd.DataFrame
    score: str


def trade_off(runs: SweepRuns, cost: str, cost_label: str, scale: float = 1.0,
              score: str = "mean_score") -> TradeOff:
    """Trials as (cost / ``scale``, score) points; ``pareto`` marks those no other trial beats on both."""
    columns = ["trial_number", "configuration", "method", "budget", cost, score]
    points = runs.trials[[c for c in columns if c in runs.trials]].copy()
    if cost not in points:
        points[cost] = np.nan
    points["cost"] = points[cost] / scale
    points["pareto"] = False
    points.iloc[pareto_front(points, maximize=[score], minimize=["cost"]), points.columns.get_loc("pareto")] = True
    return TradeOff(cost, cost_label, points.reset_index(drop=True), score)


# ---- ablations ------------------------------------------------------------------------------------------
PARAM_SYMBOLS = {"lambda_k": "λk", "lambda_v": "λv", "beta": "β", "steps": "S", "window_size": "m"}
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
        return ", ".join(f"{PARAM_SYMBOLS.get(p, p)}={_param_text(p, v)}" for p, v in zip(self.params, values))

    def range_label(self, values: pd.Series) -> str:
        """A binned setting, named by the range of its first param's values."""
        param = self.params[0]
        return (f"{PARAM_SYMBOLS.get(param, param)} ∈ [{_param_text(param, values.min())}, "
                f"{_param_text(param, values.max())}]")

    def restricted_to(self, params: list[str]) -> "AblationFactor":
        """The same factor over only the params this sweep searched (e.g. λ_k alone)."""
        return AblationFactor(self.title, tuple(p for p in self.params if p in params))


ABLATION_FACTORS = (
    AblationFactor("Regularization strength (λ = λ_k = λ_v)", ("lambda_k", "lambda_v")),
    AblationFactor("Fixed retained-token ratio (β)", ("beta",)),
    AblationFactor("Update steps (S)", ("steps",)),
    AblationFactor("Surrogate window size (m)", ("window_size",)),
    AblationFactor("Fixed sink tokens (n_sink)", ("n_sink",)),
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
    if isinstance(left, (float, int, np.floating, np.integer)) and isinstance(right, (float, int, np.floating, np.integer)):
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
    (trials averaged), ``trials``, one column per task, ``avg`` and ``better`` (tasks where the row
    beats the eviction-only base press; NaN without one).
    """

    table: pd.DataFrame
    reference_trial: int | None
    base_trial: int | None
    notes: list[str] = field(default_factory=list)


def ablation_table(runs: SweepRuns, factors: tuple[AblationFactor, ...] = ABLATION_FACTORS,
                   score: str = "mean_score", max_levels: int = 6) -> AblationTable:
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
        return AblationTable(pd.DataFrame(), None, None,
                             ["no paper_default trial in this sweep: nothing to hold the other hyperparameters at"])
    reference = reference.iloc[0]
    merged = trials[(trials["merge"] == reference["merge"])
                    & np.isclose(trials["compression_ratio"], reference["compression_ratio"])]
    tunable = [name for name in runs.search_space if name != "compression_ratio" and name in trials]
    base = _eviction_rows(trials, reference["compression_ratio"])
    task_columns = _score_columns(runs)
    base_scores = base[task_columns].mean() if len(base) else None
    if base_scores is None:
        notes.append("no eviction-only trial at the paper default's budget: the Better column is empty")
    rows = []
    for factor in factors:
        factor = factor.restricted_to(tunable)
        if not factor.params:
            continue
        held = [p for p in tunable if p not in factor.params and pd.notna(reference.get(p))]
        holds = np.array([all(_same(trial[p], reference[p]) for p in held) for _, trial in merged.iterrows()], dtype=bool)
        at_defaults = merged.loc[holds]
        settings, held_label = _settings(at_defaults, factor, reference), "at defaults"
        if len(settings) < 2:
            settings, held_label = _settings(merged, factor, reference, max_levels), "varied"
            notes.append(f"{factor.title}: no trials vary it alone; rows average over the other hyperparameters")
        for label, is_default, group in settings:
            task_means = group[task_columns].mean()
            rows.append({
                "factor": factor.title, "setting": label, "default": is_default, "held": held_label,
                "n": len(group), "trials": ", ".join(str(n) for n in group["trial_number"]),
                **task_means.rename(lambda c: c.removeprefix(SCORE_PREFIX)).to_dict(),
                "avg": group[score].mean(),
                "better": int((task_means > base_scores).sum()) if base_scores is not None else np.nan,
            })
    return AblationTable(pd.DataFrame(rows), int(reference["trial_number"]),
                         int(base.iloc[0]["trial_number"]) if len(base) else None, notes)


def _settings(trials: pd.DataFrame, factor: AblationFactor, reference: pd.Series,
              max_levels: int | None = None) -> list[tuple[str, bool, pd.DataFrame]]:
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
        return [(factor.range_label(group[factor.params[0]]), bool(interval.left < reference[factor.params[0]]
                                                                  <= interval.right), group)
                for interval, group in trials.groupby(bins, observed=True, sort=True)]
    default = tuple(reference[p] for p in factor.params)
    keyed = trials.assign(_setting=[tuple(row) for row in values.itertuples(index=False)])
    ordered = sorted(keyed.groupby("_setting", sort=False), key=lambda item: _sort_key(item[0]))
    return [(factor.label(setting), all(_same(a, b) for a, b in zip(setting, default)), group.drop(columns="_setting"))
            for setting, group in ordered]


def _sort_key(setting: tuple) -> tuple:
    return tuple((0, float(v)) if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
                 else (1, str(v)) for v in setting)


# ---- multi-seed significance ----------------------------------------------------------------------------
def tidy_task_scores(runs: SweepRuns) -> pd.DataFrame:
    """Per-task scores as a tidy table ``config, seed, task, score, trial_number``.

    ``config`` is the baseline name for baseline trials (so tables from sweeps run with different data
    seeds line up) and ``trial N`` otherwise; ``seed`` is the sweep's ``data.seed``.
    """
    columns = _score_columns(runs)
    long = runs.trials.melt(id_vars=["configuration", "trial_number"], value_vars=columns,
                            var_name="task", value_name="score").dropna(subset=["score"])
    long["task"] = long["task"].str.removeprefix(SCORE_PREFIX)
    long["seed"] = runs.data_seed
    return long.rename(columns={"configuration": "config"})[["config", "seed", "task", "score", "trial_number"]]


def significance(runs: SweepRuns, score: str = "mean_score", n_resamples: int = 100_000,
                 seed: int = 0) -> tuple[list[PairedComparison], list[str]]:
    """Paper default and best merging trial at the base's budget, each against the eviction-only base.

    Returns the comparisons and notes (e.g. which could not be made). With one data seed the standard
    deviations are NaN; pass several sweeps' :func:`tidy_task_scores` to :func:`compare_configs` for
    the paper's multi-seed version.
    """
    base = runs.baseline_trial(EVICTION_ONLY)
    if base is None:
        return [], ["no eviction_only trial: nothing to test merging against"]
    if not runs.task_names:
        return [], ["no per-task scores (score.<task> metrics) to pair"]
    treatments = representative_trials(runs, score, base["compression_ratio"])
    if not treatments:
        return [], [f"no merging trial at the eviction_only trial's budget ({base['budget']:.0%})"]
    tidy = tidy_task_scores(runs)
    control_name = f"{EVICTION_ONLY} (trial {int(base['trial_number'])})"
    control = tidy[tidy["trial_number"] == base["trial_number"]].assign(config=control_name)
    comparisons = []
    for label, trial in treatments:
        treatment_name = f"{label} (trial {int(trial['trial_number'])})"
        treatment = tidy[tidy["trial_number"] == trial["trial_number"]].assign(config=treatment_name)
        comparisons.append(compare_configs(pd.concat([treatment, control]), treatment_name, control_name,
                                           n_resamples=n_resamples, seed=seed))
    return comparisons, []
