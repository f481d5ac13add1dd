"""The paper's analyses over a sweep's runs: loss vs performance, screening, iso-resource comparisons, ablations,
significance, the score per needle depth.

Performance is the score and the answer metrics, which see what the binary score ties on (``PERFORMANCE_METRICS``);
every metric's direction comes from ``grkv_core.config.HIGHER_IS_BETTER`` (``higher_is_better``).

Each function takes a :class:`~tracking.reports.data.SweepRuns` and returns tables (pandas) plus the
numbers the summary quotes; figures and files are made elsewhere. Every analysis uses the full-stage runs
(scored on the tuning samples) unless its docstring says otherwise: screening runs have no score, and the
held-out test stage is kept for the comparisons that decide (budgets and significance).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from grkv_core.config import ANSWER_METRICS, HIGHER_IS_BETTER, LOSS_METRICS, SCREENING_METRICS
from tracking.mlflow_tracker import DEPTH_SAMPLES_PREFIX, DEPTH_SCORE_PREFIX, SAMPLE_FIELDS
from tracking.names import EVICTION_ONLY, FULL_STAGE, PAPER_DEFAULT, PROMOTED_FROM_TAG, SAMPLER_PREFIX, TEST_STAGE
from tracking.reports.data import BUDGET_SEPARATOR, SCORE_PREFIX, SweepRuns
from tracking.reports.stats import (
    Correlation,
    PairedComparison,
    WithinSampleCorrelation,
    compare_configs,
    correlate,
    pareto_front,
    within_sample_correlation,
)

MIB = 2**20
SCREEN_PREFIX = "screen_"  # a promoted configuration's loss as its screening run measured it
# NOTE: the loader keeps every tag as a ``tag.<key>`` column.
PROMOTED_FROM_COLUMN = f"tag.{PROMOTED_FROM_TAG}"


# What a configuration is judged by: the score (0-100), and the answer metrics, continuous and measured on every
# run without decoding.
PERFORMANCE_METRICS = ("mean_score", *ANSWER_METRICS)


def _score_columns(runs: SweepRuns) -> list[str]:
    return [SCORE_PREFIX + task for task in runs.task_names]


def higher_is_better(metric: str) -> bool:
    """A metric's direction, from ``HIGHER_IS_BETTER`` (a per-task ``score.<task>`` is a score)."""
    return metric in HIGHER_IS_BETTER or metric.startswith(SCORE_PREFIX)


def performance_metrics(frame: pd.DataFrame) -> list[str]:
    """The ``PERFORMANCE_METRICS`` that ``frame`` holds a value of, the score first."""
    return [metric for metric in PERFORMANCE_METRICS if metric in frame and frame[metric].notna().any()]


def _best_index(values: pd.Series, metric: str):
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


# ---- loss vs performance ------------------------------------------------------------------------------
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


def loss_performance(runs: SweepRuns, metrics: tuple[str, ...] | None = None,
                     losses: tuple[str, ...] = LOSS_METRICS) -> LossPerformance:
    """Correlate each reconstruction loss with each performance metric over the full-stage runs: across the
    configurations, and within each tuning sample (per-sample rows of ``SweepRuns.trial_predictions``).

    ``metrics`` defaults to the ``PERFORMANCE_METRICS`` the runs logged.
    """
    trials = runs.trials
    metrics = list(metrics or performance_metrics(trials) or ["mean_score"])
    present = [loss for loss in losses if loss in trials]
    shown = ["trial_number", "configuration", "method", "budget",
             *[name for name in ("lambda_k", "lambda_v", "window_size", "steps", "components") if name in trials],
             *present, *metrics]
    table = trials[[column for column in shown if column in trials]].reset_index(drop=True)
    correlations = [correlate(trials[loss], trials[metric], loss, metric)
                    for metric in metrics if metric in trials for loss in present]
    samples = sample_table(runs.trial_predictions)
    within = [within_sample_correlation(samples, loss, metric)
              for metric in metrics for loss in present if samples[[loss, metric]].notna().all(axis=1).any()]
    return LossPerformance(table, correlations, metrics[0], within)


# ---- screening ----------------------------------------------------------------------------------------
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


def screening(runs: SweepRuns, score: str = "mean_score",
              losses: tuple[str, ...] = SCREENING_METRICS) -> Screening:
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
            notes.append(f"screening trials {int(by_proposal[key]['trial_number'])} and {number} proposed the same "
                         "configuration; a full run without a promoted_from tag is matched to the first")
        else:
            by_proposal[key] = run
    rows = []
    for _, trial in trials.iterrows():
        tagged = trial.get(PROMOTED_FROM_COLUMN)
        source = (by_number.get(int(tagged)) if isinstance(tagged, str)
                  else by_proposal.get(_proposal(trial, columns)))
        if source is not None:
            rows.append({"trial_number": trial["trial_number"], "screen_trial": source["trial_number"],
                         "configuration": trial["configuration"], "method": trial["method"],
                         "budget": trial["budget"], **{SCREEN_PREFIX + loss: source[loss] for loss in present},
                         score: trial.get(score, np.nan)})
    table = pd.DataFrame(rows, columns=["trial_number", "screen_trial", "configuration", "method", "budget",
                                        *[SCREEN_PREFIX + loss for loss in present], score])
    correlations = [correlate(table[SCREEN_PREFIX + loss], table[score], SCREEN_PREFIX + loss, score)
                    for loss in present]
    if len(screen) and not present:
        notes.append(f"the screening runs logged none of {', '.join(losses)}")
    return Screening(len(screen), LossPerformance(table, correlations, score), len(trials) - len(table), notes)


# ---- iso-memory, budgets and iso-prefill ----------------------------------------------------------------
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
    """The paper-default trial among ``merged`` and the best one on ``score``; one entry when they coincide."""
    if score not in merged:
        return []
    scored = merged.dropna(subset=[score])
    if scored.empty:
        return []
    default = scored[scored["baseline"] == PAPER_DEFAULT]
    best = scored.loc[[_best_index(scored[score], score)]]
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


def tuning_scores(runs: SweepRuns, score: str = "mean_score") -> pd.Series:
    """For each test-stage run, the ``score`` of the full-stage trial it confirms (NaN where there is none)."""
    by_number = runs.trials.set_index("trial_number")[score] if score in runs.trials else pd.Series(dtype=float)
    return runs.test_trials["trial_number"].map(by_number).astype(float)


def budget_points(runs: SweepRuns, score: str = "mean_score") -> tuple[str, pd.DataFrame]:
    """``score`` (any performance metric), KV memory and prefill time per method and budget: the points of one
    line per method.

    On the test stage when the sweep has one (every confirmed configuration and every eviction-only run,
    ``eviction_only@<ratio>`` giving the other budgets), on the full stage otherwise (the paper default and
    the best trial of each merger at each budget, and the eviction-only run). ``selected`` marks the points a
    method's line goes through: eviction only, and per merger and budget the configuration with the best score
    on the tuning samples (so on the test stage the selection never saw the samples the point is scored on).

    Returns
    -------
    (str, pandas.DataFrame)
        The stage used, and one row per point: ``label``, ``method``, ``configuration``, ``trial_number``,
        ``budget``, ``compression_ratio``, ``is_eviction``, ``selected``, ``kv_mib``, ``prefill_s``, ``ttft_s``,
        ``score``.
    """
    if runs.has_test_stage:
        stage, frame = TEST_STAGE, runs.test_trials.assign(_selection=tuning_scores(runs, score))
    else:
        stage, frame = FULL_STAGE, runs.trials.assign(_selection=runs.trials.get(score, np.nan))
    points = []
    for _, at_budget in frame.groupby("budget", sort=True):
        eviction = _eviction_rows(at_budget, at_budget["compression_ratio"].iloc[0])
        if len(eviction):
            points.append(_point(eviction.iloc[0], "eviction only", True, score))
        for _, merged in at_budget[at_budget["merge"] != "none"].groupby("merge"):
            best = _best_index(merged["_selection"], score)
            if stage == TEST_STAGE:
                labelled = [(row["configuration"].replace("_", " "), row) for _, row in merged.iterrows()]
            else:
                labelled = [(label, rows.iloc[0]) for label, rows in _default_and_best(merged, score)]
            points += [_point(row, label, row.name == best, score) for label, row in labelled]
    columns = ["label", "method", "configuration", "trial_number", "budget", "compression_ratio", "is_eviction",
               "selected", "kv_mib", "prefill_s", "ttft_s", score]
    return stage, pd.DataFrame(points, columns=columns)


def _point(row: pd.Series, label: str, selected: bool, score: str) -> dict:
    return {"label": label, "method": row["method"], "configuration": row["configuration"],
            "trial_number": row["trial_number"], "budget": row["budget"],
            "compression_ratio": row["compression_ratio"], "is_eviction": row["merge"] == "none",
            "selected": bool(selected), "kv_mib": _cost(row, "kv_bytes") / MIB, "prefill_s": _cost(row, "prefill_s"),
            "ttft_s": _cost(row, "ttft_s"), score: _cost(row, score)}


def _side(prefix: str, point: pd.Series, score: str) -> dict:
    return {f"{prefix}_configuration": point["configuration"], f"{prefix}_trial": point["trial_number"],
            f"{prefix}_budget": point["budget"], f"{prefix}_kv_mib": point["kv_mib"],
            f"{prefix}_prefill_s": point["prefill_s"], f"{prefix}_ttft_s": point["ttft_s"],
            f"{prefix}_{score}": point[score]}


def _pair(merging: pd.Series, eviction: pd.Series, score: str) -> dict:
    return {**_side("eviction", eviction, score),
            "eviction_minus_merging": eviction[score] - merging[score],
            "kv_ratio": eviction["kv_mib"] / merging["kv_mib"],
            "prefill_ratio": eviction["prefill_s"] / merging["prefill_s"],
            "ttft_gap": (eviction["ttft_s"] - merging["ttft_s"]) / merging["ttft_s"]}


@dataclass
class IsoResource:
    """Iso-memory, cross-budget and approximate iso-prefill comparisons.

    Attributes
    ----------
    iso_memory : pandas.DataFrame
        Full stage, per budget: eviction only, the paper default and the best trial, ``gain_vs_eviction``.
    stage : str
        The stage of ``points``, ``cross_budget`` and ``iso_prefill``: ``test`` when the sweep has a test stage.
    points : pandas.DataFrame
        :func:`budget_points`: one line per method across budgets.
    cross_budget : pandas.DataFrame
        Every merging point at budget b against the eviction-only point at every budget b' >= b: the merging
        point's ``merging_*`` columns, the eviction point's ``eviction_*`` columns, ``eviction_minus_merging``,
        ``kv_ratio`` and ``prefill_ratio`` (eviction over merging) and ``ttft_gap`` (relative TTFT difference).
    iso_prefill : pandas.DataFrame
        Per merging point, the row of ``cross_budget`` at b' > b whose TTFT is closest within
        ``ttft_tolerance`` (eviction columns NaN where none is).
    ttft_tolerance : float
    notes : list[str]
    """

    iso_memory: pd.DataFrame
    stage: str
    points: pd.DataFrame
    cross_budget: pd.DataFrame
    iso_prefill: pd.DataFrame
    ttft_tolerance: float
    notes: list[str] = field(default_factory=list)


def iso_resource(runs: SweepRuns, score: str = "mean_score", ttft_tolerance: float = 0.10) -> IsoResource:
    """Compare methods at equal persistent KV memory, and merging at budget b with eviction at every b' >= b.

    Parameters
    ----------
    runs : SweepRuns
    score : str
        The metric compared (any performance metric; its direction from ``higher_is_better``).
    ttft_tolerance : float
        Relative TTFT difference still counted as "approximately equal prefill" (0.10 = within 10%).
    """
    stage, points = budget_points(runs, score)
    notes = []
    cross, prefill = [], []
    evictions = points[points["is_eviction"]]
    for _, merging in points[~points["is_eviction"]].iterrows():
        merging_columns = {"merging": f"{merging['method']} {merging['label']}", **_side("merging", merging, score)}
        pairs = [{**merging_columns, **_pair(merging, eviction, score)}
                 for _, eviction in evictions.iterrows() if eviction["budget"] >= merging["budget"] - 1e-12]
        cross += pairs
        close = [pair for pair in pairs if pair["eviction_budget"] > merging["budget"] + 1e-12
                 and abs(pair["ttft_gap"]) <= ttft_tolerance]
        if close:
            prefill.append(min(close, key=lambda pair: abs(pair["ttft_gap"])))
        else:
            prefill.append(merging_columns)
            if stage == TEST_STAGE:
                hint = "; list larger budgets in test.eviction_ratios to test eviction there"
            else:
                hint = "" if "compression_ratio" in runs.search_space else (
                    "; search compression_ratio (with merge 'none') to get eviction runs at other budgets")
            notes.append(f"iso-prefill: no eviction-only trial at a budget above {merging['budget']:.0%} has a TTFT "
                         f"within {ttft_tolerance:.0%} of {merging_columns['merging']} ({merging['ttft_s']:.3g} s)"
                         f"{hint}")
    return IsoResource(_iso_memory(runs, score, notes), stage, points, pd.DataFrame(cross), pd.DataFrame(prefill),
                       ttft_tolerance, notes)


def _iso_memory(runs: SweepRuns, score: str, notes: list[str]) -> pd.DataFrame:
    """Full stage, per budget: eviction only, and per merger its paper default and best trial."""
    rows = []
    for budget, at_budget in runs.trials.groupby("budget", sort=True):
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
        rows += [{**row, "gain_vs_eviction": np.nan if row["configuration"] == "eviction only"
                  else row[score] - eviction_score} for row in budget_rows]
    return pd.DataFrame(rows)


@dataclass
class TradeOff:
    """Score against one cost over the full-stage trials, with the Pareto-optimal trials flagged."""

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
    better = {"maximize": [score], "minimize": ["cost"]} if higher_is_better(score) else {"minimize": [score, "cost"]}
    points.iloc[pareto_front(points, **better), points.columns.get_loc("pareto")] = True
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


# ---- significance ----------------------------------------------------------------------------------------
def tidy_task_scores(runs: SweepRuns) -> pd.DataFrame:
    """Per-task scores of the full-stage runs as a tidy table ``config, seed, task, score, trial_number``.

    ``config`` is the baseline name for baseline trials (so tables from sweeps run with different data
    seeds line up) and ``trial N`` otherwise; ``seed`` is the sweep's ``data.seed``.
    """
    columns = [column for column in _score_columns(runs) if column in runs.trials]
    long = runs.trials.melt(id_vars=["configuration", "trial_number"], value_vars=columns,
                            var_name="task", value_name="score").dropna(subset=["score"])
    long["task"] = long["task"].str.removeprefix(SCORE_PREFIX)
    long["seed"] = runs.data_seed
    return long.rename(columns={"configuration": "config"})[["config", "seed", "task", "score", "trial_number"]]


def tidy_sample_scores(runs: SweepRuns, metric: str = "mean_score") -> pd.DataFrame:
    """Per-sample ``metric`` of the test-stage runs as a tidy table ``run_id, seed, sample, <metric>``
    (:func:`sample_table`: ``mean_score`` is the mean of the sample's questions in points, 0-100)."""
    return sample_table(runs.test_predictions).assign(seed=runs.data_seed)[["run_id", "seed", "sample", metric]]


@dataclass
class Significance:
    """Paired tests of merging against the eviction-only base press (and the paper default).

    Attributes
    ----------
    metric : str
        What is compared: ``mean_score`` or an answer metric (direction from ``higher_is_better``).
    stage : str
        ``test``: every confirmed merging configuration against eviction only at its budget and against the
        paper default at its budget, paired per held-out test sample. ``full`` (no test stage): the paper
        default and the best trial at the base press's budget, paired per task on the tuning samples that also
        selected the best trial.
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


def significance(runs: SweepRuns, metric: str = "mean_score", n_resamples: int = 100_000,
                 seed: int = 0) -> Significance:
    """Paired bootstrap CI and sign-flip test of merging against the base press on ``metric`` (the score or an
    answer metric), on held-out samples when the sweep has a test stage.

    Without a test stage only the score is paired (per task: the answer metrics have no per-task values). With
    one data seed the standard deviations are NaN; pass several sweeps' :func:`tidy_task_scores` to
    :func:`compare_configs` for the paper's multi-seed version.
    """
    if runs.has_test_stage:
        return _test_significance(runs, metric, n_resamples, seed)
    return _tuning_significance(runs, metric, n_resamples, seed)


def _test_name(run: pd.Series) -> str:
    return f"{run['configuration']} ({run['method']}, {run['budget']:.0%})"


def _test_tidy(runs: SweepRuns, metric: str) -> pd.DataFrame:
    """:func:`tidy_sample_scores` with each test run's name (``_test_name``) as its ``config``."""
    samples = tidy_sample_scores(runs, metric)
    names = {run["run_id"]: _test_name(run) for _, run in runs.test_trials.iterrows()}
    return samples.assign(config=samples["run_id"].map(names))


def _test_comparison(tidy: pd.DataFrame, treatment: pd.Series, control: pd.Series, metric: str, n_resamples: int,
                     seed: int) -> PairedComparison:
    """Two test runs paired per held-out sample on ``metric``."""
    return compare_configs(tidy, _test_name(treatment), _test_name(control), unit="sample", metric=metric,
                           higher_is_better=higher_is_better(metric), n_resamples=n_resamples, seed=seed)


def _test_significance(runs: SweepRuns, metric: str, n_resamples: int, seed: int) -> Significance:
    test, notes = runs.test_trials, []
    tidy = _test_tidy(runs, metric)
    if tidy[metric].isna().all():
        return Significance(metric, TEST_STAGE, [], pd.DataFrame(), runs.test_sample_count,
                            [f"no test-stage run logged a per-sample {metric} (its predictions.json predates it)"])
    comparisons = []
    for _, treatment in test[test["merge"] != "none"].iterrows():
        same_budget = test[np.isclose(test["compression_ratio"], treatment["compression_ratio"])]
        eviction = _eviction_rows(same_budget, treatment["compression_ratio"])
        default = same_budget[(same_budget["baseline"] == PAPER_DEFAULT) & (same_budget["merge"] != "none")
                              & (same_budget["run_id"] != treatment["run_id"])]
        for kind, controls in (("eviction-only", eviction), ("paper-default", default)):
            if kind == "paper-default" and treatment["baseline"] == PAPER_DEFAULT:
                continue
            if controls.empty:
                notes.append(f"no {kind} test run at {treatment['budget']:.0%} to compare "
                             f"{_test_name(treatment)} with")
                continue
            try:
                comparisons.append(_test_comparison(tidy, treatment, controls.iloc[0], metric, n_resamples, seed))
            except (KeyError, ValueError) as error:
                notes.append(f"{_test_name(treatment)} vs {_test_name(controls.iloc[0])}: {error}")
    held_out = pd.DataFrame({"configuration": test["configuration"], "method": test["method"],
                             "budget": test["budget"], "merge": test["merge"],
                             f"tuning_{metric}": tuning_scores(runs, metric),
                             f"test_{metric}": test.get(metric, np.nan)})
    held_out = held_out.dropna(subset=[f"tuning_{metric}"]).assign(
        change=lambda frame: frame[f"test_{metric}"] - frame[f"tuning_{metric}"])
    held_out = held_out.sort_values(f"tuning_{metric}", ascending=not higher_is_better(metric),
                                    kind="stable").reset_index(drop=True)
    return Significance(metric, TEST_STAGE, comparisons, held_out, runs.test_sample_count, notes)


def _tuning_significance(runs: SweepRuns, metric: str, n_resamples: int, seed: int) -> Significance:
    """Without a test stage: the paper default and the best trial at the base's budget, paired per task."""
    def result(comparisons: list[PairedComparison], notes: list[str]) -> Significance:
        return Significance(metric, FULL_STAGE, comparisons, pd.DataFrame(), 0, notes)

    if metric != "mean_score":
        return result([], [f"no test stage: {metric} has no per-task values to pair (only the score does)"])
    base = runs.baseline_trial(EVICTION_ONLY)
    if base is None:
        return result([], ["no eviction_only trial: nothing to test merging against"])
    if not runs.task_names:
        return result([], ["no per-task scores (score.<task> metrics) to pair"])
    treatments = representative_trials(runs, metric, base["compression_ratio"])
    if not treatments:
        return result([], [f"no merging trial at the eviction_only trial's budget ({base['budget']:.0%})"])
    tidy = tidy_task_scores(runs)
    control_name = f"{EVICTION_ONLY} (trial {int(base['trial_number'])})"
    control = tidy[tidy["trial_number"] == base["trial_number"]].assign(config=control_name)
    comparisons = []
    for label, trial in treatments:
        treatment_name = f"{label} (trial {int(trial['trial_number'])})"
        treatment = tidy[tidy["trial_number"] == trial["trial_number"]].assign(config=treatment_name)
        comparisons.append(compare_configs(pd.concat([treatment, control]), treatment_name, control_name,
                                           n_resamples=n_resamples, seed=seed))
    return result(comparisons, [])


# ---- the headline comparison ---------------------------------------------------------------------------
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
    candidates = test[(test["merge"] != "none") & test["trial_number"].notna()
                      & ~test["test_of"].astype(str).str.contains(BUDGET_SEPARATOR, regex=False)]
    if candidates.empty:
        return None
    keys = [name for name in dict.fromkeys([runs.objectives[0].metric, metric]) if name in runs.trials]
    oriented = pd.DataFrame({name: tuning_scores(runs, name)[candidates.index] * (1 if higher_is_better(name) else -1)
                             for name in keys}, index=candidates.index).fillna(-np.inf)
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
    same_budget = runs.test_trials[np.isclose(runs.test_trials["compression_ratio"], winner["compression_ratio"])]
    eviction = _eviction_rows(same_budget, winner["compression_ratio"])
    if eviction.empty:
        return nothing(f"no eviction-only test run at {winner['budget']:.0%}", winner)
    tidy = _test_tidy(runs, metric)
    try:
        comparison = _test_comparison(tidy, winner, eviction.iloc[0], metric, n_resamples, seed)
    except (KeyError, ValueError):
        return nothing(f"the test runs logged no per-sample {metric} to pair", winner)
    return HeldOutFinding(metric, winner, eviction.iloc[0], comparison)


# ---- needle depth and the always-kept window ------------------------------------------------------------
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
    return DepthWindow(stage, table.rename(columns=lambda column: column.removeprefix(DEPTH_SCORE_PREFIX)),
                       {name: int(count) for name, count in samples.items() if pd.notna(count)})
