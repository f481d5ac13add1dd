"""How ``grkv sweep`` (and ``grkv demo``) follow a sweep's Ray job to its end: the progress lines read from MLflow,
the job's end, and what happens when the cluster goes away under it.

``ray stop`` on the head stops the cluster's processes (the raylet first, then the rest, the GCS last). The job's
supervisor dies with the raylet and Ray kills the job's driver with it, so the driver can neither close its runs nor
say anything. Ray's own ``ray job submit`` then reads the job's status before the head has noticed, and exits 0 on
"RUNNING". ``grkv sweep`` follows the sweep's own state instead: once the Jobs API stops answering it waits for the
sweep's driver to end (its lease), closes the runs it left RUNNING as KILLED and stops in one line (exit 3) with the
command that resumes the sweep.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Callable

from sweeps.lease import SweepBusyError, SweepLease
from workers.names import FULL_STAGE, ROLE_TAG, SCREEN_STAGE, STAGE_TAG, SWEEP_TAG, TEST_OF_TAG, TRIAL_TAG

ACTIVE_JOB = ("PENDING", "RUNNING")
POLL_S = 3.0
# How long the sweep's driver may outlive its cluster: Ray's job supervisor SIGKILLs the driver within a second of
# its own death, and Ray ends any driver whose GCS has been gone for gcs_rpc_server_reconnect_timeout_s (60 s).
DRIVER_END_WAIT_S = 90.0


class SweepLostError(RuntimeError):
    """The sweep's Ray cluster stopped answering before the sweep's end; the message is one line."""


class ProgressPrinter:
    """What a sweep did since the last look, read from its MLflow runs: one line per batch of runs that started
    and one per trial or test run that ended (its objective, or the screening metric, and its evaluation time).

    Each look asks MLflow only for the runs that ended since the last one and those running now, so it costs the
    same at trial 10 and at trial 10,000, and every page of an answer is read (no cap drops a line).
    NOTE: a run's end time is taken when the driver sends its close, from one of its writer's threads, so a run can
    reach MLflow after a run that ended later and that a look has already counted. Each look therefore reaches
    ``LOOKBACK_MS`` back from the latest end time seen, and leaves out by id the runs already counted there: it
    returns only runs not counted yet (measured on 5,100 runs: benchmarks/follow_scale.py).
    """

    PAGE = 1000
    # Longer than a close can take to reach MLflow once its end time is set (its request, retried on errors).
    LOOKBACK_MS = 120_000
    # The longest silence while runs are running (a look every POLL_S: under 30 s in all): then a line says which still
    # run and how far they are.
    HEARTBEAT_S = 25.0
    # The most runs a "running" line names.
    NAMES_SHOWN = 6

    def __init__(self, client, config, sweep_id: str, checkpoints: Path | None = None):
        self.client, self.config, self.sweep_id = client, config, sweep_id
        self.checkpoints = checkpoints  # the state directory's checkpoints/: the running trials' samples done
        self.stage_of: dict[str, str] = {}  # run id -> stage, of every run already shown or counted
        self.end_time: dict[str, int] = {}  # run id -> end time (ms), of the runs counted
        self.running: set[str] = set()  # run ids already announced as running
        self.started = self.last_line = time.monotonic()
        self.totals = {SCREEN_STAGE: config.screening.trials, FULL_STAGE: config.trials}

    def runs(self, role: str = "trial", condition: str = "") -> list:
        """The sweep's runs of ``role`` (matching ``condition``, an MLflow filter clause), every page of them."""
        experiment = self.client.get_experiment_by_name(self.config.tracking.experiment)
        if experiment is None:
            return []
        query = f"tags.`{SWEEP_TAG}` = '{self.sweep_id}' and tags.`{ROLE_TAG}` = '{role}'"
        found, token = [], None
        while True:
            page = self.client.search_runs(
                [experiment.experiment_id],
                f"{query} and {condition}" if condition else query,
                max_results=self.PAGE,
                page_token=token,
            )
            found += page
            token = page.token
            if not token:
                return found

    def update(self, quiet: bool = False) -> None:
        """Print the runs that started or ended since the last call (with ``quiet``, only count those that ended:
        a resumed sweep's)."""
        since = max(self.end_time.values(), default=0) - self.LOOKBACK_MS
        counted = ", ".join(f"'{run_id}'" for run_id, ended in self.end_time.items() if ended >= since)
        recent = self.runs(
            condition=f"attributes.end_time >= {since}"
            + (f" and attributes.run_id NOT IN ({counted})" if counted else "")
        )
        for child in recent:
            self.end_time[child.info.run_id] = child.info.end_time or 0
        ended = [
            child
            for child in recent
            if child.info.status in ("FINISHED", "FAILED") and child.info.run_id not in self.stage_of
        ]
        for child in sorted(ended, key=lambda child: child.info.end_time or 0):
            stage = child.data.tags.get(STAGE_TAG, FULL_STAGE)
            self.stage_of[child.info.run_id] = stage
            if quiet:
                continue
            done = sum(seen == stage for seen in self.stage_of.values())
            count = f"{done}/{self.totals[stage]}" if stage in self.totals else str(done)
            metric = self.config.screening.metric if stage == SCREEN_STAGE else self.config.objectives[0].metric
            metrics = child.data.metrics
            value = f"{metric} {metrics[metric]:.4g}" if metric in metrics else child.info.status.lower()
            self._print(
                f"{stage:6} {count:>5}  {self._name(child):<24} {value:<26} {metrics.get('trial_eval_s', 0.0):6.1f} s"
            )
        running = self.runs(condition="attributes.status = 'RUNNING'")
        started = [child for child in running if child.info.run_id not in self.running]
        self.running.update(child.info.run_id for child in started)
        if quiet or not running:
            return
        if started or time.monotonic() - self.last_line >= self.HEARTBEAT_S:
            stage = running[0].data.tags.get(STAGE_TAG, FULL_STAGE)
            names = [self._name(child) for child in sorted(running, key=lambda child: child.info.start_time)]
            # NOTE: a line, not a screenful, for many workers' batches.
            shown = (
                ", ".join(names)
                if len(names) <= self.NAMES_SHOWN
                else f"{len(names)} runs ({', '.join(names[: self.NAMES_SHOWN - 1])} … {names[-1]})"
            )
            self._print(f"{stage:6} {'running' if started else 'still running'}: {shown}{self._samples_done(stage)}")

    def _print(self, line: str) -> None:
        print(f"  [{self._minutes():4.1f} min] {line}", flush=True)
        self.last_line = time.monotonic()

    def _samples_done(self, stage: str) -> str:
        """How many samples the running trials of ``stage`` have finished, from their checkpoints (one JSON file
        per trial: a prefill evaluation's ``samples``, or a bounded-cache evaluation's lines after its header)."""
        folder = self.checkpoints / stage if self.checkpoints is not None else None
        if folder is None or not folder.is_dir():
            return ""
        done = 0
        for path in folder.glob("*.json"):
            try:
                text = path.read_text()
                done += len(json.loads(text)["samples"]) if text.startswith("{\n") else text.count("\n") - 1
            except (OSError, ValueError, KeyError):
                continue  # NOTE: a checkpoint removed or replaced under the look: counted at the next one
        return f"; {done} sample(s) done in their checkpoints"

    def _minutes(self) -> float:
        return (time.monotonic() - self.started) / 60

    @staticmethod
    def _name(run) -> str:
        """``trial N`` for a trial or a test run confirming one, else what the test run tests (a baseline)."""
        tags = run.data.tags
        tested = tags.get(TRIAL_TAG, tags.get(TEST_OF_TAG, "?"))
        return f"trial {tested}" if tested.isdigit() else tested

    def parent_status(self) -> str:
        parents = self.runs(role="sweep")
        return parents[0].info.status if parents else "missing"


def job_end(jobs, job_id: str, on_poll: Callable[[], None]) -> tuple[str | None, str]:
    """Wait for the Ray job ``job_id`` to end, calling ``on_poll`` between looks. Returns its final status and, when
    the Jobs API stopped answering first, None and the reason."""
    while True:
        try:
            status = str(jobs.get_job_status(job_id).value)
        except (OSError, RuntimeError) as error:  # NOTE: requests' ConnectionError is an OSError
            return None, _reason(error)
        if status not in ACTIVE_JOB:
            return status, ""
        time.sleep(POLL_S)
        on_poll()


def cluster_loss(
    jobs,
    status: str | None,
    reason: str,
    dashboard_url: str,
    tracking_uri: str,
    experiment: str,
    state: Path,
    sweep_id: str,
) -> SweepLostError | None:
    """After the job's end (``status``; None, with ``reason``, when the Jobs API stopped answering first): the error
    to stop on when the cluster went away under the sweep, once the runs its driver left RUNNING are closed; None
    when the cluster still answers."""
    # NOTE: a job seen ending while its head goes down (its supervisor died with the raylet) is the cluster's loss.
    if status is not None and jobs_api_answers(jobs):
        return None
    done = close_runs_left_running(tracking_uri, experiment, state, sweep_id)
    return SweepLostError(
        f"the Ray cluster stopped answering (Jobs API {dashboard_url}: {reason or f'job {status}'}); "
        f"{done}; nothing finished is lost, the resume re-queues the trials that were in flight"
    )


def jobs_api_answers(jobs) -> bool:
    try:
        jobs.get_version()
    except (OSError, RuntimeError):
        return False
    return True


def close_runs_left_running(
    tracking_uri: str, experiment: str, state: Path, sweep_id: str, wait_s: float = DRIVER_END_WAIT_S
) -> str:
    """Once the sweep's driver has ended (its lease free, waiting up to ``wait_s``), close the sweep's runs it left
    RUNNING as KILLED, holding the lease meanwhile so that no driver starts on the sweep; returns what was done, in
    words.

    NOTE: the resume would close them too (``TrialLedger.reconcile``), but until then the MLflow UI would show a
    sweep still running that nothing runs.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    if not (state / "driver.lease").is_file():
        return "its driver had not started"
    lease = SweepLease(state, sweep_id)
    try:
        lease.acquire(wait_s=wait_s, announce=False)
    except SweepBusyError as error:
        return f"its driver still runs ({error.holder}), its runs left as they are"
    try:
        client = MlflowClient(tracking_uri)
        found = client.get_experiment_by_name(experiment)
        runs = (
            client.search_runs(
                [found.experiment_id],
                f"tags.`{SWEEP_TAG}` = '{sweep_id}' and attributes.status = 'RUNNING'",
                max_results=5000,
            )
            if found
            else []
        )
        for run in runs:
            client.set_terminated(run.info.run_id, "KILLED")
    except (OSError, MlflowException) as error:
        return f"the runs it left RUNNING stay so until the resume (MLflow: {_reason(error)})"
    finally:
        lease.release()
    return f"the driver ended with it and its {len(runs)} run(s) left RUNNING are closed KILLED"


def _reason(error: BaseException) -> str:
    """An HTTP client's error in a few words: the operating system's (``Connection refused``) when it has one."""
    text = str(error)
    found = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if found:
        return found.group(1).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1][:160]}" if lines else type(error).__name__
