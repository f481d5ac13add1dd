"""What every stage of a sweep writes through (``SweepRecords``: the state directory, the Optuna storage, the
MLflow runs and the service overhead), the trials it has open, and what the driver asks of a stage's ledger
(``StageLedger``)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import optuna
from sqlalchemy.exc import DBAPIError

from sweeps.config import SweepConfig
from sweeps.lease import SweepLease
from sweeps.state.driver_times import DriverTimes
from sweeps.state.optuna_storage import open_journal, open_storage_url
from sweeps.state.rdb_storage import StorageUnavailableError, root_cause
from sweeps.state.state_dir import StateDir
from sweeps.state.writer import WRITER_LANES, RecordWriter
from tracking.export import export_press
from tracking.mlflow_tracker import SweepTracker, check_tracking_server
from tracking.retry import RetryPolicy, TrackingUnavailableError
from workers.names import BASELINE_TAG, FULL_STAGE, PRESS_ARTIFACT, PROMOTED_FROM_TAG, RECOVERED_TAG
from workers.protocol import TrialOutcome, TrialRequest

log = logging.getLogger("grkv.sweep")
PARENT_EVERY_S = 5.0  # see ``SweepRecords.parent_every_s``


@dataclass
class OpenTrial:
    """A trial handed to a worker; ``run``: the opening of its MLflow run, on the writer (``sweeps.state.writer``);
    ``trial``: its Optuna trial (None in the test stage); ``times``: the driver's seconds on it by part, opening and
    recording it."""

    request: TrialRequest
    run: Future
    trial: optuna.Trial | None = None
    times: DriverTimes = field(default_factory=DriverTimes)

    @property
    def run_id(self) -> str | None:
        """Its MLflow run's id, once opened; None when the writer could not open it (MLflow lost: the resume
        reconciles)."""
        return None if self.run.exception() is not None else self.run.result()


@dataclass
class Overhead:
    """Driver-side seconds spent around trials (Optuna, MLflow, Ray dispatch) vs seconds spent evaluating."""

    service_s: float = 0.0
    evaluation_s: float = 0.0
    trials: int = 0

    def as_metrics(self) -> dict[str, float]:
        fraction = self.service_s / self.evaluation_s if self.evaluation_s else 0.0
        return {
            "service_overhead_s": self.service_s,
            "evaluation_s": self.evaluation_s,
            "service_overhead_fraction": fraction,
            "timed_trials": self.trials,
        }


class StageLedger(Protocol):
    """What the driver and the records ask of one stage's ledger (``sweeps.state.ledgers``), whichever it is."""

    stage: str
    # Whether the driver fills each batch up to ``workers.batch_size`` (the test stage: the methods it compares are
    # measured together) rather than spreading the stage's trials over the workers.
    fills_batches: bool

    def remaining(self) -> int:
        """Evaluations still to run."""
        ...

    def open_trials(self, count: int) -> list[OpenTrial]:
        """The next ``count`` evaluations (fewer only when an Optuna stage's space is exhausted), runs opened."""
        ...

    def record(self, open_trial: OpenTrial, outcome: TrialOutcome, dispatch_s: float, attempts: int) -> None:
        """Write an evaluation's outcome, in the order of ``sweeps.state``."""
        ...

    def abandon(self, open_trial: OpenTrial) -> None:
        """Close an evaluation's run as KILLED and put the evaluation back to be run again."""
        ...

    def progress(self) -> dict[str, float]:
        """This stage's counts on the parent run."""
        ...

    def artifacts(self) -> dict[str, str]:
        """Files (name: text) this stage logs on the parent run when the sweep closes."""
        ...


class SweepRecords:
    """What every stage of a sweep writes to: the state directory, the Optuna storage and the MLflow runs.

    The ledgers register themselves in ``ledgers`` (by stage); the parent run carries their progress.
    """

    def __init__(self, config: SweepConfig, sweep_id: str):
        self.config = config
        self.sweep_id = sweep_id
        self.overhead = Overhead()
        self.ledgers: dict[str, StageLedger] = {}
        self.state = StateDir(Path(config.storage.state_dir).expanduser(), sweep_id)
        self.lease = SweepLease(self.state.root, sweep_id, config.storage.url)
        # NOTE: set once an MLflow call has failed for good; from then on nothing more is sent to MLflow and the
        # runs left open are closed by the resume (``close_leftovers``).
        self.tracking_lost = False
        # NOTE: likewise for the Optuna database, away for longer than ``storage.outage_s``: the resume reconciles.
        self.storage_lost = False
        self.writer = RecordWriter(lanes=WRITER_LANES)
        self._counting = threading.Lock()  # the overhead and the parent run's time, counted on the writer's lanes
        # NOTE: the parent run's progress is a view for a person: updated at most every ``parent_every_s`` as trials
        # are recorded (one MLflow request a trial was a tenth of the driver's time at 500 trials), and at a stage's
        # end and when the sweep closes.
        self.parent_every_s = PARENT_EVERY_S
        self.parent_updated_at = -math.inf

    def check_services(self) -> None:
        """Fail fast, in one line, when the MLflow server or the Optuna storage URL does not answer.

        NOTE: called before anything of the sweep is created, so a sweep that cannot run leaves no study, no
        state directory and no half-made runs behind.
        """
        check_tracking_server(self.config.tracking.tracking_uri)
        storage = self.config.storage
        self.storage = open_storage_url(storage.url, storage.outage_s) if storage.url else None

    def open(self) -> None:
        """After ``check_services``: create the state directory, take the sweep's lease, open the Optuna storage
        and the MLflow parent run. NOTE: nothing of the sweep is written before its lease is held."""
        tracking = self.config.tracking
        self.state.create()
        try:
            self.lease.acquire()
        except DBAPIError as error:  # the database of a PostgreSQL storage.url, lost since check_services
            raise StorageUnavailableError(
                f"Optuna storage {self.storage.shown} cannot hold the sweep's lease ({root_cause(error)}); start it "
                "or fix storage.url / --storage-url"
            ) from None
        try:
            self.storage = self.storage or open_journal(self.state.journal)
            self.tracker = SweepTracker.open(
                tracking.tracking_uri,
                tracking.experiment,
                self.sweep_id,
                self.config.model_dump(mode="json"),
                RetryPolicy(tracking.retries, tracking.retry_backoff_s),
            )
        except BaseException:
            self.lease.release()
            raise

    def open_run(
        self,
        request: TrialRequest,
        times: DriverTimes,
        sampler_params: dict | None = None,
        user_attrs: dict | None = None,
    ) -> Future:
        """Hand the opening of a request's MLflow run (``start``) to the writer; the future gives its id."""
        future, waited = self.writer.submit(
            self._timed, times, "mlflow", self.start, request, sampler_params, user_attrs, lane=hash(request.key)
        )
        times.add("wait", waited)
        return future

    def save(self, open_trial: OpenTrial, outcome: TrialOutcome) -> None:
        """Write an outcome to the state directory: the first of its records, on the driver's thread."""
        self.lease.check()
        with open_trial.times.part("state"):
            self.state.save(outcome)
        if not outcome.ok:
            log.warning("%s failed: %s", outcome, outcome.error)

    def hand_over(
        self, open_trial: OpenTrial, outcome: TrialOutcome, dispatch_s: float, attempts: int, tell: Callable | None
    ) -> None:
        """After ``save``: hand the rest of an outcome's records to the writer: its MLflow run logged and closed, then
        ``tell`` (Optuna told), then the parent run's progress when due."""
        lane = hash(open_trial.request.key)  # the lane its run was opened on
        _, waited = self.writer.submit(self._write, open_trial, outcome, dispatch_s, attempts, tell, lane=lane)
        open_trial.times.add("wait", waited)

    def _write(
        self, open_trial: OpenTrial, outcome: TrialOutcome, dispatch_s: float, attempts: int, tell: Callable | None
    ) -> None:
        """On the writer: an outcome's MLflow run, then ``tell``, the service overhead, the parent run's progress at
        most every ``parent_every_s``, and the driver's seconds on it (``sweeps.state.driver_times``)."""
        self.lease.check()
        times = open_trial.times
        timing = None
        with times.part("mlflow"):
            if outcome.ok:
                timing = outcome.worker_timing()
                # NOTE: the per-trial figure is logged with the run's other metrics, before it is closed, so a crash
                # never leaves a finished run without it; it therefore leaves out its own MLflow write and the
                # Optuna tell that follow. The sweep-level total on the parent run includes them.
                timing.update(
                    trial_dispatch_s=dispatch_s, worker_attempts=attempts, service_overhead_s=dispatch_s + times.total_s
                )
                self.tracker.finish_trial(open_trial.run_id, outcome, timing, self.state.kvpress_folder(outcome))
            else:
                self.tracker.fail_trial(open_trial.run_id, outcome)
        if tell is not None:
            with times.part("tell"):
                tell()
        with self._counting:
            if timing is not None:
                self.overhead.evaluation_s += timing["trial_eval_s"]
                self.overhead.service_s += dispatch_s + times.total_s
                self.overhead.trials += 1
            due = time.monotonic() - self.parent_updated_at >= self.parent_every_s
            if due:
                self.parent_updated_at = time.monotonic()
        if due:
            with times.part("parent"):
                self.update_parent()
        self.state.log_times(times.row(open_trial.request.stage, open_trial.request.key, dispatch_s))

    @staticmethod
    def _timed(times: DriverTimes, part: str, call: Callable, *args):
        with times.part(part):
            return call(*args)

    def start(
        self, item: TrialRequest | TrialOutcome, sampler_params: dict | None = None, user_attrs: dict | None = None
    ) -> str:
        """Open the MLflow run of a request (or of a recovered outcome); the Optuna user attributes that name a
        baseline or a promotion become tags."""
        self.lease.check()
        user_attrs = user_attrs or {}
        tags = {PROMOTED_FROM_TAG: str(user_attrs[PROMOTED_FROM_TAG])} if PROMOTED_FROM_TAG in user_attrs else {}
        return self.tracker.start_trial(
            item.trial_number,
            sampler_params or {},
            user_attrs.get(BASELINE_TAG),
            stage=item.stage,
            test_of=item.test_of,
            tags=tags,
        )

    def recover(
        self, outcome: TrialOutcome, sampler_params: dict | None = None, user_attrs: dict | None = None
    ) -> None:
        """Log a finished outcome of the state directory whose run never closed (the driver died in between)."""
        run_id = self.start(outcome, sampler_params, user_attrs)
        self.tracker.client.set_tag(run_id, RECOVERED_TAG, "true")
        self.tracker.finish_trial(run_id, outcome, outcome.worker_timing(), self.state.kvpress_folder(outcome))
        log.info("%s: recovered its finished result", outcome)

    def close_leftovers(self, runs: list) -> list:
        """Close the RUNNING ones of an item's runs as KILLED (their driver is gone); return the FINISHED ones."""
        for run in runs:
            if run.info.status == "RUNNING":
                self.tracker.client.set_terminated(run.info.run_id, "KILLED")
        return [run for run in runs if run.info.status == "FINISHED"]

    def abandon(self, open_trial: OpenTrial) -> None:
        """On a stop: close the trial's run as KILLED (left to the resume when MLflow is lost)."""
        if self.tracking_lost or open_trial.run_id is None:
            return
        try:
            self.tracker.fail_trial(
                open_trial.run_id, TrialOutcome.unfinished(open_trial.request, "sweep stopped"), status="KILLED"
            )
        except TrackingUnavailableError:
            self.tracking_lost = True

    def settle(self) -> None:
        """Wait for the writer to make what it was handed, for a driver that stops: a service its error shows lost
        is marked so (``tracking_lost``, ``storage_lost``), and nothing more is sent to it."""
        error = self.writer.settle()
        self.tracking_lost |= isinstance(error, TrackingUnavailableError)
        self.storage_lost |= isinstance(error, StorageUnavailableError)

    def update_parent(self) -> None:
        """The parent run's progress: every stage's counts, the service overhead and the best trials so far."""
        self.parent_updated_at = time.monotonic()
        full = self.ledgers[FULL_STAGE]
        metrics = self.overhead.as_metrics()
        for ledger in self.ledgers.values():
            metrics.update(ledger.progress())
        self.tracker.update_parent(full.best(), full.completed(), metrics)

    def export_recommendation(self) -> None:
        """At the end of a sweep: the press it recommends (``tracking.export.choose``: the test stage's best, else
        the best trial) as a press file in the state directory and on the parent run (``press.yaml``)."""
        path = self.state.root / PRESS_ARTIFACT
        try:
            exported = export_press(
                self.tracker.client, self.sweep_id, path, experiment=self.config.tracking.experiment
            )
        except ValueError as error:  # no finished run carries the objective's metric
            log.warning("sweep %s: no press to recommend (%s)", self.sweep_id, error)
            return
        log.info(
            "sweep %s: recommends %s (%s); press file %s, also %s on the parent run",
            self.sweep_id,
            exported.choice.configuration,
            exported.choice.how,
            path,
            PRESS_ARTIFACT,
        )

    def close(self, status: str) -> None:
        """Close the parent run with ``status`` (when MLflow still answers; its Optuna summary when the database
        does too) and give the lease back; a driver whose lease another took writes nothing."""
        self.settle()
        self.writer.close()
        try:
            if not self.tracking_lost and not self.lease.lost:
                if not self.storage_lost:
                    self.update_parent()
                self.tracker.close(
                    status,
                    {}
                    if self.storage_lost
                    else {name: text for ledger in self.ledgers.values() for name, text in ledger.artifacts().items()},
                )
        except TrackingUnavailableError:
            self.tracking_lost = True
        except StorageUnavailableError:
            self.storage_lost = True
        finally:
            self.lease.release()


def discard_checkpoint(outcome: TrialOutcome, request: TrialRequest) -> None:
    """Remove a finished trial's per-sample checkpoint, its results now in the state directory; a failed trial's
    stays for the next attempt at the same press.

    NOTE: workers write checkpoints on their own machines; on a single-machine cluster that is the state
    directory, elsewhere there is nothing here to remove.
    """
    if outcome.ok and request.checkpoint is not None:
        request.checkpoint.unlink(missing_ok=True)
