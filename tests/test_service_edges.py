"""The sweep service at its edges. ``infra/local/start.sh`` on a stack that already runs a job: slow is not dead (a
start that waits on another's lock waits for it; a Ray head that runs a job is never restarted, even when its
dashboard stops answering: exit 3, one line; the job keeps running). ``grkv sweep`` sent SIGTERM stops as on Ctrl-C
(exit 143) and the same command resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from conftest import local_stack_ports, sigterm_stops_everything, stop_local_stack
from mlflow.tracking import MlflowClient
from test_sweep_service import REPO, SMOKE, local_stack, wait_for

from benchmarks.follow_scale import CountingClient
from workers.names import ROLE_TAG, STAGE_TAG, SWEEP_TAG

START = REPO / "infra" / "local" / "start.sh"


def _job_status(stack, job_id: str) -> str:
    result = subprocess.run(
        ["ray", "job", "status", "--address", stack["dashboard"], job_id],
        env=stack["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.stdout + result.stderr


def _dashboard_pid(ray_pid: int) -> int:
    listed = subprocess.run(
        ["ps", "-ww", "-o", "pid=,args=", "-g", str(ray_pid)], capture_output=True, text=True
    ).stdout
    return next(int(line.split()[0]) for line in listed.splitlines() if "dashboard/dashboard.py" in line)


def test_a_start_waits_for_a_held_lock_and_never_restarts_a_head_that_runs_a_job():
    state = Path(tempfile.mkdtemp(prefix="grkv-", dir="/tmp"))
    with local_stack(state) as stack:
        env = stack["env"]
        ray_pid = int((state / "ray.pid").read_text())
        submitted = subprocess.run(
            ["ray", "job", "submit", "--address", stack["dashboard"], "--no-wait", "--submission-id", "sleeper", "--"]
            + ["python", "-c", "import time; time.sleep(600)"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        wait_for(lambda: "RUNNING" in _job_status(stack, "sleeper"), 120, "the job to run")

        # Another start holds the lock for a while: this one says it waits, then finds the stack as it is.
        holder = subprocess.Popen(["flock", str(state / ".lock"), "sleep", "6"])
        time.sleep(1)
        again = subprocess.run(["bash", str(START)], env=env, capture_output=True, text=True, timeout=300)
        holder.wait(timeout=30)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "waiting for it" in again.stdout and "already running" in again.stdout

        # The dashboard stops answering while the job runs: the start leaves the head alone, in one line, exit 3.
        dashboard = _dashboard_pid(ray_pid)
        os.kill(dashboard, signal.SIGSTOP)
        try:
            frozen = subprocess.run(
                ["bash", str(START)], env={**env, "GRKV_HEALTH_WAIT": "4"}, capture_output=True, text=True, timeout=300
            )
        finally:
            os.kill(dashboard, signal.SIGCONT)
        errors = [line for line in frozen.stderr.splitlines() if "error:" in line]
        assert frozen.returncode == 3 and len(errors) == 1 and "runs a job" in errors[0], frozen.stdout + frozen.stderr
        assert int((state / "ray.pid").read_text()) == ray_pid
        assert "RUNNING" in _job_status(stack, "sleeper")
        subprocess.run(["ray", "job", "stop", "--address", stack["dashboard"], "sleeper"], env=env, timeout=120)


def test_a_sweep_sent_sigterm_stops_its_job_and_stack_and_the_same_command_resumes():
    state = Path(tempfile.mkdtemp(prefix="grkv-", dir="/tmp"))
    config = yaml.safe_load(SMOKE.read_text())
    for section in ("screening", "test"):
        config.pop(section)
    config["data"].pop("test")
    config.update(trials=6, name="sigterm")
    config["tracking"]["experiment"] = "grkv-sigterm"
    (state / "sweep.yaml").write_text(yaml.safe_dump(config))
    ports = local_stack_ports()
    env = {**os.environ, **ports, "GRKV_RAY_CPUS": "2", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "sweeps.cli", "sweep", "--config", str(state / "sweep.yaml")]
    command += ["--sweep-id", "term", "--state-dir", str(state), "--stop"]
    try:
        sweep = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for line in sweep.stdout:  # the first trial's line: mid-stage
            if "full" in line and "trial" in line and "/6" in line:
                break
        client, experiment_id = sigterm_stops_everything(sweep, "sweep", state, "grkv-sigterm", "term")

        resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        runs = client.search_runs([experiment_id], f"tags.`{SWEEP_TAG}` = 'term'", max_results=100)
        finished = [run for run in runs if run.data.tags.get(ROLE_TAG) == "trial" and run.info.status == "FINISHED"]
        numbers = [run.data.tags["grkv.trial_number"] for run in finished if run.data.tags[STAGE_TAG] == "full"]
        assert sorted(numbers) == sorted(set(numbers)) and len(numbers) == 6
    finally:
        stop_local_stack(env, state)


def test_following_a_sweep_reads_only_what_changed_since_the_last_look(tmp_path, capsys):
    from sweeps.config import load_config
    from sweeps.follow import ProgressPrinter

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("grkv-smoke", artifact_location=(tmp_path / "artifacts").as_uri())
    config = load_config(SMOKE)
    clock = iter(range(10**6, 10**9, 1000))  # end times a second apart, as one driver's writer closes runs

    def add_runs(count: int, first: int) -> None:
        for number in range(first, first + count):
            tags = {SWEEP_TAG: "big", ROLE_TAG: "trial", STAGE_TAG: "full", "grkv.trial_number": str(number)}
            run = client.create_run(experiment, tags=tags)
            client.log_metric(run.info.run_id, "mean_score", float(number))
            client.set_terminated(run.info.run_id, "FINISHED", end_time=next(clock))

    add_runs(300, 0)
    counting = CountingClient(client)
    progress = ProgressPrinter(counting, config, "big")
    progress.PAGE = 64  # several pages for the first look: none is dropped
    progress.update(quiet=True)
    assert len(progress.stage_of) == 300 and counting.returned == 300
    counted = 300
    for new in (5, 1, 12):
        counting.returned = 0
        add_runs(new, counted)
        progress.update()
        counted += new
        # The runs that ended since the last look, and none of those counted before.
        assert counting.returned == new and len(progress.stage_of) == counted
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 18 and printed[-1].split()[4] == "318/8" and "trial 317" in printed[-1]

    # The driver's writer closes two runs at a time: a run whose end time precedes one already counted can reach
    # MLflow after it. It is counted at the next look, once.
    latest = max(progress.end_time.values())
    tags = {SWEEP_TAG: "big", ROLE_TAG: "trial", STAGE_TAG: "full", "grkv.trial_number": "318"}
    late = client.create_run(experiment, tags=tags)
    client.set_terminated(late.info.run_id, "FINISHED", end_time=latest - 5_000)
    counting.returned = 0
    progress.update()
    progress.update()
    assert counting.returned == 1 and len(progress.stage_of) == 319
    assert capsys.readouterr().out.count("trial 318") == 1


def test_a_long_running_stage_is_never_silent_and_says_how_far_its_trials_are(tmp_path, capsys):
    import json

    from sweeps.config import load_config
    from sweeps.follow import ProgressPrinter

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("grkv-smoke", artifact_location=(tmp_path / "artifacts").as_uri())
    tags = {SWEEP_TAG: "slow", ROLE_TAG: "trial", STAGE_TAG: "test", "grkv.test_of": "eviction_only"}
    client.create_run(experiment, tags=tags)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "test").mkdir(parents=True)
    (checkpoints / "test" / "a.json").write_text(json.dumps({"samples": [{}, {}, {}]}, indent=1))
    (checkpoints / "test" / "b.json").write_text('{"config": {}}\n{"item_id": "x"}\n')  # a bounded-cache one
    progress = ProgressPrinter(client, load_config(SMOKE), "slow", checkpoints)
    progress.update()
    progress.update()  # nothing new within the heartbeat: silent
    progress.last_line -= progress.HEARTBEAT_S
    progress.update()
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and printed[0].endswith(
        "test   running: eviction_only; 4 sample(s) done in their checkpoints"
    )
    assert "still running: eviction_only; 4 sample(s)" in printed[1]


def test_a_running_line_names_a_few_runs_and_counts_the_rest(tmp_path, capsys):
    from sweeps.config import load_config
    from sweeps.follow import ProgressPrinter

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("grkv-smoke", artifact_location=(tmp_path / "artifacts").as_uri())
    for number in range(9):
        tags = {SWEEP_TAG: "wide", ROLE_TAG: "trial", STAGE_TAG: "full", "grkv.trial_number": str(number)}
        client.create_run(experiment, start_time=1000 + number, tags=tags)
    ProgressPrinter(client, load_config(SMOKE), "wide").update()
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith("full   running: 9 runs (trial 0, trial 1, trial 2, trial 3, trial 4 … trial 8)")
    )
