"""The trial worker in-process on the tiny model: batches, their one-at-a-time fallback, stages and samples."""

from __future__ import annotations

import json

import pytest

from grkv_core.config import EvalConfig, PressConfig
from grkv_core.datasets import load_dataset_samples
from grkv_core.evaluation.leaderboard import read_runs
from sweeps.state import state_dir
from sweeps.state.state_dir import StateDir
from workers.names import FULL_STAGE, SCREEN_STAGE, TEST_STAGE
from workers.protocol import TrialOutcome, TrialRequest
from workers.trial_worker import CHECKPOINT_DIR_ENV, TrialWorker, split_samples

CONFIG = EvalConfig(
    model="tiny-llama",
    dataset="ruler",
    tasks=("niah_single_1", "niah_single_2"),
    context_length=512,
    samples=1,
    dtype="float32",
    device="cpu",
)
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


class Killed(BaseException):
    """The driver killed mid-write (no handler runs)."""


def killed(*_):
    raise Killed


def test_the_test_stage_runs_on_the_held_out_samples_and_in_kvpress_layout(worker, tmp_path, monkeypatch):
    (outcome,) = worker.evaluate_batch([TrialRequest(None, EVICTION, TEST_STAGE, "eviction_only")])
    assert outcome.ok and outcome.test_of == "eviction_only"
    assert [row["sample_id"] for row in outcome.samples] == [s.sample_id for s in worker.samples[TEST_STAGE]]
    assert outcome.summary["mean_score"] is not None and all(row["predictions"] for row in outcome.samples)
    # In kvpress's layout too: the held-out samples' rows, which the driver writes to its state directory.
    (run,) = outcome.kvpress_runs
    assert run["name"] == "ruler__512__tiny-llama__snapkv__0.75"
    assert [row["sample_id"] for row in run["rows"]] == [s.sample_id for s in worker.samples[TEST_STAGE]]
    assert [row["predicted_answer"] for row in run["rows"]] == [row["predictions"][0] for row in outcome.samples]
    assert TrialOutcome.from_dict(json.loads(json.dumps(outcome.to_dict()))) == outcome
    state = StateDir(tmp_path, "sweep")
    state.create()
    # Killed while it writes the kvpress folder, the driver leaves no record: the resume runs the trial again
    # (a record is taken as finished and only logged, with whatever kvpress folder is there).
    with monkeypatch.context() as patched:
        patched.setattr(state_dir, "write_run", killed)
        with pytest.raises(Killed):
            state.save(outcome)
    assert state.load(TEST_STAGE, outcome.key) is None
    state.save(outcome)
    assert state.load(TEST_STAGE, outcome.key) == outcome
    (row,) = read_runs(state.kvpress / "eviction_only")
    assert row.method == "snapkv" and row.rows == len(worker.samples[TEST_STAGE]) and row.answer_nll is not None
    full_stage = worker.evaluate_batch([TrialRequest(5, EVICTION)])[0]
    assert full_stage.ok and full_stage.kvpress_runs == []


def test_a_batch_of_mixed_stages_is_refused(worker):
    with pytest.raises(ValueError, match="one stage"):
        worker.evaluate_batch([TrialRequest(0, GRKV), TrialRequest(1, GRKV, SCREEN_STAGE)])


def test_the_tuning_samples_are_those_of_a_sweep_without_a_test_stage(worker):
    alone = load_dataset_samples(
        CONFIG.dataset,
        tasks=CONFIG.tasks,
        context_length=CONFIG.context_length,
        samples_per_task=CONFIG.samples,
        seed=CONFIG.seed,
        tokenizer=worker.setup.loaded.tokenizer,
    )
    assert alone == worker.samples[FULL_STAGE]


def test_a_trial_asked_again_resumes_from_its_checkpoint_at_the_sample_it_had_reached(worker, tmp_path):
    """An interrupted batch leaves each trial's finished samples in the checkpoint directory; the same press,
    asked again under another number, evaluates only the samples missing there."""
    checkpoints = str(tmp_path / "checkpoints")
    first = worker.evaluate_batch(
        [TrialRequest(5, GRKV, checkpoint_dir=checkpoints), TrialRequest(6, EVICTION, checkpoint_dir=checkpoints)]
    )
    stored = sorted((tmp_path / "checkpoints" / FULL_STAGE).glob("*.json"))
    assert len(stored) == 2
    # The interruption: GRKV's file keeps only its first sample, marked so that a recomputation would show.
    grkv_file = next(path for path in stored if json.loads(path.read_text())["resolved_press"]["merge"] == "grkv")
    payload = json.loads(grkv_file.read_text())
    payload["samples"] = payload["samples"][:1]
    payload["samples"][0]["predictions"] = ["from the checkpoint"]
    grkv_file.write_text(json.dumps(payload))
    (again,) = worker.evaluate_batch([TrialRequest(7, GRKV, checkpoint_dir=checkpoints)])
    assert again.ok and again.trial_number == 7
    assert [first[0].resumed_samples, again.resumed_samples] == [0, 1]
    assert [row["sample_id"] for row in again.samples] == [row["sample_id"] for row in first[0].samples]
    assert again.samples[0]["predictions"] == ["from the checkpoint"]
    assert_same_measurements(again.samples[1], first[0].samples[1])
    # Without a checkpoint directory nothing is kept or read.
    (plain,) = worker.evaluate_batch([TrialRequest(8, GRKV)])
    for row, expected in zip(plain.samples, first[0].samples, strict=True):
        assert_same_measurements(row, expected)


def test_a_node_with_its_own_checkpoint_folder_keeps_checkpoints_there_and_reads_no_others(
    worker, tmp_path, monkeypatch
):
    """``GRKV_CHECKPOINT_DIR`` on a node (here: this process's environment, as a node's workers inherit it) moves its
    workers' checkpoints below that folder; a node without it, or with another, does not find them."""
    checkpoints = tmp_path / "state" / "sweep" / "checkpoints"
    node = tmp_path / "node-a"
    monkeypatch.setenv(CHECKPOINT_DIR_ENV, str(node))
    (first,) = worker.evaluate_batch([TrialRequest(1, GRKV, checkpoint_dir=str(checkpoints))])
    (kept,) = (node / checkpoints.relative_to("/") / FULL_STAGE).glob("*.json")
    assert len(json.loads(kept.read_text())["samples"]) == len(first.samples) and not checkpoints.exists()
    (again,) = worker.evaluate_batch([TrialRequest(2, GRKV, checkpoint_dir=str(checkpoints))])
    assert again.resumed_samples == len(first.samples)
    monkeypatch.setenv(CHECKPOINT_DIR_ENV, str(tmp_path / "node-b"))
    (elsewhere,) = worker.evaluate_batch([TrialRequest(3, GRKV, checkpoint_dir=str(checkpoints))])
    monkeypatch.delenv(CHECKPOINT_DIR_ENV)
    (shared,) = worker.evaluate_batch([TrialRequest(4, GRKV, checkpoint_dir=str(checkpoints))])
    assert [elsewhere.resumed_samples, shared.resumed_samples] == [0, 0]
    assert (checkpoints / FULL_STAGE).is_dir()


def assert_same_measurements(row: dict, expected: dict) -> None:
    """Two results of one press on one sample agree but for timings (which differ between two evaluations), and
    losses to float32 round-off (a batch's full-cache reference is computed for the batch's caches together)."""
    losses = ("window_loss", "heldout_loss", "question_loss")
    timings = ("ttft_s", "prefill_s", "decode_ms_per_token", "wall_s", "peak_memory_bytes", "batch_trials")
    assert {name: row[name] for name in losses} == pytest.approx({name: expected[name] for name in losses}, rel=1e-5)
    kept = [name for name in row if name not in (*losses, *timings)]
    assert {name: row[name] for name in kept} == {name: expected[name] for name in kept}
