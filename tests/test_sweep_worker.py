"""The trial worker in-process on the tiny model: batches, their one-at-a-time fallback, stages and samples."""

from __future__ import annotations

import pytest

from grkv_core.config import FULL_STAGE, SCREEN_STAGE, TEST_STAGE, EvalConfig, PressConfig
from grkv_core.datasets import load_dataset_samples
from workers.protocol import TrialRequest
from workers.trial_worker import TrialWorker, split_samples

CONFIG = EvalConfig(model="tiny-llama", dataset="ruler", tasks=("niah_single_1", "niah_single_2"), context_length=512,
                    samples=1, dtype="float32", device="cpu")
GRKV = PressConfig("snapkv", 0.75, "grkv", {"lambda_k": 0.1})
EVICTION = PressConfig("snapkv", 0.75)


@pytest.fixture(scope="module")
def worker():
    return TrialWorker(CONFIG.to_dict(), test_samples=1)


def test_the_first_samples_of_each_task_tune_and_the_rest_test(worker):
    tuning, test = worker.samples[FULL_STAGE], worker.samples[TEST_STAGE]
    assert worker.samples[SCREEN_STAGE] == tuning
    assert [s.task for s in tuning] == [s.task for s in test] == ["niah_single_1", "niah_single_2"]
    assert not {s.sample_id for s in tuning} & {s.sample_id for s in test}
    with pytest.raises(ValueError, match="share ids"):
        split_samples([*tuning, tuning[0]], tuning_per_task=1)


def test_a_failing_trial_fails_alone_and_its_batch_still_finishes(worker):
    # h2o needs eager attention and the worker's model runs sdpa: that trial raises, so the batch does.
    broken = PressConfig("h2o", 0.75)
    requests = [TrialRequest(0, GRKV), TrialRequest(1, broken), TrialRequest(2, EVICTION)]
    outcomes = worker.evaluate_batch(requests)
    assert [outcome.trial_number for outcome in outcomes] == [0, 1, 2]
    assert [outcome.ok for outcome in outcomes] == [True, False, True]
    assert "eager" in outcomes[1].error and outcomes[1].traceback
    # Evaluated alone after the batch failed, each in a batch of one.
    assert {outcome.batch_trials for outcome in outcomes} == {1}
    assert outcomes[0].resolved_press["compression_ratio"] == 0.75 and outcomes[0].resolved_press["lambda_k"] == 0.1
    assert [row["sample_id"] for row in outcomes[0].samples] == [s.sample_id for s in worker.samples[FULL_STAGE]]


def test_a_batch_evaluates_together_and_screening_generates_nothing(worker):
    requests = [TrialRequest(3, GRKV, SCREEN_STAGE), TrialRequest(4, EVICTION, SCREEN_STAGE)]
    outcomes = worker.evaluate_batch(requests)
    assert all(outcome.ok and outcome.batch_trials == 2 for outcome in outcomes)
    for outcome in outcomes:
        assert outcome.stage == SCREEN_STAGE and outcome.summary["mean_score"] is None
        assert None not in (outcome.summary["costs"]["window_loss"], outcome.summary["costs"]["question_loss"])
        assert all(row["predictions"] == [] and row["score"] is None for row in outcome.samples)
    assert outcomes[0].started_at == outcomes[1].started_at and outcomes[0].finished_at == outcomes[1].finished_at


def test_the_test_stage_runs_on_the_held_out_samples(worker):
    (outcome,) = worker.evaluate_batch([TrialRequest(None, EVICTION, TEST_STAGE, "eviction_only")])
    assert outcome.ok and outcome.test_of == "eviction_only"
    assert [row["sample_id"] for row in outcome.samples] == [s.sample_id for s in worker.samples[TEST_STAGE]]
    assert outcome.summary["mean_score"] is not None and all(row["predictions"] for row in outcome.samples)


def test_a_batch_of_mixed_stages_is_refused(worker):
    with pytest.raises(ValueError, match="one stage"):
        worker.evaluate_batch([TrialRequest(0, GRKV), TrialRequest(1, GRKV, SCREEN_STAGE)])


def test_the_tuning_samples_are_those_of_a_sweep_without_a_test_stage(worker):
    alone = load_dataset_samples(CONFIG.dataset, tasks=CONFIG.tasks, context_length=CONFIG.context_length,
                                 samples_per_task=CONFIG.samples, seed=CONFIG.seed,
                                 tokenizer=worker.setup.loaded.tokenizer)
    assert alone == worker.samples[FULL_STAGE]
