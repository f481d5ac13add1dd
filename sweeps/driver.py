"""The sweep driver: Optuna ask/tell over a pool of Ray workers, every trial tracked in MLflow.

Only the driver writes the Optuna storage. A trial's result is first written to the sweep's state
directory (atomically), then to MLflow, then told to Optuna; on a restart with the same sweep id,
``reconcile`` walks that chain so nothing finished is redone and nothing is logged twice.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from grkv_core.config import (
    BASELINE_TAG,
    BASELINES_ENQUEUED_ATTR,
    RECOVERED_TAG,
    REQUEUED_ATTR,
    TRIAL_TAG,
    EvalConfig,
    PressConfig,
)
from sweeps.config import SweepConfig
from sweeps.space import baseline_params, make_sampler, suggest_press
from tracking.mlflow_tracker import SweepTracker, check_tracking_server, trial_metrics
from workers.trial_worker import TrialWorker

log = logging.getLogger("grkv.sweep")

WORKER_FAILURES = (RayActorError, ActorDiedError, ActorUnavailableError)


@dataclass
class InFlight:
    trial: optuna.Trial
    press: PressConfig
    run_id: str
    worker: int
    attempt: int
    submitted_at: float
    driver_seconds: float


@dataclass
class Overhead:
    """Driver-side seconds spent around trials (Optuna, MLflow, Ray dispatch) vs seconds spent evaluating."""

    service_s: float = 0.0
    evaluation_s: float = 0.0
    trials: int = 0

    def as_metrics(self) -> dict[str, float]:
        fraction = self.service_s / self.evaluation_s if self.evaluation_s else 0.0
        return {"service_overhead_s": self.service_s, "evaluation_s": self.evaluation_s,
                "service_overhead_fraction": fraction, "timed_trials": self.trials}


class StateDir:
    """The driver's own record of finished trials: ``<state>/<sweep>/trials/<number>.json``."""

    def __init__(self, root: Path, sweep_id: str):
        self.root = Path(root) / sweep_id
        (self.root / "trials").mkdir(parents=True, exist_ok=True)

    def path(self, number: int) -> Path:
        return self.root / "trials" / f"{number}.json"

    def save(self, number: int, outcome: dict) -> None:
        temporary = self.path(number).with_suffix(".tmp")
        temporary.write_text(json.dumps(outcome))
        os.replace(temporary, self.path(number))

    def load(self, number: int) -> dict | None:
        path = self.path(number)
        return json.loads(path.read_text()) if path.exists() else None

    @property
    def journal(self) -> Path:
        return self.root / "optuna.journal"


def objective_values(config: SweepConfig, summary: dict) -> list[float]:
    metrics = trial_metrics(summary)
    return [metrics[objective.metric] for objective in config.objectives]


def worker_timing(outcome: dict) -> dict[str, float]:
    """What the worker itself measured of a finished trial."""
    return {"trial_eval_s": outcome["finished_at"] - outcome["started_at"],
            "worker_model_loads": outcome["worker"]["model_loads"]}


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
        self.overhead = Overhead()

    # ---- set-up -------------------------------------------------------------------------------------
    def open(self) -> None:
        # NOTE: the tracking server is checked before anything is created, so a sweep that cannot be
        # tracked leaves no study, no state directory and no half-made runs behind.
        check_tracking_server(self.config.tracking.tracking_uri)
        self.state = StateDir(Path(self.config.storage.state_dir).expanduser(), self.sweep_id)
        storage = self.config.storage.url or optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(self.state.journal))
        )
        self.study = optuna.create_study(study_name=self.sweep_id, storage=storage, load_if_exists=True,
                                         directions=self.config.directions, sampler=make_sampler(self.config))
        self.tracker = SweepTracker.open(self.config.tracking.tracking_uri, self.config.tracking.experiment,
                                         self.sweep_id, self.config.model_dump(mode="json"))
        self.reconcile()
        if not self.study.user_attrs.get(BASELINES_ENQUEUED_ATTR):
            for name, params in baseline_params(self.config):
                self.study.enqueue_trial(params, user_attrs={BASELINE_TAG: name})
            self.study.set_user_attr(BASELINES_ENQUEUED_ATTR, True)

    def reconcile(self) -> None:
        """Bring Optuna, MLflow and the state directory back in line after an interrupted run."""
        children: dict[int, list] = {}
        for run in self.tracker.child_runs():
            children.setdefault(int(run.data.tags[TRIAL_TAG]), []).append(run)
        for frozen in self.study.get_trials(deepcopy=False):
            runs = children.get(frozen.number, [])
            finished = [run for run in runs if run.info.status == "FINISHED"]
            for run in runs:
                if run.info.status == "RUNNING":
                    self.tracker.client.set_terminated(run.info.run_id, "KILLED")
            if frozen.state != optuna.trial.TrialState.RUNNING:
                continue
            outcome = self.state.load(frozen.number)
            if outcome is not None and outcome["status"] == "ok":
                if not finished:
                    run_id = self.tracker.start_trial(frozen.number, frozen.params,
                                                      frozen.user_attrs.get(BASELINE_TAG))
                    self.tracker.client.set_tag(run_id, RECOVERED_TAG, "true")
                    self.tracker.finish_trial(run_id, outcome, worker_timing(outcome))
                self.study.tell(frozen.number, objective_values(self.config, outcome["summary"]))
                log.info("trial %d: recovered its finished result", frozen.number)
            else:
                self.study._storage.set_trial_user_attr(frozen._trial_id, REQUEUED_ATTR, True)
                self.study.tell(frozen.number, state=optuna.trial.TrialState.FAIL)
                self.study.enqueue_trial(frozen.params, user_attrs={
                    k: v for k, v in frozen.user_attrs.items() if k != REQUEUED_ATTR})
                log.info("trial %d: interrupted, re-enqueued", frozen.number)

    def finished_trials(self) -> int:
        """Trials that count against the budget: complete, or failed on their own (not re-enqueued)."""
        count = 0
        for frozen in self.study.get_trials(deepcopy=False):
            if frozen.state == optuna.trial.TrialState.COMPLETE:
                count += 1
            elif frozen.state == optuna.trial.TrialState.FAIL and not frozen.user_attrs.get(REQUEUED_ATTR):
                count += 1
        return count

    # ---- the loop -----------------------------------------------------------------------------------
    def run(self) -> str:
        """Run until the trial budget is met or a stop is requested; returns the parent run's final status."""
        self.open()
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"))
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        options = dict(num_cpus=self.config.workers.num_cpus, num_gpus=self.config.workers.num_gpus,
                       max_restarts=self.config.workers.max_retries * self.config.workers.count, max_task_retries=0)
        eval_config = eval_config_for(self.config).to_dict()
        workers = [TrialWorker.options(**options).remote(eval_config) for _ in range(self.config.workers.count)]
        in_flight: dict[ray.ObjectRef, InFlight] = {}
        # NOTE: a trial whose worker died waits here for that worker to answer a ping (Ray restarts it and
        # reloads the model) before it is sent again; a ping refused while the actor restarts is retried.
        waiting: dict[ray.ObjectRef, InFlight] = {}
        idle = list(range(len(workers)))
        done = self.finished_trials()
        log.info("sweep %s: %d of %d trials already finished", self.sweep_id, done, self.config.trials)
        busy = lambda: len(in_flight) + len(waiting)  # noqa: E731
        while (done + busy() < self.config.trials or busy()) and not self.stop_requested:
            while idle and done + busy() < self.config.trials and not self.stop_requested:
                started = time.perf_counter()
                trial = self.study.ask()
                press = suggest_press(trial, self.config)
                run_id = self.tracker.start_trial(trial.number, trial.params, trial.user_attrs.get(BASELINE_TAG))
                worker = idle.pop()
                reference = workers[worker].evaluate.remote(trial.number, _press_dict(press))
                in_flight[reference] = InFlight(trial, press, run_id, worker, 0, time.time(),
                                                time.perf_counter() - started)
            ready, _ = ray.wait([*in_flight, *waiting], num_returns=1, timeout=1.0)
            for reference in ready:
                if reference in waiting:
                    flight = waiting.pop(reference)
                    try:
                        ray.get(reference)
                    except ActorUnavailableError:
                        time.sleep(0.5)
                        waiting[workers[flight.worker].identity.remote()] = flight
                        continue
                    except WORKER_FAILURES as error:
                        self._finish(flight, {"status": "failed", "error": f"worker is gone: {error}"})
                        done += 1
                        continue
                    flight.submitted_at = time.time()
                    in_flight[workers[flight.worker].evaluate.remote(flight.trial.number, _press_dict(flight.press))] = flight
                    continue
                flight = in_flight.pop(reference)
                try:
                    outcome = ray.get(reference)
                except WORKER_FAILURES as error:
                    if flight.attempt < self.config.workers.max_retries:
                        log.warning("trial %d: worker died (%s); retrying", flight.trial.number, type(error).__name__)
                        flight.attempt += 1
                        waiting[workers[flight.worker].identity.remote()] = flight
                        continue
                    outcome = {"status": "failed", "error": f"worker died {flight.attempt + 1} times: {error}"}
                self._finish(flight, outcome)
                idle.append(flight.worker)
                done += 1
        status = "KILLED" if self.stop_requested else "FINISHED"
        for flight in [*in_flight.values(), *waiting.values()]:
            self._abandon(flight)
        self.tracker.update_parent(self._best(), self._completed(), self.overhead.as_metrics())
        self.tracker.close(status, self.study.trials_dataframe().to_csv(index=False))
        return status

    def _finish(self, flight: InFlight, outcome: dict) -> None:
        received = time.time()
        started = time.perf_counter()
        number = flight.trial.number
        self.state.save(number, outcome)
        if outcome["status"] == "ok":
            timing = worker_timing(outcome)
            evaluation = timing["trial_eval_s"]
            dispatch = max(outcome["started_at"] - flight.submitted_at, 0.0) + max(received - outcome["finished_at"], 0.0)
            # NOTE: the per-trial figure is logged with the run's other metrics, before it is closed, so a
            # crash never leaves a finished run without it; it therefore leaves out its own MLflow write and
            # the Optuna tell that follow. The sweep-level total on the parent run includes them.
            timing.update(trial_dispatch_s=dispatch, worker_attempts=flight.attempt + 1,
                          service_overhead_s=flight.driver_seconds + dispatch + (time.perf_counter() - started))
            self.tracker.finish_trial(flight.run_id, outcome, timing)
            self.study.tell(flight.trial, objective_values(self.config, outcome["summary"]))
            self.overhead.evaluation_s += evaluation
            self.overhead.service_s += flight.driver_seconds + dispatch + (time.perf_counter() - started)
            self.overhead.trials += 1
            self.tracker.update_parent(self._best(), self._completed(), self.overhead.as_metrics())
            log.info("trial %d: %s -> %s", number, flight.trial.params, outcome["summary"]["macro_score"])
        else:
            self.tracker.fail_trial(flight.run_id, outcome.get("traceback") or outcome["error"])
            self.study.tell(flight.trial, state=optuna.trial.TrialState.FAIL)
            self.tracker.update_parent(self._best(), self._completed(), self.overhead.as_metrics())
            log.warning("trial %d failed: %s", number, outcome["error"])

    def _abandon(self, flight: InFlight) -> None:
        """On a stop: close the trial's run as KILLED and hand its parameters to the next run of the sweep."""
        self.tracker.fail_trial(flight.run_id, "sweep stopped", status="KILLED")
        trial_id = flight.trial._trial_id
        self.study._storage.set_trial_user_attr(trial_id, REQUEUED_ATTR, True)
        self.study.tell(flight.trial, state=optuna.trial.TrialState.FAIL)
        self.study.enqueue_trial(flight.trial.params, user_attrs={
            k: v for k, v in flight.trial.user_attrs.items() if k != REQUEUED_ATTR})

    def _completed(self) -> int:
        return sum(t.state == optuna.trial.TrialState.COMPLETE for t in self.study.get_trials(deepcopy=False))

    def _best(self) -> list[dict]:
        if not self._completed():
            return []
        best = self.study.best_trials[:5]
        return [{"number": t.number, "values": t.values, "params": t.params} for t in best]

    def _request_stop(self, signum, frame) -> None:
        log.warning("signal %d: stopping after cleaning up in-flight trials", signum)
        self.stop_requested = True


def _press_dict(press: PressConfig) -> dict:
    return {"press": press.press, "compression_ratio": press.compression_ratio, "merge": press.merge,
            "merge_options": press.merge_options}
