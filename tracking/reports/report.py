"""The sweep report: every analysis, its tables and figures, one HTML page, a text summary, MLflow artifacts."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from mlflow.tracking import MlflowClient

from grkv_core.config import EVICTION_ONLY, PAPER_DEFAULT, TRIAL_TAG
from tracking.reports import figures
from tracking.reports.analyses import (
    MIB,
    AblationTable,
    IsoResource,
    LossPerformance,
    ablation_table,
    iso_resource,
    loss_performance,
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
from tracking.reports.stats import PairedComparison

ARTIFACT_DIR = "report"
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
    writer.path("report.html").write_text(html_page(title, headline(runs, options.score), sections))
    artifact_uri = None
    if log_artifacts:
        for path in writer.files:
            client.log_artifact(runs.parent_run_id, str(path), ARTIFACT_DIR)
        artifact_uri = f"{client.get_run(runs.parent_run_id).info.artifact_uri}/{ARTIFACT_DIR}"
    return Report(runs, output_dir, writer.files, summary, artifact_uri)


def _overview(runs: SweepRuns) -> Section:
    counts = ", ".join(f"{count} {status}" for status, count in sorted(runs.child_status_counts.items())) or "none"
    params = runs.parent_params
    section = Section("Sweep", lines=[
        f"Parent run {runs.parent_run_id} ({runs.parent_status}) in experiment {runs.experiment_id}.",
        f"Model {params.get('model.name', '?')}, dataset {params.get('data.dataset', '?')}, "
        f"press {runs.press_name} at compression ratio {params.get('press.compression_ratio', '?')}, "
        f"data seed {runs.data_seed}; {len(runs.task_names)} task(s).",
        f"Child runs: {counts}. Analyses use the {len(runs.trials)} FINISHED trial(s).",
        *runs.notes,
    ])
    if runs.trials.empty:
        section.lines.append("No finished trials yet: nothing to analyse.")
    return section


def _analyses(runs: SweepRuns, writer: _Writer, options: ReportOptions) -> list[Section]:
    runs.trials.to_csv(writer.path("trials.csv"), index=False)
    colors = figures.method_colors(runs.trials["method"])
    return [
        _loss_section(loss_performance(runs, options.score), colors, writer),
        _resource_section(runs, iso_resource(runs, options.score, options.ttft_tolerance), colors, writer, options),
        _ablation_section(runs, ablation_table(runs, score=options.score), writer),
        _significance_section(runs, writer, options),
        _optuna_section(runs, colors, writer),
    ]


def _loss_section(result: LossPerformance, colors: dict[str, str], writer: _Writer) -> Section:
    section = Section("Loss–performance correlation")
    table_formats = {"budget": PERCENT, "window_loss": "{:.4g}", "heldout_loss": "{:.4g}",
                     result.score: SCORE_FORMAT}
    display = formatted(result.table, table_formats, {"trial_number": "trial", "lambda_k": "λk", "lambda_v": "λv",
                                                     "window_size": "m", "steps": "S"})
    writer.table("loss_performance", result.table, display)
    correlations = pd.DataFrame([vars(c) for c in result.correlations])
    if correlations.empty:
        section.lines.append("No reconstruction discrepancy metric (window_loss, heldout_loss) was logged.")
        return section
    correlation_display = formatted(correlations, {"pearson_r": "{:+.3f}", "spearman_rho": "{:+.3f}",
                                                   "pearson_p": P_VALUE, "spearman_p": P_VALUE})
    writer.table("correlations", correlations, correlation_display)
    for c in result.correlations:
        section.lines.append(
            f"{c.x} vs {c.y}: Pearson r = {c.pearson_r:+.3f} ({p_value_text(c.pearson_p)}), Spearman ρ = "
            f"{c.spearman_rho:+.3f} ({p_value_text(c.spearman_p)}), n = {c.n}" + (f" — {c.note}" if c.note else ""))
    section.tables += [("Correlations", correlation_display),
                       ("Per configuration (relative discrepancies; score 0-100)", display)]
    section.figures.append(figures.loss_performance_figure(result, colors, writer.path("loss_performance.png")))
    return section


def _resource_section(runs: SweepRuns, result: IsoResource, colors: dict[str, str], writer: _Writer,
                      options: ReportOptions) -> Section:
    score = options.score
    section = Section("Efficiency, memory and iso-resource trade-offs",
                      lines=_iso_memory_lines(result, score) + _iso_prefill_lines(result, score) + result.notes)
    memory_display = formatted(result.iso_memory, {"budget": PERCENT, "kv_mib": "{:.3f}", "ttft_s": "{:.3g}",
                                                   score: SCORE_FORMAT, "gain_vs_eviction": "{:+.2f}"},
                               {"kv_mib": "persistent KV (MiB)", "ttft_s": "TTFT (s)",
                                "gain_vs_eviction": "Δ vs eviction"})
    writer.table("iso_memory", result.iso_memory, memory_display)
    prefill_display = formatted(result.iso_prefill, {
        "merging_budget": PERCENT, "eviction_budget": PERCENT, "merging_ttft_s": "{:.3g}", "eviction_ttft_s": "{:.3g}",
        "merging_kv_mib": "{:.3f}", "eviction_kv_mib": "{:.3f}", f"merging_{score}": SCORE_FORMAT,
        f"eviction_{score}": SCORE_FORMAT, "eviction_minus_merging": "{:+.2f}", "kv_ratio": "{:.2f}",
        "merging_trial": "{:d}", "eviction_trial": "{:.0f}"}, {
        "merging_trial": "trial", "merging_budget": "budget", "merging_ttft_s": "TTFT (s)",
        "merging_kv_mib": "KV (MiB)", f"merging_{score}": score, "eviction_trial": "eviction trial",
        "eviction_budget": "eviction budget", "eviction_ttft_s": "eviction TTFT (s)",
        "eviction_kv_mib": "eviction KV (MiB)", f"eviction_{score}": f"eviction {score}",
        "eviction_minus_merging": "eviction − merging", "kv_ratio": "KV ratio"})
    writer.table("iso_prefill", result.iso_prefill, prefill_display)
    section.tables += [("Iso-memory: methods at the same persistent KV budget", memory_display),
                       (f"Approximate iso-prefill: merging at budget b vs eviction at b' > b with TTFT within "
                        f"±{result.ttft_tolerance:.0%}", prefill_display)]
    trade_offs = [trade_off(runs, "kv_bytes", figures.axis_label("kv_bytes"), scale=MIB, score=score),
                  trade_off(runs, "ttft_s", figures.axis_label("ttft_s"), score=score)]
    for trade in trade_offs:
        trade.points.to_csv(writer.path(f"tradeoff_{trade.cost}.csv"), index=False)
        front = trade.points[trade.points["pareto"]].sort_values("cost")
        section.lines.append(f"Pareto front, {score} vs {trade.cost_label}: trials "
                             + (", ".join(str(int(n)) for n in front["trial_number"]) or "none (cost not logged)"))
    section.figures.append(figures.trade_off_figure(trade_offs, colors, writer.path("tradeoffs.png")))
    return section


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
    if "eviction_trial" not in result.iso_prefill:
        return []
    matched = result.iso_prefill.dropna(subset=["eviction_trial"])
    return [f"Iso-prefill: {row['merging']} (trial {row['merging_trial']}) at {row['merging_budget']:.0%}, TTFT "
            f"{row['merging_ttft_s']:.3g} s: {row[f'merging_{score}']:.2f} vs eviction only (trial "
            f"{int(row['eviction_trial'])}) at {row['eviction_budget']:.0%}, TTFT {row['eviction_ttft_s']:.3g} s, "
            f"{row['kv_ratio']:.2f}x the persistent KV: {row[f'eviction_{score}']:.2f} "
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
    comparisons, notes = significance(runs, options.score, options.bootstrap_resamples, options.seed)
    section = Section("Paired significance over tasks", lines=[
        f"Task-level paired differences: percentile bootstrap with {options.bootstrap_resamples:,} resamples and an "
        f"exact two-sided sign-flip test over all 2^T sign assignments (seed {runs.data_seed} only; give "
        "tracking.reports.compare_configs a tidy table from several sweeps for the multi-seed version).", *notes])
    if not comparisons:
        return section
    section.lines += [
        f"{c.treatment} vs {c.control}: gain {c.gain:+.2f}, {c.ci.confidence:.0%} CI [{c.ci.low:+.2f}, "
        f"{c.ci.high:+.2f}], exact p = {c.p_value:.3g}, better on {c.better_tasks}/{len(c.tasks)} tasks"
        for c in comparisons]
    if any(c.treatment.startswith("best of") for c in comparisons):
        section.lines.append("The best trial is selected on the very scores it is tested on: its gain and p-value "
                             "are optimistic.")
    table = pd.DataFrame([_comparison_row(c) for c in comparisons])
    display = formatted(table, {"control_score": SCORE_FORMAT, "treatment_score": SCORE_FORMAT,
                                "gain": "{:+.2f}", "ci_low": "{:+.2f}", "ci_high": "{:+.2f}", "p_value": P_VALUE},
                        {"control_score": "control score", "treatment_score": "treatment score",
                         "ci_low": "CI low", "ci_high": "CI high", "p_value": "exact p", "better_tasks": "better"})
    writer.table("significance", table, display)
    section.tables.append(("Treatment vs the eviction-only base press", display))
    section.figures.append(figures.task_difference_figure(comparisons, writer.path("task_differences.png")))
    return section


def _comparison_row(comparison: PairedComparison) -> dict:
    return {"treatment": comparison.treatment, "control": comparison.control, "seeds": len(comparison.seeds),
            "tasks": len(comparison.tasks), "control_score": comparison.control_mean,
            "treatment_score": comparison.treatment_mean, "gain": comparison.gain, "ci_low": comparison.ci.low,
            "ci_high": comparison.ci.high, "confidence": comparison.ci.confidence, "p_value": comparison.p_value,
            "better_tasks": f"{comparison.better_tasks}/{len(comparison.tasks)}"}


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
    """The sweep in two lines: its id and status, then the anchors (base press, paper default) and best trial."""
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
    return "\n".join(lines + [f"{score}: " + "; ".join(anchors)])


def text_summary(runs: SweepRuns, sections: list[Section], score: str = "mean_score") -> str:
    """The report as plain text: the headline, then each section's findings."""
    lines = [headline(runs, score)]
    for section in sections:
        lines.append(f"\n[{section.title}]")
        lines += [f"  {line}" for line in section.lines]
    return "\n".join(lines) + "\n"
