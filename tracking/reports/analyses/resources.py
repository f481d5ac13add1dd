"""Iso-resource comparisons: methods at equal persistent KV memory, merging at budget b against eviction at every
budget b' >= b (and at about the same prefill time), and score against one cost with its Pareto front."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from tracking.reports.analyses.anchors import default_and_best, eviction_rows, tuning_scores
from tracking.reports.analyses.metrics import best_index, budget_text, higher_is_better
from tracking.reports.data import SweepRuns
from tracking.reports.stats import pareto_front
from workers.names import FULL_STAGE, TEST_STAGE

MIB = 2**20


def _cost(row: pd.Series, name: str) -> float:
    return float(row.get(name, np.nan))


def _iso_row(budget: float, label: str, method: str, rows: pd.DataFrame, score: str) -> dict:
    return {
        "budget": budget,
        "method": method,
        "configuration": label,
        "trials": ", ".join(str(n) for n in rows["trial_number"]),
        "kv_mib": rows["kv_bytes"].mean() / MIB if "kv_bytes" in rows else np.nan,
        "ttft_s": rows["ttft_s"].mean() if "ttft_s" in rows else np.nan,
        score: rows[score].mean(),
    }


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
        eviction = eviction_rows(at_budget, at_budget["budget"].iloc[0])
        if len(eviction):
            points.append(_point(eviction.iloc[0], "eviction only", True, score))
        for _, merged in at_budget[at_budget["merge"] != "none"].groupby("merge"):
            best = best_index(merged["_selection"], score)
            if stage == TEST_STAGE:
                labelled = [(row["configuration"].replace("_", " "), row) for _, row in merged.iterrows()]
            else:
                labelled = [(label, rows.iloc[0]) for label, rows in default_and_best(merged, score)]
            points += [_point(row, label, row.name == best, score) for label, row in labelled]
    columns = [
        "label",
        "method",
        "configuration",
        "trial_number",
        "budget",
        "compression_ratio",
        "is_eviction",
        "selected",
        "kv_mib",
        "prefill_s",
        "ttft_s",
        score,
    ]
    return stage, pd.DataFrame(points, columns=columns)


def _point(row: pd.Series, label: str, selected: bool, score: str) -> dict:
    return {
        "label": label,
        "method": row["method"],
        "configuration": row["configuration"],
        "trial_number": row["trial_number"],
        "budget": row["budget"],
        "compression_ratio": row["compression_ratio"],
        "is_eviction": row["merge"] == "none",
        "selected": bool(selected),
        "kv_mib": _cost(row, "kv_bytes") / MIB,
        "prefill_s": _cost(row, "prefill_s"),
        "ttft_s": _cost(row, "ttft_s"),
        score: _cost(row, score),
    }


def _side(prefix: str, point: pd.Series, score: str) -> dict:
    return {
        f"{prefix}_configuration": point["configuration"],
        f"{prefix}_trial": point["trial_number"],
        f"{prefix}_budget": point["budget"],
        f"{prefix}_kv_mib": point["kv_mib"],
        f"{prefix}_prefill_s": point["prefill_s"],
        f"{prefix}_ttft_s": point["ttft_s"],
        f"{prefix}_{score}": point[score],
    }


def _pair(merging: pd.Series, eviction: pd.Series, score: str) -> dict:
    return {
        **_side("eviction", eviction, score),
        "eviction_minus_merging": eviction[score] - merging[score],
        "kv_ratio": eviction["kv_mib"] / merging["kv_mib"],
        "prefill_ratio": eviction["prefill_s"] / merging["prefill_s"],
        "ttft_gap": (eviction["ttft_s"] - merging["ttft_s"]) / merging["ttft_s"],
    }


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
        pairs = [
            {**merging_columns, **_pair(merging, eviction, score)}
            for _, eviction in evictions.iterrows()
            if eviction["budget"] >= merging["budget"] - 1e-12
        ]
        cross += pairs
        close = [
            pair
            for pair in pairs
            if pair["eviction_budget"] > merging["budget"] + 1e-12 and abs(pair["ttft_gap"]) <= ttft_tolerance
        ]
        if close:
            prefill.append(min(close, key=lambda pair: abs(pair["ttft_gap"])))
        else:
            prefill.append(merging_columns)
            if np.isnan(merging["ttft_s"]):
                continue  # NOTE: a bounded cache's stream has no prefill to compare
            if stage == TEST_STAGE:
                hint = "; list larger budgets in test.eviction_ratios to test eviction there"
            else:
                hint = (
                    ""
                    if "compression_ratio" in runs.search_space
                    else ("; search compression_ratio (with merge 'none') to get eviction runs at other budgets")
                )
            notes.append(
                f"iso-prefill: no eviction-only trial at a budget above {budget_text(merging['budget'])} has a TTFT "
                f"within {ttft_tolerance:.0%} of {merging_columns['merging']} ({merging['ttft_s']:.3g} s)"
                f"{hint}"
            )
    return IsoResource(
        _iso_memory(runs, score, notes),
        stage,
        points,
        pd.DataFrame(cross),
        pd.DataFrame(prefill),
        ttft_tolerance,
        notes,
    )


def _iso_memory(runs: SweepRuns, score: str, notes: list[str]) -> pd.DataFrame:
    """Full stage, per budget: eviction only, and per merger its paper default and best trial."""
    rows = []
    for budget, at_budget in runs.trials.groupby("budget", sort=True):
        if "kv_bytes" in at_budget and at_budget["kv_bytes"].notna().any():
            kv = at_budget["kv_bytes"]
            spread = (kv.max() - kv.min()) / kv.max() if kv.max() > 0 else 0.0
            if spread > 0.01:
                notes.append(f"budget {budget_text(budget)}: persistent KV bytes differ by {spread:.1%} across trials")
        eviction = eviction_rows(at_budget, budget)
        budget_rows = [_iso_row(budget, "eviction only", runs.press_name, eviction, score)] if len(eviction) else []
        for merge, merged in at_budget[at_budget["merge"] != "none"].groupby("merge"):
            budget_rows += [
                _iso_row(budget, label, f"{runs.press_name}+{merge}", rows, score)
                for label, rows in default_and_best(merged, score)
            ]
        eviction_score = eviction[score].mean() if len(eviction) else np.nan
        rows += [
            {
                **row,
                "gain_vs_eviction": np.nan if row["configuration"] == "eviction only" else row[score] - eviction_score,
            }
            for row in budget_rows
        ]
    return pd.DataFrame(rows)


@dataclass
class TradeOff:
    """Score against one cost over the full-stage trials, with the Pareto-optimal trials flagged."""

    cost: str
    cost_label: str
    points: pd.DataFrame
    score: str


def trade_off(runs: SweepRuns, cost: str, cost_label: str, scale: float = 1.0, score: str = "mean_score") -> TradeOff:
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
