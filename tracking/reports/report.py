"""The sweep report: every analysis, its tables and figures, one HTML page, a text summary, MLflow artifacts.

Each comparison is made on the score and on the answer metrics (continuous, so they separate configurations the
binary score ties on); a metric that ties everywhere says so in one line instead of a NaN or a [0, 0] interval.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

from grkv_core.config import ANSWER_METRICS, LOSS_METRICS
from tracking.names import EVICTION_ONLY, PAPER_DEFAULT, TEST_STAGE, TRIAL_TAG
from tracking.reports import figures
from tracking.reports.analyses import (
    MIB,
    AblationTable,
    DepthWindow,
    IsoResource,
    LossPerformance,
    Screening,
    Significance,
    ablation_table,
    depth_window,
    held_out_finding,
    higher_is_better,
    iso_resource,
    loss_performance,
    screening,
    significance,
    trade_off,
)
from tracking.reports.data import SweepRuns, load_sweep
from tracking.reports.optuna_study import Importance, param_importances, rebuild_study
from tracking.reports.render import (
    Section,
    ablation_display,
    format_value,
    formatted,
    html_page,
    markdown_table,
    metric_name,
    metric_spec,
    metric_text,
    p_value_text,
)
from tracking.reports.stats import MAX_EXACT_SIGN_FLIP_UNITS, PairedComparison, WithinSampleCorrelation

ARTIFACT_DIR = "report"
REPORT_PAGE = "report.html"
SCORE_FORMAT = "{:.2f}"
PERCENT = "{:.0%}"
P_VALUE = "{:.3g}"


@dataclass(frozen=True)
class ReportOptions:
    """Knobs of the analyses.

    Attributes
    ----------
    score : str
        The child metric compared first across configurations (its direction from ``HIGHER_IS_BETTER``); the
        answer metrics the runs logged are compared after it.
    ttft_tolerance : float
        Relative TTFT gap still "approximately equal prefill" in the iso-prefill comparison.
    bootstrap_resamples : int
        Resamples of the paired bootstrap (the paper uses 100,000).
    seed : int
        Seed of the bootstrap.
    """

    score: str = "mean_score"
    ttft_tolerance: float = 0.10
    bootstrap_resamples: int = 100_000
    seed: int = 0


@dataclass
class Report:
    """What a report run produced: the files written, the text summary, where the artifacts went."""

    runs: SweepRuns
    output_dir: Path
    files: list[Path]
    summary: str
    artifact_uri: str | None


class _Writer:
    """Writes tables (CSV + Markdown) and remembers every file, for the artifact upload."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.files: list[Path] = []

    def path(self, name: str) -> Path:
        path = self.output_dir / name
        self.files.append(path)
        return path

    def table(self, stem: str, raw: pd.DataFrame, display: pd.DataFrame, footer: str = "") -> None:
        raw.to_csv(self.path(f"{stem}.csv"), index=False)
        self.path(f"{stem}.md").write_text(markdown_table(display) + (f"\n{footer}\n" if footer else ""))

    def text(self, name: str, text: str) -> None:
        self.path(name).write_text(text)


def build_report(client: MlflowClient, sweep_id: str, output_dir: str | Path, *, experiment: str | None = None,
                 options: ReportOptions = ReportOptions(), log_artifacts: bool = True) -> Report:
    """Load the sweep from MLflow, run every analysis, write the report and log it on the parent run.

    Parameters
    ----------
    client : mlflow.tracking.MlflowClient
        Client of the tracking store the sweep logged to.
    sweep_id : str
        The sweep's id; a running sweep is reported on its finished trials so far.
    output_dir : str or pathlib.Path
        Where the PNG, CSV, Markdown, HTML and summary files go (created if needed).
    experiment : str, optional
        Restrict the search for the sweep to this experiment.
    options : ReportOptions
    log_artifacts : bool
        Also log the files as artifacts of the parent run, under ``report/``.

    Raises
    ------
    tracking.reports.data.SweepNotFoundError
        No parent run carries ``sweep_id``.
    """
    runs = load_sweep(client, sweep_id, experiment)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    writer = _Writer(output_dir)
    sections = [_overview(runs)]
    finding_text = None
    if not runs.trials.empty:
        sections += _analyses(runs, writer, options)
        finding_text = finding(runs, n_resamples=options.bootstrap_resamples, seed=options.seed)
    summary = text_summary(runs, sections, options.score, finding_text)
    writer.text("summary.txt", summary)
    title = f"GRKV sweep report: {runs.sweep_id}"
    top = "\n".join(filter(None, [headline(runs, options.score), finding_text]))
    writer.path(REPORT_PAGE).write_text(html_page(title, top, sections))
    artifact_uri = None
    if log_artifacts:
        for path in writer.files:
            client.log_artifact(runs.parent_run_id, str(path), ARTIFACT_DIR)
        artifact_uri = f"{client.get_run(runs.parent_run_id).info.artifact_uri}/{ARTIFACT_DIR}"
    return Report(runs, output_dir, writer.files, summary, artifact_uri)


def _overview(runs: SweepRuns) -> Section:
    counts = ", ".join(f"{count} {status}" for status, count in sorted(runs.child_status_counts.items())) or "none"
    params = runs.parent_params
    stages = ", ".join(f"{count} {stage}" for stage, count in runs.stage_counts.items())
    section = Section("Sweep", lines=[
        f"Parent run {runs.parent_run_id} ({runs.parent_status}) in experiment {runs.experiment_id}.",
        f"Model {params.get('model.name', '?')}, dataset {params.get('data.dataset', '?')}, "
        f"press {runs.press_name} at compression ratio {params.get('press.compression_ratio', '?')}, "
        f"data seed {runs.data_seed}; {len(runs.task_names)} task(s).",
        f"Child runs: {counts}. Finished runs per stage: {stages}. Analyses use the {len(runs.trials)} "
        "full-stage trial(s) (scored on the tuning samples) unless a section says otherwise.",
        *runs.notes,
    ])
    if runs.trials.empty:
        section.lines.append("No finished trials yet: nothing to analyse.")
    return section


def compared_metrics(runs: SweepRuns, score: str = "mean_score") -> list[str]:
    """``score``, then each answer metric that a full- or test-stage run logged: what the report compares."""
    logged = [metric for metric in ANSWER_METRICS
              if any(metric in frame and frame[metric].notna().any() for frame in (runs.trials, runs.test_trials))]
    return list(dict.fromkeys([score, *logged]))


def _analyses(runs: SweepRuns, writer: _Writer, options: ReportOptions) -> list[Section]:
    every_run = pd.concat([runs.screen_trials, runs.trials, runs.test_trials], ignore_index=True)
    every_run.to_csv(writer.path("trials.csv"), index=False)
    colors = figures.method_colors(pd.concat([runs.trials["method"], runs.test_trials["method"]]))
    metrics = compared_metrics(runs, options.score)
    sections = [_loss_section(loss_performance(runs, tuple(metrics)), colors, writer)]
    if len(runs.screen_trials):
        sections.append(_screening_section(screening(runs, options.score), colors, writer))
    iso = {metric: iso_resource(runs, metric, options.ttft_tolerance) for metric in metrics}
    return sections + [
        _resource_section(runs, iso, colors, writer, options),
        _ablation_section(runs, ablation_table(runs, score=options.score), writer),
        _significance_section(runs, writer, options, metrics),
        _depth_section(runs, depth_window(runs), writer),
        _optuna_section(runs, colors, writer),
    ]


def _ties(values: pd.Series) -> bool:
    """At least two finite values, all equal."""
    finite = values.astype(float)[np.isfinite(values.astype(float))]
    return len(finite) > 1 and finite.min() == finite.max()


def _tie_line(metric: str, where: str) -> str:
    """The one line said of a metric that ties ``where``, pointing to the continuous answer metrics."""
    others = ", ".join(name for name in ANSWER_METRICS if name != metric)
    return (f"{metric} ties {where}, so it cannot tell these configurations apart (no correlation, interval or "
            f"p-value on it means anything); the continuous answer metrics ({others}) can.")


def _loss_section(result: LossPerformance, colors: dict[str, str], writer: _Writer) -> Section:
    metrics = list(dict.fromkeys(c.y for c in result.correlations))
    section = Section("Loss–performance correlation", lines=[
        f"Over the {len(result.table)} full-stage trial(s): each reconstruction discrepancy against "
        f"{', '.join(metrics) or result.score}, across the configurations (Pearson and Spearman over each "
        "configuration's means) and within each tuning sample (Spearman ρ across the configurations on that sample, "
        "summarised over the samples: free of what makes one sample harder than another for every configuration)."])
    table_formats = {"budget": PERCENT, **{loss: "{:.4g}" for loss in LOSS_METRICS},
                     **{metric: metric_spec(metric) for metric in metrics}}
    display = formatted(result.table, table_formats, {"trial_number": "trial", "lambda_k": "λk", "lambda_v": "λv",
                                                     "window_size": "m", "steps": "S"})
    writer.table("loss_performance", result.table, display)
    correlations = pd.DataFrame([vars(c) for c in result.correlations])
    if correlations.empty:
        section.lines.append(f"No reconstruction discrepancy metric ({', '.join(LOSS_METRICS)}) was logged.")
        return section
    correlation_display = formatted(correlations, {"pearson_r": "{:+.3f}", "spearman_rho": "{:+.3f}",
                                                   "pearson_p": P_VALUE, "spearman_p": P_VALUE})
    writer.table("correlations", correlations, correlation_display)
    for metric in metrics:
        if _ties(result.table[metric]):
            tied_value = metric_text(metric, result.table[metric].dropna().iloc[0])
            section.lines.append(_tie_line(metric, f"over the {len(result.table)} configurations ({tied_value} each)"))
        else:
            section.lines += [_correlation_line(c) for c in result.correlations if c.y == metric]
    section.lines += _within_sample_lines(result.within_sample)
    section.tables += [("Correlations across configurations", correlation_display),
                       ("Per configuration (relative discrepancies; score 0-100)", display)]
    if result.within_sample:
        within = pd.DataFrame([vars(w) for w in result.within_sample])
        within_display = formatted(within, {"mean_rho": "{:+.3f}", "median_rho": "{:+.3f}"},
                                   {"mean_rho": "mean ρ", "median_rho": "median ρ", "positive": "ρ > 0",
                                    "x_constant": "x constant in", "y_constant": "y constant in"})
        writer.table("within_sample_correlations", within, within_display)
        section.tables.append(("Within each tuning sample: Spearman ρ across configurations, over the samples",
                               within_display))
    section.figures.append(figures.loss_performance_figure(result, colors, writer.path("loss_performance.png")))
    return section


def _correlation_line(c) -> str:
    """A correlation in words; one that is not defined says why (which side is constant) instead of NaN."""
    if not np.isfinite(c.pearson_r):
        return f"{c.x} vs {c.y}: no correlation defined — {c.note}"
    return (f"{c.x} vs {c.y}: Pearson r = {c.pearson_r:+.3f} ({p_value_text(c.pearson_p)}), Spearman ρ = "
            f"{c.spearman_rho:+.3f} ({p_value_text(c.spearman_p)}), n = {c.n}")


def _within_sample_lines(correlations: list[WithinSampleCorrelation]) -> list[str]:
    """Per metric, one line per loss; a metric constant within every sample it was measured on gets one line."""
    if not correlations:
        return ["No per-sample rows of the full-stage runs (their predictions.json with losses and answer metrics): "
                "no within-sample correlations."]
    lines = []
    for metric in dict.fromkeys(w.y for w in correlations):
        of_metric = [w for w in correlations if w.y == metric]
        if all(w.samples == 0 and w.y_constant for w in of_metric):
            lines.append(_tie_line(metric, f"within each of the {max(w.y_constant for w in of_metric)} tuning "
                                           "samples across configurations"))
            continue
        lines += [_within_line(w) for w in of_metric]
    return lines


def _within_line(w: WithinSampleCorrelation) -> str:
    if not w.samples:
        return f"{w.x} vs {w.y} within samples: no ρ defined — {w.note}"
    constant = "".join(f"; {name} constant within {count} other sample(s)"
                       for name, count in ((w.y, w.y_constant), (w.x, w.x_constant)) if count)
    return (f"{w.x} vs {w.y} within samples: mean Spearman ρ = {w.mean_rho:+.3f}, median {w.median_rho:+.3f} over "
            f"{w.samples} sample(s), positive on {w.positive}{constant}")


def _screening_section(result: Screening, colors: dict[str, str], writer: _Writer) -> Section:
    promoted = result.promoted
    section = Section("Screening", lines=[
        f"{result.screened} configuration(s) screened on their losses alone (no decoding); {len(promoted.table)} "
        f"promoted to full scoring (full-stage runs whose sampler proposals match a screening run's), "
        f"{result.unscreened} full-stage run(s) not from screening.",
        "How well each loss predicts the score over all full-stage runs: see the loss–performance section.",
        *result.notes])
    if promoted.table.empty:
        return section
    section.lines += [f"Promoted configurations, screening loss vs full-stage score: {_correlation_line(c)}"
                      for c in promoted.correlations]
    display = formatted(promoted.table, {"budget": PERCENT, "trial_number": "{:.0f}", "screen_trial": "{:.0f}",
                                         promoted.score: SCORE_FORMAT},
                        {"trial_number": "trial", "screen_trial": "screening trial"})
    writer.table("screening", promoted.table, display)
    section.tables.append(("Promoted configurations: losses measured by their screening run, full-stage score",
                           display))
    if promoted.correlations:
        section.figures.append(figures.loss_performance_figure(
            promoted, colors, writer.path("screening.png"),
            title="Screening loss vs full-stage score of the promoted configurations"))
    return section


def _direction(metric: str) -> str:
    return "higher is better" if higher_is_better(metric) else "lower is better"


def _resource_section(runs: SweepRuns, results: dict[str, IsoResource], colors: dict[str, str], writer: _Writer,
                      options: ReportOptions) -> Section:
    """The iso-memory, budget and iso-prefill comparisons on each compared metric (``results``, the score first);
    figures and Pareto fronts on the score."""
    score = options.score
    result = results[score]
    section = Section("Efficiency, memory and iso-resource trade-offs", lines=list(result.notes))
    for metric, compared in results.items():
        if len(results) > 1:
            section.lines.append(f"On {metric_name(metric)} ({metric}, {_direction(metric)}):")
        section.lines += (_iso_memory_lines(compared, metric) + _budget_lines(runs, compared, metric)
                          + _iso_prefill_lines(compared, metric))
        _resource_tables(runs, compared, metric, "" if metric == score else f"_{metric}", section, writer)
    if len(result.points):
        section.figures.append(figures.budget_figure(result, colors, score, writer.path("budgets.png")))
    trade_offs = [trade_off(runs, "kv_bytes", figures.axis_label("kv_bytes"), scale=MIB, score=score),
                  trade_off(runs, "ttft_s", figures.axis_label("ttft_s"), score=score)]
    for trade in trade_offs:
        trade.points.to_csv(writer.path(f"tradeoff_{trade.cost}.csv"), index=False)
        front = trade.points[trade.points["pareto"]].sort_values("cost")
        section.lines.append(f"Pareto front, {score} vs {trade.cost_label}: trials "
                             + (", ".join(str(int(n)) for n in front["trial_number"]) or "none (cost not logged)"))
    section.figures.append(figures.trade_off_figure(trade_offs, colors, writer.path("tradeoffs.png")))
    return section


def _resource_tables(runs: SweepRuns, result: IsoResource, metric: str, suffix: str, section: Section,
                     writer: _Writer) -> None:
    """The iso-memory, budget, cross-budget and iso-prefill tables of one metric (files named with ``suffix``)."""
    spec = metric_spec(metric)
    memory_display = formatted(result.iso_memory, {"budget": PERCENT, "kv_mib": "{:.3f}", "ttft_s": "{:.3g}",
                                                   metric: spec, "gain_vs_eviction": metric_spec(metric, signed=True)},
                               {"kv_mib": "persistent KV (MiB)", "ttft_s": "TTFT (s)",
                                "gain_vs_eviction": "Δ vs eviction"})
    writer.table(f"iso_memory{suffix}", result.iso_memory, memory_display)
    points_display = formatted(result.points.drop(columns=["compression_ratio", "is_eviction"]), {
        "budget": PERCENT, "trial_number": "{:.0f}", "kv_mib": "{:.3f}", "prefill_s": "{:.3g}", "ttft_s": "{:.3g}",
        metric: spec}, {"trial_number": "trial", "kv_mib": "persistent KV (MiB)", "prefill_s": "prefill (s)",
                        "ttft_s": "TTFT (s)", "selected": "on the line"})
    writer.table(f"budgets{suffix}", result.points, points_display)
    cross_display = _pairs_display(result.cross_budget, metric)
    prefill_display = _pairs_display(result.iso_prefill, metric)
    writer.table(f"cross_budget{suffix}", result.cross_budget, cross_display)
    writer.table(f"iso_prefill{suffix}", result.iso_prefill, prefill_display)
    stage, what = _stage_words(runs, result.stage), f"{metric} ({_direction(metric)})"
    section.tables += [(f"Iso-memory on {what}: methods at the same persistent KV budget (full stage)",
                        memory_display),
                       (f"{what}, KV memory and prefill time per method and budget ({stage})", points_display),
                       (f"{what}: merging at budget b vs eviction only at every budget b' ≥ b ({stage})",
                        cross_display),
                       (f"{what}, approximate iso-prefill: merging at budget b vs eviction at b' > b with TTFT "
                        f"within ±{result.ttft_tolerance:.0%} ({stage})", prefill_display)]


def _stage_words(runs: SweepRuns, stage: str) -> str:
    if stage == TEST_STAGE:
        return f"held-out test stage, {runs.test_sample_count} samples"
    return "tuning samples; the best at each budget is selected on them"


def _pairs_display(frame: pd.DataFrame, score: str) -> pd.DataFrame:
    """A merging-vs-eviction table (``IsoResource.cross_budget`` or ``iso_prefill``) as text."""
    formats = {"ttft_gap": "{:+.1%}", "eviction_minus_merging": metric_spec(score, signed=True), "kv_ratio": "{:.2f}",
               "prefill_ratio": "{:.2f}"}
    names = {"eviction_minus_merging": "eviction − merging", "kv_ratio": "KV ratio", "prefill_ratio": "prefill ratio",
             "ttft_gap": "TTFT gap"}
    for side in ("merging", "eviction"):
        formats.update({f"{side}_trial": "{:.0f}", f"{side}_budget": PERCENT, f"{side}_kv_mib": "{:.3f}",
                        f"{side}_prefill_s": "{:.3g}", f"{side}_ttft_s": "{:.3g}",
                        f"{side}_{score}": metric_spec(score)})
        names.update({f"{side}_configuration": f"{side} configuration", f"{side}_trial": f"{side} trial",
                      f"{side}_budget": f"{side} budget", f"{side}_kv_mib": f"{side} KV (MiB)",
                      f"{side}_prefill_s": f"{side} prefill (s)", f"{side}_ttft_s": f"{side} TTFT (s)",
                      f"{side}_{score}": f"{side} {score}"})
    return formatted(frame, formats, names)


def _trial_text(result: IsoResource, number) -> str:
    """`` (trial N)`` after a full-stage label such as "best of 6"; test-stage labels name the configuration."""
    return "" if result.stage == TEST_STAGE or pd.isna(number) else f" (trial {int(number)})"


def _budget_lines(runs: SweepRuns, result: IsoResource, score: str) -> list[str]:
    """Each method's line across budgets, then each merging point on a line against eviction at b' ≥ b."""
    if result.points.empty:
        return []
    if result.stage == TEST_STAGE:
        lines = [f"Across budgets, on {runs.test_sample_count} held-out test samples (disjoint from the tuning "
                 "samples that chose these configurations); at each budget a merger's line goes through its "
                 "configuration best on the tuning samples."]
    else:
        lines = ["Across budgets, on the tuning samples (no test stage): the best trial at each budget is selected "
                 "on the samples it is scored on, so its score is optimistic."]
    on_lines = result.points[result.points["selected"]]
    for method, rows in on_lines.groupby("method"):
        lines.append(f"{method}: " + ", ".join(f"{row['budget']:.0%} {metric_text(score, row[score])}"
                                               for _, row in rows.sort_values("budget").iterrows()))
    selected = set(on_lines.loc[~on_lines["is_eviction"], "configuration"])
    for _, pair in result.cross_budget.iterrows():
        if pair["merging_configuration"] in selected:
            lines.append(
                f"{pair['merging']}{_trial_text(result, pair['merging_trial'])} at {pair['merging_budget']:.0%}: "
                f"{metric_text(score, pair[f'merging_{score}'])} vs eviction only at {pair['eviction_budget']:.0%}: "
                f"{metric_text(score, pair[f'eviction_{score}'])} (eviction "
                f"{metric_text(score, pair['eviction_minus_merging'], signed=True)}) with "
                f"{pair['kv_ratio']:.2f}x the persistent KV and {pair['prefill_ratio']:.2f}x the prefill time")
    return lines


def _iso_memory_lines(result: IsoResource, score: str) -> list[str]:
    if result.iso_memory.empty:
        return []
    lines = []
    for budget, rows in result.iso_memory.groupby("budget", sort=True):
        entries = [f"{row['method']} {row['configuration']} {metric_text(score, row[score])}"
                   + ("" if pd.isna(row["gain_vs_eviction"]) or row["configuration"] == "eviction only"
                      else f" ({metric_text(score, row['gain_vs_eviction'], signed=True)})")
                   for _, row in rows.iterrows()]
        lines.append(f"Iso-memory at budget {budget:.0%} ({rows['kv_mib'].mean():.3g} MiB persistent KV): "
                     + "; ".join(entries))
    return lines


def _iso_prefill_lines(result: IsoResource, score: str) -> list[str]:
    if "eviction_budget" not in result.iso_prefill:
        return []
    matched = result.iso_prefill.dropna(subset=["eviction_budget"])
    return [f"Iso-prefill: {row['merging']}{_trial_text(result, row['merging_trial'])} at {row['merging_budget']:.0%}, "
            f"TTFT {row['merging_ttft_s']:.3g} s: {metric_text(score, row[f'merging_{score}'])} vs eviction only"
            f"{_trial_text(result, row['eviction_trial'])} at {row['eviction_budget']:.0%}, TTFT "
            f"{row['eviction_ttft_s']:.3g} s, {row['kv_ratio']:.2f}x the persistent KV: "
            f"{metric_text(score, row[f'eviction_{score}'])} "
            f"(eviction {metric_text(score, row['eviction_minus_merging'], signed=True)})"
            for _, row in matched.iterrows()]


def _ablation_section(runs: SweepRuns, result: AblationTable, writer: _Writer) -> Section:
    section = Section("Ablations", lines=list(result.notes))
    if result.table.empty:
        return section
    section.lines.insert(0, f"Paper default: trial {result.reference_trial}; base press (Better counts tasks "
                            f"beating it): trial {result.base_trial if result.base_trial is not None else '–'}.")
    footer = ("† paper default. ‡ other hyperparameters not held at the paper default (mean over the trials). "
              "Bold: best Avg. in the group. Better: tasks on which the setting beats the eviction-only base press.")
    writer.table("ablation", result.table, ablation_display(result.table, runs.task_names, lambda s: f"**{s}**"),
                 footer)
    markup = ablation_display(result.table, runs.task_names, lambda s: f"<b>{s}</b>", html.escape).to_html(
        index=False, border=0, escape=False)
    section.raw_tables.append((footer, markup))
    return section


def _significance_section(runs: SweepRuns, writer: _Writer, options: ReportOptions, metrics: list[str]) -> Section:
    results = [significance(runs, metric, options.bootstrap_resamples, options.seed) for metric in metrics]
    score = results[0]
    resamples = f"{options.bootstrap_resamples:,}"
    if score.stage == TEST_STAGE:
        section = Section("Paired significance on the held-out test samples", lines=[
            f"On {score.test_samples} held-out test samples (disjoint from the tuning samples that chose these "
            "configurations): each confirmed merging configuration against eviction only and against the paper "
            "default at its budget, paired per test sample (the mean score of its questions, in points; the sample's "
            "answer metrics), on each of " + ", ".join(metrics) + "; percentile "
            f"bootstrap over the samples with {resamples} resamples and a two-sided sign-flip test (exact over all "
            f"2^n sign assignments up to {MAX_EXACT_SIGN_FLIP_UNITS} samples, else {resamples} random ones).",
            *_held_out_lines(score, options.score)])
    else:
        section = Section("Paired significance over tasks", lines=[
            f"Task-level paired differences on the tuning samples: percentile bootstrap with {resamples} resamples "
            f"and an exact two-sided sign-flip test over all 2^T sign assignments (seed {runs.data_seed} only; give "
            "tracking.reports.compare_configs a tidy table from several sweeps for the multi-seed version).",
            "No test stage: the best trial was selected and evaluated on the same samples (selection bias), so its "
            "gain and p-value are optimistic; only the paper default, fixed before the sweep, is tested without it."])
    section.lines += list(dict.fromkeys(note for result in results for note in result.notes))
    compared = [result for result in results if result.comparisons]
    for result in compared:
        section.lines += _comparison_lines(result)
    if not compared:
        return section
    table = pd.DataFrame([_comparison_row(c) for result in compared for c in result.comparisons])
    display = formatted(table, {"control_value": "{:.4g}", "treatment_value": "{:.4g}", "difference": "{:+.4g}",
                                "ci_low": "{:+.4g}", "ci_high": "{:+.4g}", "p_value": P_VALUE},
                        {"control_value": "control", "treatment_value": "treatment", "difference": "Δ (mean)",
                         "ci_low": "CI low", "ci_high": "CI high", "p_value": "p", "p_exact": "exact p",
                         "better_units": "better"})
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
        return [_tie_line(result.metric, f"on every {unit} in each of the {len(result.comparisons)} comparisons "
                                         "(every paired difference is 0)")]
    return [_comparison_line(c, result.metric) for c in result.comparisons]


def _comparison_line(c: PairedComparison, metric: str) -> str:
    """``treatment vs control: metric +0.02 (lower is better), 95% CI [..], p = ..: worse``."""
    if c.tied:
        return f"{c.treatment} vs {c.control}: {metric} identical on every one of the {len(c.units)} {c.unit}s"
    return (f"{c.treatment} vs {c.control}: {metric} {metric_text(metric, c.gain, signed=True)} "
            f"({_direction(metric)}), "
            f"{c.ci.confidence:.0%} CI [{metric_text(metric, c.ci.low, signed=True)}, "
            f"{metric_text(metric, c.ci.high, signed=True)}], {'exact' if c.p_exact else 'sampled'} "
            f"p = {c.p_value:.3g}, better on {c.better_units}/{len(c.units)} {c.unit}s: {c.verdict}")


def _held_out_lines(result: Significance, score: str) -> list[str]:
    """Each confirmed configuration's tuning and held-out scores, then the verdict on each budget's tuned winner."""
    tuning, test = f"tuning_{score}", f"test_{score}"

    def value(number: float, signed: bool = False) -> str:
        return metric_text(score, number, signed)

    lines = [f"{row['configuration']} ({row['method']}, {row['budget']:.0%}): {value(row[tuning])} on the tuning "
             f"samples, {value(row[test])} on the held-out test samples ({value(row['change'], True)})"
             for _, row in result.held_out.iterrows()]
    sign = 1.0 if higher_is_better(score) else -1.0  # NOTE: sign * change < 0 is a change for the worse
    for _, winner in result.tuned_winners.iterrows():
        verdict = ("worse on the held-out samples than on the samples that selected it" if sign * winner["change"] < 0
                   else "no worse on the held-out samples than on the samples that selected it")
        lines.append(f"The tuned winner at {winner['budget']:.0%}, {winner['configuration']} (best tuning score of "
                     f"the confirmed merging configurations there, {value(winner[tuning])}), scores "
                     f"{value(winner[test])} on the held-out test samples ({value(winner['change'], True)}): "
                     f"{verdict}.")
    return lines


def _comparison_row(comparison: PairedComparison) -> dict:
    return {"metric": comparison.metric, "treatment": comparison.treatment, "control": comparison.control,
            "unit": comparison.unit, "seeds": len(comparison.seeds), "units": len(comparison.units),
            "control_value": comparison.control_mean, "treatment_value": comparison.treatment_mean,
            "difference": comparison.gain, "ci_low": comparison.ci.low, "ci_high": comparison.ci.high,
            "confidence": comparison.ci.confidence, "p_value": comparison.p_value, "p_exact": comparison.p_exact,
            "better_units": f"{comparison.better_units}/{len(comparison.units)}", "verdict": comparison.verdict}


def _depth_section(runs: SweepRuns, result: DepthWindow, writer: _Writer) -> Section:
    """The score per needle-depth bin, and the samples whose needle the press always keeps counted apart."""
    section = Section("Needle depth and the always-kept window", lines=[
        f"On the {_stage_words(runs, result.stage)}: a sample whose needle lies in the press's always-kept window "
        "(its observation window) scores at any budget, so it says nothing about compression; the score without "
        "those samples stands beside the overall score."])
    table = result.table
    if table["mean_score_outside_window"].isna().all() and not result.bin_samples:
        section.lines.append("No run logged mean_score_outside_window or score_depth.<bin> (sweeps from before "
                             "they existed, or runs that decoded nothing).")
        return section
    section.lines += [
        f"{row['configuration']} ({row['method']}, {row['budget']:.0%}): {metric_text('mean_score', row['mean_score'])} "
        f"overall, {metric_text('mean_score', row['mean_score_outside_window'])} outside the window "
        f"({format_value(row['window_samples'], '{:.0f}')} sample(s) inside it)" for _, row in table.iterrows()]
    if result.bin_samples:
        section.lines.append("Scored samples per needle depth (position / prefill length): "
                             + ", ".join(f"{name}: {count}" for name, count in result.bin_samples.items()))
    display = formatted(table, {"budget": PERCENT, "window_samples": "{:.0f}",
                                **{column: SCORE_FORMAT for column in table.columns[3:] if column != "window_samples"}},
                        {"mean_score_outside_window": "outside the window", "window_samples": "samples in the window"})
    writer.table("depth", table, display)
    section.tables.append(("Score (0-100) overall, outside the always-kept window, and per needle depth", display))
    return section


def _optuna_section(runs: SweepRuns, colors: dict[str, str], writer: _Writer) -> Section:
    rebuilt = rebuild_study(runs)
    importances = param_importances(rebuilt)
    section = Section("Optuna: hyperparameter importances and optimisation history", lines=[
        f"In-memory study rebuilt from {len(rebuilt.study.trials)} MLflow run(s); the Optuna storage is not read.",
        *rebuilt.notes, *[_importance_line(i) for i in importances]])
    if len(rebuilt.objectives) > 1:
        objectives = ", ".join(f"{o.metric} {o.direction}" for o in rebuilt.objectives)
        front = sorted(t.user_attrs[TRIAL_TAG] for t in rebuilt.study.best_trials)
        section.lines.append(f"Pareto-optimal trials over ({objectives}): {', '.join(map(str, front))}")
    table = pd.DataFrame([{"objective": i.objective.metric, "evaluator": i.evaluator, "param": name,
                           "importance": value} for i in importances for name, value in i.importances.items()],
                         columns=["objective", "evaluator", "param", "importance"])
    writer.table("param_importances", table, formatted(table, {"importance": "{:.3f}"}))
    section.tables.append(("Importances", formatted(table, {"importance": "{:.3f}"})))
    section.figures.append(figures.importance_figure(importances, writer.path("param_importances.png")))
    if rebuilt.study.trials:
        section.figures.append(figures.history_figure(rebuilt, colors, writer.path("optimization_history.png")))
    return section


def _importance_line(importance: Importance, top: int = 3) -> str:
    ranked = ", ".join(f"{name} {value:.2f}" for name, value in list(importance.importances.items())[:top])
    line = f"Importances for {importance.objective.metric} ({importance.evaluator})"
    return line + (f": {ranked}" if ranked else "") + (f" — {importance.note}" if importance.note else "")


def headline(runs: SweepRuns, score: str = "mean_score") -> str:
    """The sweep in a few lines: its id and status, the anchors (base press, paper default) and best trial on the
    first objective, then every configuration's objective and ``score`` on the held-out test samples when the sweep
    has a test stage."""
    lines = [f"GRKV sweep {runs.sweep_id} ({runs.parent_status}, {len(runs.trials)} finished trial(s))"]
    trials = runs.trials
    objective = runs.objectives[0].metric if runs.objectives[0].metric in trials else score
    if trials.empty or objective not in trials:
        return "\n".join(lines)
    anchors = []
    for name in (EVICTION_ONLY, PAPER_DEFAULT):
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
        if runs.has_test_stage and metric in runs.test_trials:
            lines.append(f"{metric} on {runs.test_sample_count} held-out test samples: " + "; ".join(
                f"{row['configuration']} ({row['budget']:.0%}) {metric_text(metric, row[metric])}"
                for _, row in runs.test_trials.iterrows()))
    return "\n".join(lines)


def finding_metric(runs: SweepRuns) -> str:
    """The metric of the one-sentence finding: the first objective when it is an answer metric, else answer_nll."""
    first = runs.objectives[0].metric
    return first if first in ANSWER_METRICS else "answer_nll"


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
    who = (f"{treatment['method']} ({treatment['configuration']}) vs {control['method']} at {treatment['budget']:.0%} "
           f"on {len(comparison.units)} held-out samples")
    if comparison.tied:
        return f"{who}: {metric_name(metric)} identical on every sample, no difference."
    low, high = (metric_text(metric, bound, signed=True) for bound in (comparison.ci.low, comparison.ci.high))
    return (f"{who}: {metric_name(metric)} {metric_text(metric, comparison.gain, signed=True)} [{low}, {high}] "
            f"({p_value_text(comparison.p_value)}), {comparison.verdict}")


def text_summary(runs: SweepRuns, sections: list[Section], score: str = "mean_score",
                 finding_text: str | None = None) -> str:
    """The report as plain text: the headline and the one-sentence finding (``finding``), then each section's
    findings."""
    lines = [headline(runs, score), *([finding_text] if finding_text else [])]
    for section in sections:
        lines.append(f"\n[{section.title}]")
        lines += [f"  {line}" for line in section.lines]
    return "\n".join(lines) + "\n"
