"""Faults of a multi-node cluster, for real on 127.0.0.1: the node holding the workers lost mid-batch (a
``ray.cluster_utils.Cluster`` of a 0-CPU head and one worker node), workers killed more often than Ray restarts
them, a worker whose checkpoint folder fills up mid-batch, and `ray stop` (what it does, to the test's own cluster
only: ``ray_stop``) under ``ray job submit`` and under ``grkv sweep``. Each ends with Optuna's and MLflow's end
state: nothing FAILED for the fault, exactly one FINISHED run per complete trial, nothing lost after the resume."""

import fcntl
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import optuna
import pytest
from conftest import local_stack_ports
from ray_stop import ray_stop
from test_sweep_faults import (
    EXPERIMENT,
    a_trial_running,
    assert_sweep_complete,
    children_of,
    one_line,
    start,
)
from test_sweep_service import (
    REPO,
    VENV_BIN,
    child_env,
    local_stack,
    of_stage,
    runs_of,
    services,  # noqa: F401 - the module's stack: a Ray head and an MLflow server
    slow_config,
    study_of,
    wait_for,
)

from workers.names import FULL_STAGE, REQUEUE_OF_ATTR, REUSES_ATTR

WORKER_NODE = dict(num_cpus=2, node_ip_address="127.0.0.1")


def start_on_the_head(services, cluster, config, sweep_id, state, **node_args):
    """A driver on ``cluster`` attached to its head, then a worker node (``node_args`` on top of ``WORKER_NODE``).

    NOTE: a driver attaches to the first alive node of its IP address that Ray's GCS lists, in no set order. Here every
    node is 127.0.0.1, so a driver started beside a worker node may attach to that node and hang when a test removes
    it (on a real cluster the driver runs on the head, which these tests never lose). Started while the head is the
    only node, the driver attaches to the head; its lease, taken once it has joined the cluster, says when.
    """
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node)
    driver = start(dict(services, ray_address=cluster.address), config, sweep_id, state)
    wait_for(
        lambda: (state / sweep_id / "driver.lease").is_file() or driver.poll() is not None, 300, "the driver's lease"
    )
    cluster.add_node(**WORKER_NODE, **node_args)
    return driver


def failed_trials(study) -> set[int]:
    """Trials failed other than to be re-queued (a trial the sweep runs again) or as a reused proposal."""
    requeued = {t.user_attrs[REQUEUE_OF_ATTR] for t in study.trials if REQUEUE_OF_ATTR in t.user_attrs}
    return {
        t.number for t in study.trials if t.state == optuna.trial.TrialState.FAIL and REUSES_ATTR not in t.user_attrs
    } - requeued


def newest_checkpoint_write(state, sweep_id) -> float:
    """When a worker last wrote a sample's result (0: never)."""
    folder = state / sweep_id / "checkpoints"
    return max((path.stat().st_mtime for path in folder.rglob("*.json")), default=0.0)


@pytest.fixture
def cluster():
    """A head with no CPUs (so no worker can run there) and one 2-CPU worker node, all on 127.0.0.1."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args=dict(num_cpus=0, node_ip_address="127.0.0.1", include_dashboard=False),
    )
    cluster.add_node(**WORKER_NODE)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def test_the_node_holding_the_workers_lost_mid_batch_three_times_fails_nothing(services, cluster, tmp_path):
    sweep_id, state, trials = "node-lost", tmp_path / "state", 4
    config = slow_config(tmp_path, trials=trials, **{"data.samples": 6})
    driver = start_on_the_head(services, cluster, config, sweep_id, state)
    try:
        wait_for(a_trial_running(services["tracking_uri"], sweep_id), 300, "a running trial")
        node_added = time.time()
        for _ in range(3):
            # Mid-batch: the batch has written a sample's result on the node now holding its workers.
            wait_for(lambda: newest_checkpoint_write(state, sweep_id) > node_added, 300, "a sample on the node")
            (worker_node,) = cluster.worker_nodes
            cluster.remove_node(worker_node)
            cluster.add_node(**WORKER_NODE)
            node_added = time.time()
        stdout, stderr = driver.communicate(timeout=900)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "lost with its node" in stdout + stderr
    study, runs = assert_sweep_complete(services["tracking_uri"], state, sweep_id, trials)
    assert not failed_trials(study), "a trial failed for a lost node"
    finished = of_stage(runs, FULL_STAGE, "FINISHED")
    # Node losses are not the workers' deaths: every trial finished on its first attempt's count.
    assert {run.data.metrics["worker_attempts"] for run in finished} == {1.0}


def alive_worker_pids(dashboard) -> list[int]:
    from ray.util.state import list_actors

    actors = list_actors(address=dashboard, filters=[("class_name", "=", "TrialWorker"), ("state", "=", "ALIVE")])
    return [actor.pid for actor in actors if actor.pid]


def test_workers_killed_more_often_than_ray_restarts_them_stop_the_sweep_in_one_line(services, tmp_path):
    sweep_id, state, trials = "workers-gone", tmp_path / "state", 4
    config = slow_config(tmp_path, trials=trials, **{"workers.max_retries": 1})
    driver = start(services, config, sweep_id, state)
    try:
        wait_for(a_trial_running(services["tracking_uri"], sweep_id), 300, "a running trial")
        first_kill = time.monotonic()
        while driver.poll() is None and time.monotonic() - first_kill < 300:
            for pid in alive_worker_pids(services["dashboard"]):
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        _, stderr = driver.communicate(timeout=60)
        stopped_s = time.monotonic() - first_kill
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 3, stderr[-3000:]
    line = one_line(stderr)
    assert f"sweep {sweep_id}: stopped: no trial worker is left: each died more than 1 times" in line, line
    reason = line.split(": stopped: ", 1)[1].split("; nothing finished is lost", 1)[0]
    assert "resume with:" in line and len(reason) < 250, line
    assert stopped_s < 120, f"the driver took {stopped_s:.0f} s to stop"
    study = study_of(state, sweep_id)
    assert not failed_trials(study), "a trial failed for its workers' deaths"
    assert not of_stage(children_of(services["tracking_uri"], sweep_id), FULL_STAGE, "RUNNING")

    resumed = start(services, config, sweep_id, state)
    stdout, stderr = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert_sweep_complete(services["tracking_uri"], state, sweep_id, trials)


@pytest.fixture
def small_tmpfs(tmp_path):
    """Mount a 256 KiB tmpfs where asked, filled on demand (root only: skipped where mounting is not allowed)."""
    mounted = []

    def mount(where):
        where.mkdir(parents=True)
        if subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True
        ).returncode:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(where)

    def fill(where):
        with open(where / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(b"\0" * 4096)
            except OSError:
                pass

    def empty(where):
        (where / "filler").unlink()

    try:
        yield mount, fill, empty
    finally:
        for where in mounted:
            subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_checkpoint_folder_filling_up_mid_batch_stops_the_sweep_and_fails_no_trial(services, tmp_path, small_tmpfs):
    mount, fill, empty = small_tmpfs
    sweep_id, state, trials = "checkpoints-full", tmp_path / "state", 4
    checkpoints = state / sweep_id / "checkpoints"
    mount(checkpoints)
    config = slow_config(tmp_path, trials=trials, **{"data.samples": 6})
    driver = start(services, config, sweep_id, state)
    try:
        wait_for(lambda: newest_checkpoint_write(state, sweep_id) > 0, 300, "a sample's checkpoint")
        fill(checkpoints)
        _, stderr = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 3, stderr[-3000:]
    line = one_line(stderr)
    assert "cannot write its checkpoints (No space left on device" in line and "resume with:" in line, line
    # The other worker's WorkerStorageError, dropped unread, is not reported after it (see the test below).
    assert stderr.rstrip().splitlines()[-1] == line and "Unhandled error" not in stderr, stderr[-3000:]
    study = study_of(state, sweep_id)
    assert not failed_trials(study), "a trial failed for a full disk"
    parents, runs = runs_of(services["tracking_uri"], EXPERIMENT, sweep_id)
    assert [parent.info.status for parent in parents] == ["KILLED"], "a sweep that stopped is not FINISHED"
    assert not of_stage(runs, FULL_STAGE, "FAILED") and not of_stage(runs, FULL_STAGE, "RUNNING")

    empty(checkpoints)
    resumed = start(services, config, sweep_id, state)
    stdout, stderr = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert_sweep_complete(services["tracking_uri"], state, sweep_id, trials)


def test_a_stopped_pool_drops_its_in_flight_errors_without_an_unhandled_error(
    tmp_path, small_tmpfs, monkeypatch, local_ray
):
    """Two workers whose checkpoints cannot be written: the first WorkerStorageError stops the pool, and the
    other's, which the pool drops unread, must not come back as Ray's "Unhandled error" traceback after the driver's
    one-line stop (it did, from the second worker, in the sweep of the test above)."""
    import logging

    import ray

    from grkv_core.config import PressConfig
    from sweeps.config import load_config
    from sweeps.worker_pool import WorkerPool
    from workers.protocol import TrialRequest
    from workers.trial_worker import WorkerStorageError

    mount, fill, _ = small_tmpfs
    checkpoints = tmp_path / "checkpoints"
    mount(checkpoints)
    fill(checkpoints)
    monkeypatch.delenv("RAY_IGNORE_UNHANDLED_ERRORS", raising=False)  # NOTE: restored after, so others see Ray's
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("ray._private.worker").addHandler(handler)  # NOTE: where Ray logs an unhandled error
    config = load_config(slow_config(tmp_path, trials=2))
    try:
        pool = WorkerPool(
            config.eval_config().to_dict(), 0, count=2, num_cpus=1, num_gpus=0, max_retries=0, node_wait_s=60
        )
        for number in (0, 1):
            pool.submit([TrialRequest(number, PressConfig("snapkv", 0.75), checkpoint_dir=str(checkpoints))])
        with pytest.raises(WorkerStorageError):
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                pool.wait(timeout_s=1.0)
        assert len(pool.drain()) == 2  # NOTE: the failed batch too: its trials are re-queued with the rest
        # An actor's calls run in order: once each worker answers, its batch has ended and its error reached here.
        ray.get([worker.identity.remote() for worker in pool.workers], timeout=300)
        time.sleep(2)
    finally:
        ray.shutdown()  # NOTE: before the handler goes: a dropped error would be logged by then
        logging.getLogger("ray._private.worker").removeHandler(handler)
    assert not [message for message in logged if "Unhandled error" in message], logged


def lease_held(folder: Path) -> bool:
    """Whether a live driver holds the sweep's lease, looked at without taking it (the resume still finds the dead
    driver's name in it)."""
    with open(folder / "driver.lease") as lease:
        try:
            fcntl.flock(lease, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lease, fcntl.LOCK_UN)
        return False


def ray_stop_mid_batch(stack_dir: Path, state: Path, sweep_id: str) -> None:
    """Once a batch has written a sample's checkpoint, what `ray stop` does, to this stack's Ray only (``ray_stop``:
    the real command would stop every Ray on the machine, other tests' and other users' included)."""
    wait_for(lambda: newest_checkpoint_write(state, sweep_id) > 0, 300, "a sample's checkpoint")
    signalled = ray_stop(int((stack_dir / "ray.pid").read_text()), (stack_dir / "ray.tempdir").read_text().strip())
    print(f"signalled as `ray stop` would: {signalled}")
    terminated = [name for sent, _, name in signalled if sent == "SIGTERM"]
    # Its order: the raylet, then the other Ray processes still there, the GCS server last.
    assert terminated[0] == "raylet" and terminated[-1] == "gcs_server" and len(terminated) > 2, signalled


def test_no_test_runs_the_real_ray_stop():
    """`ray stop` stops every Ray of the machine, other tests' and other users' clusters included: the tests only do
    what it does to their own cluster (``ray_stop``)."""
    # NOTE: its command line as argv or as a string, or its Python function (tests/test_infra.py checks the scripts)
    real = re.compile(r"""["']ray["'],\s*["']stop["']|["']ray stop\b|scripts\.scripts import .*\bstop\b""")
    for path in Path(__file__).parent.glob("*.py"):
        assert not real.search(path.read_text()), f"{path} runs `ray stop`"


def ray_job_submit(stack, config, sweep_id, state, submission_id) -> subprocess.Popen:
    """The README's command by hand: ``ray job submit ... -- python sweep.py ...``, its output as the user sees it."""
    return subprocess.Popen(
        [
            "ray",
            "job",
            "submit",
            "--address",
            stack["dashboard"],
            "--working-dir",
            str(REPO),
            "--submission-id",
            submission_id,
            "--",
            "python",
            "sweep.py",
            "--config",
            str(config),
            "--sweep-id",
            sweep_id,
            "--tracking-uri",
            stack["tracking_uri"],
            "--state-dir",
            str(state),
        ],
        cwd=REPO,
        env=stack["env"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_ray_stop_under_ray_job_submit_leaves_the_client_at_0_and_the_resume_finishes(tmp_path):
    """`ray stop` under `ray job submit` (one to three minutes). The driver cannot say anything: its job supervisor dies
    with the raylet, and the supervisor's watcher SIGKILLs the driver's process group within a second
    (ray/dashboard/modules/job/job_supervisor.py, ``_exec_entrypoint``). Ray's client, whose log stream closes
    with the raylet's agents, asks the head for the job's status before the head has noticed, so it exits 0 on
    "RUNNING": what the fault table says, and why it points to `grkv sweep`. start.sh and the resume, as a user runs
    them, finish the sweep with nothing lost."""
    stack_dir = Path(tempfile.mkdtemp(prefix="grkv-", dir="/tmp"))  # short: Ray's socket paths
    sweep_id, state, trials = "ray-stopped", tmp_path / "state", 4
    config = slow_config(tmp_path, trials=trials, **{"data.samples": 6})
    with local_stack(stack_dir, GRKV_STOP_TIMEOUT=5) as stack:
        client = ray_job_submit(stack, config, sweep_id, state, sweep_id)
        try:
            ray_stop_mid_batch(stack_dir, state, sweep_id)
            output, _ = client.communicate(timeout=120)
        finally:
            if client.poll() is None:
                client.kill()
        assert client.returncode == 0, output[-3000:]
        *_, status, message = output.rstrip().splitlines()
        assert f"Status for job '{sweep_id}': RUNNING" in status, output[-3000:]
        assert "Status message: Job is currently running." in message, output[-3000:]
        wait_for(lambda: not lease_held(state / sweep_id), 60, "the driver's end")
        parents, runs = runs_of(stack["tracking_uri"], EXPERIMENT, sweep_id)
        assert [parent.info.status for parent in parents] == ["RUNNING"], "closed by nothing until the resume"
        assert of_stage(runs, FULL_STAGE, "RUNNING") and not of_stage(runs, FULL_STAGE, "FAILED")

        restart = subprocess.run(
            ["bash", str(REPO / "infra/local/start.sh")], env=stack["env"], capture_output=True, text=True, timeout=300
        )
        assert restart.returncode == 0, restart.stdout + restart.stderr
        assert "does not answer" in restart.stdout, "`ray stop` leaves the `ray start --block` leader running"
        resumed = ray_job_submit(stack, config, sweep_id, state, f"{sweep_id}-2")
        output, _ = resumed.communicate(timeout=900)
        assert resumed.returncode == 0, output[-3000:]
        takeover = next(line for line in output.splitlines() if "taking over the lease" in line)
        assert f"Ray job {sweep_id});" in takeover and "ray job stop" not in takeover, takeover
        assert f"sweep {sweep_id}: FINISHED" in output
        assert_sweep_complete(stack["tracking_uri"], state, sweep_id, trials)


@pytest.mark.slow
def test_ray_stop_under_grkv_sweep_stops_it_in_one_line_and_the_same_command_resumes_it(tmp_path):
    """`ray stop` under `grkv sweep` (one to three minutes): the command follows the sweep's own state, so it stops
    in one line, exit 3, once the driver has ended with the cluster, with the runs the driver left RUNNING closed
    KILLED; the same command again restarts Ray and finishes the sweep with nothing lost."""
    stack_dir = Path(tempfile.mkdtemp(prefix="grkv-", dir="/tmp"))  # short: Ray's socket paths
    ports = local_stack_ports()
    # NOTE: PYTHONPATH: the console script runs this checkout, wherever the virtual environment was installed from
    env = child_env(GRKV_RAY_CPUS=2, GRKV_STOP_TIMEOUT=5, PYTHONPATH=REPO, **ports)
    tracking_uri = f"http://127.0.0.1:{ports['GRKV_MLFLOW_PORT']}"
    sweep_id, state, trials = "grkv-ray-stopped", stack_dir / "sweeps", 4
    config = slow_config(tmp_path, trials=trials, **{"data.samples": 6})
    command = [
        str(VENV_BIN / "grkv"),
        "sweep",
        "--config",
        str(config),
        "--sweep-id",
        sweep_id,
        "--state-dir",
        str(stack_dir),
    ]
    try:
        sweep = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ray_stop_mid_batch(stack_dir, state, sweep_id)
            stdout, stderr = sweep.communicate(timeout=300)
        finally:
            if sweep.poll() is None:
                sweep.kill()
        assert sweep.returncode == 3, stdout[-3000:] + stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        last = stderr.rstrip().splitlines()[-1]
        print(last)
        assert last.startswith(
            f"sweep {sweep_id}: stopped: the Ray cluster stopped answering (Jobs API "
            f"http://127.0.0.1:{ports['GRKV_RAY_DASHBOARD_PORT']}: "
        ), last
        assert "the driver ended with it and its " in last and " run(s) left RUNNING are closed KILLED" in last, last
        assert last.endswith(f"resume with: {shlex.join(['grkv', *command[1:]])}"), last
        assert not lease_held(state / sweep_id)
        parents, runs = runs_of(tracking_uri, EXPERIMENT, sweep_id)
        assert [parent.info.status for parent in parents] == ["KILLED"], "a sweep that stopped is not RUNNING"
        assert of_stage(runs, FULL_STAGE, "KILLED") and not of_stage(runs, FULL_STAGE, "RUNNING")
        assert not of_stage(runs, FULL_STAGE, "FAILED")

        resumed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert "does not answer" in resumed.stdout and f"sweep {sweep_id}: FINISHED" in resumed.stdout
        assert_sweep_complete(tracking_uri, state, sweep_id, trials)
    finally:
        subprocess.run(
            ["bash", str(REPO / "infra/local/stop.sh")],
            env=dict(env, GRKV_STATE_DIR=str(stack_dir)),
            capture_output=True,
            timeout=300,
        )
