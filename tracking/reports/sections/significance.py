"""The paired significance section: merging against eviction only (and the paper and library defaults), on the
held-out test samples when the sweep has them, on each compared metric."""

from __future__ import annotations

import pandas as pd

from tracking.reports import figures
from tracking.reports.analyses.metrics import budget_text, higher_is_better
from tracking.reports.analyses.significance import Significance, significance
from tracking.reports.data import SweepRuns
from tracking.reports.options import ReportOptions
from tracking.reports.render import P_VALUE, Section, TableWriter, formatted, metric_text
from tracking.reports.sections.words import direction, tie_line
from tracking.reports.stats import MAX_EXACT_SIGN_FLIP_UNITS, PairedComparison
from workers.names import TEST_STAGE


def significance_section(runs: SweepRuns, writer: TableWriter, options: ReportOptions, metrics: list[str]) -> Section:
    results = [significance(runs, metric, options.bootstrap_resamples, options.seed) for metric in metrics]
    score = results[0]
    # NOTE: a sweep tuned on an answer metric picks its winner by that metric, not by the score: both are told.
    tuned_on = next((result for result in results[1:] if result.metric == runs.objectives[0].metric), None)
    resamples = f"{options.bootstrap_resamples:,}"
    if score.stage == TEST_STAGE:
        section = Section(
            "Paired significance on the held-out test samples",
            lines=[
                f"On {score.test_samples} held-out test samples (disjoint from the tuning samples that chose these "
                "configurations): each confirmed merging configuration against eviction only and against the paper "
                "and library defaults at its budget, paired per test sample (the mean score of its questions, in "
                "points; the sample's answer metrics), on each of " + ", ".join(metrics) + "; percentile "
                f"bootstrap over the samples with {resamples} resamples and a two-sided sign-flip test (exact over all "
                f"2^n sign assignments up to {MAX_EXACT_SIGN_FLIP_UNITS} samples, else {resamples} random ones).",
                *_held_out_lines(score, options.score),
                *(_held_out_lines(tuned_on, tuned_on.metric, winners_only=True) if tuned_on is not None else []),
            ],
        )
    else:
        unit = next((result.comparisons[0].unit for result in results if result.comparisons), "task")
        section = Section(
            "Paired significance on the tuning samples",
            lines=[
                f"Paired differences per {unit} on the tuning samples: percentile bootstrap with {resamples} resamples "
                f"and a two-sided sign-flip test (exact over all 2^n sign assignments up to "
                f"{MAX_EXACT_SIGN_FLIP_UNITS} "
                f"{unit}s, else {resamples} random ones; seed {runs.data_seed} only; give "
                "tracking.reports.compare_configs a tidy table from several sweeps for the multi-seed version).",
                "No test stage: the best trial was selected and evaluated on the same samples (selection bias), so its "
                "gain and p-value are optimistic; only the paper default, fixed before the sweep, is tested without "
                "it.",
            ],
        )
    section.lines += list(dict.fromkeys(note for result in results for note in result.notes))
    compared = [result for result in results if result.comparisons]
    for result in compared:
        section.lines += _comparison_lines(result)
    if not compared:
        return section
    table = pd.DataFrame([_comparison_row(c) for result in compared for c in result.comparisons])
    display = formatted(
        table,
        {
            "control_value": "{:.4g}",
            "treatment_value": "{:.4g}",
            "difference": "{:+.4g}",
            "ci_low": "{:+.4g}",
            "ci_high": "{:+.4g}",
            "p_value": P_VALUE,
        },
        {
            "control_value": "control",
            "treatment_value": "treatment",
            "difference": "Δ (mean)",
            "ci_low": "CI low",
            "ci_high": "CI high",
            "p_value": "p",
            "p_exact": "exact p",
            "better_units": "better",
        },
    )
    writer.table("significance", table, display)
    unit = compared[0].comparisons[0].unit
    section.tables.append((f"Treatment vs control, paired per {unit} (Δ = treatment − control)", display))
    for result in compared:
        if not result.tied:
            name = f"{unit}_differences" + ("" if result.metric == options.score else f"_{result.metric}")
            section.figures.append(figures.paired_difference_figure(result.comparisons, writer.path(f"{name}.png")))
    return section


def _comparison_lines(result: Significance) -> list[str]:
    """Each comparison on ``result.metric`` in words; a metric tied in every comparison gets one line."""
    if result.tied:
        unit = result.comparisons[0].unit
        return [
            tie_line(
                result.metric,
                f"on every {unit} in each of the {len(result.comparisons)} comparisons (every paired difference is 0)",
            )
        ]
    return [_comparison_line(c, result.metric) for c in result.comparisons]


def _comparison_line(c: PairedComparison, metric: str) -> str:
    """``treatment vs control: metric +0.02 (lower is better), 95% CI [..], p = ..: worse``."""
    if c.tied:
        return f"{c.treatment} vs {c.control}: {metric} identical on every one of the {len(c.units)} {c.unit}s"
    return (
        f"{c.treatment} vs {c.control}: {metric} {metric_text(metric, c.gain, signed=True)} "
        f"({direction(metric)}), "
        f"{c.ci.confidence:.0%} CI [{metric_text(metric, c.ci.low, signed=True)}, "
        f"{metric_text(metric, c.ci.high, signed=True)}], {'exact' if c.p_exact else 'sampled'} "
        f"p = {c.p_value:.3g}, better on {c.better_units}/{len(c.units)} {c.unit}s: {c.verdict}"
    )


def _held_out_lines(result: Significance, score: str, winners_only: bool = False) -> list[str]:
    """Each confirmed configuration's tuning and held-out values of ``score`` (unless ``winners_only``), then the
    verdict on each budget's tuned winner by that metric."""
    tuning, test = f"tuning_{score}", f"test_{score}"

    def value(number: float, signed: bool = False) -> str:
        return metric_text(score, number, signed)

    lines = (
        []
        if winners_only
        else [
            f"{row['configuration']} ({row['method']}, {budget_text(row['budget'])}): {value(row[tuning])} on the "
            f"tuning samples, {value(row[test])} on the held-out test samples ({value(row['change'], True)})"
            for _, row in result.held_out.iterrows()
        ]
    )
    sign = 1.0 if higher_is_better(score) else -1.0  # NOTE: sign * change < 0 is a change for the worse
    for _, winner in result.tuned_winners.iterrows():
        verdict = (
            "worse on the held-out samples than on the samples that selected it"
            if sign * winner["change"] < 0
            else "no worse on the held-out samples than on the samples that selected it"
        )
        measure = "score" if score == "mean_score" else score
        lines.append(
            f"The tuned winner at {budget_text(winner['budget'])}, {winner['configuration']} (best tuning {measure} of "
            f"the confirmed merging configurations there, {value(winner[tuning])}), scores "
            f"{value(winner[test])} on the held-out test samples ({value(winner['change'], True)}): "
            f"{verdict}."
        )
    return lines


def _comparison_row(comparison: PairedComparison) -> dict:
    return {
        "metric": comparison.metric,
        "treatment": comparison.treatment,
        "control": comparison.control,
        "unit": comparison.unit,
        "seeds": len(comparison.seeds),
        "units": len(comparison.units),
        "control_value": comparison.control_mean,
        "treatment_value": comparison.treatment_mean,
        "difference": comparison.gain,
        "ci_low": comparison.ci.low,
        "ci_high": comparison.ci.high,
        "confidence": comparison.ci.confidence,
        "p_value": comparison.p_value,
        "p_exact": comparison.p_exact,
        "better_units": f"{comparison.better_units}/{len(comparison.units)}",
        "verdict": comparison.verdict,
    }
