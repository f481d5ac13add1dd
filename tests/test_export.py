"""``grkv export`` and ``press_from_file``: synthetic sweeps logged through the driver's own tracker into a real
MLflow store (SQLite), exported, built back and evaluated."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import json

import pytest
import yaml
from conftest import sqlite_tracking_store
from mlflow.tracking import MlflowClient

from grkv_core.config import PressConfig
from grkv_core.presses.from_config import build, load_press_config, press_from_file, resolved
from sweeps.cli import main
from sweeps.config import SweepConfig
from tracking.mlflow_tracker import SweepTracker
from workers.names import PRESS_ARTIFACT, TEST_STAGE
from workers.protocol import TrialOutcome, WorkerIdentity

EXPERIMENT = "grkv-export-test"
TASK = "niah_single_1"
# Every trial's press differs in options the file must carry exactly (floats that do not round nicely, a
# switched-off safeguard, None caps among GRKV's defaults).
TRIALS = {
    0: PressConfig(
        "snapkv",
        0.8,
        "grkv",
        {"lambda_k": 0.01, "lambda_v": 0.01, "safeguard": False, "cg_max_iter": 200, "cg_rtol": 1e-7},
    ),
    1: PressConfig("snapkv", 0.8, "none"),
    2: PressConfig(
        "snapkv",
        0.8,
        "grkv",
        {"lambda_k": 0.0, "lambda_v": 0.123456789012345, "beta": 0.2718281828, "window_size": 16, "components": "v"},
    ),
    3: PressConfig("snapkv", 0.8, "grkv", {"lambda_k": 3.3e-05, "lambda_v": 1.7, "steps": 2}),
}
BASELINES = {0: "paper_default", 1: "eviction_only"}


def sweep_config(test_samples: int) -> dict:
    return SweepConfig.model_validate(
        {
            "name": "export",
            "model": {"name": "tiny-llama", "dtype": "float32"},
            "data": {"tasks": [TASK], "context_length": 512, "samples": 2, "test": {"samples": test_samples}},
            "press": {"name": "snapkv", "compression_ratio": 0.8},
            "merge": ["grkv"],
            "search_space": {"lambda_k": {"type": "float", "low": 1e-4, "high": 10.0, "log": True}},
            "trials": 4,
            "test": {"top_k": 2, "eviction_ratios": [0.7] if test_samples else []},
        }
    ).model_dump(mode="json")


def finish(tracker: SweepTracker, run_id: str, press: PressConfig, score: float, held_out: bool) -> None:
    """Close a run as a worker's outcome would: the press as it ran, its score and (held out) its predictions."""
    worker = WorkerIdentity(pid=1, node_id="node", actor_id="actor", model_loads=1, trials_evaluated=1, samples=2)
    samples = (
        [{"sample_id": index, "task": TASK, "predictions": ["x"], "scores": [score / 100]} for index in range(2)]
        if held_out
        else []
    )
    outcome = TrialOutcome(
        0,
        "ok",
        started_at=0.0,
        finished_at=1.0,
        worker=worker,
        resolved_press=resolved(press),
        summary={"mean_score": score, "tasks": {TASK: score}, "costs": {}},
        samples=samples,
    )
    tracker.finish_trial(run_id, outcome, outcome.worker_timing())


def log_sweep(store: str, sweep_id: str, tuning: dict[int, float], held_out: dict[str, float]) -> str:
    """A sweep with full trials ``TRIALS`` scored ``tuning`` and test-stage runs scored ``held_out`` (by what they
    test: a trial number, a baseline, ``eviction_only@0.7``); returns the parent run's id."""
    tracker = SweepTracker.open(store, EXPERIMENT, sweep_id, sweep_config(len(held_out) and 2))
    for number, score in tuning.items():
        run_id = tracker.start_trial(number, {}, BASELINES.get(number))
        finish(tracker, run_id, TRIALS[number], score, held_out=False)
    for test_of, score in held_out.items():
        tested = (
            PressConfig("snapkv", 0.7)
            if "@" in test_of
            else TRIALS[int(test_of)]
            if test_of.isdigit()
            else TRIALS[{v: k for k, v in BASELINES.items()}[test_of]]
        )
        finish(tracker, tracker.start_trial(None, {}, stage=TEST_STAGE, test_of=test_of), tested, score, True)
    tracker.close("FINISHED")
    return tracker.parent_run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return sqlite_tracking_store(tmp_path_factory.mktemp("mlflow"), EXPERIMENT)


def export(store, sweep_id, tmp_path, *extra) -> tuple[PressConfig, str]:
    output = tmp_path / f"{sweep_id}.yaml"
    assert main(["export", "--sweep-id", sweep_id, "--tracking-uri", store, "--output", str(output), *extra]) == 0
    return load_press_config(output), output.read_text()


def test_export_round_trips_every_trials_press_exactly(store, tmp_path):
    log_sweep(store, "round-trip", {0: 20.0, 1: 10.0, 2: 30.0, 3: 25.0}, {})
    client = MlflowClient(store)
    for number, press in TRIALS.items():
        loaded, text = export(store, "round-trip", tmp_path, "--trial", str(number), "--no-log-artifacts")
        # Every option of the merger, defaults included, each one as the trial ran it; and the same press.
        assert resolved(loaded) == resolved(press)
        assert press_from_file(tmp_path / "round-trip.yaml") == build(press)
        assert f"chosen: {BASELINES.get(number, f'trial {number}')} (trial {number}, chosen with --trial)" in text
    run = client.search_runs(
        [client.get_experiment_by_name(EXPERIMENT).experiment_id],
        "tags.`grkv.sweep_id` = 'round-trip' and tags.`grkv.role` = 'sweep'",
    )[0]
    assert PRESS_ARTIFACT not in {a.path for a in client.list_artifacts(run.info.run_id)}


def test_default_is_the_best_test_stage_configuration_at_the_sweeps_budget(store, tmp_path, capsys):
    # Eviction-only at 30% scores best on the held-out samples but is a reference at a larger budget; trials 2
    # and 3 tie on them, and trial 3 scored better on the tuning samples.
    parent = log_sweep(
        store,
        "with-test",
        {0: 20.0, 1: 10.0, 2: 25.0, 3: 30.0},
        {"2": 50.0, "3": 50.0, "paper_default": 40.0, "eviction_only": 10.0, "eviction_only@0.7": 90.0},
    )
    loaded, text = export(store, "with-test", tmp_path)
    assert resolved(loaded) == resolved(TRIALS[3])
    assert "chosen: trial 3 (best of the test stage: mean_score 50 on 2 held-out sample(s))" in text
    assert f"press file: {tmp_path / 'with-test.yaml'}; logged to" in capsys.readouterr().out
    logged = MlflowClient(store).download_artifacts(parent, PRESS_ARTIFACT, str(tmp_path / "artifact"))
    assert open(logged).read() == text


def test_export_reads_the_test_stages_predictions_only(store, tmp_path, monkeypatch):
    """The end of a sweep of thousands of trials exports in seconds: one download per test-stage run, none per trial
    (the report reads those)."""
    import mlflow.artifacts

    held_out = {"2": 50.0, "3": 40.0, "eviction_only": 10.0}
    log_sweep(store, "downloads", {0: 20.0, 1: 10.0, 2: 25.0, 3: 30.0}, held_out)
    downloaded, download = [], mlflow.artifacts.download_artifacts
    monkeypatch.setattr(
        mlflow.artifacts, "download_artifacts", lambda **kwargs: downloaded.append(kwargs) or download(**kwargs)
    )
    loaded, text = export(store, "downloads", tmp_path, "--no-log-artifacts")
    assert resolved(loaded) == resolved(TRIALS[2]) and "on 2 held-out sample(s)" in text
    assert len(downloaded) == len(held_out)


def test_a_recommendation_that_only_ties_eviction_only_on_the_test_stage_says_so(store, tmp_path):
    log_sweep(
        store,
        "tied",
        {0: 20.0, 1: 10.0, 2: 25.0, 3: 30.0},
        {"2": 40.0, "3": 50.0, "paper_default": 40.0, "eviction_only": 50.0, "eviction_only@0.7": 90.0},
    )
    loaded, text = export(store, "tied", tmp_path, "--no-log-artifacts")
    assert resolved(loaded) == resolved(TRIALS[3])
    assert (
        "(best of the test stage: mean_score 50 on 2 held-out sample(s); eviction-only scores the same there: "
        "no merging configuration beat the base press)"
    ) in text


def test_without_a_test_stage_the_main_studys_best_trial_is_exported(store, tmp_path):
    log_sweep(store, "no-test", {0: 20.0, 1: 10.0, 2: 35.0, 3: 30.0}, {})
    loaded, text = export(store, "no-test", tmp_path, "--no-log-artifacts")
    assert resolved(loaded) == resolved(TRIALS[2])
    assert "best trial of the main study: mean_score 35 on the tuning samples" in text


def test_export_errors_are_one_line(store, tmp_path, capsys):
    log_sweep(store, "errors", {0: 20.0, 1: 10.0}, {})
    assert main(["export", "--sweep-id", "errors", "--tracking-uri", store, "--trial", "7"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "has no finished trial 7 (finished: [0, 1])" in error
    assert main(["export", "--sweep-id", "missing", "--tracking-uri", store]) == 4
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize(
    "content, problem",
    [
        ("press: snapkv\nmerge: grkv\nmerge_options: {lambda_k: -1}\n", "lambda_k must be a finite number >= 0"),
        ("press: snapkv\nratio: 0.5\n", "unknown field(s) ['ratio']"),
        ("- snapkv\n", "expected a mapping with at least 'press'"),
        ("press: snapkv\nmerge: grkv\nmerge_options: {lambda_q: 1}\n", "unknown option(s) ['lambda_q']"),
    ],
)
def test_a_bad_press_file_is_refused_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "press.yaml"
    path.write_text(content)
    with pytest.raises(ValueError) as error:
        press_from_file(path)
    assert str(path) in str(error.value) and problem in str(error.value)


def test_grkv_eval_evaluates_a_press_file(tmp_path, capsys):
    press = TRIALS[2]
    path = tmp_path / "press.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "press": press.press,
                "compression_ratio": press.compression_ratio,
                "merge": press.merge,
                "merge_options": press.merge_options,
            }
        )
    )
    output = tmp_path / "results.json"
    common = [
        "eval",
        "--model",
        "tiny-llama",
        "--dtype",
        "float32",
        "--tasks",
        TASK,
        "--context-length",
        "512",
        "--samples",
        "1",
        "--no-progress",
        "--output",
        str(output),
    ]
    assert main([*common, "--press-config", str(path)]) == 0
    result = json.loads(output.read_text())
    assert result["config"]["press"] == {**press.__dict__, "variant": None}
    assert result["resolved_press"] == resolved(press)
    assert "snapkv 20% + grkv" in capsys.readouterr().out
    assert main([*common, "--press-config", str(path), "--lambda-k", "0.5"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--press-config sets the whole press; drop --lambda-k" in error
