"""The efficiency, memory and iso-resource section: iso-memory, budgets, cross-budget and iso-prefill comparisons
on each compared metric, and the cost trade-offs' Pareto fronts."""

from __future__ import annotations

import pandas as pd

from tracking.reports import figures
from tracking.reports.analyses.metrics import budget_text
from tracking.reports.analyses.resources import MIB, IsoResource, budget_points, trade_off
from tracking.reports.data import SweepRuns
from tracking.reports.options import ReportOptions
from tracking.reports.render import BUDGET, Section, TableWriter, formatted, metric_name, metric_spec, metric_text
from tracking.reports.sections.words import direction, stage_words
from workers.names import TEST_STAGE


def resource_section(
    runs: SweepRuns,
    results: dict[str, IsoResource],
    colors: dict[str, str],
    writer: TableWriter,
    options: ReportOptions,
) -> Section:
    """The iso-memory, budget and iso-prefill comparisons on each compared metric (``results``, the score first);
    figures and Pareto fronts on the sweep's objective, and on the score where it varies."""
    score = options.score
    result = results[score]
    section = Section("Efficiency, memory and iso-resource trade-offs", lines=list(result.notes))
    for metric, compared in results.items():
        if len(results) > 1:
            section.lines.append(f"On {metric_name(metric)} ({metric}, {direction(metric)}):")
        section.lines += (
            _iso_memory_lines(compared, metric)
            + _budget_lines(runs, compared, metric)
            + _iso_prefill_lines(compared, metric)
        )
        _resource_tables(runs, compared, metric, "" if metric == score else f"_{metric}", section, writer)
    if len(result.points):
        lines = {metric: budget_points(runs, metric)[1] for metric in plotted_metrics(runs, score, result.points)}
        section.figures.append(figures.budget_figure(lines, result.stage, colors, writer.path("budgets.png")))
    trade_offs = [
        trade
        for metric in plotted_metrics(runs, score, runs.trials)
        for trade in (
            trade_off(runs, "kv_bytes", figures.axis_label("kv_bytes"), scale=MIB, score=metric),
            trade_off(runs, "ttft_s", figures.axis_label("ttft_s"), score=metric),
        )
    ]
    for trade in trade_offs:
        trade.points.to_csv(writer.path(f"tradeoff_{trade.score}_{trade.cost}.csv"), index=False)
        front = trade.points[trade.points["pareto"]].sort_values("cost")
        section.lines.append(
            f"Pareto front, {trade.score} vs {trade.cost_label}: trials "
            + (", ".join(str(int(n)) for n in front["trial_number"]) or "none (cost not logged)")
        )
    section.figures.append(figures.trade_off_figure(trade_offs, colors, writer.path("tradeoffs.png")))
    return section


def plotted_metrics(runs: SweepRuns, score: str, points: pd.DataFrame) -> list[str]:
    """What a figure of ``points`` plots (the full-stage trials for the trade-offs, :func:`budget_points` for the
    budgets): the sweep's first objective (what it optimised), then ``score`` where it differs and varies across
    ``points`` (a score every point ties on draws a flat line that separates no configuration)."""
    objective = runs.objectives[0].metric
    values = points[score].dropna() if score in points else pd.Series(dtype=float)
    return [objective] + ([score] if score != objective and values.nunique() > 1 else [])


def _resource_tables(
    runs: SweepRuns, result: IsoResource, metric: str, suffix: str, section: Section, writer: TableWriter
) -> None:
    """The iso-memory, budget, cross-budget and iso-prefill tables of one metric (files named with ``suffix``)."""
    spec = metric_spec(metric)
    memory_display = formatted(
        result.iso_memory,
        {
            "budget": BUDGET,
            "kv_mib": "{:.3f}",
            "ttft_s": "{:.3g}",
            metric: spec,
            "gain_vs_eviction": metric_spec(metric, signed=True),
        },
        {"kv_mib": "persistent KV (MiB)", "ttft_s": "TTFT (s)", "gain_vs_eviction": "Δ vs eviction"},
    )
    writer.table(f"iso_memory{suffix}", result.iso_memory, memory_display)
    points_display = formatted(
        result.points.drop(columns=["compression_ratio", "is_eviction"]),
        {
            "budget": BUDGET,
            "trial_number": "{:.0f}",
            "kv_mib": "{:.3f}",
            "prefill_s": "{:.3g}",
            "ttft_s": "{:.3g}",
            metric: spec,
        },
        {
            "trial_number": "trial",
            "kv_mib": "persistent KV (MiB)",
            "prefill_s": "prefill (s)",
            "ttft_s": "TTFT (s)",
            "selected": "on the line",
        },
    )
    writer.table(f"budgets{suffix}", result.points, points_display)
    cross_display = _pairs_display(result.cross_budget, metric)
    prefill_display = _pairs_display(result.iso_prefill, metric)
    writer.table(f"cross_budget{suffix}", result.cross_budget, cross_display)
    writer.table(f"iso_prefill{suffix}", result.iso_prefill, prefill_display)
    stage, what = stage_words(runs, result.stage), f"{metric} ({direction(metric)})"
    section.tables += [
        (f"Iso-memory on {what}: methods at the same persistent KV budget (full stage)", memory_display),
        (f"{what}, KV memory and prefill time per method and budget ({stage})", points_display),
        (f"{what}: merging at budget b vs eviction only at every budget b' ≥ b ({stage})", cross_display),
        (
            f"{what}, approximate iso-prefill: merging at budget b vs eviction at b' > b with TTFT "
            f"within ±{result.ttft_tolerance:.0%} ({stage})",
            prefill_display,
        ),
    ]


def _pairs_display(frame: pd.DataFrame, score: str) -> pd.DataFrame:
    """A merging-vs-eviction table (``IsoResource.cross_budget`` or ``iso_prefill``) as text."""
    formats = {
        "ttft_gap": "{:+.1%}",
        "eviction_minus_merging": metric_spec(score, signed=True),
        "kv_ratio": "{:.2f}",
        "prefill_ratio": "{:.2f}",
    }
    names = {
        "eviction_minus_merging": "eviction − merging",
        "kv_ratio": "KV ratio",
        "prefill_ratio": "prefill ratio",
        "ttft_gap": "TTFT gap",
    }
    for side in ("merging", "eviction"):
        formats.update(
            {
                f"{side}_trial": "{:.0f}",
                f"{side}_budget": BUDGET,
                f"{side}_kv_mib": "{:.3f}",
                f"{side}_prefill_s": "{:.3g}",
                f"{side}_ttft_s": "{:.3g}",
                f"{side}_{score}": metric_spec(score),
            }
        )
        names.update(
            {
                f"{side}_configuration": f"{side} configuration",
                f"{side}_trial": f"{side} trial",
                f"{side}_budget": f"{side} budget",
                f"{side}_kv_mib": f"{side} KV (MiB)",
                f"{side}_prefill_s": f"{side} prefill (s)",
                f"{side}_ttft_s": f"{side} TTFT (s)",
                f"{side}_{score}": f"{side} {score}",
            }
        )
    return formatted(frame, formats, names)


def _trial_text(result: IsoResource, number) -> str:
    """`` (trial N)`` after a full-stage label such as "best of 6"; test-stage labels name the configuration."""
    return "" if result.stage == TEST_STAGE or pd.isna(number) else f" (trial {int(number)})"


def _budget_lines(runs: SweepRuns, result: IsoResource, score: str) -> list[str]:
    """Each method's line across budgets, then each merging point on a line against eviction at b' ≥ b."""
    if result.points.empty:
        return []
    if result.stage == TEST_STAGE:
        lines = [
            f"Across budgets, on {runs.test_sample_count} held-out test samples (disjoint from the tuning "
            "samples that chose these configurations); at each budget a merger's line goes through its "
            "configuration best on the tuning samples."
        ]
    else:
        lines = [
            "Across budgets, on the tuning samples (no test stage): the best trial at each budget is selected "
            "on the samples it is scored on, so its score is optimistic."
        ]
    on_lines = result.points[result.points["selected"]]
    for method, rows in on_lines.groupby("method"):
        lines.append(
            f"{method}: "
            + ", ".join(
                f"{budget_text(row['budget'])} {metric_text(score, row[score])}"
                for _, row in rows.sort_values("budget").iterrows()
            )
        )
    selected = set(on_lines.loc[~on_lines["is_eviction"], "configuration"])
    for _, pair in result.cross_budget.iterrows():
        if pair["merging_configuration"] in selected:
            lines.append(
                f"{pair['merging']}{_trial_text(result, pair['merging_trial'])} at "
                f"{budget_text(pair['merging_budget'])}: {metric_text(score, pair[f'merging_{score}'])} vs eviction "
                f"only at {budget_text(pair['eviction_budget'])}: "
                f"{metric_text(score, pair[f'eviction_{score}'])} (eviction "
                f"{metric_text(score, pair['eviction_minus_merging'], signed=True)}) with "
                f"{pair['kv_ratio']:.2f}x the persistent KV"
                + (f" and {pair['prefill_ratio']:.2f}x the prefill time" if pd.notna(pair["prefill_ratio"]) else "")
            )
    return lines


def _iso_memory_lines(result: IsoResource, score: str) -> list[str]:
    if result.iso_memory.empty:
        return []
    lines = []
    for budget, rows in result.iso_memory.groupby("budget", sort=True):
        entries = [
            f"{row['method']} {row['configuration']} {metric_text(score, row[score])}"
            + (
                ""
                if pd.isna(row["gain_vs_eviction"]) or row["configuration"] == "eviction only"
                else f" ({metric_text(score, row['gain_vs_eviction'], signed=True)})"
            )
            for _, row in rows.iterrows()
        ]
        lines.append(
            f"Iso-memory at budget {budget_text(budget)} ({rows['kv_mib'].mean():.3g} MiB persistent KV): "
            + "; ".join(entries)
        )
    return lines


def _iso_prefill_lines(result: IsoResource, score: str) -> list[str]:
    if "eviction_budget" not in result.iso_prefill:
        return []
    matched = result.iso_prefill.dropna(subset=["eviction_budget"])
    return [
        f"Iso-prefill: {row['merging']}{_trial_text(result, row['merging_trial'])} at "
        f"{budget_text(row['merging_budget'])}, "
        f"TTFT {row['merging_ttft_s']:.3g} s: {metric_text(score, row[f'merging_{score}'])} vs eviction only"
        f"{_trial_text(result, row['eviction_trial'])} at {budget_text(row['eviction_budget'])}, TTFT "
        f"{row['eviction_ttft_s']:.3g} s, {row['kv_ratio']:.2f}x the persistent KV: "
        f"{metric_text(score, row[f'eviction_{score}'])} "
        f"(eviction {metric_text(score, row['eviction_minus_merging'], signed=True)})"
        for _, row in matched.iterrows()
    ]
