"""A sweep in MLflow as a person sees it: the runs' names, the experiment's kind and runs view (on a SQLite store),
and the UI itself in a real headless Chromium against a real MLflow server (slow; skipped without Chromium).

``GRKV_UI_SCREENSHOTS=benchmarks/results/mlflow-ui`` keeps the browser test's screenshots there.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import free_ports, sqlite_tracking_store

from grkv_core.config import PressConfig
from grkv_core.presses.from_config import resolved
from sweeps.config import SweepConfig
from sweeps.space import press_of, suggest_press
from tracking.mlflow_tracker import (
    EXPERIMENT_KIND_TAG,
    MODEL_TRAINING_KIND,
    SHARED_VIEW_TAG_PREFIX,
    SweepTracker,
    TrackingUnavailableError,
    check_tracking_server,
)
from tracking.reports.report import build_report
from tracking.ui_check import CHROMIUM_NAMES, GENAI_MARKERS, check_sweep, render, visible_text
from workers.names import BASELINE_TAG, EVICTION_ONLY, PAPER_DEFAULT, PARENT_TAG, SCREEN_STAGE, TEST_STAGE
from workers.protocol import TrialOutcome, WorkerIdentity

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)
EXPERIMENT, SWEEP = "grkv-ui", "ui-check"
PAPER = {
    "merge": "grkv",
    "lambda_k_is_zero": False,
    "lambda_k": 0.01,
    "lambda_v": 0.01,
    "beta": 0.1,
    "window_size": 32,
    "steps": 1,
    "components": "kv",
}
BEST = PAPER | {"lambda_v": 0.3, "beta": 0.2, "window_size": 16}
NO_LAMBDA_K = PAPER | {"lambda_k_is_zero": True, "components": "v"}
# Every kind of child run and the name it must carry; the trial that failed without a result keeps its start name.
EXPECTED_NAMES = {
    "screen t0 snapkv 25% + grkv λk=0.01 λv=0.3 β=0.2 m=16 S=1 components=kv",
    "screen t1 snapkv 25% + grkv λk=0 λv=0.01 β=0.1 m=32 S=1 components=v",
    "t0 baseline paper_default snapkv 25% + grkv λk=0.01 λv=0.01 β=0.1 m=32 S=1 components=kv",
    "t1 baseline eviction_only snapkv 25%",
    "t2 snapkv 25% + grkv λk=0.01 λv=0.3 β=0.2 m=16 S=1 components=kv",
    "t3 snapkv 25% + grkv λk=0 λv=0.01 β=0.1 m=32 S=1 components=v",
    "t4",
    "test t2 snapkv 25% + grkv λk=0.01 λv=0.3 β=0.2 m=16 S=1 components=kv",
    "test eviction_only@0.5 snapkv 50%",
}


def smoke_config(tracking_uri: str) -> SweepConfig:
    config = yaml.safe_load((REPO / "sweeps/configs/smoke.yaml").read_text())
    config["tracking"] = {"tracking_uri": tracking_uri, "experiment": EXPERIMENT}
    return SweepConfig.model_validate(config)


def log_sweep(tracking_uri: str) -> SweepTracker:
    """The smoke config's stages through the tracker the driver uses: two screening trials, the two baselines,
    two searched trials, a trial lost with its worker, and two test-stage evaluations; then the report."""
    config = smoke_config(tracking_uri)
    tracker = SweepTracker.open(tracking_uri, EXPERIMENT, SWEEP, config.model_dump(mode="json"))
    worker = WorkerIdentity(pid=1, node_id="node", actor_id="actor", model_loads=1, trials_evaluated=1, samples=2)

    def run(number, press: PressConfig, score, params=None, baseline=None, stage="full", test_of=None):
        run_id = tracker.start_trial(number, params or {}, baseline, stage=stage, test_of=test_of)
        screening = stage == SCREEN_STAGE
        summary = {
            "mean_score": None if screening else score,
            "tasks": {} if screening else {"niah_single_1": score},
            "costs": {"kv_bytes": 1e6, "window_loss": 0.05, "question_loss": 1 - score / 100},
        }
        outcome = TrialOutcome(
            number,
            "ok",
            started_at=0.0,
            finished_at=1.0,
            worker=worker,
            summary=summary,
            resolved_press=resolved(press),
            stage=stage,
            test_of=test_of,
            samples=[{"sample_id": "s0", "task": "niah_single_1", "predictions": ["x"], "scores": [score]}],
        )
        tracker.finish_trial(run_id, outcome, outcome.worker_timing())

    def trial(number, params, score, **kwargs):
        run(number, press_of(params, config, {BASELINE_TAG: kwargs.get("baseline")}), score, params, **kwargs)

    trial(0, BEST, 40.0, stage=SCREEN_STAGE)
    trial(1, NO_LAMBDA_K, 20.0, stage=SCREEN_STAGE)
    trial(0, PAPER, 62.5, baseline=PAPER_DEFAULT)
    trial(1, {}, 50.0, baseline=EVICTION_ONLY)
    trial(2, BEST, 75.0)
    trial(3, NO_LAMBDA_K, 37.5)
    tracker.fail_trial(tracker.start_trial(4, BEST), TrialOutcome.lost(4, "worker died"))
    run(None, suggest_press(optuna.trial.FixedTrial(BEST), config), 80.0, stage=TEST_STAGE, test_of="2")
    run(None, PressConfig("snapkv", 0.5), 60.0, stage=TEST_STAGE, test_of=f"{EVICTION_ONLY}@0.5")
    tracker.update_parent([{"number": 2, "values": [75.0]}], 4, {})
    tracker.close("FINISHED")
    return tracker


def test_runs_are_named_nested_and_the_experiment_opens_on_them(tmp_path):
    uri = sqlite_tracking_store(tmp_path, EXPERIMENT)
    tracker = log_sweep(uri)
    client = tracker.client
    parent = client.get_run(tracker.parent_run_id)
    assert parent.info.run_name == f"sweep {SWEEP}"
    assert parent.data.params["press.name"] == "snapkv" and parent.data.params["screening.trials"] == "4"
    children = client.search_runs([tracker.experiment_id], f"tags.`{PARENT_TAG}` = '{tracker.parent_run_id}'")
    assert {run.info.run_name for run in children} == EXPECTED_NAMES
    tags = client.get_experiment(tracker.experiment_id).tags
    assert tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND
    view = json.loads(tags[SHARED_VIEW_TAG_PREFIX + SWEEP])
    assert view["orderByKey"] == "metrics.`mean_score`" and view["orderByAsc"] is False
    assert view["selectedColumns"] == ["metrics.`mean_score`", "metrics.`question_loss`"]
    assert view["searchFilter"] == f"tags.`grkv.sweep_id` = '{SWEEP}'"
    # A resumed sweep's parent keeps its run and gets the readable name (sweeps logged before were named by id).
    client.update_run(tracker.parent_run_id, name=SWEEP)
    reopened = SweepTracker.open(uri, EXPERIMENT, SWEEP, smoke_config(uri).model_dump(mode="json"))
    assert reopened.parent_run_id == tracker.parent_run_id
    assert client.get_run(tracker.parent_run_id).info.run_name == f"sweep {SWEEP}"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow server on a free port, SQLite and local artifacts in a temporary folder, telemetry and the
    job runner off as infra/local/start.sh starts it."""
    root = tmp_path_factory.mktemp("mlflow-ui")
    uri = f"http://127.0.0.1:{free_ports(1)[0]}"
    log = (root / "server.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            uri.rsplit(":", 1)[1],
            "--backend-store-uri",
            f"sqlite:///{root}/mlflow.db",
            "--default-artifact-root",
            str(root / "artifacts"),
            "--workers",
            "1",
        ],
        cwd=root,
        env=dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 180
        while True:
            try:
                check_tracking_server(uri)
                break
            except TrackingUnavailableError:
                if time.time() > deadline or server.poll() is not None:
                    raise AssertionError(f"MLflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
                time.sleep(1)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None, reason=f"no Chromium binary ({', '.join(CHROMIUM_NAMES)}): apt-get install chromium"
)
def test_the_ui_shows_the_sweep_as_model_training_runs(mlflow_server, tmp_path):
    tracker = log_sweep(mlflow_server)
    build_report(tracker.client, SWEEP, tmp_path / "report", experiment=EXPERIMENT)
    shots = Path(os.environ.get("GRKV_UI_SCREENSHOTS", tmp_path / "screenshots"))
    report = check_sweep(mlflow_server, EXPERIMENT, SWEEP, shots, CHROMIUM)
    assert report.failures == []
    assert all(path.stat().st_size > 10_000 for path in report.screenshots)
    # The check's GenAI markers are what MLflow 3 shows on the experiment's plain address, so their absence on
    # the runs page means something.
    plain = visible_text(
        render(CHROMIUM, f"{mlflow_server}/#/experiments/{tracker.experiment_id}", shots / "plain-address.png")
    ).splitlines()
    assert any(marker in plain for marker in GENAI_MARKERS)
