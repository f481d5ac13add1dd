"""Faults of a sweep whose state lives in PostgreSQL (issue #52): Optuna's storage and MLflow's backend store on the
tests' PostgreSQL server, a local stack started as a user starts it (``GRKV_POSTGRES=1 bash infra/local/start.sh``).

A driver SIGKILLed mid-trial and resumed; twin drivers on two machines (two state directories, one database)
refused through the database's lease; PostgreSQL stopped for 30 s mid-sweep and ridden out, and stopped for longer
than ``storage.outage_s``, stopping the driver in one line; ``grkv report`` and ``grkv export`` of a sweep kept
there. Each sweep ends as every fault test's does (``assert_sweep_complete``): one FINISHED MLflow run per complete
trial, none left RUNNING, no configuration evaluated twice, nothing lost.
"""

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml
from conftest import free_ports
from mlflow.tracking import MlflowClient
from sqlalchemy import event, exc, text
from test_sweep_faults import (
    EXPERIMENT,
    a_trial_running,
    assert_sweep_complete,
    children_of,
    mlflow_server,
    one_line,
    start,
)
from test_sweep_service import REPO, complete_trials, local_stack, of_stage, slow_config, study_of, wait_for

from grkv_core.presses.from_config import load_press_config, resolved
from sweeps.lease import SweepBusyError, SweepLease
from sweeps.state.optuna_storage import open_storage_url
from sweeps.state.rdb_storage import StorageUnavailableError
from workers.names import FULL_STAGE, PRESS_ARTIFACT

# NOTE: sweep ids are the studies' names in the session's one database: each test has its own.
OUTAGE_S = 30


@pytest.fixture(scope="module")
def stack(postgres, tmp_path_factory):
    """A Ray head and an MLflow server whose backend store is the tests' PostgreSQL, which also holds the sweeps'
    Optuna storage (``$GRKV_OPTUNA_STORAGE``, sweep.py's ``--storage-url`` default).

    NOTE: stop.sh stops the stack's PostgreSQL too, so it is started here, whoever stopped it last.
    """
    postgres.run("start")
    with local_stack(
        tmp_path_factory.mktemp("grkv-state"),
        GRKV_POSTGRES=1,
        GRKV_POSTGRES_DIR=postgres.folder / "cluster",
        GRKV_POSTGRES_PORT=postgres.port,
    ) as services:
        assert services["env"]["GRKV_OPTUNA_STORAGE"] == postgres.url("optuna")
        yield services


def finish(driver: subprocess.Popen, timeout: float = 900) -> tuple[str, str]:
    stdout, stderr = driver.communicate(timeout=timeout)
    assert driver.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return stdout, stderr


def kill_mid_trial(stack, config, sweep_id, state) -> subprocess.Popen:
    driver = start(stack, config, sweep_id, state)
    try:
        wait_for(a_trial_running(stack["tracking_uri"], sweep_id), 300, "a running trial")
    finally:
        driver.kill()
        driver.wait(timeout=60)
    return driver


# ---------------------------------------------------------------- the pieces, on the real server, in-process


def test_a_retried_write_whose_first_try_committed_is_not_applied_twice(postgres):
    """The connection lost just after a commit (``after_commit`` raising what a dropped connection raises): the
    re-tried trial creation finds the trial the first try made, the re-tried tell finds its trial finished, and the
    re-tried write of a trial's parameters finds them written."""
    postgres.run("start")
    storage = open_storage_url(postgres.url("optuna"), outage_s=10)
    study = optuna.create_study(study_name="pieces-committed", storage=storage)
    wrote, lose = [], []

    def lost_after_a_write(session):
        if wrote and lose:
            wrote.clear()
            lose.pop()
            raise exc.OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))

    event.listen(storage.scoped_session, "after_flush", lambda session, context: wrote.append(True))
    event.listen(storage.scoped_session, "after_commit", lost_after_a_write)
    lose.append(True)
    study.enqueue_trial({"x": 0.5})
    assert not lose, "the commit was lost once"
    trial = study.ask()
    x = trial.suggest_float("x", 0.0, 1.0)
    lose.append(True)
    study.tell(trial, x)
    assert not lose
    second = study.ask()
    lose.append(True)
    with storage.parameters_in_one_commit():  # as the ledger suggests a trial
        y = second.suggest_float("x", 0.0, 1.0)
        n = second.suggest_int("n", 1, 3)
    assert not lose
    study.tell(second, y)
    assert [(t.number, t.state, t.params) for t in study.trials] == [
        (0, optuna.trial.TrialState.COMPLETE, {"x": 0.5}),
        (1, optuna.trial.TrialState.COMPLETE, {"x": y, "n": n}),
    ]


HOLD_LEASE = """
import logging, sys, time
logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
from sweeps.lease import LeaseLostError, SweepLease
lease = SweepLease(sys.argv[1], sys.argv[2], sys.argv[3])
lease.acquire()
print("held", flush=True)
try:
    while True:
        lease.check()
        time.sleep(0.2)
except LeaseLostError as error:
    print(error, flush=True)
"""


def hold_lease(folder: Path, sweep_id: str, url: str) -> tuple[subprocess.Popen, queue.Queue]:
    """A driver of its own holding a lease until it learns it lost it; its output lines come on the queue."""
    folder.mkdir(exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LEASE, str(folder), sweep_id, url],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in holder.stdout], daemon=True).start()
    return holder, lines


def next_line_with(lines: queue.Queue, wanted: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        if wanted in line:
            return line


def test_the_database_lease_holds_across_state_dirs_and_is_taken_again_after_a_server_restart(
    postgres, tmp_path, caplog
):
    """Two "machines" (two state directories) on one database: the second refused naming the first, even after a
    server restart dropped the lock (the first takes it again); when the second takes it first after a restart, the
    first learns it lost the sweep. A SIGKILLed holder's lease is free at once."""
    postgres.run("start")
    url = postgres.url("optuna")
    (tmp_path / "b").mkdir()
    holder, lines = hold_lease(tmp_path / "a", "lease", url)
    try:
        next_line_with(lines, "held")
        with pytest.raises(SweepBusyError, match=f"pid {holder.pid} on {socket.gethostname()}"):
            SweepLease(tmp_path / "b", "lease", url).acquire()
        postgres.run("stop")
        postgres.run("start")
        next_line_with(lines, "took its database lease again after its connection was lost")
        with pytest.raises(SweepBusyError, match=f"pid {holder.pid} on"):
            SweepLease(tmp_path / "b", "lease", url).acquire()

        postgres.run("stop")
        holder.send_signal(signal.SIGSTOP)  # away while the server restarts: the other machine is first
        postgres.run("start")
        other = SweepLease(tmp_path / "b", "lease", url)
        with caplog.at_level("WARNING", logger="grkv.sweep"):
            other.acquire()
        holder.send_signal(signal.SIGCONT)
        lost = next_line_with(lines, "taken over")
        assert lost.startswith(f"sweep lease was taken over by another driver (pid {os.getpid()} on"), lost
        assert holder.wait(timeout=30) == 0
        with other.database.engine.connect() as connection:
            named = connection.execute(text("SELECT holder FROM grkv_sweep_leases WHERE sweep_id = 'lease'"))
            assert json.loads(named.scalar_one())["pid"] == os.getpid(), "the loser does not clear the winner's name"
        other.release()
    finally:
        holder.kill()
        holder.wait()

    holder, lines = hold_lease(tmp_path / "a", "lease", url)
    next_line_with(lines, "held")
    holder.kill()
    holder.wait()
    started = time.monotonic()
    caplog.clear()
    lease = SweepLease(tmp_path / "b", "lease", url)
    with caplog.at_level("WARNING", logger="grkv.sweep"):
        # NOTE: the server frees the lock once the dead holder's backend has read the end of its connection:
        # milliseconds after the kill, not at the kill.
        lease.acquire(wait_s=2.0)
    print(f"the lease was free {time.monotonic() - started:.2f} s after the kill")
    lease.release()
    (takeover,) = [record.getMessage() for record in caplog.records]
    assert f"taking over the lease of a driver that died (pid {holder.pid} on" in takeover, takeover


def test_a_storage_away_longer_than_its_bound_fails_in_one_line(postgres):
    postgres.run("start")
    storage = open_storage_url(postgres.url("optuna"), outage_s=2)
    study = optuna.create_study(study_name="pieces-bound", storage=storage)
    postgres.run("stop")
    try:
        started = time.monotonic()
        with pytest.raises(StorageUnavailableError) as error:
            study.ask()
        assert 2.0 <= time.monotonic() - started < 10.0
        message = str(error.value)
        assert message.startswith(f"Optuna storage postgresql+psycopg2://grkv:***@127.0.0.1:{postgres.port}/optuna")
        assert re.search(r"did not answer for \d+ s \(storage.outage_s 2; .*Connection refused", message), message
        assert "\n" not in message, message
        started = time.monotonic()
        with pytest.raises(StorageUnavailableError):
            study.ask()  # the outage already outlasted its bound: one try
        assert time.monotonic() - started < 2.0
    finally:
        postgres.run("start")
    assert study.ask().number == 0, "the storage is used again once the database is back"


# ---------------------------------------------------------------- sweeps, as a user runs them


@pytest.fixture(scope="module")
def resumed_sweep(stack, postgres, tmp_path_factory):
    """A sweep whose driver was SIGKILLed mid-trial, then resumed to its end: (sweep id, state dir, config, the
    resume's stderr, the killed driver's pid)."""
    tmp_path = tmp_path_factory.mktemp("killed")
    sweep_id, state = "pg-killed", tmp_path / "state"
    config = slow_config(tmp_path, trials=4)
    killed = kill_mid_trial(stack, config, sweep_id, state)
    study = study_of(state, sweep_id, storage_url=postgres.url("optuna"))
    assert [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING], "killed mid-trial"
    assert of_stage(children_of(stack["tracking_uri"], sweep_id), FULL_STAGE, "RUNNING")
    _, stderr = finish(start(stack, config, sweep_id, state))
    return sweep_id, state, config, stderr, killed.pid


def test_a_driver_killed_mid_trial_resumes_with_optuna_and_mlflow_in_postgresql(stack, postgres, resumed_sweep):
    sweep_id, state, _, stderr, pid = resumed_sweep
    assert f"taking over the lease of a driver that died (pid {pid} on" in stderr, stderr[-3000:]
    assert not (state / sweep_id / "optuna.journal").exists(), "Optuna's storage is the database"
    _, runs = assert_sweep_complete(stack["tracking_uri"], state, sweep_id, 4, storage_url=postgres.url("optuna"))
    assert of_stage(runs, FULL_STAGE, "KILLED"), "the dead driver's runs are closed KILLED"


def test_twin_drivers_on_two_machines_are_refused_and_a_killed_ones_lease_is_taken_over_at_once(
    stack, postgres, tmp_path
):
    """Machine A and machine B: the same sweep id and Optuna database, each its own state directory (where the file
    lock cannot see the other)."""
    sweep_id, trials = "pg-twins", 3
    config = slow_config(tmp_path, trials=trials)
    machine_a, machine_b = tmp_path / "machine-a", tmp_path / "machine-b"
    first = start(stack, config, sweep_id, machine_a)
    try:
        wait_for(a_trial_running(stack["tracking_uri"], sweep_id), 300, "a running trial")
        first.send_signal(signal.SIGSTOP)  # frozen mid-trial, its lease held, so it cannot finish meanwhile
        second = start(stack, config, sweep_id, machine_b)
        _, stderr = second.communicate(timeout=300)
        assert second.returncode == 4, stderr[-3000:]
        line = one_line(stderr)
        assert line.startswith(f"sweep: sweep {sweep_id} is already being run by another driver (pid {first.pid} on")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    started = time.monotonic()
    _, stderr = finish(start(stack, config, sweep_id, machine_b))
    print(f"the takeover ran {time.monotonic() - started:.1f} s")
    # Machine B's lease file never named machine A's driver: the database did.
    assert f"taking over the lease of a driver that died (pid {first.pid} on" in stderr, stderr[-3000:]
    assert_sweep_complete(stack["tracking_uri"], machine_b, sweep_id, trials, storage_url=postgres.url("optuna"))


def test_postgresql_stopped_for_30_s_mid_sweep_is_ridden_out(stack, postgres, tmp_path):
    sweep_id, trials = "pg-outage", 4
    config = slow_config(tmp_path, trials=trials)
    driver = start(stack, config, sweep_id, tmp_path / "state")
    try:
        wait_for(a_trial_running(stack["tracking_uri"], sweep_id), 300, "a running trial")
        postgres.run("stop")
        time.sleep(OUTAGE_S)
        assert driver.poll() is None, "the driver waits for the database"
    finally:
        postgres.run("start")
    _, stderr = finish(driver)
    print("\n".join(line for line in stderr.splitlines() if "retrying" in line or "again" in line))
    assert "took its database lease again" in stderr, stderr[-3000:]
    assert_sweep_complete(
        stack["tracking_uri"], tmp_path / "state", sweep_id, trials, storage_url=postgres.url("optuna")
    )


def test_postgresql_away_longer_than_storage_outage_s_stops_the_driver_in_one_line_and_the_resume_finishes(
    stack, postgres, tmp_path
):
    """MLflow here on its own SQLite store, so that the Optuna database alone is lost."""
    sweep_id, state, trials = "pg-gone", tmp_path / "state", 3
    config = slow_config(tmp_path, trials=trials)
    settings = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**settings, "storage": {"outage_s": 5}}))
    port = free_ports(1)[0]
    tracking_uri = f"http://127.0.0.1:{port}"
    server = mlflow_server(tmp_path, port)
    try:
        driver = start(stack, config, sweep_id, state, tracking_uri)
        try:
            wait_for(a_trial_running(tracking_uri, sweep_id), 300, "a running trial")
            postgres.run("stop")
            _, stderr = driver.communicate(timeout=300)
        finally:
            if driver.poll() is None:
                driver.kill()
            postgres.run("start")
        assert driver.returncode == 3, stderr[-3000:]
        line = one_line(stderr)
        shown = f"postgresql+psycopg2://grkv:***@127.0.0.1:{postgres.port}/optuna"
        assert line.startswith(f"sweep {sweep_id}: stopped: Optuna storage {shown} did not answer for "), line
        assert "s (storage.outage_s 5; " in line and "nothing finished is lost" in line, line
        resume = f"python sweep.py --config {config} --tracking-uri {tracking_uri} --state-dir {state} --sweep-id"
        assert line.endswith(f"resume with: {resume} {sweep_id}"), line
        assert not of_stage(children_of(tracking_uri, sweep_id), FULL_STAGE, "FAILED")

        finish(start(stack, config, sweep_id, state, tracking_uri))
        assert_sweep_complete(tracking_uri, state, sweep_id, trials, storage_url=postgres.url("optuna"))
    finally:
        os.killpg(server.pid, signal.SIGKILL)


def test_report_and_export_read_a_sweep_kept_in_postgresql(stack, postgres, resumed_sweep, tmp_path):
    sweep_id, state, _, _, _ = resumed_sweep
    uri = stack["tracking_uri"]
    grkv = [sys.executable, "-m", "sweeps.cli"]
    report = subprocess.run(
        [*grkv, "report", "--sweep-id", sweep_id, "--tracking-uri", uri, "--output-dir", str(tmp_path / "report")],
        cwd=REPO,
        env=stack["env"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert report.returncode == 0, report.stdout[-3000:] + report.stderr[-3000:]
    assert f"GRKV sweep {sweep_id} (FINISHED, 4 finished trial(s))" in report.stdout, report.stdout[-3000:]
    assert (tmp_path / "report" / "report.html").is_file()
    study = study_of(state, sweep_id, storage_url=postgres.url("optuna"))
    rows = pd.read_csv(tmp_path / "report" / "trials.csv")
    assert len(rows) == len(complete_trials(study)), "one row per complete trial of the study in PostgreSQL"
    client = MlflowClient(uri)
    parent = client.search_runs(
        [client.get_experiment_by_name(EXPERIMENT).experiment_id],
        f"tags.`grkv.sweep_id` = '{sweep_id}' and tags.`grkv.role` = 'sweep'",
    )[0]
    assert "report/report.html" in {a.path for a in client.list_artifacts(parent.info.run_id, "report")}

    output = tmp_path / "press.yaml"
    export = subprocess.run(
        [*grkv, "export", "--sweep-id", sweep_id, "--tracking-uri", uri, "--output", str(output)],
        cwd=REPO,
        env=stack["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert export.returncode == 0, export.stdout[-3000:] + export.stderr[-3000:]
    # The sweep's own recommendation (its driver exported it at the end) is what `grkv export` chooses.
    assert resolved(load_press_config(output)) == resolved(load_press_config(state / sweep_id / PRESS_ARTIFACT))
    logged = Path(client.download_artifacts(parent.info.run_id, PRESS_ARTIFACT, str(tmp_path / "logged")))
    assert logged.read_text() == output.read_text()
