"""The local Ray + MLflow stack (``infra/local/start.sh``, ``stop.sh``) and one sweep run on it as a Ray job,
followed from its MLflow runs: what ``grkv sweep`` and ``grkv demo`` run.

NOTE: imports nothing heavy at import time; Ray's job client and MLflow's are imported where a sweep is run.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sweeps.follow import ACTIVE_JOB, ProgressPrinter, cluster_loss, job_end
from workers.names import CHECKPOINT_FOLDER

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCAL_INFRA = REPO_ROOT / "infra" / "local"
SWEEP_ENTRYPOINT = REPO_ROOT / "sweep.py"


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1, outside Ray's worker port range 10002-19999 (for the services)."""
    sockets, ports = [], []
    try:
        while len(ports) < n:
            probe = socket.socket()
            probe.bind(("127.0.0.1", 0))
            sockets.append(probe)
            port = probe.getsockname()[1]
            if not 10002 <= port <= 19999:
                ports.append(port)
    finally:
        for probe in sockets:
            probe.close()
    return ports


class ServiceError(RuntimeError):
    """The local stack or the sweep job failed; the message says where its log is."""


@dataclass(frozen=True)
class LocalStack:
    """Ray head and MLflow server on 127.0.0.1, started by ``infra/local/start.sh`` from ``state_dir``; with
    ``postgres``, a PostgreSQL server of its own holds MLflow's backend store and the sweeps' Optuna storage."""

    state_dir: Path
    postgres: bool = False

    def _script(self, name: str) -> None:
        """Run ``infra/local/<name>``, echoing its progress lines as they come."""
        env = {**os.environ, "GRKV_STATE_DIR": str(self.state_dir)}
        if self.postgres:
            env["GRKV_POSTGRES"] = "1"
        with subprocess.Popen(
            ["bash", str(LOCAL_INFRA / name)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ) as script:
            for line in script.stdout:
                if line.startswith("grkv-local:"):
                    print(line, end="", flush=True)
            errors = script.stderr.read()
        if script.returncode:
            first = next(
                (line for line in errors.splitlines() if "error:" in line), f"{name} exited {script.returncode}"
            )
            raise ServiceError(
                f"{first.removeprefix('grkv-local: error: ')} (logs: {self.state_dir}/ray.log, mlflow.log)"
            )

    def start(self) -> None:
        """Start what is not running; a healthy stack already running from ``state_dir`` is reused as it is."""
        self._script("start.sh")

    def stop(self) -> None:
        self._script("stop.sh")

    @property
    def stop_command(self) -> str:
        return f"GRKV_STATE_DIR={shlex.quote(str(self.state_dir))} bash {LOCAL_INFRA / 'stop.sh'}"

    def _endpoint(self, name: str) -> str:
        for line in (self.state_dir / "endpoints.env").read_text().splitlines():
            key, _, value = line.partition("=")
            if key == name:
                return value
        raise ServiceError(f"{self.state_dir / 'endpoints.env'} has no {name}; restart the stack")

    @property
    def mlflow_url(self) -> str:
        return f"http://127.0.0.1:{self._endpoint('MLFLOW_PORT')}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self._endpoint('RAY_DASHBOARD_PORT')}"

    @property
    def sweeps_dir(self) -> Path:
        return self.state_dir / "sweeps"


# ---- one sweep as a Ray job, followed from MLflow --------------------------------------------------------------

SWEEP_ID_METADATA = "grkv.sweep_id"


def _submit(stack: LocalStack, config_path: Path, sweep_id: str):
    """Submit the sweep as a Ray job (``ray job submit`` through the Jobs API), or find the job already running it.

    Returns the job client and the job's submission id.
    """
    import logging

    from ray.job_submission import JobSubmissionClient

    # NOTE: the job uploads the repository (what git ignores stays out, the stack's state dir included); Ray
    # logs every file it leaves out and warns that it leaves out .git, noise here.
    for name in ("ray", "ray.dashboard.modules.dashboard_sdk"):  # NOTE: the latter sets its own level
        logging.getLogger(name).setLevel(logging.ERROR)
    jobs = JobSubmissionClient(stack.dashboard_url)
    for job in jobs.list_jobs():
        if (job.metadata or {}).get(SWEEP_ID_METADATA) == sweep_id and str(job.status.value) in ACTIVE_JOB:
            print(f"sweep {sweep_id}: following its running Ray job {job.submission_id}")
            return jobs, job.submission_id
    entrypoint = shlex.join(
        [
            sys.executable,
            SWEEP_ENTRYPOINT.name,
            "--config",
            str(config_path.resolve()),
            "--sweep-id",
            sweep_id,
            "--tracking-uri",
            stack.mlflow_url,
            "--state-dir",
            str(stack.sweeps_dir),
        ]
    )
    job_id = jobs.submit_job(
        entrypoint=entrypoint,
        metadata={SWEEP_ID_METADATA: sweep_id},
        submission_id=f"grkv-{sweep_id}-{time.strftime('%Y%m%d-%H%M%S')}",
        runtime_env={"working_dir": str(REPO_ROOT)},
    )
    print(
        f"sweep {sweep_id}: submitted as Ray job {job_id} (logs: ray job logs --address {stack.dashboard_url} {job_id})"
    )
    return jobs, job_id


def run_sweep(stack: LocalStack, config_path: Path, sweep_id: str) -> str:
    """Run (or resume, or follow) one sweep on the local stack to its end, showing a line per finished run;
    returns the parent run's status. A Ctrl-C stops the job cleanly (its in-flight trials are re-queued); a
    cluster that stops answering meanwhile raises ``SweepLostError`` (``sweeps.follow.cluster_loss``)."""
    from mlflow.tracking import MlflowClient

    from sweeps.config import load_config

    config = load_config(config_path)
    jobs, job_id = _submit(stack, config_path, sweep_id)
    progress = ProgressPrinter(
        MlflowClient(stack.mlflow_url), config, sweep_id, stack.sweeps_dir / sweep_id / CHECKPOINT_FOLDER
    )
    progress.update(quiet=True)
    if progress.stage_of:
        print(f"sweep {sweep_id}: resuming, {len(progress.stage_of)} run(s) already finished")
    try:
        status, reason = job_end(jobs, job_id, progress.update)
    except KeyboardInterrupt:
        print(f"\nstopping Ray job {job_id} (in-flight trials are closed and re-queued) ...", file=sys.stderr)
        jobs.stop_job(job_id)
        for _ in range(60):
            if str(jobs.get_job_status(job_id).value) not in ACTIVE_JOB:
                break
            time.sleep(1)
        raise
    progress.update()
    if status == "SUCCEEDED":
        return progress.parent_status()
    if lost := cluster_loss(
        jobs,
        status,
        reason,
        stack.dashboard_url,
        stack.mlflow_url,
        config.tracking.experiment,
        stack.sweeps_dir / sweep_id,
        sweep_id,
    ):
        raise lost
    tail = "\n".join(jobs.get_job_logs(job_id).splitlines()[-15:])
    print(tail, file=sys.stderr)
    raise ServiceError(f"Ray job {job_id} of sweep {sweep_id} ended {status} (its last log lines are above)")
