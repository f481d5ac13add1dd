"""The sweep service with real components: a Ray head and an MLflow server on 127.0.0.1, Optuna journal storage.

Started once per session through infra/local/start.sh (the script a user runs), with free ports and a
temporary state directory, and stopped through infra/local/stop.sh.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient

from conftest import free_ports
from grkv_core.config import RECOVERED_TAG, ROLE_TAG, SWEEP_TAG, TRIAL_TAG
from sweeps.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = REPO / ".venv" / "bin"
SMOKE = REPO / "sweeps" / "configs" / "smoke.yaml"
REQUIRED_METRICS = {"mean_score", "score.niah_single_1", "ttft_s", "decode_ms_per_token", "peak_memory_bytes",
                    "kv_bytes", "window_loss", "trial_eval_s", "service_overhead_s"}


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}:{env['PATH']}"
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    state = tmp_path_factory.mktemp("grkv-state")
    names = ("GRKV_RAY_PORT", "GRKV_RAY_DASHBOARD_PORT", "GRKV_RAY_CLIENT_PORT", "GRKV_RAY_AGENT_PORT",
             "GRKV_MLFLOW_PORT")
    ports = dict(zip(names, free_ports(len(names))))
    env = child_env(GRKV_STATE_DIR=state, GRKV_RAY_CPUS=2, **ports)
    subprocess.run(["bash", str(REPO / "infra/local/start.sh")], env=env, check=True, timeout=300)
    # A driver started directly (not through `ray job submit`) needs the variables the start script
    # exports for clients, e.g. the one that keeps Ray's node address on 127.0.0.1.
    for line in (state / "env.sh").read_text().splitlines():
        if line.startswith("export ") and "$" not in line:
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value
    try:
        yield {
            "env": env,
            "state": state,
            "tracking_uri": f"http://127.0.0.1:{ports['GRKV_MLFLOW_PORT']}",
            "dashboard": f"http://127.0.0.1:{ports['GRKV_RAY_DASHBOARD_PORT']}",
            "ray_address": f"127.0.0.1:{ports['GRKV_RAY_PORT']}",
        }
    finally:
        subprocess.run(["bash", str(REPO / "infra/local/stop.sh")], env=env, timeout=120)


def write_config(tmp_path: Path, **changes) -> Path:
    config = yaml.safe_load(SMOKE.read_text())
    for dotted, value in changes.items():
        node = config
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def runs_of(tracking_uri: str, experiment: str, sweep_id: str):
    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, "the sweep created no MLflow experiment"
    runs = client.search_runs([found.experiment_id], f"tags.`{SWEEP_TAG}` = '{sweep_id}'", max_results=1000)
    parents = [r for r in runs if r.data.tags.get(ROLE_TAG) == "sweep"]
    children = [r for r in runs if r.data.tags.get(ROLE_TAG) == "trial"]
    return parents, children


def study_of(state_dir: Path, sweep_id: str) -> optuna.Study:
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(state_dir / sweep_id / "optuna.journal")))
    return optuna.load_study(study_name=sweep_id, storage=storage)


def complete_trials(study):
    return [t for t in study.get_trials() if t.state == optuna.trial.TrialState.COMPLETE]


def assert_one_finished_child_per_complete_trial(children, study):
    finished = [r for r in children if r.info.status == "FINISHED"]
    numbers = sorted(int(r.data.tags[TRIAL_TAG]) for r in finished)
    assert numbers == sorted(t.number for t in complete_trials(study))
    for run in finished:
        # A trial recovered after a driver crash has no driver-side timing: nobody watched it finish.
        required = REQUIRED_METRICS - ({"service_overhead_s"} if run.data.tags.get(RECOVERED_TAG) else set())
        assert required <= set(run.data.metrics), sorted(required - set(run.data.metrics))


def test_invalid_config_gives_one_line_error_naming_the_field(tmp_path):
    path = write_config(tmp_path, **{"workers.count": 0})
    result = subprocess.run([sys.executable, "sweep.py", "--config", str(path)], cwd=REPO, env=child_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "workers.count" in lines[0], result.stderr
    bad_space = write_config(tmp_path, **{"search_space.lambda_k.low": -1.0})
    with pytest.raises(ConfigError, match="search_space.lambda_k"):
        load_config(bad_space)


def test_safeguard_and_ridge_scale_are_searched_and_the_paper_default_trial_is_the_paper():
    from sweeps.space import baseline_params, suggest_press

    config = load_config(REPO / "sweeps" / "configs" / "ruler-snapkv.yaml")
    paper = dict(baseline_params(config))["paper_default"]
    assert paper["safeguard"] is False and paper["ridge_scale"] == "absolute" and paper["cg_max_iter"] == 200
    params = {**paper, "lambda_k": 0.5, "lambda_v": 0.5, "safeguard": True, "ridge_scale": "relative"}
    press = suggest_press(optuna.trial.FixedTrial(params), config).build()
    assert press.safeguard is True and press.ridge_scale == "relative" and press.lambda_k == 0.5


def test_mlflow_down_at_start_is_a_clear_error_and_writes_nothing(tmp_path):
    state = tmp_path / "state"
    result = subprocess.run(
        [sys.executable, "sweep.py", "--config", str(SMOKE), "--sweep-id", "down",
         "--tracking-uri", f"http://127.0.0.1:{free_ports(1)[0]}", "--state-dir", str(state)],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert "not reachable" in result.stderr and "Traceback" not in result.stderr
    assert not state.exists(), "nothing may be written when the tracking server is down"


def test_ray_job_submit_runs_the_smoke_sweep_end_to_end(services, tmp_path):
    sweep_id = "e2e"
    state = services["state"] / "sweeps"
    submit = subprocess.run(
        ["ray", "job", "submit", "--address", services["dashboard"], "--working-dir", str(REPO), "--",
         "python", "sweep.py", "--config", "sweeps/configs/smoke.yaml", "--sweep-id", sweep_id,
         "--tracking-uri", services["tracking_uri"], "--state-dir", str(state)],
        cwd=REPO, env=services["env"], capture_output=True, text=True, timeout=900)
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    assert "FINISHED" in submit.stdout
    parents, children = runs_of(services["tracking_uri"], "grkv-smoke", sweep_id)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    finished = [r for r in children if r.info.status == "FINISHED"]
    assert len(finished) == 8 and len(children) == 8
    assert all(r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for r in children)
    study = study_of(state, sweep_id)
    assert len(complete_trials(study)) == 8
    assert_one_finished_child_per_complete_trial(children, study)
    # Baselines first: the paper's defaults, then the eviction press alone.
    first = sorted(complete_trials(study), key=lambda t: t.number)[:2]
    assert first[0].params["merge"] == "grkv" and first[0].params["lambda_k"] == 1e-2
    assert first[1].params == {"merge": "none"}
    # Each worker loaded its model exactly once for the whole sweep.
    assert {r.data.metrics["worker_model_loads"] for r in finished} == {1.0}
    assert "study_trials.csv" in {a.path for a in MlflowClient(services["tracking_uri"]).list_artifacts(parents[0].info.run_id)}


def slow_config(tmp_path, trials):
    # Enough work per trial (about seconds) to interrupt one while it runs.
    return write_config(tmp_path, trials=trials, **{"data.samples": 4, "data.context_length": 1536,
                                                   "tracking.experiment": "grkv-faults"})


def start_driver(services, config, sweep_id, state):
    return subprocess.Popen(
        [sys.executable, "sweep.py", "--config", str(config), "--sweep-id", sweep_id,
         "--tracking-uri", services["tracking_uri"], "--state-dir", str(state)],
        cwd=REPO, env=dict(services["env"], RAY_ADDRESS=services["ray_address"]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_killed_worker_mid_trial_is_retried_and_the_sweep_completes(services, tmp_path):
    from ray.util.state import list_actors

    sweep_id, state = "worker-kill", tmp_path / "state"
    driver = start_driver(services, slow_config(tmp_path, trials=4), sweep_id, state)
    try:
        def running_worker_pids():
            # The state API is asked over the dashboard's HTTP address: this process joins no Ray cluster.
            actors = list_actors(address=services["dashboard"],
                                 filters=[("class_name", "=", "TrialWorker"), ("state", "=", "ALIVE")])
            return [a.pid for a in actors if a.pid]

        def a_trial_is_running():
            _, children = runs_of(services["tracking_uri"], "grkv-faults", sweep_id) if \
                MlflowClient(services["tracking_uri"]).get_experiment_by_name("grkv-faults") else (None, [])
            return bool(running_worker_pids()) and any(r.info.status == "RUNNING" for r in children)

        wait_for(a_trial_is_running, 300, "a running trial")
        # Both workers take a trial as soon as they are up, so killing every worker hits a running trial.
        for pid in running_worker_pids():
            os.kill(pid, signal.SIGKILL)
        output, _ = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, output[-3000:]
    assert "retrying" in output
    _, children = runs_of(services["tracking_uri"], "grkv-faults", sweep_id)
    study = study_of(state, sweep_id)
    assert len(complete_trials(study)) == 4
    assert_one_finished_child_per_complete_trial(children, study)
    assert max(r.data.metrics["worker_attempts"] for r in children if r.info.status == "FINISHED") == 2


def test_sigkilled_driver_resumes_with_one_finished_run_per_trial(services, tmp_path):
    sweep_id, state = "driver-kill", tmp_path / "state"
    config = slow_config(tmp_path, trials=6)
    driver = start_driver(services, config, sweep_id, state)
    try:
        def finished_children():
            if not MlflowClient(services["tracking_uri"]).get_experiment_by_name("grkv-faults"):
                return []
            return [r for r in runs_of(services["tracking_uri"], "grkv-faults", sweep_id)[1]
                    if r.info.status == "FINISHED"]

        wait_for(lambda: len(finished_children()) >= 2, 600, "two finished trials")
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    before = {int(r.data.tags[TRIAL_TAG]): r.info.run_id for r in finished_children()}

    resumed = start_driver(services, config, sweep_id, state)
    output, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, output[-3000:]
    parents, children = runs_of(services["tracking_uri"], "grkv-faults", sweep_id)
    study = study_of(state, sweep_id)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(complete_trials(study)) == 6
    assert_one_finished_child_per_complete_trial(children, study)
    after = {int(r.data.tags[TRIAL_TAG]): r.info.run_id for r in children if r.info.status == "FINISHED"}
    assert all(after[number] == run_id for number, run_id in before.items()), "finished trials must not be redone"
    assert all(r.info.status in ("FINISHED", "KILLED") for r in children), "no run may be left RUNNING"
