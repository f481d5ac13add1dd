"""The sweep driver: Optuna ask/tell over a pool of Ray workers, every trial tracked in MLflow.

The loop is small on purpose: the ledgers (``sweeps.state``) own the studies, the MLflow runs and the state
directory and write every outcome to them in order; the ``WorkerPool`` (``sweeps.worker_pool``) owns the Ray
workers, their dispatch and retries. For each stage in turn (screening, full trials, the held-out test stage)
the driver opens batches of trials while workers are idle and hands the stage's ledger every outcome the pool
returns.

A sweep that cannot go on (the Ray cluster, the MLflow server or the state directory lost) stops with
``SweepStopped``: its in-flight trials are re-queued for the resume, and everything finished stays in the state
directory, which the resume reconciles with MLflow and Optuna.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time

import ray

from grkv_core.files import storage_failure
from sweeps.config import SweepConfig
from sweeps.space import baseline_params, one_at_a_time_params
from sweeps.stages import presses_to_test, promotions
from sweeps.state.ledgers import HeldOutLedger, TrialLedger
from sweeps.state.rdb_storage import StorageUnavailableError
from sweeps.state.records import StageLedger, SweepRecords
from sweeps.state.state_dir import StateDirError
from sweeps.worker_pool import ClusterLostError, NoWorkerLeftError, WorkerPool
from tracking.retry import TrackingUnavailableError, one_line
from workers.names import BASELINE_TAG, DESIGN_ROW_ATTR, FULL_STAGE, SCREEN_STAGE
from workers.stream_worker import StreamTrialWorker
from workers.trial_worker import TrialWorker, WorkerStartError, WorkerStorageError

log = logging.getLogger("grkv.sweep")


class SweepStopped(RuntimeError):
    """The sweep stopped before its end because a service it needs was lost; the message is one line.
    ``cluster_lost``: the lost service is the Ray cluster."""

    def __init__(self, message: str, cluster_lost: bool = False):
        super().__init__(message)
        self.cluster_lost = cluster_lost


# NOTE: what stops a sweep mid-way without being any trial's fault (a full or unwritable state directory also
# shows as an OSError from the Optuna journal; see ``storage_failure``; a worker that cannot start on its node,
# or cannot write its checkpoints, would fail every trial it is given).
LOST_SERVICES = (
    ClusterLostError,
    TrackingUnavailableError,
    StorageUnavailableError,
    StateDirError,
    WorkerStartError,
    WorkerStorageError,
    NoWorkerLeftError,
)


def connect_to_ray() -> None:
    """Join the cluster at ``RAY_ADDRESS`` (a local one without it), or ``ClusterLostError`` in one line."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    try:
        ray.init(address=address)
    except (ConnectionError, RuntimeError, TimeoutError) as error:
        reason = one_line(error)
        raise ClusterLostError(
            f"the Ray cluster at {address or 'a local address'} is not reachable ({reason}); "
            "start it (infra/local/start.sh) or fix RAY_ADDRESS"
        ) from None


class SweepDriver:
    def __init__(self, config: SweepConfig, sweep_id: str):
        self.config = config
        self.sweep_id = sweep_id
        self.stop_requested = False
        self.records = SweepRecords(config, sweep_id)

    def run(self) -> str:
        """Run every stage to its end or until a stop is requested; returns the parent run's final status.

        Raises
        ------
        SweepStopped
            When the Ray cluster, the MLflow server or the state directory is lost mid-sweep (after re-queueing
            the in-flight trials and closing what can still be closed).
        """
        # NOTE: every service is checked before the sweep writes anything: a cluster, a tracking server or a
        # storage that is not there leaves nothing behind.
        self.records.check_services()
        connect_to_ray()
        self.records.open()
        try:
            status = self._run_stages()
        except (*LOST_SERVICES, OSError) as error:
            if isinstance(error, OSError) and not storage_failure(error):
                self.records.close("FAILED")
                raise
            if isinstance(error, TrackingUnavailableError):
                self.records.tracking_lost = True
            elif isinstance(error, StorageUnavailableError):
                self.records.storage_lost = True
            elif isinstance(error, OSError):
                error = StateDirError(self.records.state.unwritable(error))
            self.records.close("KILLED")
            raise SweepStopped(str(error), isinstance(error, ClusterLostError)) from None
        except BaseException:
            self.records.close("FAILED")
            raise
        self.records.close(status)
        return status

    def _run_stages(self) -> str:
        screen = TrialLedger(self.records, SCREEN_STAGE) if self.config.screening.trials else None
        full = TrialLedger(self.records, FULL_STAGE)
        for ledger in (screen, full):
            if ledger is not None:
                ledger.open()
        full.enqueue_once(
            [(params, {BASELINE_TAG: name}) for name, params in baseline_params(self.config)]
            + [(params, {DESIGN_ROW_ATTR: row}) for row, params in enumerate(one_at_a_time_params(self.config))]
        )
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        workers = self.config.workers
        pool = WorkerPool(
            self.config.worker_config(),
            self.config.data.test.samples,
            workers.count,
            workers.num_cpus,
            workers.num_gpus,
            workers.max_retries,
            workers.node_wait_s,
            StreamTrialWorker if self.config.bounded else TrialWorker,
        )
        if screen is not None:
            self._run_stage(pool, screen)
            if not self.stop_requested:
                # NOTE: enqueued after the baselines, so the promoted configurations are the first full trials
                # after them; enqueue_once makes this a no-op when a resumed sweep gets here again.
                full.enqueue_once(
                    promotions(screen.study, self.config.screening.promote, self.config.screening.min_distance)
                )
        if not self.stop_requested:
            self._run_stage(pool, full)
        if self.config.test_stage and not self.stop_requested:
            tests = HeldOutLedger(self.records, presses_to_test(full.study, self.config))
            tests.open()
            self._run_stage(pool, tests)
        if self.stop_requested:
            return "KILLED"
        self.records.export_recommendation()
        return "FINISHED"

    def _run_stage(self, pool: WorkerPool, ledger: StageLedger) -> None:
        """Open and dispatch the stage's trials in batches until none is left (or a stop), recording outcomes.

        NOTE: an Optuna stage spreads its trials over the workers (batches of at most ``workers.batch_size``);
        the test stage fills each batch up to ``workers.batch_size`` instead, so the methods it compares are
        measured together, on one worker, as far as the batch size allows.
        """
        remaining = ledger.remaining()
        log.info("sweep %s: %s stage, %d to run", self.sweep_id, ledger.stage, remaining)
        batch_size = self.config.workers.batch_size
        try:
            while (remaining or pool.busy) and not self.stop_requested:
                while pool.idle and remaining and not self.stop_requested:
                    spread = remaining if ledger.fills_batches else math.ceil(remaining / pool.size)
                    size = min(batch_size, spread)
                    opened = ledger.open_trials(size)
                    # NOTE: fewer than asked only when the sampler has exhausted the space (see TrialLedger)
                    remaining = remaining - len(opened) if len(opened) == size else 0
                    if opened:
                        pool.submit([open_trial.request for open_trial in opened], opened)
                for dispatch, outcomes in pool.wait(timeout_s=1.0):
                    if dispatch.infrastructure:  # not the trials' fault: they run again, in this run
                        for open_trial in dispatch.context:
                            ledger.abandon(open_trial)
                        remaining += len(dispatch.context)
                        continue
                    self._record(ledger, dispatch, outcomes)
                self.records.writer.check()
            # NOTE: the next stage opens on every outcome of this one told (its promotions read the study).
            self.records.writer.drain()
            self.records.update_parent()
        except TrackingUnavailableError:
            self.records.tracking_lost = True
            raise
        finally:
            self.records.settle()  # the in-flight trials' runs opened (or not) before they are abandoned
            for dispatch in pool.drain():
                for open_trial in dispatch.context:
                    self._abandon(ledger, open_trial)

    def _record(self, ledger: StageLedger, dispatch, outcomes) -> None:
        received = time.time()
        for index, (open_trial, outcome) in enumerate(zip(dispatch.context, outcomes, strict=True)):
            try:
                ledger.record(
                    open_trial, outcome, self._dispatch_share(dispatch, outcome, received), dispatch.attempt + 1
                )
            except (TrackingUnavailableError, StorageUnavailableError):
                # NOTE: nothing finished is lost: the batch's outcomes not recorded yet go to the state directory
                # (the first place a record writes), where the resume finds and logs them. The error is one the
                # writer met on an earlier trial, raised as this one's records were handed over (its file written).
                for later in outcomes[index + 1 :]:
                    self.records.state.save(later)
                raise

    def _abandon(self, ledger: StageLedger, open_trial) -> None:
        """Abandon an in-flight trial on a stop; a service already lost leaves it to the resume's reconcile, and a
        lease another driver took leaves it to that driver."""
        if self.records.lease.lost:
            return
        try:
            ledger.abandon(open_trial)
        except (TrackingUnavailableError, StorageUnavailableError, OSError) as error:
            self.records.tracking_lost |= isinstance(error, TrackingUnavailableError)
            log.warning("%s: left for the resume to re-queue (%s)", open_trial.request, error)

    @staticmethod
    def _dispatch_share(dispatch, outcome, received: float) -> float:
        """A finished trial's share of its batch's Ray round trip (sending, queueing, returning)."""
        if not outcome.ok:
            return 0.0
        round_trip = max(outcome.started_at - dispatch.submitted_at, 0.0) + max(received - outcome.finished_at, 0.0)
        return round_trip / len(dispatch.requests)

    def _request_stop(self, signum, frame) -> None:
        log.warning("signal %d: stopping after cleaning up in-flight trials", signum)
        self.stop_requested = True
