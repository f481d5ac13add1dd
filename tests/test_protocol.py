"""The driver-worker boundary: trial requests and outcomes survive JSON (the state directory) exactly."""

from __future__ import annotations

import json

import pytest

from grkv_core.config import PressConfig
from workers.protocol import TrialOutcome, TrialRequest, WorkerIdentity

WORKER = WorkerIdentity(pid=7, node_id="n", actor_id="a", model_loads=2, trials_evaluated=3, samples=4)


def through_json(data: dict) -> dict:
    return json.loads(json.dumps(data))


def test_a_request_round_trips_through_json():
    request = TrialRequest(5, PressConfig("snapkv", 0.8, "grkv", {"lambda_k": 0.0, "safeguard": False}))
    assert TrialRequest.from_dict(through_json(request.to_dict())) == request


def test_finished_and_lost_outcomes_round_trip_through_json():
    press = PressConfig("snapkv", 0.8, "grkv", {"lambda_k": 0.0})
    finished = TrialOutcome(5, "ok", started_at=10.0, finished_at=12.5, worker=WORKER,
                            resolved_press=press.resolved(), summary={"mean_score": 50.0, "tasks": {"a": 50.0}},
                            samples=[{"sample_id": "a-0", "predictions": ["x"], "scores": [0.5]}])
    lost = TrialOutcome.lost(6, "worker is gone")
    for outcome in (finished, lost):
        assert TrialOutcome.from_dict(through_json(outcome.to_dict())) == outcome
    assert finished.ok and not lost.ok
    assert finished.worker_timing() == {"trial_eval_s": 2.5, "worker_model_loads": 2}
    assert finished.resolved_press["lambda_k"] == 0.0 and finished.resolved_press["press.window_size"] == 32


def test_an_outcome_that_cannot_be_recorded_is_refused():
    with pytest.raises(ValueError, match="status must be"):
        TrialOutcome(1, "done")
    with pytest.raises(ValueError, match="needs its summary"):
        TrialOutcome(1, "ok", worker=WORKER, finished_at=1.0)
