"""The report in words: the sweep's headline and its held-out result in one sentence (``finding``), and the whole
report as plain text."""

from __future__ import annotations

import pandas as pd

from grkv_core.metrics import ANSWER_METRICS, STREAM_METRICS
from tracking.reports.analyses.metrics import budget_text, higher_is_better
from tracking.reports.analyses.significance import held_out_finding
from tracking.reports.data import SweepRuns
from tracking.reports.render import Section, format_value, metric_name, metric_text, p_value_text
from workers.names import EVICTION_ONLY, LIBRARY_DEFAULT, PAPER_DEFAULT


def headline(runs: SweepRuns, score: str = "mean_score") -> str:
    """The sweep in a few lines: its id and status, the anchors (base press, paper and library defaults) and best
    trial on the first objective, then every configuration's objective and ``score`` on the held-out test samples
    when the sweep has a test stage."""
    lines = [f"GRKV sweep {runs.sweep_id} ({runs.parent_status}, {len(runs.trials)} finished trial(s))"]
    trials = runs.trials
    objective = runs.objectives[0].metric if runs.objectives[0].metric in trials else score
    if trials.empty or objective not in trials:
        return "\n".join(lines)
    anchors = []
    for name in (EVICTION_ONLY, PAPER_DEFAULT, LIBRARY_DEFAULT):
        row = runs.baseline_trial(name)
        if row is not None:
            anchors.append(f"{name} (trial {int(row['trial_number'])}) {metric_text(objective, row[objective])}")
    values = trials[objective]
    best = trials.loc[values.idxmax() if higher_is_better(objective) else values.idxmin()]
    searched = ["merge", *runs.search_space]
    settings = ", ".join(f"{p}={format_value(best[p], '{:.3g}')}" for p in searched if pd.notna(best.get(p)))
    anchors.append(f"best trial {int(best['trial_number'])} {metric_text(objective, best[objective])} ({settings})")
    lines.append(f"{objective}: " + "; ".join(anchors))
    for metric in dict.fromkeys([objective, score]):
        # NOTE: a metric equal for every configuration (a score every cache ties on) says nothing: left out, as the
        # figures leave it out.
        tested = runs.test_trials
        if runs.has_test_stage and metric in tested and (len(tested) < 2 or tested[metric].nunique(dropna=True) > 1):
            lines.append(
                f"{metric} on {runs.test_sample_count} held-out test samples: "
                + "; ".join(
                    f"{row['configuration']} ({budget_text(row['budget'])}) {metric_text(metric, row[metric])}"
                    for _, row in runs.test_trials.iterrows()
                )
            )
    return "\n".join(lines)


def finding_metric(runs: SweepRuns) -> str:
    """The metric of the one-sentence finding: the first objective when it is an answer or bounded-cache metric, else
    answer_nll."""
    first = runs.objectives[0].metric
    return first if first in (*ANSWER_METRICS, *STREAM_METRICS) else "answer_nll"


def finding(runs: SweepRuns, metric: str | None = None, n_resamples: int = 100_000, seed: int = 0) -> str:
    """The sweep's result in one sentence: its tuned pick (``analyses.tuned_winner``) against eviction only at the
    same budget on the held-out test samples, on ``metric`` (default ``finding_metric``), e.g.
    ``snapkv+grkv (trial 12) vs snapkv at 20% on 24 held-out samples: answer NLL +0.02 [+0.01, +0.03]
    (p = 0.003), worse``; "no significant difference" where the interval holds 0."""
    metric = metric or finding_metric(runs)
    result = held_out_finding(runs, metric, n_resamples, seed)
    if result.comparison is None:
        return f"Sweep {runs.sweep_id}: no held-out finding on {metric_name(metric)} ({result.reason})."
    comparison, treatment, control = result.comparison, result.treatment, result.control
    who = (
        f"{treatment['method']} ({treatment['configuration']}) vs {control['method']} at "
        f"{budget_text(treatment['budget'])} "
        f"on {len(comparison.units)} held-out samples"
    )
    if comparison.tied:
        return f"{who}: {metric_name(metric)} identical on every sample, no difference."
    low, high = (metric_text(metric, bound, signed=True) for bound in (comparison.ci.low, comparison.ci.high))
    return (
        f"{who}: {metric_name(metric)} {metric_text(metric, comparison.gain, signed=True)} [{low}, {high}] "
        f"({p_value_text(comparison.p_value)}), {comparison.verdict}"
    )


def text_summary(
    runs: SweepRuns, sections: list[Section], score: str = "mean_score", finding_text: str | None = None
) -> str:
    """The report as plain text: the headline and the one-sentence finding (``finding``), then each section's
    findings."""
    lines = [headline(runs, score), *([finding_text] if finding_text else [])]
    for section in sections:
        lines.append(f"\n[{section.title}]")
        lines += [f"  {line}" for line in section.lines]
    return "\n".join(lines) + "\n"
