"""The loss-performance and screening sections: reconstruction losses against performance, across configurations,
within samples, and for the configurations screening promoted."""

from __future__ import annotations

import numpy as np
import pandas as pd

from grkv_core.metrics import LOSS_METRICS
from grkv_core.options import OPTION_SYMBOLS
from tracking.reports import figures
from tracking.reports.analyses.loss_performance import LossPerformance
from tracking.reports.analyses.screening import Screening
from tracking.reports.render import (
    BUDGET,
    P_VALUE,
    SCORE_FORMAT,
    Section,
    TableWriter,
    formatted,
    metric_spec,
    metric_text,
    p_value_text,
)
from tracking.reports.sections.words import tie_line
from tracking.reports.stats import WithinSampleCorrelation


def _ties(values: pd.Series) -> bool:
    """At least two finite values, all equal."""
    finite = values.astype(float)[np.isfinite(values.astype(float))]
    return len(finite) > 1 and finite.min() == finite.max()


def loss_section(result: LossPerformance, colors: dict[str, str], writer: TableWriter) -> Section:
    metrics = list(dict.fromkeys(c.y for c in result.correlations))
    section = Section(
        "Loss–performance correlation",
        lines=[
            f"Over the {len(result.table)} full-stage trial(s): each reconstruction discrepancy against "
            f"{', '.join(metrics) or result.score}, across the configurations (Pearson and Spearman over each "
            "configuration's means) and within each tuning sample (Spearman ρ across the configurations on that "
            "sample, "
            "summarised over the samples: free of what makes one sample harder than another for every configuration)."
        ],
    )
    table_formats = {
        "budget": BUDGET,
        **{loss: "{:.4g}" for loss in LOSS_METRICS},
        **{metric: metric_spec(metric) for metric in metrics},
    }
    display = formatted(result.table, table_formats, {"trial_number": "trial", **OPTION_SYMBOLS})
    writer.table("loss_performance", result.table, display)
    correlations = pd.DataFrame([vars(c) for c in result.correlations])
    if correlations.empty:
        section.lines.append(f"No reconstruction discrepancy metric ({', '.join(LOSS_METRICS)}) was logged.")
        return section
    correlation_display = formatted(
        correlations, {"pearson_r": "{:+.3f}", "spearman_rho": "{:+.3f}", "pearson_p": P_VALUE, "spearman_p": P_VALUE}
    )
    writer.table("correlations", correlations, correlation_display)
    for metric in metrics:
        if _ties(result.table[metric]):
            tied_value = metric_text(metric, result.table[metric].dropna().iloc[0])
            section.lines.append(tie_line(metric, f"over the {len(result.table)} configurations ({tied_value} each)"))
        else:
            section.lines += [_correlation_line(c) for c in result.correlations if c.y == metric]
    section.lines += _within_sample_lines(result.within_sample)
    section.tables += [
        ("Correlations across configurations", correlation_display),
        ("Per configuration (relative discrepancies; score 0-100)", display),
    ]
    if result.within_sample:
        within = pd.DataFrame([vars(w) for w in result.within_sample])
        within_display = formatted(
            within,
            {"mean_rho": "{:+.3f}", "median_rho": "{:+.3f}"},
            {
                "mean_rho": "mean ρ",
                "median_rho": "median ρ",
                "positive": "ρ > 0",
                "x_constant": "x constant in",
                "y_constant": "y constant in",
            },
        )
        writer.table("within_sample_correlations", within, within_display)
        section.tables.append(
            ("Within each tuning sample: Spearman ρ across configurations, over the samples", within_display)
        )
    section.figures.append(figures.loss_performance_figure(result, colors, writer.path("loss_performance.png")))
    return section


def _correlation_line(c) -> str:
    """A correlation in words; one that is not defined says why (which side is constant) instead of NaN."""
    if not np.isfinite(c.pearson_r):
        return f"{c.x} vs {c.y}: no correlation defined — {c.note}"
    return (
        f"{c.x} vs {c.y}: Pearson r = {c.pearson_r:+.3f} ({p_value_text(c.pearson_p)}), Spearman ρ = "
        f"{c.spearman_rho:+.3f} ({p_value_text(c.spearman_p)}), n = {c.n}"
    )


def _within_sample_lines(correlations: list[WithinSampleCorrelation]) -> list[str]:
    """Per metric, one line per loss; a metric constant within every sample it was measured on gets one line."""
    if not correlations:
        return [
            "No per-sample rows of the full-stage runs (their predictions.json with losses and answer metrics): "
            "no within-sample correlations."
        ]
    lines = []
    for metric in dict.fromkeys(w.y for w in correlations):
        of_metric = [w for w in correlations if w.y == metric]
        if all(w.samples == 0 and w.y_constant for w in of_metric):
            lines.append(
                tie_line(
                    metric,
                    f"within each of the {max(w.y_constant for w in of_metric)} tuning samples across configurations",
                )
            )
            continue
        lines += [_within_line(w) for w in of_metric]
    return lines


def _within_line(w: WithinSampleCorrelation) -> str:
    if not w.samples:
        return f"{w.x} vs {w.y} within samples: no ρ defined — {w.note}"
    constant = "".join(
        f"; {name} constant within {count} other sample(s)"
        for name, count in ((w.y, w.y_constant), (w.x, w.x_constant))
        if count
    )
    return (
        f"{w.x} vs {w.y} within samples: mean Spearman ρ = {w.mean_rho:+.3f}, median {w.median_rho:+.3f} over "
        f"{w.samples} sample(s), positive on {w.positive}{constant}"
    )


def screening_section(result: Screening, colors: dict[str, str], writer: TableWriter) -> Section:
    promoted = result.promoted
    section = Section(
        "Screening",
        lines=[
            f"{result.screened} configuration(s) screened on their losses alone (no decoding); {len(promoted.table)} "
            f"promoted to full scoring (full-stage runs whose sampler proposals match a screening run's), "
            f"{result.unscreened} full-stage run(s) not from screening.",
            "How well each loss predicts the score over all full-stage runs: see the loss–performance section.",
            *result.notes,
        ],
    )
    if promoted.table.empty:
        return section
    section.lines += [
        f"Promoted configurations, screening loss vs full-stage score: {_correlation_line(c)}"
        for c in promoted.correlations
    ]
    display = formatted(
        promoted.table,
        {"budget": BUDGET, "trial_number": "{:.0f}", "screen_trial": "{:.0f}", promoted.score: SCORE_FORMAT},
        {"trial_number": "trial", "screen_trial": "screening trial"},
    )
    writer.table("screening", promoted.table, display)
    section.tables.append(
        ("Promoted configurations: losses measured by their screening run, full-stage score", display)
    )
    if promoted.correlations:
        section.figures.append(
            figures.loss_performance_figure(
                promoted,
                colors,
                writer.path("screening.png"),
                title="Screening loss vs full-stage score of the promoted configurations",
            )
        )
    return section
