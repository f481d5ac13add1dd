"""GPU scheduling without a GPU: a Ray head that declares two logical GPUs (``ray start --num-gpus 2``, through
``infra/local/start.sh``) and sweeps whose workers ask for one each."""

from __future__ import annotations

import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient
from test_sweep_service import REPO, local_stack, of_stage, runs_of, write_config

from workers.names import FULL_STAGE


@pytest.fixture(scope="module")
def two_gpu_node(tmp_path_factory):
    with local_stack(tmp_path_factory.mktemp("grkv-gpu-state"), GRKV_RAY_GPUS=2) as stack:
        # NOTE: a driver started directly joins the cluster at RAY_ADDRESS, this one, not another on the machine
        stack["env"]["RAY_ADDRESS"] = stack["ray_address"]
        yield stack


def two_trial_sweep(tmp_path, **changes):
    """Two trials (the two baselines), no screening, no test stage, two workers of one logical GPU each."""
    return write_config(
        tmp_path,
        drop=("screening", "test", "data.test"),
        **{
            "trials": 2,
            "workers": {"count": 2, "num_cpus": 1, "num_gpus": 1, "max_retries": 1, "batch_size": 1},
            **changes,
        },
    )


def run_sweep(node, config, sweep_id):
    return subprocess.run(
        [
            sys.executable,
            "sweep.py",
            "--config",
            str(config),
            "--sweep-id",
            sweep_id,
            "--tracking-uri",
            node["tracking_uri"],
            "--state-dir",
            str(node["state"] / "sweeps"),
        ],
        cwd=REPO,
        env=node["env"],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_one_worker_per_declared_gpu_each_seeing_its_own(two_gpu_node, tmp_path):
    result = run_sweep(two_gpu_node, two_trial_sweep(tmp_path, **{"model.device": "cpu"}), "gpu-cpu")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _, children = runs_of(two_gpu_node["tracking_uri"], "grkv-smoke", "gpu-cpu")
    finished = of_stage(children, FULL_STAGE, "FINISHED")
    assert len(finished) == 2
    params = [run.data.params for run in finished]
    # Each actor holds one of the two declared GPUs: Ray sets its CUDA_VISIBLE_DEVICES to that one.
    assert sorted(p["worker.cuda_visible_devices"] for p in params) == ["0", "1"]
    # The model ran where it was told to, in the dtype "auto" resolves to there.
    assert {(p["worker.device"], p["worker.dtype"]) for p in params} == {("cpu", "float32")}
    pids = {run.data.tags["grkv.worker_pid"] for run in finished}
    assert len(pids) == 2


def test_a_worker_told_to_use_cuda_where_there_is_none_fails_its_start_in_one_line(two_gpu_node, tmp_path):
    # workers.num_gpus: 1 and no model.device: the workers use CUDA, which these logical GPUs do not have.
    result = run_sweep(two_gpu_node, two_trial_sweep(tmp_path), "gpu-cuda")
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("sweep gpu-cuda")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "a worker cannot start on node" in lines[0] and "model.device is 'cuda'" in lines[0]
    assert "Ray node" in lines[0] and "resume with:" in lines[0] and "Traceback" not in lines[0]
    parents, _ = runs_of(two_gpu_node["tracking_uri"], "grkv-smoke", "gpu-cuda")
    assert [run.info.status for run in parents] == ["KILLED"]
    assert (
        MlflowClient(two_gpu_node["tracking_uri"]).search_runs(
            [parents[0].info.experiment_id], "tags.`grkv.sweep_id` = 'gpu-cuda' and attributes.status = 'FINISHED'"
        )
        == []
    )
