"""The needle-depth section: the score per needle depth, and without the samples whose needle the press always
keeps."""

from __future__ import annotations

from tracking.reports.analyses.depth_window import DepthWindow
from tracking.reports.analyses.metrics import budget_text
from tracking.reports.data import SweepRuns
from tracking.reports.render import BUDGET, SCORE_FORMAT, Section, TableWriter, format_value, formatted, metric_text
from tracking.reports.sections.words import stage_words


def depth_section(runs: SweepRuns, result: DepthWindow, writer: TableWriter) -> Section:
    """The score per needle-depth bin, and the samples whose needle the press always keeps counted apart."""
    section = Section(
        "Needle depth and the always-kept window",
        lines=[
            f"On the {stage_words(runs, result.stage)}: a sample whose needle lies in the press's always-kept window "
            "(its observation window) scores at any budget, so it says nothing about compression; the score without "
            "those samples stands beside the overall score."
        ],
    )
    table = result.table
    if table["mean_score_outside_window"].isna().all() and not result.bin_samples:
        section.lines.append(
            "No run logged mean_score_outside_window or score_depth.<bin> (sweeps from before "
            "they existed, or runs that decoded nothing)."
        )
        return section
    section.lines += [
        f"{row['configuration']} ({row['method']}, {budget_text(row['budget'])}): "
        f"{metric_text('mean_score', row['mean_score'])} "
        f"overall, {metric_text('mean_score', row['mean_score_outside_window'])} outside the window "
        f"({format_value(row['window_samples'], '{:.0f}')} sample(s) inside it)"
        for _, row in table.iterrows()
    ]
    if result.bin_samples:
        section.lines.append(
            "Scored samples per needle depth (position / prefill length): "
            + ", ".join(f"{name}: {count}" for name, count in result.bin_samples.items())
        )
    display = formatted(
        table,
        {
            "budget": BUDGET,
            "window_samples": "{:.0f}",
            **{column: SCORE_FORMAT for column in table.columns[3:] if column != "window_samples"},
        },
        {"mean_score_outside_window": "outside the window", "window_samples": "samples in the window"},
    )
    writer.table("depth", table, display)
    section.tables.append(("Score (0-100) overall, outside the always-kept window, and per needle depth", display))
    return section
