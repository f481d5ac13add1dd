"""Where a sweep's state lives on a multi-node cluster, for real on 127.0.0.1 (the two-node ``cluster`` of
test_sweep_cluster_faults.py): a trial interrupted by its node's loss, whose batch runs again on a new node, resumes
at its next sample when every node sees the state directory's ``checkpoints/`` (a shared volume: here, one
machine's disk), and starts over when each node keeps its own (``GRKV_CHECKPOINT_DIR`` on each node's raylet: a
state directory per node). Both sweeps end with every trial FINISHED once and the same results for the same
presses."""

import json
import time
from pathlib import Path

from test_sweep_cluster_faults import (  # noqa: F401 - cluster: the fixture, a 0-CPU head and one worker node
    WORKER_NODE,
    cluster,
    start_on_the_head,
)
from test_sweep_faults import a_trial_running, assert_sweep_complete
from test_sweep_service import (
    complete_trials,
    of_stage,
    services,  # noqa: F401 - the module's stack: a Ray head and an MLflow server
    slow_config,
    wait_for,
)

from workers.names import FULL_STAGE, TRIAL_TAG
from workers.protocol import TrialOutcome
from workers.trial_worker import CHECKPOINT_DIR_ENV

TRIALS = 4
SAMPLES = 6  # per trial: the smoke config's one task


def press_key(resolved_press: dict) -> str:
    return json.dumps(resolved_press, sort_keys=True)


def checkpointed(folder: Path) -> dict[str, int]:
    """How many samples each press's checkpoint below ``folder`` holds, by press."""
    found = {}
    for path in folder.rglob("*.json"):
        try:
            payload = json.loads(path.read_text())
        except OSError:  # NOTE: removed by the driver as it was read (written whole: never half a file)
            continue
        found[press_key(payload["resolved_press"])] = len(payload["samples"])
    return found


def sweep_with_a_node_lost_mid_batch(services, cluster, tmp_path, per_node: bool):
    """Run a sweep on the cluster's worker node, replace that node once a trial is half done there, and return how
    many samples the lost node had checkpointed of each trial it was running and every finished trial's outcome,
    both by press."""
    sweep_id = "per-node" if per_node else "shared"
    state = tmp_path / sweep_id / "state"
    (tmp_path / sweep_id).mkdir()

    def node_dir(index: int) -> dict:
        return {CHECKPOINT_DIR_ENV: str(tmp_path / sweep_id / f"node-{index}")} if per_node else {}

    # The first node's checkpoints: its own folder, or the state directory every node sees.
    lost_node_checkpoints = tmp_path / sweep_id / "node-0" if per_node else state / sweep_id / "checkpoints"
    config = slow_config(tmp_path / sweep_id, trials=TRIALS, **{"data.samples": SAMPLES})
    driver = start_on_the_head(services, cluster, config, sweep_id, state, env_vars=node_dir(0))
    try:
        wait_for(a_trial_running(services["tracking_uri"], sweep_id), 300, "a running trial")
        # Mid-trial: a checkpoint holds some of a trial's samples (2, so that resuming shows), not all.
        wait_for(
            lambda: any(2 <= n < SAMPLES for n in checkpointed(lost_node_checkpoints).values()), 300, "half a trial"
        )
        (lost,) = cluster.worker_nodes
        at_loss = checkpointed(lost_node_checkpoints)
        cluster.remove_node(lost)
        cluster.add_node(**WORKER_NODE, env_vars=node_dir(1))
        stdout, stderr = driver.communicate(timeout=900)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "lost with its node" in stdout + stderr
    study, runs = assert_sweep_complete(services["tracking_uri"], state, sweep_id, TRIALS)
    outcomes = {
        t.number: TrialOutcome.from_dict(json.loads((state / sweep_id / "trials" / f"{t.number}.json").read_text()))
        for t in complete_trials(study)
    }
    # What the worker recorded is what MLflow shows for each finished trial.
    finished = of_stage(runs, FULL_STAGE, "FINISHED")
    logged = {run.data.tags[TRIAL_TAG]: run.data.metrics["resumed_samples"] for run in finished}
    assert logged == {str(number): float(outcome.resumed_samples) for number, outcome in outcomes.items()}
    # NOTE: a checkpoint of all the samples is a finished trial's (per node: left there; shared: not yet removed)
    interrupted = {key: samples for key, samples in at_loss.items() if samples < SAMPLES}
    assert interrupted, at_loss
    return interrupted, {press_key(o.resolved_press): o for o in outcomes.values()}


def test_a_trial_whose_node_is_lost_resumes_on_another_from_a_shared_state_dir_and_starts_over_on_per_node_disks(
    services, cluster, tmp_path
):
    started = time.monotonic()
    interrupted, shared = sweep_with_a_node_lost_mid_batch(services, cluster, tmp_path, per_node=False)
    # A shared volume: the new node's workers read what the lost node's wrote, and skip those samples.
    resumed = {key: shared[key].resumed_samples for key in interrupted}
    assert all(resumed[key] >= samples > 0 for key, samples in interrupted.items()), (interrupted, resumed)
    print(f"shared: checkpointed at the loss {sorted(interrupted.values())}, resumed {sorted(resumed.values())}")

    interrupted, per_node = sweep_with_a_node_lost_mid_batch(services, cluster, tmp_path, per_node=True)
    # A disk per node: what the lost node checkpointed stays there, and its trials start over on the new node.
    resumed = {key: per_node[key].resumed_samples for key in interrupted}
    assert set(resumed.values()) == {0}, (interrupted, resumed)
    print(f"per node: checkpointed at the loss {sorted(interrupted.values())}, resumed {sorted(resumed.values())}")
    assert not checkpointed(tmp_path / "per-node" / "state" / "per-node" / "checkpoints"), "a worker wrote there"

    # Resumed or recomputed, a press's results are the same (the baselines at least are in both sweeps).
    common = shared.keys() & per_node.keys()
    assert len(common) >= 3
    for key in common:
        assert shared[key].summary["mean_score"] == per_node[key].summary["mean_score"]
        assert [row["predictions"] for row in shared[key].samples] == [
            row["predictions"] for row in per_node[key].samples
        ]
    print(f"both sweeps in {time.monotonic() - started:.0f} s")
