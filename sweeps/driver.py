"""The sweep driver: Optuna ask/tell over a pool of Ray workers, every trial tracked in MLflow.

The loop is small on purpose: the ``TrialLedger`` (``sweeps.ledger``) owns the study, the MLflow runs and the
state directory and writes every outcome to them in order; the ``WorkerPool`` (``sweeps.worker_pool``) owns
the Ray workers, their dispatch and retries. The driver asks the ledger for trials while workers are idle and
hands it every outcome the pool returns.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import ray

from grkv_core.config import EvalConfig, PressConfig
from sweeps.config import SweepConfig
from sweeps.ledger import TrialLedger
from sweeps.worker_pool import WorkerPool

log = logging.getLogger("grkv.sweep")


def eval_config_for(config: SweepConfig) -> EvalConfig:
    return EvalConfig(
        model=config.model.name, dataset=config.data.dataset,
        tasks=tuple(config.data.tasks) if config.data.tasks else None,
        context_length=config.data.context_length if config.data.dataset == "ruler" else None,
        samples=config.data.samples, seed=config.data.seed,
        press=PressConfig(config.press.name, config.press.compression_ratio),
        dtype=config.model.dtype, attn_implementation=config.model.attn_implementation,
        device="cuda" if config.workers.num_gpus > 0 else "cpu", data_dir=config.data.data_dir,
    )


class SweepDriver:
    def __init__(self, config: SweepConfig, sweep_id: str):
        self.config = config
        self.sweep_id = sweep_id
        self.stop_requested = False
        self.ledger = TrialLedger(config, sweep_id)

    def run(self) -> str:
        """Run until the trial budget is met or a stop is requested; returns the parent run's final status."""
        self.ledger.open()
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"))
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        workers = self.config.workers
        pool = WorkerPool(eval_config_for(self.config).to_dict(), workers.count, workers.num_cpus, workers.num_gpus,
                          workers.max_retries)
        done = self.ledger.finished_trials()
        log.info("sweep %s: %d of %d trials already finished", self.sweep_id, done, self.config.trials)
        while (done + pool.busy < self.config.trials or pool.busy) and not self.stop_requested:
            while pool.idle and done + pool.busy < self.config.trials and not self.stop_requested:
                open_trial = self.ledger.ask()
                pool.submit(open_trial.request, open_trial)
            for dispatch, outcome in pool.wait(timeout_s=1.0):
                received = time.time()
                dispatch_s = 0.0
                if outcome.ok:
                    dispatch_s = (max(outcome.started_at - dispatch.submitted_at, 0.0)
                                  + max(received - outcome.finished_at, 0.0))
                self.ledger.record(dispatch.context, outcome, dispatch_s, dispatch.attempt + 1)
                done += 1
        status = "KILLED" if self.stop_requested else "FINISHED"
        for dispatch in pool.drain():
            self.ledger.abandon(dispatch.context)
        self.ledger.close(status)
        return status

    def _request_stop(self, signum, frame) -> None:
        log.warning("signal %d: stopping after cleaning up in-flight trials", signum)
        self.stop_requested = True
