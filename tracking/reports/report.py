"""The sweep report: every analysis, its tables and figures, one HTML page, a text summary, MLflow artifacts.

Each comparison is made on the score and on the answer metrics (continuous, so they separate configurations the
binary score ties on); a metric that ties everywhere says so in one line instead of a NaN or a [0, 0] interval.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
from mlflow.tracking import MlflowClient

from grkv_core.metrics import ANSWER_METRICS, STREAM_METRICS
from grkv_core.stream_options import STREAM_NLL, STREAM_PROTOCOLS
from tracking.reports import figures
from tracking.reports.analyses.ablation import ablation_table
from tracking.reports.analyses.depth_window import depth_window
from tracking.reports.analyses.loss_performance import loss_performance
from tracking.reports.analyses.resources import iso_resource
from tracking.reports.analyses.screening import screening
from tracking.reports.data import SweepRuns, load_sweep
from tracking.reports.options import ReportOptions
from tracking.reports.render import Section, TableWriter, html_page
from tracking.reports.sections.ablation import ablation_section
from tracking.reports.sections.depth import depth_section
from tracking.reports.sections.importances import optuna_section
from tracking.reports.sections.losses import loss_section, screening_section
from tracking.reports.sections.resources import resource_section
from tracking.reports.sections.significance import significance_section
from tracking.reports.summary import finding, headline, text_summary

ARTIFACT_DIR = "report"
REPORT_PAGE = "report.html"


@dataclass
class Report:
    """What a report run produced: the files written, the text summary, where the artifacts went."""

    runs: SweepRuns
    output_dir: Path
    files: list[Path]
    summary: str
    artifact_uri: str | None


def build_report(
    client: MlflowClient,
    sweep_id: str,
    output_dir: str | Path,
    *,
    experiment: str | None = None,
    options: ReportOptions = ReportOptions(),
    log_artifacts: bool = True,
) -> Report:
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
    if runs.protocol in STREAM_PROTOCOLS and options.score == ReportOptions.score:
        # NOTE: a bounded-cache sweep scores no benchmark: its first objective is what it measures.
        options = replace(options, score=runs.objectives[0].metric)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    writer = TableWriter(output_dir)
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
    section = Section(
        "Sweep",
        lines=[
            f"Parent run {runs.parent_run_id} ({runs.parent_status}) in experiment {runs.experiment_id}.",
            f"Model {params.get('model.name', '?')}, {_what_is_measured(runs)}, "
            f"data seed {runs.data_seed}" + (f"; {len(runs.task_names)} task(s)." if runs.task_names else "."),
            f"Child runs: {counts}. Finished runs per stage: {stages}. Analyses use the {len(runs.trials)} "
            "full-stage trial(s) (scored on the tuning samples) unless a section says otherwise.",
            *runs.notes,
        ],
    )
    if runs.trials.empty:
        section.lines.append("No finished trials yet: nothing to analyse.")
    return section


def _what_is_measured(runs: SweepRuns) -> str:
    params = runs.parent_params
    if runs.protocol not in STREAM_PROTOCOLS:
        return (
            f"dataset {params.get('data.dataset', '?')}, press {runs.press_name} at compression ratio "
            f"{params.get('press.compression_ratio', '?')}"
        )
    streamed = (
        f"{params.get('data.texts', '?')} texts"
        if runs.protocol == STREAM_NLL
        else f"dataset {params.get('data.dataset', '?')}, contexts"
    )
    return (
        f"{streamed} streamed through {runs.press_name} kept at {params.get('press.target_size', '?')} tokens every "
        f"{params.get('press.compression_interval', '?')}"
    )


def compared_metrics(runs: SweepRuns, score: str = "mean_score") -> list[str]:
    """``score``, then each answer (or bounded-cache) metric that a full- or test-stage run logged: what the report
    compares."""
    logged = [
        metric
        for metric in (*ANSWER_METRICS, *STREAM_METRICS)
        if any(metric in frame and frame[metric].notna().any() for frame in (runs.trials, runs.test_trials))
    ]
    return list(dict.fromkeys([score, *logged]))


def _analyses(runs: SweepRuns, writer: TableWriter, options: ReportOptions) -> list[Section]:
    every_run = pd.concat([runs.screen_trials, runs.trials, runs.test_trials], ignore_index=True)
    every_run.to_csv(writer.path("trials.csv"), index=False)
    colors = figures.method_colors(pd.concat([runs.trials["method"], runs.test_trials["method"]]))
    metrics = compared_metrics(runs, options.score)
    sections = [loss_section(loss_performance(runs, tuple(metrics)), colors, writer)]
    if len(runs.screen_trials):
        sections.append(screening_section(screening(runs, options.score), colors, writer))
    iso = {metric: iso_resource(runs, metric, options.ttft_tolerance) for metric in metrics}
    return sections + [
        resource_section(runs, iso, colors, writer, options),
        ablation_section(runs, ablation_table(runs, score=options.score), writer),
        significance_section(runs, writer, options, metrics),
        depth_section(runs, depth_window(runs), writer),
        optuna_section(runs, colors, writer),
    ]
