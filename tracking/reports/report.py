"""The sweep report: every analysis, its tables and figures, one HTML page, a text summary, MLflow artifacts."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from mlflow.tracking import MlflowClient

from grkv_core.config import EVICTION_ONLY, LOSS_METRICS, PAPER_DEFAULT, TEST_STAGE, TRIAL_TAG
from tracking.reports import figures
from tracking.reports.analyses import (
    MIB,
    AblationTable,
    IsoResource,
    LossPerformance,
    Screening,
    Significance,
    ablation_table,
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
    p_value_text,
)
from tracking.reports.stats import MAX_EXACT_SIGN_FLIP_UNITS, PairedComparison

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
        The child metric compared across configurations (higher is better).
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
    if not runs.trials.empty:
        sections += _analyses(runs, writer, options)
    summary = text_summary(runs, sections, options.score)
    writer.text("summary.txt", summary)
    title = f"GRKV sweep report: {runs.sweep_id}"
    writer.path(REPORT_PAGE).write_text(html_page(title, headline(runs, options.score), sections))
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


def _analyses(runs: SweepRuns, writer: _Writer, options: ReportOptions) -> list[Section]:
    every_run = pd.concat([runs.screen_trials, runs.trials, runs.test_trials], ignore_index=True)
    every_run.to_csv(writer.path("trials.csv"), index=False)
    colors = figures.method_colors(pd.concat([runs.trials["method"], runs.test_trials["method"]]))
    sections = [_loss_section(loss_performance(runs, options.score), colors, writer)]
    if len(runs.screen_trials):
        sections.append(_screening_section(screening(runs, options.score), colors, writer))
    return sections + [
        _resource_section(runs, iso_resource(runs, options.score, options.ttft_tolerance), colors, writer, options),
        _ablation_section(runs, ablation_table(runs, score=options.score), writer),
        _significance_section(runs, writer, options),
        _optuna_section(runs, colors, writer),
    ]


def _loss_section(result: LossPerformance, colors: dict[str, str], writer: _Writer) -> Section:
    section = Section("Loss–performance correlation", lines=[
        f"Over the {len(result.table)} full-stage trial(s): each reconstruction discrepancy against {result.score}."])
    table_formats = {"budget": PERCENT, **{loss: "{:.4g}" for loss in LOSS_METRICS}, result.score: SCORE_FORMAT}
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
    section.lines += [_correlation_line(c) for c in result.correlations]
    section.tables += [("Correlations", correlation_display),
                       ("Per configuration (relative discrepancies; score 0-100)", display)]
    section.figures.append(figures.loss_performance_figure(result, colors, writer.path("loss_performance.png")))
    return section


def _correlation_line(c) -> str:
    return (f"{c.x} vs {c.y}: Pearson r = {c.pearson_r:+.3f} ({p_value_text(c.pearson_p)}), Spearman ρ = "
            f"{c.spearman_rho:+.3f} ({p_value_text(c.spearman_p)}), n = {c.n}" + (f" — {c.note}" if c.note else ""))


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


def _resource_section(runs: SweepRuns, result: IsoResource, colors: dict[str, str], writer: _Writer,
                      options: ReportOptions) -> Section:
    score = options.score
    section = Section("Efficiency, memory and iso-resource trade-offs",
                      lines=_iso_memory_lines(result, score) + _budget_lines(runs, result, score)
                      + _iso_prefill_lines(result, score) + result.notes)
    memory_display = formatted(result.iso_memory, {"budget": PERCENT, "kv_mib": "{:.3f}", "ttft_s": "{:.3g}",
                                                   score: SCORE_FORMAT, "gain_vs_eviction": "{:+.2f}"},
                               {"kv_mib": "persistent KV (MiB)", "ttft_s": "TTFT (s)",
                                "gain_vs_eviction": "Δ vs eviction"})
    writer.table("iso_memory", result.iso_memory, memory_display)
    points_display = formatted(result.points.drop(columns=["compression_ratio", "is_eviction"]), {
        "budget": PERCENT, "trial_number": "{:.0f}", "kv_mib": "{:.3f}", "prefill_s": "{:.3g}", "ttft_s": "{:.3g}",
        score: SCORE_FORMAT}, {"trial_number": "trial", "kv_mib": "persistent KV (MiB)", "prefill_s": "prefill (s)",
                               "ttft_s": "TTFT (s)", "selected": "on the line"})
    writer.table("budgets", result.points, points_display)
    cross_display = _pairs_display(result.cross_budget, score)
    prefill_display = _pairs_display(result.iso_prefill, score)
    writer.table("cross_budget", result.cross_budget, cross_display)
    writer.table("iso_prefill", result.iso_prefill, prefill_display)
    stage = _stage_words(runs, result.stage)
    section.tables += [("Iso-memory: methods at the same persistent KV budget (full stage)", memory_display),
                       (f"Score, KV memory and prefill time per method and budget ({stage})", points_display),
                       (f"Merging at budget b vs eviction only at every budget b' ≥ b ({stage})", cross_display),
                       (f"Approximate iso-prefill: merging at budget b vs eviction at b' > b with TTFT within "
                        f"±{result.ttft_tolerance:.0%} ({stage})", prefill_display)]
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


def _stage_words(runs: SweepRuns, stage: str) -> str:
    if stage == TEST_STAGE:
        return f"held-out test stage, {runs.test_sample_count} samples"
    return "tuning samples; the best at each budget is selected on them"


def _pairs_display(frame: pd.DataFrame, score: str) -> pd.DataFrame:
    """A merging-vs-eviction table (``IsoResource.cross_budget`` or ``iso_prefill``) as text."""
    formats = {"ttft_gap": "{:+.1%}", "eviction_minus_merging": "{:+.2f}", "kv_ratio": "{:.2f}",
               "prefill_ratio": "{:.2f}"}
    names = {"eviction_minus_merging": "eviction − merging", "kv_ratio": "KV ratio", "prefill_ratio": "prefill ratio",
             "ttft_gap": "TTFT gap"}
    for side in ("merging", "eviction"):
        formats.update({f"{side}_trial": "{:.0f}", f"{side}_budget": PERCENT, f"{side}_kv_mib": "{:.3f}",
                        f"{side}_prefill_s": "{:.3g}", f"{side}_ttft_s": "{:.3g}", f"{side}_{score}": SCORE_FORMAT})
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
        lines.append(f"{method}: " + ", ".join(f"{row['budget']:.0%} {row[score]:.2f}"
                                               for _, row in rows.sort_values("budget").iterrows()))
    selected = set(on_lines.loc[~on_lines["is_eviction"], "configuration"])
    for _, pair in result.cross_budget.iterrows():
        if pair["merging_configuration"] in selected:
            lines.append(
                f"{pair['merging']}{_trial_text(result, pair['merging_trial'])} at {pair['merging_budget']:.0%}: "
                f"{pair[f'merging_{score}']:.2f} vs eviction only at {pair['eviction_budget']:.0%}: "
                f"{pair[f'eviction_{score}']:.2f} (eviction {pair['eviction_minus_merging']:+.2f}) with "
                f"{pair['kv_ratio']:.2f}x the persistent KV and {pair['prefill_ratio']:.2f}x the prefill time")
    return lines


def _iso_memory_lines(result: IsoResource, score: str) -> list[str]:
    if result.iso_memory.empty:
        return []
    lines = []
    for budget, rows in result.iso_memory.groupby("budget", sort=True):
        entries = [f"{row['method']} {row['configuration']} {row[score]:.2f}"
                   + ("" if pd.isna(row["gain_vs_eviction"]) or row["configuration"] == "eviction only"
                      else f" ({row['gain_vs_eviction']:+.2f})") for _, row in rows.iterrows()]
        lines.append(f"Iso-memory at budget {budget:.0%} ({rows['kv_mib'].mean():.3g} MiB persistent KV): "
                     + "; ".join(entries))
    return lines


def _iso_prefill_lines(result: IsoResource, score: str) -> list[str]:
    if "eviction_budget" not in result.iso_prefill:
        return []
    matched = result.iso_prefill.dropna(subset=["eviction_budget"])
    return [f"Iso-prefill: {row['merging']}{_trial_text(result, row['merging_trial'])} at {row['merging_budget']:.0%}, "
            f"TTFT {row['merging_ttft_s']:.3g} s: {row[f'merging_{score}']:.2f} vs eviction only"
            f"{_trial_text(result, row['eviction_trial'])} at {row['eviction_budget']:.0%}, TTFT "
            f"{row['eviction_ttft_s']:.3g} s, {row['kv_ratio']:.2f}x the persistent KV: {row[f'eviction_{score}']:.2f} "
            f"(eviction {row['eviction_minus_merging']:+.2f})" for _, row in matched.iterrows()]


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


def _significance_section(runs: SweepRuns, writer: _Writer, options: ReportOptions) -> Section:
    result = significance(runs, options.score, options.bootstrap_resamples, options.seed)
    resamples = f"{options.bootstrap_resamples:,}"
    if result.stage == TEST_STAGE:
        section = Section("Paired significance on the held-out test samples", lines=[
            f"On {result.test_samples} held-out test samples (disjoint from the tuning samples that chose these "
            "configurations): each confirmed merging configuration against eviction only and against the paper "
            "default at its budget, paired per test sample (the mean score of its questions, in points); percentile "
            f"bootstrap over the samples with {resamples} resamples and a two-sided sign-flip test (exact over all "
            f"2^n sign assignments up to {MAX_EXACT_SIGN_FLIP_UNITS} samples, else {resamples} random ones).",
            *_held_out_lines(result, options.score)])
    else:
        section = Section("Paired significance over tasks", lines=[
            f"Task-level paired differences on the tuning samples: percentile bootstrap with {resamples} resamples "
            f"and an exact two-sided sign-flip test over all 2^T sign assignments (seed {runs.data_seed} only; give "
            "tracking.reports.compare_configs a tidy table from several sweeps for the multi-seed version).",
            "No test stage: the best trial was selected and evaluated on the same samples (selection bias), so its "
            "gain and p-value are optimistic; only the paper default, fixed before the sweep, is tested without it."])
    section.lines += result.notes
    if not result.comparisons:
        return section
    section.lines += [
        f"{c.treatment} vs {c.control}: gain {c.gain:+.2f}, {c.ci.confidence:.0%} CI [{c.ci.low:+.2f}, "
        f"{c.ci.high:+.2f}], {'exact' if c.p_exact else 'sampled'} p = {c.p_value:.3g}, better on "
        f"{c.better_units}/{len(c.units)} {c.unit}s" for c in result.comparisons]
    table = pd.DataFrame([_comparison_row(c) for c in result.comparisons])
    display = formatted(table, {"control_score": SCORE_FORMAT, "treatment_score": SCORE_FORMAT,
                                "gain": "{:+.2f}", "ci_low": "{:+.2f}", "ci_high": "{:+.2f}", "p_value": P_VALUE},
                        {"control_score": "control score", "treatment_score": "treatment score",
                         "ci_low": "CI low", "ci_high": "CI high", "p_value": "p", "p_exact": "exact p",
                         "better_units": "better"})
    writer.table("significance", table, display)
    section.tables.append(("Treatment vs control, paired per " + result.comparisons[0].unit, display))
    unit = result.comparisons[0].unit
    section.figures.append(figures.paired_difference_figure(result.comparisons, writer.path(f"{unit}_differences.png")))
    return section


def _held_out_lines(result: Significance, score: str) -> list[str]:
    """Each confirmed configuration's tuning and held-out scores, then the verdict on each budget's tuned winner."""
    tuning, test = f"tuning_{score}", f"test_{score}"
    lines = [f"{row['configuration']} ({row['method']}, {row['budget']:.0%}): {row[tuning]:.2f} on the tuning "
             f"samples, {row[test]:.2f} on the held-out test samples ({row['change']:+.2f})"
             for _, row in result.held_out.iterrows()]
    for _, winner in result.tuned_winners.iterrows():
        verdict = ("worse on the held-out samples than on the samples that selected it" if winner["change"] < 0
                   else "no worse on the held-out samples than on the samples that selected it")
        lines.append(f"The tuned winner at {winner['budget']:.0%}, {winner['configuration']} (best tuning score of "
                     f"the confirmed merging configurations there, {winner[tuning]:.2f}), scores {winner[test]:.2f} "
                     f"on the held-out test samples ({winner['change']:+.2f}): {verdict}.")
    return lines


def _comparison_row(comparison: PairedComparison) -> dict:
    return {"treatment": comparison.treatment, "control": comparison.control, "unit": comparison.unit,
            "seeds": len(comparison.seeds), "units": len(comparison.units), "control_score": comparison.control_mean,
            "treatment_score": comparison.treatment_mean, "gain": comparison.gain, "ci_low": comparison.ci.low,
            "ci_high": comparison.ci.high, "confidence": comparison.ci.confidence, "p_value": comparison.p_value,
            "p_exact": comparison.p_exact, "better_units": f"{comparison.better_units}/{len(comparison.units)}"}


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
    """The sweep in a few lines: its id and status, the anchors (base press, paper default) and best trial, then
    every configuration's score on the held-out test samples when the sweep has a test stage."""
    lines = [f"GRKV sweep {runs.sweep_id} ({runs.parent_status}, {len(runs.trials)} finished trial(s))"]
    trials = runs.trials
    if trials.empty or score not in trials:
        return "\n".join(lines)
    anchors = []
    for name in (EVICTION_ONLY, PAPER_DEFAULT):
        row = runs.baseline_trial(name)
        if row is not None:
            anchors.append(f"{name} (trial {int(row['trial_number'])}) {row[score]:.2f}")
    best = trials.loc[trials[score].idxmax()]
    searched = ["merge", *runs.search_space]
    settings = ", ".join(f"{p}={format_value(best[p], '{:.3g}')}" for p in searched if pd.notna(best.get(p)))
    anchors.append(f"best trial {int(best['trial_number'])} {best[score]:.2f} ({settings})")
    lines.append(f"{score}: " + "; ".join(anchors))
    if runs.has_test_stage and score in runs.test_trials:
        lines.append(f"{score} on {runs.test_sample_count} held-out test samples: " + "; ".join(
            f"{row['configuration']} ({row['budget']:.0%}) {row[score]:.2f}" for _, row in runs.test_trials.iterrows()))
    return "\n".join(lines)


def text_summary(runs: SweepRuns, sections: list[Section], score: str = "mean_score") -> str:
    """The report as plain text: the headline, then each section's findings."""
    lines = [headline(runs, score)]
    for section in sections:
        lines.append(f"\n[{section.title}]")
        lines += [f"  {line}" for line in section.lines]
    return "\n".join(lines) + "\n"
