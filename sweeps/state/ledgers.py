"""One ledger a stage of a sweep: a ``TrialLedger`` keeps an Optuna stage (the screening study or the main study), a
``HeldOutLedger`` the held-out test stage; both write through the sweep's ``SweepRecords`` and answer the
driver as a ``StageLedger``."""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import replace

import optuna

from grkv_core.config import PressConfig
from sweeps.space import (
    RANDOM_AFTER_DUPLICATES,
    make_sampler,
    press_of,
    proposing_at_random,
    suggest_press,
    trials_read_once,
)
from sweeps.stages import SCREEN_SEED_OFFSET, SCREEN_STUDY_SUFFIX, as_costs, dominates
from sweeps.state.driver_times import DriverTimes
from sweeps.state.rdb_storage import parameters_in_one_commit
from sweeps.state.records import OpenTrial, SweepRecords, discard_checkpoint
from tracking.mlflow_tracker import trial_metrics
from workers.names import FULL_STAGE, REQUEUE_OF_ATTR, REUSES_ATTR, SCREEN_STAGE, TEST_STAGE
from workers.protocol import FAILED, TrialOutcome, TrialRequest, configuration_key

log = logging.getLogger("grkv.sweep")
# NOTE: a duplicate proposal costs an ask and a tell, no evaluation; this many in a row means the sampler finds
# nothing new (a small categorical space, or a grid) rather than an unlucky streak.
EXHAUSTED_AFTER_DUPLICATES = 100


class TrialLedger:
    """One Optuna stage of a sweep, screening or full trials: its study, its runs and its results in step.

    The full stage is the sweep's main study (named as the sweep, its configured objectives, ``trials``); the
    screening stage a study ``<sweep_id>.screen`` that minimises ``screening.metric`` over
    ``screening.trials``. Both propose from the same search space.

    A configuration is evaluated once per study: a proposal whose press (``PressConfig.resolved``) equals a
    finished trial's, or a trial's being evaluated, is not evaluated; it is marked ``REUSES_ATTR`` (that trial's
    number), has no MLflow run and does not count against the budget. So eviction-only (``merge: none``, no
    parameters) costs one evaluation however often the sampler proposes it.
    NOTE: such a proposal is told as failed, not with its original's values: samplers leave failed trials out,
    so one configuration never weighs as several in the sampler's model (told as complete, every duplicate of a
    good configuration made the sampler propose it again, and the duplicates fed on themselves).
    NOTE: proposals keep being asked until ``count`` new configurations are open; after
    ``RANDOM_AFTER_DUPLICATES`` duplicates in a row they are drawn at random (a sampler stuck on one evaluated
    point, such as ``merge: none``, is not an exhausted space), and after ``EXHAUSTED_AFTER_DUPLICATES`` in a row
    the space is taken to be exhausted and the stage ends.
    """

    fills_batches = False

    def __init__(self, records: SweepRecords, stage: str):
        config = records.config
        self.records = records
        self.stage = stage
        if stage == SCREEN_STAGE:
            self.study_name = records.sweep_id + SCREEN_STUDY_SUFFIX
            self.metrics, self.directions = [config.screening.metric], ["minimize"]
            self.budget, self.seed = config.screening.trials, config.sampler.seed + SCREEN_SEED_OFFSET
        else:
            self.study_name = records.sweep_id
            self.metrics = [objective.metric for objective in config.objectives]
            self.directions = config.directions
            self.budget, self.seed = config.trials, config.sampler.seed
        self.evaluated: dict[str, int] = {}  # configuration key -> the trial that evaluated it
        self.in_flight: dict[str, OpenTrial] = {}  # configuration key -> its open trial
        self.duplicates_in_a_row = 0
        # NOTE: counted as trials are told, not by reading the study: a count per trial that walks every trial
        # makes a sweep's bookkeeping grow with the square of its trials (tests/test_sweep_scaling.py).
        self._completed = self._reused = 0
        self._front: list[dict] = []  # the best trials (the Pareto set), by number: see ``best``
        records.ledgers[stage] = self

    def open(self) -> None:
        self.study = optuna.create_study(
            study_name=self.study_name,
            storage=self.records.storage,
            load_if_exists=True,
            directions=self.directions,
            sampler=make_sampler(self.records.config, self.seed),
        )
        self.reconcile()
        trials = self.study.get_trials(deepcopy=False)
        self._reused = sum(REUSES_ATTR in trial.user_attrs for trial in trials)
        for frozen in trials:
            if frozen.state == optuna.trial.TrialState.COMPLETE and REUSES_ATTR not in frozen.user_attrs:
                self._add_completed(frozen.number, frozen.values, frozen.params)
                press = press_of(frozen.params, self.records.config, frozen.user_attrs)
                self.evaluated.setdefault(configuration_key(press), frozen.number)

    def enqueue_once(self, trials: list[tuple[dict, dict]]) -> None:
        """Enqueue each ``(params, user_attrs)`` whose user attributes no trial of the study carries yet, so a
        resumed sweep enqueues nothing twice (a re-enqueued copy carries its original's)."""
        existing = [trial.user_attrs.items() for trial in self.study.get_trials(deepcopy=False)]
        for params, user_attrs in trials:
            if not any(user_attrs.items() <= attrs for attrs in existing):
                self.study.enqueue_trial(params, user_attrs=user_attrs)

    def reconcile(self) -> None:
        """Bring Optuna, MLflow and the state directory back in line after an interrupted run."""
        children = self.records.tracker.child_runs(self.stage)
        for frozen in self.study.get_trials(deepcopy=False):
            finished = self.records.close_leftovers(children.get(str(frozen.number), []))
            if frozen.state != optuna.trial.TrialState.RUNNING:
                continue
            outcome = self.records.state.load(self.stage, str(frozen.number))
            if outcome is not None and outcome.ok:
                if not finished:
                    self.records.recover(outcome, frozen.params, frozen.user_attrs)
                self.study.tell(frozen.number, self._objective_values(outcome))
            else:
                self._requeue(frozen.number, frozen.params, frozen.user_attrs)
                log.info("%s trial %d: interrupted, re-enqueued", self.stage, frozen.number)

    def remaining(self) -> int:
        """Trials still to run: the budget less those that count against it, complete or failed on their own
        (not re-enqueued, not reused); none once the sampler has exhausted the space."""
        if self.exhausted:
            return 0
        trials = self.study.get_trials(deepcopy=False)
        requeued = {trial.user_attrs[REQUEUE_OF_ATTR] for trial in trials if REQUEUE_OF_ATTR in trial.user_attrs}
        done = sum(
            REUSES_ATTR not in trial.user_attrs
            and (
                trial.state == optuna.trial.TrialState.COMPLETE
                or (trial.state == optuna.trial.TrialState.FAIL and trial.number not in requeued)
            )
            for trial in trials
        )
        return max(self.budget - done, 0)

    @property
    def reused(self) -> int:
        """Proposals not evaluated because their configuration was."""
        return self._reused

    @property
    def exhausted(self) -> bool:
        return self.duplicates_in_a_row >= EXHAUSTED_AFTER_DUPLICATES

    def open_trials(self, count: int) -> list[OpenTrial]:
        """The next ``count`` new configurations: asked of Optuna, turned into press configurations, their MLflow
        runs opened. Fewer only when the space is exhausted; proposals of configurations already evaluated or
        being evaluated are told as reused on the way."""
        opened = []
        # NOTE: the duplicates' asks and tells count as the ask of the next trial opened: they are its price.
        times = DriverTimes()
        while len(opened) < count and not self.exhausted:
            stuck = self.duplicates_in_a_row >= RANDOM_AFTER_DUPLICATES
            with (
                times.part("ask"),
                proposing_at_random(self.study, self.seed + len(self.study.get_trials(deepcopy=False)))
                if stuck
                else contextlib.nullcontext(),
                trials_read_once(self.study),
                parameters_in_one_commit(self.records.storage),
            ):
                trial = self.study.ask()
                press = suggest_press(trial, self.records.config)
            key = configuration_key(press)
            self.duplicates_in_a_row += 1
            original = self.evaluated.get(key, self.in_flight[key].trial.number if key in self.in_flight else None)
            if original is not None:
                trial.set_user_attr(REUSES_ATTR, original)
                with times.part("ask"):
                    self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                self._reused += 1
                log.info(
                    "%s trial %d: the configuration of trial %d, not evaluated again",
                    self.stage,
                    trial.number,
                    original,
                )
            else:
                self.duplicates_in_a_row = 0
                request = TrialRequest(trial.number, press, self.stage, checkpoint_dir=self.records.state.checkpoints)
                run = self.records.open_run(request, times, trial.params, trial.user_attrs)
                self.in_flight[key] = OpenTrial(request, run, trial, times)
                opened.append(self.in_flight[key])
                times = DriverTimes()
        if self.exhausted:
            log.warning(
                "%s stage: the sampler proposed %d configurations in a row that were already evaluated; "
                "the search space looks exhausted, so the stage ends",
                self.stage,
                self.duplicates_in_a_row,
            )
        return opened

    def record(self, open_trial: OpenTrial, outcome: TrialOutcome, dispatch_s: float, attempts: int) -> None:
        """Write a trial's outcome to the state directory, then hand the rest to the writer: MLflow, then Optuna,
        then the parent run's summary (``SweepRecords.hand_over``).

        A finished trial whose objectives were not all measured is recorded as failed.
        NOTE: the ledger counts the trial as evaluated here, not once the writer has told Optuna: the next proposal
        of its configuration is a duplicate from now on, as it was while the trial was in flight.
        """
        values = self._objective_values(outcome) if outcome.ok else None
        if outcome.ok and values is None:
            missing = [name for name in self.metrics if name not in trial_metrics(outcome.summary)]
            outcome = replace(outcome, status=FAILED, error=f"objective(s) {missing} not measured")
        self.records.save(open_trial, outcome)
        discard_checkpoint(outcome, open_trial.request)
        key = configuration_key(open_trial.request.press)
        del self.in_flight[key]
        if outcome.ok:
            self._add_completed(open_trial.trial.number, values, open_trial.trial.params)
            self.evaluated[key] = open_trial.trial.number
            log.info("%s: %s -> %s", outcome, open_trial.trial.params, dict(zip(self.metrics, values)))
            tell = functools.partial(self.study.tell, open_trial.trial, values)
        else:
            tell = functools.partial(self.study.tell, open_trial.trial, state=optuna.trial.TrialState.FAIL)
        self.records.hand_over(open_trial, outcome, dispatch_s, attempts, tell)

    def abandon(self, open_trial: OpenTrial) -> None:
        """On a stop: close the trial's run as KILLED and hand its parameters to the next run of the sweep."""
        self.records.abandon(open_trial)
        del self.in_flight[configuration_key(open_trial.request.press)]
        self._requeue(open_trial.trial.number, open_trial.trial.params, open_trial.trial.user_attrs)

    def completed(self) -> int:
        """Trials evaluated to the end (reused proposals left out)."""
        return self._completed

    def progress(self) -> dict[str, float]:
        """The parent run's counts of this stage: ``completed_trials`` and ``reused_proposals`` (full), or
        ``completed_screen_trials`` and ``reused_screen_proposals``."""
        infix = "" if self.stage == FULL_STAGE else f"{self.stage}_"
        return {f"completed_{infix}trials": self.completed(), f"reused_{infix}proposals": self.reused}

    def artifacts(self) -> dict[str, str]:
        """The study's trials as a CSV: ``study_trials.csv`` (full) or ``screen_trials.csv``."""
        name = "study" if self.stage == FULL_STAGE else self.stage
        return {f"{name}_trials.csv": self.study.trials_dataframe().to_csv(index=False)}

    def best(self) -> list[dict]:
        """The first 5 best trials by number (``Study.best_trials``: the Pareto set, all ties at the best value for
        one objective), as ``number``, ``values`` and ``params``."""
        return self._front[:5]

    def _add_completed(self, number: int, values: list[float], params: dict) -> None:
        """Count a completed trial, and keep the Pareto set up to date with it."""
        self._completed += 1
        costs = as_costs(values, self.directions)
        if any(dominates(as_costs(best["values"], self.directions), costs) for best in self._front):
            return
        kept = [best for best in self._front if not dominates(costs, as_costs(best["values"], self.directions))]
        self._front = sorted(
            [*kept, {"number": number, "values": list(values), "params": params}], key=lambda best: best["number"]
        )

    def _objective_values(self, outcome: TrialOutcome) -> list[float] | None:
        metrics = trial_metrics(outcome.summary)
        values = [metrics.get(name) for name in self.metrics]
        return None if None in values else values

    def _requeue(self, number: int, params: dict, user_attrs: dict) -> None:
        """Fail trial ``number`` and enqueue its parameters again; the copy names it, so it no longer counts."""
        self.study.tell(number, state=optuna.trial.TrialState.FAIL)
        self.study.enqueue_trial(params, user_attrs={**user_attrs, REQUEUE_OF_ATTR: number})


class HeldOutLedger:
    """The held-out test stage: one evaluation per ``(test_of, press)`` of ``sweeps.stages.presses_to_test``,
    each with one MLflow run (tag ``grkv.test_of``) and one state file ``test/<test_of>.json``.

    On ``open`` it resumes: an evaluation with a FINISHED run is done, a finished result in the state
    directory whose run never closed is logged, and any other is (re)done.
    """

    stage = TEST_STAGE
    fills_batches = True

    def __init__(self, records: SweepRecords, presses: list[tuple[str, PressConfig]]):
        self.records = records
        self.presses = presses
        self.pending: list[TrialRequest] = []
        self.finished = 0
        records.ledgers[TEST_STAGE] = self

    def open(self) -> None:
        finished = {
            test_of: self.records.close_leftovers(runs)
            for test_of, runs in self.records.tracker.child_runs(TEST_STAGE).items()
        }
        for test_of, press in self.presses:
            if finished.get(test_of):
                self.finished += 1
                continue
            outcome = self.records.state.load(TEST_STAGE, test_of)
            if outcome is not None and outcome.ok:
                self.records.recover(outcome)
                self.finished += 1
            else:
                self.pending.append(TrialRequest(None, press, TEST_STAGE, test_of, self.records.state.checkpoints))

    def remaining(self) -> int:
        return len(self.pending)

    def open_trials(self, count: int) -> list[OpenTrial]:
        """The next ``count`` test evaluations, the opening of their MLflow runs handed to the writer."""
        opened = []
        for request in self.pending[:count]:
            times = DriverTimes()
            opened.append(OpenTrial(request, self.records.open_run(request, times), times=times))
        del self.pending[:count]
        return opened

    def record(self, open_trial: OpenTrial, outcome: TrialOutcome, dispatch_s: float, attempts: int) -> None:
        """Write a test evaluation's outcome to the state directory, then hand the rest to the writer: MLflow, then
        the parent run's summary."""
        self.records.save(open_trial, outcome)
        discard_checkpoint(outcome, open_trial.request)
        if outcome.ok:
            self.finished += 1
            log.info("%s: %s", outcome, outcome.summary["mean_score"])
        self.records.hand_over(open_trial, outcome, dispatch_s, attempts, None)

    def abandon(self, open_trial: OpenTrial) -> None:
        """Close the run as KILLED and put the evaluation back: this run of the sweep does it again (its worker
        was lost) or the next one (on a stop)."""
        self.records.abandon(open_trial)
        self.pending.append(open_trial.request)

    def progress(self) -> dict[str, float]:
        return {"finished_test_runs": self.finished}

    def artifacts(self) -> dict[str, str]:
        """None: the test stage's results are its runs."""
        return {}
