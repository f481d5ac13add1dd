"""The ablation section: the paper's ablation table, in Markdown and HTML."""

from __future__ import annotations

import html

from tracking.reports.analyses.ablation import AblationTable
from tracking.reports.data import SweepRuns
from tracking.reports.render import Section, TableWriter, ablation_display


def ablation_section(runs: SweepRuns, result: AblationTable, writer: TableWriter) -> Section:
    section = Section("Ablations", lines=list(result.notes))
    if result.table.empty:
        return section
    section.lines.insert(
        0,
        f"Paper default: trial {result.reference_trial}; base press (Better counts tasks "
        f"beating it): trial {result.base_trial if result.base_trial is not None else '–'}.",
    )
    footer = (
        "† paper default. ‡ other hyperparameters not held at the paper default (mean over the trials). "
        "Bold: the best Avg. (the report's score) and the best answer metric in the group. Better: tasks on "
        "which the setting beats the eviction-only base press. "
        f"Δ vs † (vs base): the row's {result.paired_metric} minus the paper default's (the eviction-only base "
        "press's), paired per sample, with its 95% bootstrap CI and (samples); p: sign-flip test; – where the "
        "row is the default's, averages trials, or has no samples."
    )
    shown = dict(score=result.score, metrics=tuple(result.metrics), paired_metric=result.paired_metric)
    writer.table(
        "ablation", result.table, ablation_display(result.table, runs.task_names, lambda s: f"**{s}**", **shown), footer
    )
    markup = ablation_display(result.table, runs.task_names, lambda s: f"<b>{s}</b>", html.escape, **shown).to_html(
        index=False, border=0, escape=False
    )
    section.raw_tables.append((footer, markup))
    return section
