"""PNG figures of the report, drawn with matplotlib's object API (no pyplot, so no global backend state)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from tracking.reports.analyses.loss_performance import LossPerformance
from tracking.reports.analyses.metrics import budget_text
from tracking.reports.analyses.resources import TradeOff
from tracking.reports.analyses.screening import SCREEN_PREFIX
from tracking.reports.labels import label_points, thin_ticks
from tracking.reports.optuna_study import Importance, RebuiltStudy
from tracking.reports.render import metric_name, p_value_text
from tracking.reports.stats import PairedComparison
from workers.names import EVICTION_ONLY, LIBRARY_DEFAULT, PAPER_DEFAULT, TEST_STAGE

DPI = 120
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
BASELINE_MARKERS = {PAPER_DEFAULT: "*", EVICTION_ONLY: "s", LIBRARY_DEFAULT: "D"}
BASELINE_LABELS = {
    PAPER_DEFAULT: "paper default",
    EVICTION_ONLY: "eviction only (base press)",
    LIBRARY_DEFAULT: "library default",
}
LABELS = {
    "mean_score": "mean score (0-100)",
    "window_loss": "window reconstruction discrepancy (relative)",
    "heldout_loss": "held-out reconstruction discrepancy (relative)",
    "question_loss": "question reconstruction discrepancy (relative)",
    "ttft_s": "TTFT (s)",
    "prefill_s": "prefill time (s)",
    "kv_bytes": "persistent KV cache (MiB)",
    "decode_ms_per_token": "decode latency (ms/token)",
    "answer_nll": "answer NLL (nats, lower is better)",
    "answer_kl": "answer KL to the full cache (nats, lower is better)",
    "answer_top1": "answer top-1 agreement with the full cache",
    "score": "score (points)",
}


def axis_label(metric: str) -> str:
    if metric.startswith(SCREEN_PREFIX):
        return f"{axis_label(metric.removeprefix(SCREEN_PREFIX))}, screening run"
    return LABELS.get(metric, metric)


def method_colors(methods) -> dict[str, str]:
    """One colour per method, computed once per report and passed to every figure so they agree."""
    return {method: PALETTE[index % len(PALETTE)] for index, method in enumerate(sorted(set(methods)))}


def _save(figure: Figure, path: Path) -> Path:
    figure.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


def point_style(marker: str) -> dict:
    """How every figure draws a point of a marker: stars (the baselines' best) larger, all outlined."""
    return dict(marker=marker, s=160 if marker == "*" else 45, edgecolor="black", linewidth=0.5)


def _scatter_trials(
    ax, frame: pd.DataFrame, x: str, y: str, colors: dict[str, str], labelled: pd.Series | None = None
) -> None:
    """Trials as points coloured by method, baselines with their own markers, labelled by trial number.

    ``labelled`` (a boolean mask) limits the labels where many points share an x (e.g. one KV budget).
    """
    is_baseline = frame["configuration"].isin(list(BASELINE_MARKERS))
    for method, rows in frame.groupby("method"):
        for baseline, marker in [(None, "o"), *BASELINE_MARKERS.items()]:
            chosen = rows[~is_baseline[rows.index]] if baseline is None else rows[rows["configuration"] == baseline]
            if len(chosen):
                # Baselines, then eviction-only trials, are drawn last: many trials share one KV budget.
                layer = 5 if baseline else (4 if "+" not in method else 3)
                ax.scatter(chosen[x], chosen[y], color=colors[method], zorder=layer, **point_style(marker))
    shown = frame if labelled is None else frame[labelled | is_baseline]
    for _, row in shown.iterrows():
        if np.isfinite(row[x]) and np.isfinite(row[y]):
            ax.annotate(
                str(int(row["trial_number"])),
                (row[x], row[y]),
                xytext=(4, 3),
                textcoords="offset points",
                fontsize=7,
                color="dimgray",
            )


def _figure_legend(figure: Figure, colors: dict[str, str], frame: pd.DataFrame, extra: list[Line2D] = ()) -> None:
    """One legend under all panels, so it never hides a point; baseline markers only when drawn."""
    handles = [
        Line2D([], [], marker="o", linestyle="", color=color, markeredgecolor="black", label=method)
        for method, color in colors.items()
        if method in set(frame["method"])
    ]
    for baseline, marker in BASELINE_MARKERS.items():
        if (frame["configuration"] == baseline).any():
            handles.append(
                Line2D(
                    [],
                    [],
                    marker=marker,
                    linestyle="",
                    color="lightgray",
                    markeredgecolor="black",
                    markersize=12 if marker == "*" else 6,
                    label=BASELINE_LABELS[baseline],
                )
            )
    handles += extra
    figure.legend(handles=handles, fontsize=8, loc="outside lower center", ncols=min(len(handles), 4))


def spans_decades(values: pd.Series, decades: float = 2.0) -> bool:
    """Whether positive ``values`` span more than ``decades`` orders of magnitude (log axis wanted)."""
    finite = values[np.isfinite(values)]
    return bool(len(finite) > 1 and (finite > 0).all() and finite.max() / finite.min() > 10**decades)


def loss_performance_figure(
    result: LossPerformance,
    colors: dict[str, str],
    path: Path,
    title: str = "Reconstruction discrepancy vs downstream performance",
) -> Path:
    """One panel per correlation, a row per performance metric and a column per discrepancy: the metric against
    the discrepancy over the configurations, with Pearson/Spearman in the title."""
    table = result.table
    columns = list(dict.fromkeys(correlation.x for correlation in result.correlations))
    rows = list(dict.fromkeys(correlation.y for correlation in result.correlations))
    figure = Figure(figsize=(6.2 * len(columns), 5.2 * len(rows)), layout="constrained")
    for correlation in result.correlations:
        ax = figure.add_subplot(
            len(rows), len(columns), rows.index(correlation.y) * len(columns) + columns.index(correlation.x) + 1
        )
        _scatter_trials(ax, table, correlation.x, correlation.y, colors)
        points = table[[correlation.x, correlation.y]].dropna()
        log_x = spans_decades(points[correlation.x])
        if log_x:
            # One diverged configuration would otherwise squash every other point against the axis.
            ax.set_xscale("log")
        if np.isfinite(correlation.pearson_r):
            slope, intercept = np.polyfit(points[correlation.x], points[correlation.y], 1)
            span = (np.geomspace if log_x else np.linspace)(
                points[correlation.x].min(), points[correlation.x].max(), 50
            )
            ax.plot(span, slope * span + intercept, linestyle="--", color="gray", linewidth=1, zorder=2)
            ax.set_title(
                f"Pearson r = {correlation.pearson_r:+.3f} ({p_value_text(correlation.pearson_p)})\n"
                f"Spearman ρ = {correlation.spearman_rho:+.3f} ({p_value_text(correlation.spearman_p)}), "
                f"n = {correlation.n}",
                fontsize=9,
            )
        else:
            ax.set_title(f"no correlation: {correlation.note}", fontsize=9)
        ax.set_xlabel(axis_label(correlation.x))
        ax.set_ylabel(axis_label(correlation.y))
        ax.grid(alpha=0.3)
    _figure_legend(figure, colors, table, [Line2D([], [], linestyle="--", color="gray", label="least-squares fit")])
    figure.suptitle(f"{title} (labels: trial numbers)", fontsize=11)
    return _save(figure, path)


def trade_off_figure(trade_offs: list[TradeOff], colors: dict[str, str], path: Path) -> Path:
    """Each metric (a row) against each cost (a column), the Pareto front (best metric for the cost) drawn as a step
    line."""
    metrics = list(dict.fromkeys(trade.score for trade in trade_offs))
    costs = list(dict.fromkeys(trade.cost for trade in trade_offs))
    figure = Figure(figsize=(6.2 * len(costs), 5.2 * len(metrics)), layout="constrained")
    for trade in trade_offs:
        ax = figure.add_subplot(
            len(metrics), len(costs), metrics.index(trade.score) * len(costs) + costs.index(trade.cost) + 1
        )
        points = trade.points
        _scatter_trials(ax, points, "cost", trade.score, colors, labelled=points["pareto"])
        front = points[points["pareto"]].sort_values(["cost", trade.score])
        ax.step(front["cost"], front[trade.score], where="post", color="black", linewidth=1.2, zorder=2)
        ax.scatter(
            front["cost"], front[trade.score], s=160, facecolor="none", edgecolor="black", linewidth=1.4, zorder=4
        )
        ax.set_xlabel(trade.cost_label)
        ax.set_ylabel(axis_label(trade.score))
        ax.set_title(
            f"{axis_label(trade.score)} vs {trade.cost_label}: {len(front)} Pareto-optimal trial(s)", fontsize=9
        )
        ax.grid(alpha=0.3)
    _figure_legend(
        figure,
        colors,
        pd.concat([t.points for t in trade_offs]),
        [
            Line2D(
                [],
                [],
                color="black",
                marker="o",
                markerfacecolor="none",
                markersize=10,
                label="Pareto front (the best value for the cost)",
            )
        ],
    )
    figure.suptitle(
        "Trade-offs over all finished trials (labels: Pareto-optimal and baseline trial numbers)", fontsize=11
    )
    return _save(figure, path)


def history_figure(rebuilt: RebuiltStudy, colors: dict[str, str], path: Path) -> Path:
    """Each objective by trial number, the best so far as a step line, baselines as horizontal lines."""
    history = rebuilt.history().sort_values("trial_number")
    objectives = rebuilt.objectives
    figure = Figure(figsize=(7.5, 4.2 * len(objectives)), layout="constrained")
    for index, objective in enumerate(objectives):
        ax = figure.add_subplot(len(objectives), 1, index + 1)
        values = history[objective.metric]
        best = values.cummax() if objective.maximize else values.cummin()
        for method, rows in history.groupby("method"):
            ax.scatter(
                rows["trial_number"],
                rows[objective.metric],
                color=colors[method],
                s=25,
                zorder=3,
                label=f"trial: {method}",
            )
        ax.step(history["trial_number"], best, where="post", color="tab:red", label="best so far")
        for baseline, style in ((PAPER_DEFAULT, ":"), (EVICTION_ONLY, "--"), (LIBRARY_DEFAULT, "-.")):
            rows = history[history["baseline"] == baseline]
            if len(rows):
                ax.axhline(
                    rows[objective.metric].iloc[0],
                    color="gray",
                    linestyle=style,
                    label=f"{baseline.replace('_', ' ')} (trial {int(rows['trial_number'].iloc[0])})",
                )
        ax.set_xlabel("trial number")
        ax.set_ylabel(axis_label(objective.metric))
        ax.set_title(f"Optimisation history: {objective.metric} ({objective.direction})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(figure, path)


def importance_figure(importances: list[Importance], path: Path) -> Path:
    """Horizontal bars of normalised importances, one panel per objective."""
    figure = Figure(
        figsize=(6.5 * len(importances), 0.8 + 0.45 * max([len(i.importances) for i in importances] + [4])),
        layout="constrained",
    )
    for index, result in enumerate(importances):
        ax = figure.add_subplot(1, len(importances), index + 1)
        if result.importances:
            names = list(result.importances)[::-1]
            ax.barh(names, [result.importances[name] for name in names], color="tab:green")
            ax.set_xlabel("importance (normalised to sum to 1)")
        else:
            ax.text(0.5, 0.5, result.note or "no importances", ha="center", va="center", wrap=True, fontsize=9)
            ax.set_axis_off()
        ax.set_title(f"Hyperparameter importance for {result.objective.metric}\n{result.evaluator}", fontsize=9)
    return _save(figure, path)


NEGLIGIBLE_POINTS = 1e-9  # score differences (0-100 points) below this are rounding noise


# Beyond this many paired units the bars are sorted and unlabelled (held-out samples, not tasks).
MAX_LABELLED_UNITS = 30


def paired_difference_figure(comparisons: list[PairedComparison], path: Path) -> Path:
    """Per-unit (task or held-out sample) difference of the compared metric, with the mean and its bootstrap CI;
    bars green where the treatment is better (in the metric's direction)."""
    widest = max(len(comparison.units) for comparison in comparisons)
    figure = Figure(figsize=(min(max(6.0, 0.55 * widest + 2.5), 14.0), 3.6 * len(comparisons)), layout="constrained")
    for index, comparison in enumerate(comparisons):
        ax = figure.add_subplot(len(comparisons), 1, index + 1)
        labelled = len(comparison.units) <= MAX_LABELLED_UNITS
        differences = comparison.differences if labelled else tuple(sorted(comparison.differences))
        ax.bar(
            range(len(differences)),
            differences,
            color=["tab:green" if (d > 0) == comparison.higher_is_better else "tab:red" for d in differences],
        )
        ax.axhline(0, color="black", linewidth=0.8)
        ax.axhline(comparison.gain, color="tab:blue", linestyle="--", label=f"mean {comparison.gain:+.2f}")
        ax.axhspan(
            comparison.ci.low,
            comparison.ci.high,
            color="tab:blue",
            alpha=0.15,
            label=f"{comparison.ci.confidence:.0%} bootstrap CI [{comparison.ci.low:+.2f}, {comparison.ci.high:+.2f}]",
        )
        if labelled:
            ax.set_xticks(range(len(differences)), comparison.units, rotation=35, ha="right", fontsize=8)
        else:
            ax.set_xticks([])
            ax.set_xlabel(f"{len(differences)} {comparison.unit}s, sorted by difference")
        ax.set_ylabel(f"{axis_label(comparison.metric)} difference")
        test = "exact sign-flip" if comparison.p_exact else "sampled sign-flip"
        ax.set_title(
            f"{comparison.treatment} minus {comparison.control}: better on {comparison.better_units}/"
            f"{len(differences)} {comparison.unit}s, {test} p = {comparison.p_value:.3g}",
            fontsize=9,
        )
        extent = max(abs(value) for value in (*differences, comparison.ci.low, comparison.ci.high))
        if extent < NEGLIGIBLE_POINTS:
            # NOTE: identical scores on every unit; autoscaling would blow rounding noise up to 1e-17 ticks.
            ax.set_ylim(-1.0, 1.0)
        ax.legend(fontsize=8, loc="best")
        ax.grid(alpha=0.3, axis="y")
    return _save(figure, path)


def budget_figure(lines: dict[str, pd.DataFrame], stage: str, colors: dict[str, str], path: Path) -> Path:
    """Each metric (a row) against persistent KV memory and against prefill time, one line per method across budgets.

    The memory panels name each budget once, on their top axis; the prefill panels label a point with its budget
    where the label fits in the panel without overlapping another. No two labels overlap.

    Parameters
    ----------
    lines : dict[str, pandas.DataFrame]
        Per metric, in the rows' order, its :func:`~tracking.reports.analyses.resources.budget_points`. A method's
        line goes through its selected points (eviction only; per merger and budget the configuration best on that
        metric on the tuning samples); other confirmed configurations are drawn as lone points.
    stage : str
        The points' stage: ``test`` for the held-out samples, else the tuning samples.
    colors : dict[str, str]
        :func:`method_colors`.
    path : pathlib.Path
        Where the PNG goes.
    """
    figure = Figure(figsize=(12.4, 5.2 * len(lines)), layout="constrained")
    budget_axes, prefill_panels = [], []
    for row, (metric, points) in enumerate(lines.items()):
        for column, (cost, label) in enumerate((("kv_mib", "kv_bytes"), ("prefill_s", "prefill_s"))):
            ax = figure.add_subplot(len(lines), 2, 2 * row + column + 1)
            _budget_lines(ax, points, cost, metric, colors)
            ax.set_xlabel(axis_label(label))
            ax.set_ylabel(axis_label(metric))
            ax.grid(alpha=0.3)
            if cost == "kv_mib":
                budget_axes.append(_budget_axis(ax, points))
            else:
                prefill_panels.append((ax, points, metric))
    every = pd.concat(lines.values())
    _figure_legend(
        figure,
        colors,
        every.assign(configuration=np.where(every["is_eviction"], EVICTION_ONLY, every["configuration"])),
    )
    names = " and ".join(metric_name(metric) for metric in lines)
    samples = "held-out test samples" if stage == TEST_STAGE else "tuning samples (best selected on them)"
    figure.suptitle(
        f"{names[:1].upper()}{names[1:]} across KV budgets, on the {samples} (labels: budgets)", fontsize=11
    )
    # NOTE: labels are placed by measuring them, so the layout is computed once and then kept: the save must not
    # move an axis under labels that fitted it.
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    figure.set_layout_engine("none")
    renderer = canvas.get_renderer()
    for axis in budget_axes:
        thin_ticks(axis, renderer)
    for ax, points, metric in prefill_panels:
        # The lines' points first: where labels would collide, theirs are kept.
        ordered = points.sort_values("selected", ascending=False, kind="stable")
        budgets = [budget_text(budget) for budget in ordered["budget"]]
        label_points(ax, zip(budgets, ordered["prefill_s"], ordered[metric]), renderer, fontsize=7, color="dimgray")
    return _save(figure, path)


def _budget_lines(ax, points: pd.DataFrame, cost: str, metric: str, colors: dict[str, str]) -> None:
    """Each method's line through its selected points, and every point in its method's colour and marker."""
    for method, rows in points.groupby("method"):
        line = rows[rows["selected"]].sort_values("budget")
        ax.plot(line[cost], line[metric], color=colors[method], linewidth=1.4, zorder=2)
        for _, row in rows.iterrows():
            marker = "s" if row["is_eviction"] else BASELINE_MARKERS.get(row["configuration"], "o")
            ax.scatter(
                row[cost],
                row[metric],
                color=colors[method],
                **point_style(marker),
                alpha=1.0 if row["selected"] else 0.5,
                zorder=3,
            )


def _budget_axis(ax, points: pd.DataFrame):
    """The memory panel's top axis: one tick per budget, at its points' mean persistent KV memory."""
    known = points.dropna(subset=["kv_mib"])
    # Budgets that print alike (20.0% and 20.4%) share one tick: two ticks would print the same label twice.
    memory = known.groupby(known["budget"].map(budget_text))["kv_mib"].mean()
    top = ax.secondary_xaxis("top")
    top.set_ticks(memory.to_numpy(), memory.index.to_list())
    top.tick_params(labelsize=8)
    top.set_xlabel("KV budget (fraction of the cache kept)", fontsize=9)
    return top.xaxis
