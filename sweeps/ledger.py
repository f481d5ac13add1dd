"""The trial ledger: where every trial's fate is written, always in the same order.

A finished trial goes first to the sweep's state directory (atomically), then to MLflow, then to Optuna. Only
the driver writes the Optuna storage. On a restart with the same sweep id, ``reconcile`` walks that chain, so
nothing finished is redone and nothing is logged twice; a trial that was interrupted is re-enqueued once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import optuna

from grkv_core.config import BASELINE_TAG, BASELINES_ENQUEUED_ATTR, RECOVERED_TAG, REQUEUE_OF_ATTR, TRIAL_TAG
from sweeps.config import SweepConfig
from sweeps.space import baseline_params, make_sampler, suggest_press
from tracking.mlflow_tracker import SweepTracker, check_tracking_server, trial_metrics
from workers.protocol import TrialOutcome, TrialRequest

log = logging.getLogger("grkv.sweep")


@dataclass
class OpenTrial:
    """A trial asked of Optuna whose MLflow run is open; ``asked_s``: driver seconds spent opening it."""

    trial: optuna.Trial
    request: TrialRequest
    run_id: str
    asked_s: float


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

    def save(self, outcome: TrialOutcome) -> None:
        path = self.path(outcome.trial_number)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(outcome.to_dict()))
        os.replace(temporary, path)

    def load(self, number: int) -> TrialOutcome | None:
        path = self.path(number)
        return TrialOutcome.from_dict(json.loads(path.read_text())) if path.exists() else None

    @property
    def journal(self) -> Path:
        return self.root / "optuna.journal"


def objective_values(config: SweepConfig, summary: dict) -> list[float]:
    metrics = trial_metrics(summary)
    return [metrics[objective.metric] for objective in config.objectives]


class TrialLedger:
    """The sweep's study, its MLflow runs and its state directory, kept in step."""

    def __init__(self, config: SweepConfig, sweep_id: str):
        self.config = config
        self.sweep_id = sweep_id
        self.overhead = Overhead()

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
            if outcome is not None and outcome.ok:
                if not finished:
                    run_id = self.tracker.start_trial(frozen.number, frozen.params, frozen.user_attrs.get(BASELINE_TAG))
                    self.tracker.client.set_tag(run_id, RECOVERED_TAG, "true")
                    self.tracker.finish_trial(run_id, outcome, outcome.worker_timing())
                self.study.tell(frozen.number, objective_values(self.config, outcome.summary))
                log.info("trial %d: recovered its finished result", frozen.number)
            else:
                self._requeue(frozen.number, frozen.params, frozen.user_attrs)
                log.info("trial %d: interrupted, re-enqueued", frozen.number)

    def finished_trials(self) -> int:
        """Trials that count against the budget: complete, or failed on their own (not re-enqueued)."""
        trials = self.study.get_trials(deepcopy=False)
        requeued = {trial.user_attrs[REQUEUE_OF_ATTR] for trial in trials if REQUEUE_OF_ATTR in trial.user_attrs}
        return sum(trial.state == optuna.trial.TrialState.COMPLETE
                   or (trial.state == optuna.trial.TrialState.FAIL and trial.number not in requeued)
                   for trial in trials)

    def ask(self) -> OpenTrial:
        """The next trial: asked of Optuna, turned into a press configuration, its MLflow run opened."""
        started = time.perf_counter()
        trial = self.study.ask()
        request = TrialRequest(trial.number, suggest_press(trial, self.config))
        run_id = self.tracker.start_trial(trial.number, trial.params, trial.user_attrs.get(BASELINE_TAG))
        return OpenTrial(trial, request, run_id, time.perf_counter() - started)

    def record(self, open_trial: OpenTrial, outcome: TrialOutcome, dispatch_s: float, attempts: int) -> None:
        """Write a trial's outcome: state directory, then MLflow, then Optuna, then the parent run's summary."""
        started = time.perf_counter()
        self.state.save(outcome)
        number = open_trial.trial.number
        if outcome.ok:
            timing = outcome.worker_timing()
            # NOTE: the per-trial figure is logged with the run's other metrics, before it is closed, so a
            # crash never leaves a finished run without it; it therefore leaves out its own MLflow write and
            # the Optuna tell that follow. The sweep-level total on the parent run includes them.
            timing.update(trial_dispatch_s=dispatch_s, worker_attempts=attempts,
                          service_overhead_s=open_trial.asked_s + dispatch_s + (time.perf_counter() - started))
            self.tracker.finish_trial(open_trial.run_id, outcome, timing)
            self.study.tell(open_trial.trial, objective_values(self.config, outcome.summary))
            self.overhead.evaluation_s += timing["trial_eval_s"]
            self.overhead.service_s += open_trial.asked_s + dispatch_s + (time.perf_counter() - started)
            self.overhead.trials += 1
            log.info("trial %d: %s -> %s", number, open_trial.trial.params, outcome.summary["mean_score"])
        else:
            self.tracker.fail_trial(open_trial.run_id, outcome)
            self.study.tell(open_trial.trial, state=optuna.trial.TrialState.FAIL)
            log.warning("trial %d failed: %s", number, outcome.error)
        self.update_parent()

    def abandon(self, open_trial: OpenTrial) -> None:
        """On a stop: close the trial's run as KILLED and hand its parameters to the next run of the sweep."""
        self.tracker.fail_trial(open_trial.run_id, TrialOutcome.lost(open_trial.trial.number, "sweep stopped"),
                                status="KILLED")
        self._requeue(open_trial.trial.number, open_trial.trial.params, open_trial.trial.user_attrs)

    def update_parent(self) -> None:
        self.tracker.update_parent(self._best(), self._completed(), self.overhead.as_metrics())

    def close(self, status: str) -> None:
        self.update_parent()
        self.tracker.close(status, self.study.trials_dataframe().to_csv(index=False))

    def _requeue(self, number: int, params: dict, user_attrs: dict) -> None:
        """Fail trial ``number`` and enqueue its parameters again; the copy names it, so it no longer counts."""
        self.study.tell(number, state=optuna.trial.TrialState.FAIL)
        self.study.enqueue_trial(params, user_attrs={**user_attrs, REQUEUE_OF_ATTR: number})

    def _completed(self) -> int:
        return sum(t.state == optuna.trial.TrialState.COMPLETE for t in self.study.get_trials(deepcopy=False))

    def _best(self) -> list[dict]:
        if not self._completed():
            return []
        return [{"number": t.number, "values": t.values, "params": t.params} for t in self.study.best_trials[:5]]
