"""The driver-worker boundary: trial requests and outcomes survive JSON (the state directory) exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from grkv_core.config import PressConfig
from grkv_core.options import GRKV_DEFAULTS, HEAD_WEIGHTINGS
from grkv_core.presses.from_config import resolved
from workers.names import FULL_STAGE, SCREEN_STAGE, TEST_STAGE
from workers.protocol import TrialOutcome, TrialRequest, WorkerIdentity, configuration_key

WORKER = WorkerIdentity(pid=7, node_id="n", actor_id="a", model_loads=2, trials_evaluated=3, samples=4)


def through_json(data: dict) -> dict:
    return json.loads(json.dumps(data))


def test_a_request_round_trips_through_json():
    request = TrialRequest(5, PressConfig("snapkv", 0.8, "grkv", {"lambda_k": 0.0, "safeguard": False}))
    assert TrialRequest.from_dict(through_json(request.to_dict())) == request
    assert request.stage == FULL_STAGE and request.key == "5"


def test_requests_of_every_stage_round_trip_through_json():
    screen = TrialRequest(0, PressConfig("snapkv", 0.8, "grkv", {"beta": 0.2}), SCREEN_STAGE)
    test = TrialRequest(None, PressConfig("snapkv", 0.7), TEST_STAGE, test_of="eviction_only@0.7")
    for request in (screen, test):
        assert TrialRequest.from_dict(through_json(request.to_dict())) == request
    assert test.key == "eviction_only@0.7" and str(test) == "test of eviction_only@0.7"
    assert str(screen) == "screen trial 0"


def test_a_request_from_before_stages_reads_as_a_full_trial():
    stored = {"trial_number": 3, "press": {"press": "snapkv", "compression_ratio": 0.8}}
    assert TrialRequest.from_dict(stored) == TrialRequest(3, PressConfig("snapkv", 0.8), FULL_STAGE)


def test_finished_and_lost_outcomes_round_trip_through_json():
    press = PressConfig("snapkv", 0.8, "grkv", {"lambda_k": 0.0})
    finished = TrialOutcome(
        5,
        "ok",
        started_at=10.0,
        finished_at=12.5,
        batch_trials=2,
        worker=WORKER,
        resolved_press=resolved(press),
        summary={"mean_score": 50.0, "tasks": {"a": 50.0}},
        samples=[{"sample_id": "a-0", "predictions": ["x"], "scores": [0.5]}],
    )
    lost = TrialOutcome.lost(6, "worker is gone")
    tested = TrialOutcome.of(
        TrialRequest(None, press, TEST_STAGE, "5"),
        "ok",
        started_at=1.0,
        finished_at=2.0,
        worker=WORKER,
        resolved_press=resolved(press),
        summary={"mean_score": 0.0},
    )
    screened = TrialOutcome.of(
        TrialRequest(1, press, SCREEN_STAGE),
        "ok",
        started_at=1.0,
        finished_at=2.0,
        worker=WORKER,
        summary={"mean_score": None, "tasks": {}},
    )
    for outcome in (finished, lost, tested, screened):
        assert TrialOutcome.from_dict(through_json(outcome.to_dict())) == outcome
    assert finished.ok and not lost.ok
    assert (lost.trial_number, lost.stage) == (6, FULL_STAGE)
    assert (tested.trial_number, tested.stage, tested.test_of, tested.key) == (None, TEST_STAGE, "5", "5")
    # A batch's wall time is shared out among its trials.
    assert finished.worker_timing() == {
        "trial_eval_s": 1.25,
        "batch_trials": 2,
        "worker_model_loads": 2,
        "resumed_samples": 0,
    }
    assert finished.resolved_press["lambda_k"] == 0.0 and finished.resolved_press["press.window_size"] == 32
    assert finished.resolved_press["compression_ratio"] == 0.8


def test_an_outcome_from_before_stages_reads_as_a_full_trial():
    stored = {
        "trial_number": 4,
        "status": "failed",
        "error": "x",
        "started_at": None,
        "finished_at": None,
        "worker": None,
        "resolved_press": {},
        "summary": None,
        "samples": [],
    }
    outcome = TrialOutcome.from_dict(stored)
    assert (outcome.stage, outcome.batch_trials, outcome.key) == (FULL_STAGE, 1, "4")


def test_an_outcome_that_cannot_be_recorded_is_refused():
    with pytest.raises(ValueError, match="status must be"):
        TrialOutcome(1, "done")
    with pytest.raises(ValueError, match="needs its summary"):
        TrialOutcome(1, "ok", worker=WORKER, finished_at=1.0)


def test_an_item_named_against_its_stage_is_refused():
    press = PressConfig("snapkv", 0.8)
    with pytest.raises(ValueError, match="stage must be one of"):
        TrialRequest(1, press, "final")
    with pytest.raises(ValueError, match="names what it tests"):
        TrialRequest(1, press, TEST_STAGE)
    with pytest.raises(ValueError, match="has a trial number and no test_of"):
        TrialOutcome(None, "failed", SCREEN_STAGE)


def test_a_configuration_key_names_only_the_options_off_their_defaults():
    at_defaults = {name: GRKV_DEFAULTS[name] for name in ("lambda_k", "head_weighting")}
    explicit = PressConfig("snapkv", 0.8, "grkv", {**at_defaults, "beta": 0.3})
    implicit = PressConfig("snapkv", 0.8, "grkv", {"beta": 0.3})
    assert configuration_key(explicit) == configuration_key(implicit)
    settings = json.loads(configuration_key(implicit))
    assert settings == {"press": "snapkv", "compression_ratio": 0.8, "merge": "grkv", "beta": 0.3}
    # One press, however a sampler encoded it: an integer ridge is the float one.
    integral = PressConfig("snapkv", 0.8, "grkv", {"beta": 0.3, "lambda_k": 1})
    assert configuration_key(integral) == configuration_key(
        replace(integral, merge_options={"beta": 0.3, "lambda_k": 1.0})
    )
    # An option at its default is absent, so adding one to GRKVOptions later renames no checkpoint.
    assert not set(settings) & {name for name in GRKV_DEFAULTS if name != "beta"}
    other = next(weighting for weighting in HEAD_WEIGHTINGS if weighting != GRKV_DEFAULTS["head_weighting"])
    weighted = PressConfig("snapkv", 0.8, "grkv", {"beta": 0.3, "head_weighting": other})
    assert json.loads(configuration_key(weighted))["head_weighting"] == other
    assert (
        TrialRequest(1, implicit, checkpoint_dir="c").checkpoint
        != TrialRequest(1, weighted, checkpoint_dir="c").checkpoint
    )


def test_the_driver_keys_a_configuration_without_building_its_press():
    # NOTE: the press is built once, on the worker that runs it; the driver's ledger needs only the configuration.
    code = (
        "import sys; from grkv_core.config import PressConfig; from workers.protocol import TrialRequest; "
        "request = TrialRequest(1, PressConfig('snapkv', 0.8, 'grkv', {'beta': 0.3}), checkpoint_dir='c'); "
        "print(request.checkpoint.name, 'torch' in sys.modules, 'kvpress' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0].endswith(".json") and out[1:] == ["False", "False"]
