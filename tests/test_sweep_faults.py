"""Faults an operator meets, with the real services on 127.0.0.1: a torn Optuna journal, two drivers on one sweep,
a stale journal lock, the Ray cluster or the MLflow server lost mid-sweep, an unusable state directory or
Optuna storage. Each test asserts the end state: Optuna's trial states, exactly one FINISHED MLflow run per
complete trial and none left RUNNING, no configuration run twice, and the one-line messages.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import pytest
from conftest import VENV_BIN, free_ports, local_stack_ports
from mlflow.tracking import MlflowClient
from test_sweep_service import (
    REPO,
    assert_one_finished_child_per_complete_trial,
    child_env,
    complete_trials,
    of_stage,
    reused_trials,
    runs_of,
    services,  # noqa: F401 - the module's stack: a Ray head and an MLflow server
    slow_config,
    study_of,
    wait_for,
)

from sweeps.lease import SweepBusyError, SweepLease
from sweeps.state.optuna_storage import repair_journal
from sweeps.state.state_dir import StateDirError
from tracking.mlflow_tracker import check_tracking_server
from tracking.retry import RetryingClient, RetryPolicy, TrackingUnavailableError
from workers.names import FULL_STAGE, REQUEUE_OF_ATTR, TRIAL_TAG

EXPERIMENT = "grkv-faults"


def one_line(stderr: str) -> str:
    """What the user is told of a refused or stopped sweep: one line from sweep.py (the rest of stderr is the
    driver's log), and no traceback anywhere."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("sweep")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def sweep_command(config, sweep_id, state, tracking_uri, *extra):
    return [
        sys.executable,
        "sweep.py",
        "--config",
        str(config),
        "--sweep-id",
        sweep_id,
        "--tracking-uri",
        tracking_uri,
        "--state-dir",
        str(state),
        *extra,
    ]


def start(services, config, sweep_id, state, tracking_uri=None, *extra):
    """A driver whose stderr (the user's one-line messages) is kept apart from its log on stdout."""
    return subprocess.Popen(
        sweep_command(config, sweep_id, state, tracking_uri or services["tracking_uri"], *extra),
        cwd=REPO,
        env=dict(services["env"], RAY_ADDRESS=services["ray_address"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def children_of(tracking_uri, sweep_id):
    if not MlflowClient(tracking_uri).get_experiment_by_name(EXPERIMENT):
        return []
    return runs_of(tracking_uri, EXPERIMENT, sweep_id)[1]


def a_trial_running(tracking_uri, sweep_id):
    return lambda: of_stage(children_of(tracking_uri, sweep_id), FULL_STAGE, "RUNNING")


def assert_sweep_complete(tracking_uri, state, sweep_id, trials, storage_url=None):
    """The end state of a sweep resumed after a fault: ``trials`` complete, one FINISHED run each, nothing left
    RUNNING, no configuration evaluated twice, every failed trial re-queued (not the trial's fault) or a proposal
    of a configuration already evaluated. ``storage_url``: the sweep's Optuna database (else its journal)."""
    parents, runs = runs_of(tracking_uri, EXPERIMENT, sweep_id)
    study = study_of(state, sweep_id, storage_url=storage_url)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(complete_trials(study)) == trials
    assert_one_finished_child_per_complete_trial(runs, study)
    assert all(run.info.status in ("FINISHED", "KILLED") for run in runs), "no run may be left RUNNING"
    requeued = {t.user_attrs[REQUEUE_OF_ATTR] for t in study.trials if REQUEUE_OF_ATTR in t.user_attrs}
    reused = {t.number for t in reused_trials(study)}
    failed = {t.number for t in study.trials if t.state == optuna.trial.TrialState.FAIL} - reused
    assert failed <= requeued, "a trial failed by the fault instead of being re-queued"
    # No trial ran twice: each complete trial stands for a different original (itself, or what it re-queues).
    originals = [t.user_attrs.get(REQUEUE_OF_ATTR, t.number) for t in complete_trials(study)]
    assert len(set(originals)) == len(originals)
    return study, runs


# ---------------------------------------------------------------- without services: the pieces, in-process


def test_a_torn_journal_tail_is_cut_with_a_backup_and_the_study_loads(tmp_path):
    journal = tmp_path / "optuna.journal"
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    study = optuna.create_study(study_name="s", storage=storage)
    study.enqueue_trial({"x": 1.0})
    whole = journal.read_bytes()
    last = whole.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    journal.write_bytes(whole + last[: len(last) // 2])  # the next write, cut short by a SIGKILL
    repair_journal(journal)
    assert journal.read_bytes() == whole
    (backup,) = tmp_path.glob("optuna.journal.torn-*")
    assert backup.read_bytes() == whole + last[: len(last) // 2]
    # Appending after the repair starts a line of its own: the study loads and takes new trials.
    reopened = optuna.load_study(
        study_name="s", storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    )
    reopened.enqueue_trial({"x": 2.0})
    assert (
        len(
            optuna.load_study(
                study_name="s",
                storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal))),
            ).trials
        )
        == 2
    )
    repair_journal(journal)  # a whole journal is left as it is
    assert len(list(tmp_path.glob("optuna.journal.torn-*"))) == 1


def test_a_journal_corrupt_before_its_last_line_is_refused_in_one_line(tmp_path):
    journal = tmp_path / "optuna.journal"
    journal.write_text('{"op_code": 0}\n{"op_code": 1, "study\n{"op_code": 2}\n')
    with pytest.raises(StateDirError, match=r"corrupt at line 2 .*new --sweep-id") as error:
        repair_journal(journal)
    assert "\n" not in str(error.value)
    assert journal.read_text().count("\n") == 3, "a corrupt journal is left as it was"


HOLD_LEASE = """
import sys, time
from sweeps.lease import SweepLease
lease = SweepLease(sys.argv[1], "s")
lease.acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_a_live_drivers_lease_is_refused_naming_it_and_a_dead_ones_taken_over_at_once(tmp_path, caplog):
    # NOTE: the metadata `ray job submit` hands its driver, so the lease names the driver's Ray job
    job = json.dumps({"metadata": {"job_submission_id": "sweep-job-1"}})
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LEASE, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, RAY_JOB_CONFIG_JSON_ENV_VAR=job),
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SweepBusyError, match=f"pid {holder.pid} on {socket.gethostname()}") as refused:
            SweepLease(tmp_path, "s").acquire()
        assert "Ray job sweep-job-1 (stop it with `ray job stop sweep-job-1`)" in str(refused.value)
    finally:
        holder.kill()
        holder.wait()
    lease = SweepLease(tmp_path, "s")
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="grkv.sweep"):
        lease.acquire()
    assert time.monotonic() - started < 1.0
    (takeover,) = [record.getMessage() for record in caplog.records]
    # A dead driver's job has nothing left to stop: the message says what the run taking over does instead.
    assert f"taking over the lease of a driver that died (pid {holder.pid} on" in takeover, takeover
    assert "Ray job sweep-job-1" in takeover and "ray job stop" not in takeover, takeover
    assert "closes its runs left RUNNING as KILLED and re-queues its trials in flight" in takeover, takeover
    assert json.loads((tmp_path / "driver.lease").read_text())["pid"] == os.getpid()
    lease.release()
    assert (tmp_path / "driver.lease").read_text() == "", "a lease given back names nobody"


def test_mlflow_calls_are_retried_with_backoff_then_fail_in_one_sentence(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # as sweep.py sets it: the policy is the bound
    port = free_ports(1)[0]
    client = RetryingClient(MlflowClient(f"http://127.0.0.1:{port}"), RetryPolicy(retries=2, backoff_s=0.2))
    started = time.monotonic()
    with pytest.raises(TrackingUnavailableError, match=r"MLflow get_experiment_by_name failed 3 time\(s\)") as error:
        client.get_experiment_by_name("x")
    assert time.monotonic() - started >= 0.2 + 0.4, "waits 0.2 s, then 0.4 s"
    # One short line: the server once, the endpoint, the root cause (not the HTTP client's chain of errors).
    assert str(error.value).endswith(f"(http://127.0.0.1:{port} experiments/get-by-name: Connection refused)")
    assert "\n" not in str(error.value) and len(str(error.value)) < 150, str(error.value)


# ---------------------------------------------------------------- bad places to write: one line, nothing made


def assert_nothing_of_the_sweep(services, sweep_id):
    client = MlflowClient(services["tracking_uri"])
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is not None:
        assert not client.search_runs([experiment.experiment_id], f"tags.`grkv.sweep` = '{sweep_id}'")


def test_an_unwritable_state_dir_fails_the_ray_job_with_one_line(services, tmp_path):
    """Submitted through the Jobs API: the driver exits 3, so `ray job submit` exits 1 and the job is FAILED."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = slow_config(tmp_path, trials=2)
    submit = subprocess.run(
        [
            "ray",
            "job",
            "submit",
            "--address",
            services["dashboard"],
            "--working-dir",
            str(REPO),
            "--",
            "python",
            "sweep.py",
            "--config",
            str(config),
            "--sweep-id",
            "unwritable",
            "--tracking-uri",
            services["tracking_uri"],
            "--state-dir",
            str(blocker / "state"),
        ],
        cwd=REPO,
        env=services["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert submit.returncode == 1, submit.stdout[-3000:]
    # The job's status message repeats the driver's last log lines: the one line shows twice, alone each time.
    assert "Traceback" not in submit.stdout
    (line,) = {line for line in submit.stdout.splitlines() if line.startswith("sweep")}
    assert line.startswith("sweep: state dir") and "cannot be written (Not a directory)" in line, line
    assert "exit code 3" in submit.stdout
    assert_nothing_of_the_sweep(services, "unwritable")


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs, filled up (root only: skipped where mounting is not allowed)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open(mount / "filler", "wb") as filler:
            try:
                while True:
                    filler.write(b"\0" * 65536)
                    filler.flush()
            except OSError:
                pass
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_state_dir_is_one_line_and_leaves_nothing(services, tmp_path, full_disk):
    driver = start(services, slow_config(tmp_path, trials=2), "full", full_disk / "state")
    _, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 3
    line = one_line(stderr)
    assert "state dir" in line and "No space left on device" in line, line
    assert not (full_disk / "state").exists(), "nothing half-created"
    assert_nothing_of_the_sweep(services, "full")


@pytest.mark.parametrize(
    "url, shown",
    [
        ("sqlite:////no/such/dir/optuna.db", "sqlite:////no/such/dir/optuna.db"),
        (
            "postgresql+psycopg2://grkv:s3cret@127.0.0.1:{port}/optuna",
            "postgresql+psycopg2://grkv:***@127.0.0.1:{port}/optuna",
        ),
    ],
)
def test_an_unreachable_storage_url_is_one_line_and_leaves_nothing(services, tmp_path, url, shown):
    port = free_ports(1)[0]
    driver = start(
        services,
        slow_config(tmp_path, trials=2),
        "no-storage",
        tmp_path / "state",
        None,
        "--storage-url",
        url.format(port=port),
    )
    _, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 3
    line = one_line(stderr)
    assert f"Optuna storage {shown.format(port=port)} cannot be opened" in line and "s3cret" not in line, line
    assert not (tmp_path / "state").exists(), "nothing half-created"
    assert_nothing_of_the_sweep(services, "no-storage")


# ---------------------------------------------------------------- drivers dying and doubling


@pytest.mark.slow
def test_second_driver_refused_then_a_torn_journal_and_stale_lock_resume_promptly(services, tmp_path):
    """Two drivers on one sweep: the second is refused naming the first. The first is SIGKILLed mid-trial, its
    journal left with a torn last line and Optuna's lock file: the resume repairs the journal (a backup kept),
    takes the dead driver's lease and removes the lock at once, and finishes the sweep."""
    sweep_id, state, trials = "two-drivers", tmp_path / "state", 4
    config = slow_config(tmp_path, trials=trials)
    first = start(services, config, sweep_id, state)
    try:
        wait_for(a_trial_running(services["tracking_uri"], sweep_id), 300, "a running trial")
        first.send_signal(signal.SIGSTOP)  # frozen mid-trial (its lease held), so it cannot finish meanwhile
        second = start(services, config, sweep_id, state)
        _, stderr = second.communicate(timeout=300)
        assert second.returncode == 4
        line = one_line(stderr)
        assert f"sweep {sweep_id} is already being run by another driver (pid {first.pid} on" in line, line
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    journal = state / sweep_id / "optuna.journal"
    last = journal.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    with open(journal, "ab") as file:
        file.write(last[: len(last) // 2])  # the write the SIGKILL cut short
    os.symlink(journal, str(journal) + ".lock")  # as Optuna holds it while it appends

    started = time.monotonic()
    resumed = start(services, config, sweep_id, state)
    stdout, stderr = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "taking over the lease of a driver that died" in stderr, stderr[-3000:]
    assert "removed a dead driver's journal lock" in stderr
    assert "cut off its torn last line" in stderr and list(journal.parent.glob("optuna.journal.torn-*"))
    assert "Forcibly releasing" not in stderr and "taking longer than" not in stderr, "stalled on the stale lock"
    assert f"sweep {sweep_id}: FINISHED" in stdout
    study, _ = assert_sweep_complete(services["tracking_uri"], state, sweep_id, trials)
    print(f"resume ran {time.monotonic() - started:.1f} s")
    # A double would be a trial number with two FINISHED runs, or more complete trials than the budget; a proposal
    # of a configuration already evaluated or in flight is not run (reused_trials).
    copies = [t for t in study.trials if REQUEUE_OF_ATTR in t.user_attrs or t in reused_trials(study)]
    assert len(study.trials) - len(copies) == trials, [(t.number, t.state, t.user_attrs) for t in study.trials]


# ---------------------------------------------------------------- services lost mid-sweep


def mlflow_server(state: Path, port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [
            str(VENV_BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{state}/mlflow.db",
            "--artifacts-destination",
            str(state / "artifacts"),
            "--workers",
            "1",
        ],
        env=child_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def answers():
        try:
            check_tracking_server(f"http://127.0.0.1:{port}", timeout_s=2)
            return True
        except TrackingUnavailableError:
            return False

    wait_for(answers, 120, "the MLflow server")
    return server


@pytest.mark.slow
def test_mlflow_lost_mid_sweep_stops_in_one_line_and_the_resume_loses_nothing(services, tmp_path):
    sweep_id, state, trials = "mlflow-down", tmp_path / "state", 4
    config = slow_config(tmp_path, trials=trials)
    text = config.read_text().replace(
        "experiment: grkv-faults", "experiment: grkv-faults\n  retries: 2\n  retry_backoff_s: 0.5"
    )
    config.write_text(text)
    port = free_ports(1)[0]
    tracking_uri = f"http://127.0.0.1:{port}"
    server = mlflow_server(tmp_path, port)
    try:
        driver = start(services, config, sweep_id, state, tracking_uri)
        wait_for(lambda: of_stage(children_of(tracking_uri, sweep_id), FULL_STAGE, "FINISHED"), 600, "a finished trial")
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        lost = time.monotonic()
        _, stderr = driver.communicate(timeout=300)
        stopped_s = time.monotonic() - lost
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 3
    line = one_line(stderr)
    assert f"sweep {sweep_id}: stopped: MLflow" in line and "nothing finished is lost" in line, line
    assert f"resume with: python sweep.py --config {config} --tracking-uri {tracking_uri}" in line, line
    print(f"driver stopped {stopped_s:.1f} s after MLflow went down")
    assert not (state / sweep_id / "driver.lease").read_text(), "the lease is given back"

    server = mlflow_server(tmp_path, port)
    try:
        resumed = start(services, config, sweep_id, state, tracking_uri)
        stdout, stderr = resumed.communicate(timeout=900)
        assert resumed.returncode == 0, stdout[-3000:] + stderr[-3000:]
        assert_sweep_complete(tracking_uri, state, sweep_id, trials)
        finished = {int(p.stem) for p in (state / sweep_id / "trials").glob("*.json")}
        assert {
            int(r.data.tags[TRIAL_TAG]) for r in of_stage(children_of(tracking_uri, sweep_id), FULL_STAGE, "FINISHED")
        } <= finished
    finally:
        os.killpg(server.pid, signal.SIGKILL)


@pytest.mark.slow
def test_cluster_lost_mid_sweep_requeues_in_flight_trials_and_start_sh_recovers_the_cluster(services, tmp_path):
    """A stack of its own (this test kills its Ray): Ray's processes killed mid-trial with the `ray start --block`
    leader left behind (what `ray stop` leaves), the driver stops in one line and re-queues its in-flight trials;
    start.sh sees a Ray that does not answer, restarts it, and the resume finishes the sweep."""
    state_root = Path(tempfile.mkdtemp(prefix="grkv-", dir="/tmp"))  # short: Ray's socket paths
    ports = local_stack_ports()
    env = child_env(GRKV_STATE_DIR=state_root, GRKV_RAY_CPUS=2, GRKV_STOP_TIMEOUT=5, **ports)
    subprocess.run(["bash", str(REPO / "infra/local/start.sh")], env=env, check=True, timeout=300, capture_output=True)
    own = {
        "env": dict(env, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled"),
        "tracking_uri": f"http://127.0.0.1:{ports['GRKV_MLFLOW_PORT']}",
        "ray_address": f"127.0.0.1:{ports['GRKV_RAY_PORT']}",
    }
    sweep_id, state, trials = "cluster-lost", tmp_path / "state", 4
    config = slow_config(tmp_path, trials=trials)
    try:
        driver = start(own, config, sweep_id, state)
        try:
            wait_for(a_trial_running(own["tracking_uri"], sweep_id), 300, "a running trial")
            leader = int((state_root / "ray.pid").read_text())
            os.kill(leader, signal.SIGSTOP)  # the leader outlives its cluster, as after `ray stop`
            group = subprocess.run(["ps", "-eo", "pid=,pgid="], capture_output=True, text=True).stdout.split("\n")
            for pid in [int(f.split()[0]) for f in group if f.split() and int(f.split()[1]) == leader]:
                if pid != leader:
                    os.kill(pid, signal.SIGKILL)
            lost = time.monotonic()
            _, stderr = driver.communicate(timeout=300)
            stopped_s = time.monotonic() - lost
        finally:
            if driver.poll() is None:
                driver.kill()
        assert driver.returncode == 3, stderr[-3000:]
        line = one_line(stderr)
        assert f"sweep {sweep_id}: stopped: the Ray cluster at {own['ray_address']} stopped answering" in line, line
        assert "resume with: python sweep.py" in line and f"--sweep-id {sweep_id}" in line, line
        print(f"driver stopped {stopped_s:.1f} s after the cluster went down")
        # The trials in flight were re-queued (Optuna) and their runs KILLED (MLflow), none FAILED.
        runs = children_of(own["tracking_uri"], sweep_id)
        study = study_of(state, sweep_id)
        killed = of_stage(runs, FULL_STAGE, "KILLED")
        assert killed and not of_stage(runs, FULL_STAGE, "FAILED") and not of_stage(runs, FULL_STAGE, "RUNNING")
        requeued = {t.user_attrs[REQUEUE_OF_ATTR] for t in study.trials if REQUEUE_OF_ATTR in t.user_attrs}
        assert {int(r.data.tags[TRIAL_TAG]) for r in killed} <= requeued

        restart = subprocess.run(
            ["bash", str(REPO / "infra/local/start.sh")], env=env, capture_output=True, text=True, timeout=300
        )
        assert restart.returncode == 0, restart.stdout + restart.stderr
        assert "does not answer" in restart.stdout and "already running and answering" not in restart.stdout
        resumed = start(own, config, sweep_id, state)
        stdout, stderr = resumed.communicate(timeout=900)
        assert resumed.returncode == 0, stdout[-3000:] + stderr[-3000:]
        assert_sweep_complete(own["tracking_uri"], state, sweep_id, trials)
    finally:
        subprocess.run(["bash", str(REPO / "infra/local/stop.sh")], env=env, timeout=300)


def test_a_cluster_without_room_for_a_worker_stops_the_sweep_in_one_line_naming_the_resources(monkeypatch, local_ray):
    from sweeps import worker_pool

    pool = worker_pool.WorkerPool({}, test_samples=0, count=1, num_cpus=2, num_gpus=1, max_retries=0, node_wait_s=0.5)
    assert pool.gcs_address.startswith("127.0.0.1:")  # local_ray's own instance, on loopback only
    monkeypatch.setattr(worker_pool, "alive_nodes", lambda: {"node": {"CPU": 1.0}})
    pool._check_capacity()  # the first look only starts the wait
    pool.no_node_since -= 1.0
    with pytest.raises(worker_pool.NoWorkerLeftError) as raised:
        pool._check_capacity()
    assert str(raised.value) == (
        "no node of the cluster can hold a worker (2 CPUs, 1 GPUs) for 0.5 s (workers.node_wait_s); add one"
    )
    monkeypatch.setattr(worker_pool, "alive_nodes", lambda: {"node": {"CPU": 2.0, "GPU": 1.0}})
    pool._check_capacity()
    assert pool.no_node_since is None
