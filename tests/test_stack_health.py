"""``infra/local/start.sh`` on a stack that already runs a job: slow is not dead. A start that waits on another's lock
waits for it; a Ray head that runs a job is never restarted, even when its dashboard stops answering (exit 3, one
line); the job keeps running."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from test_sweep_service import REPO, local_stack, wait_for

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
