"""Check a sweep in the MLflow UI as a person sees it, in a real headless Chromium, and save screenshots.

    python -m tracking.ui_check --tracking-uri http://127.0.0.1:5000 --experiment grkv-smoke [--sweep-id ID]

Opens the sweep's runs page (``mlflow_tracker.runs_page_url``), its best child run's page and the parent run's
artifacts, each in a fresh browser profile (a first visit), and asserts what must be visible: the runs table
with the readable run names and the objective's values, as model training (not MLflow 3's GenAI overview) and
without the usage-data notice; the run page with its parameters and metrics; the report on the parent. Exits 1
with one line per failed check. Needs ``chromium`` (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from mlflow.tracking import MlflowClient

from tracking.mlflow_tracker import SHARED_VIEW_TAG_PREFIX, WORKFLOW_TYPE_PARAM, runs_page_url
from tracking.reports.report import ARTIFACT_DIR, REPORT_PAGE
from workers.names import ROLE_TAG, SWEEP_TAG

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
# The browser window: wide enough for the runs table beside MLflow's assistant panel (open on a first visit);
# the run page is taller, to show its parameters and metrics.
WINDOW_WIDTH, WINDOW_HEIGHT, RUN_PAGE_HEIGHT = 1600, 1000, 1700
# Virtual time the page gets to fetch and render before the DOM or the screenshot is taken (ms).
RENDER_BUDGET_MS = 20000
RENDER_TIMEOUT_S = 120
# Rows the runs table shows without scrolling at WINDOW's height; only those are looked for.
VISIBLE_ROWS = 15
TELEMETRY_NOTICE = "MLflow collects usage data"
# Texts only MLflow 3's GenAI experiment pages show (its side navigation and overview).
GENAI_MARKERS = ("Overview", "Training runs", "Evaluation runs", "Prompts & versions")


class UICheckError(RuntimeError):
    """The UI cannot be checked at all (no browser, no sweep)."""


def find_chromium() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    raise UICheckError(f"no Chromium found (looked for {', '.join(CHROMIUM_NAMES)}); apt-get install chromium")


class _Text(HTMLParser):
    HIDDEN = {"script", "style", "noscript", "title"}

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag, attrs) -> None:
        self.hidden += tag in self.HIDDEN

    def handle_endtag(self, tag) -> None:
        self.hidden -= tag in self.HIDDEN

    def handle_data(self, data: str) -> None:
        if data.strip() and not self.hidden:
            self.parts.append(data.strip())


def visible_text(html: str) -> str:
    """The page's text, one element's text a line."""
    parser = _Text()
    parser.feed(html)
    return "\n".join(parser.parts)


def render(chromium: str, url: str, screenshot: Path | None = None, height: int = WINDOW_HEIGHT) -> str:
    """The DOM of ``url`` once rendered, in a fresh profile; with ``screenshot``, a PNG of the page too."""
    with tempfile.TemporaryDirectory(prefix="grkv-ui-") as profile:
        args = [
            chromium,
            "--headless=new",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={profile}",
            f"--window-size={WINDOW_WIDTH},{height}",
            f"--virtual-time-budget={RENDER_BUDGET_MS}",
        ]
        if os.geteuid() == 0:
            args.append("--no-sandbox")  # NOTE: Chromium refuses to start as root with its sandbox on
        dom = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=RENDER_TIMEOUT_S)
        if dom.returncode != 0 or not dom.stdout:
            raise UICheckError(f"chromium could not render {url}: {dom.stderr.strip()[-500:]}")
        if screenshot is not None:
            shot = subprocess.run(
                [*args, f"--screenshot={screenshot}", url], capture_output=True, text=True, timeout=RENDER_TIMEOUT_S
            )
            if shot.returncode != 0 or not screenshot.exists():
                raise UICheckError(f"chromium took no screenshot of {url}: {shot.stderr.strip()[-500:]}")
        return dom.stdout


def metric_text(value: float) -> str:
    """A metric value as the MLflow UI prints it (JavaScript's number to string)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass
class Report:
    failures: list[str] = field(default_factory=list)
    screenshots: list[Path] = field(default_factory=list)

    def expect(self, condition: bool, what: str) -> None:
        if not condition:
            self.failures.append(what)


def latest_sweep(client: MlflowClient, experiment_id: str) -> str:
    parents = client.search_runs(
        [experiment_id], f"tags.`{ROLE_TAG}` = 'sweep'", max_results=1, order_by=["attributes.start_time DESC"]
    )
    if not parents:
        raise UICheckError(f"experiment {experiment_id} holds no sweep (no run tagged {ROLE_TAG}=sweep)")
    return parents[0].data.tags[SWEEP_TAG]


def check_sweep(
    tracking_uri: str, experiment: str, sweep_id: str | None, out_dir: Path, chromium: str | None = None
) -> Report:
    """Render the sweep's pages, save ``runs.png``, ``run.png`` and ``parent-report.png`` in ``out_dir`` and
    return what failed."""
    chromium = chromium or find_chromium()
    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise UICheckError(f"experiment {experiment!r} does not exist at {tracking_uri}")
    experiment_id = found.experiment_id
    sweep_id = sweep_id or latest_sweep(client, experiment_id)
    view_tag = found.tags.get(SHARED_VIEW_TAG_PREFIX + sweep_id)
    if view_tag is None:
        raise UICheckError(f"sweep {sweep_id!r} has no runs view in experiment {experiment!r} (logged before it?)")
    view = json.loads(view_tag)
    objective = view["orderByKey"].removeprefix("metrics.`").removesuffix("`")
    runs = client.search_runs([experiment_id], f"tags.`{SWEEP_TAG}` = '{sweep_id}'", max_results=1000)
    parent = next(run for run in runs if run.data.tags[ROLE_TAG] == "sweep")
    scored = sorted(
        (run for run in runs if math.isfinite(run.data.metrics.get(objective, math.nan))),
        key=lambda run: run.data.metrics[objective],
        reverse=not view["orderByAsc"],
    )
    if not scored:
        raise UICheckError(f"no run of sweep {sweep_id!r} has its objective {objective!r} yet")
    best = scored[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report()

    with urllib.request.urlopen(f"{tracking_uri.rstrip('/')}/ajax-api/3.0/mlflow/ui-telemetry", timeout=10) as answer:
        ui_telemetry = json.load(answer)
    report.expect(
        ui_telemetry.get("disable_ui_telemetry") is True,
        f"the server collects UI telemetry ({ui_telemetry}); start it with MLFLOW_DISABLE_TELEMETRY=true",
    )

    shot = out_dir / "runs.png"
    text = visible_text(render(chromium, runs_page_url(tracking_uri, experiment_id, sweep_id), shot))
    report.screenshots.append(shot)
    report.expect("Run Name" in text, "runs page: no runs table (no 'Run Name' column)")
    report.expect(
        not any(marker in text.splitlines() for marker in GENAI_MARKERS),
        f"runs page: MLflow's GenAI pages show ({[m for m in GENAI_MARKERS if m in text.splitlines()]})",
    )
    report.expect(TELEMETRY_NOTICE not in text, "runs page: the usage-data (telemetry) notice shows")
    report.expect(parent.info.run_name in text, f"runs page: the parent run {parent.info.run_name!r} is not listed")
    for run in scored[: VISIBLE_ROWS - 1]:
        report.expect(run.info.run_name in text, f"runs page: run {run.info.run_name!r} is not listed")
    report.expect(objective in text, f"runs page: no {objective} column")
    report.expect(
        metric_text(best.data.metrics[objective]) in text.splitlines(),
        f"runs page: the best {objective} {metric_text(best.data.metrics[objective])} is not shown",
    )

    base = f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs"
    shot = out_dir / "run.png"
    text = visible_text(render(chromium, f"{base}/{best.info.run_id}?{WORKFLOW_TYPE_PARAM}", shot, RUN_PAGE_HEIGHT))
    report.screenshots.append(shot)
    lines = text.splitlines()
    report.expect(best.info.run_name in text, f"run page: no run name {best.info.run_name!r}")
    report.expect(TELEMETRY_NOTICE not in text, "run page: the usage-data (telemetry) notice shows")
    for name in ("compression_ratio", "merge"):
        report.expect(
            name in lines and best.data.params[name] in lines,
            f"run page: parameter {name} = {best.data.params[name]} not shown",
        )
    report.expect(
        objective in lines and metric_text(best.data.metrics[objective]) in lines,
        f"run page: metric {objective} = {metric_text(best.data.metrics[objective])} not shown",
    )

    # The parent's artifacts, the report's page selected (its folder then lists the report's files).
    shot = out_dir / "parent-report.png"
    page = f"{base}/{parent.info.run_id}/artifacts/{ARTIFACT_DIR}/{REPORT_PAGE}?{WORKFLOW_TYPE_PARAM}"
    lines = visible_text(render(chromium, page, shot)).splitlines()
    report.screenshots.append(shot)
    logged = [artifact.path for artifact in client.list_artifacts(parent.info.run_id)]
    report.expect(ARTIFACT_DIR in logged, f"parent run: no report logged under {ARTIFACT_DIR}/ (grkv-report)")
    for path in [*logged, *(artifact.path for artifact in client.list_artifacts(parent.info.run_id, ARTIFACT_DIR))]:
        report.expect(Path(path).name in lines, f"parent run's artifacts: {path} not listed")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tracking.ui_check", description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", required=True, help="the MLflow server's address (http://...)")
    parser.add_argument("--experiment", required=True)
    parser.add_argument("--sweep-id", help="the sweep to check (default: the latest in the experiment)")
    parser.add_argument("--out", type=Path, default=Path("mlflow-ui"), help="folder for the screenshots")
    args = parser.parse_args(argv)
    try:
        report = check_sweep(args.tracking_uri, args.experiment, args.sweep_id, args.out)
    except UICheckError as error:
        print(f"ui_check: {error}", file=sys.stderr)
        return 2
    for failure in report.failures:
        print(f"ui_check: FAILED: {failure}", file=sys.stderr)
    print(
        f"ui_check: {'ok' if not report.failures else f'{len(report.failures)} failed'}; screenshots: "
        + ", ".join(str(path) for path in report.screenshots)
    )
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
