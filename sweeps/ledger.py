"""The trial ledgers: where every trial's fate is written, always in the same order.

A finished trial goes first to the sweep's state directory (atomically), then to MLflow, then to Optuna. Only
the driver writes the Optuna storage. On a restart with the same sweep id, each ledger walks that chain
(``reconcile``), so nothing finished is redone and nothing is logged twice; a trial that was interrupted is
re-enqueued once.

A ``TrialLedger`` keeps one Optuna stage (the screening study or the main study), a ``HeldOutLedger`` the
held-out test stage; all of them write through the sweep's ``SweepRecords`` (state directory, Optuna storage,
MLflow parent run, service overhead).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import optuna

from grkv_core.config import PressConfig
from grkv_core.files import write_atomically
from grkv_core.kvpress_layout import KVPRESS_FOLDER, KvpressRun, write_run
from sweeps.config import SweepConfig
from sweeps.lease import SweepLease
from sweeps.space import RANDOM_AFTER_DUPLICATES, make_sampler, press_of, proposing_at_random, suggest_press
from sweeps.stages import SCREEN_SEED_OFFSET, SCREEN_STUDY_SUFFIX
from tracking.export import export_press
from tracking.mlflow_tracker import SweepTracker, check_tracking_server, trial_metrics
from tracking.names import (
    BASELINE_TAG,
    FULL_STAGE,
    PRESS_ARTIFACT,
    PROMOTED_FROM_TAG,
    RECOVERED_TAG,
    REQUEUE_OF_ATTR,
    REUSES_ATTR,
    SCREEN_STAGE,
    TEST_STAGE,
)
from tracking.retry import RetryPolicy, TrackingUnavailableError, one_line
from workers.protocol import FAILED, TrialOutcome, TrialRequest, configuration_key

log = logging.getLogger("grkv.sweep")
# NOTE: a duplicate proposal costs an ask and a tell, no evaluation; this many in a row means the sampler finds
# nothing new (a small categorical space, or a grid) rather than an unlucky streak.
EXHAUSTED_AFTER_DUPLICATES = 100

class StateDirError(RuntimeError):
    """The sweep's state directory (or its Optuna journal) cannot be used; the message is one line."""


class StorageUnavailableError(RuntimeError):
    """The Optuna storage URL (``storage.url``) does not answer."""


def repair_journal(journal: Path) -> None:
    """Make an Optuna journal loadable after its writer died mid-write.

    A last line without its newline is a write cut short: it is cut off (Optuna would fail on it, and append
    to it), after a copy of the whole file is kept next to it (``<journal>.torn-<time>``). Dropping it is what
    the journal would hold had the driver died a moment earlier, which every resume already handles.

    Raises
    ------
    StateDirError
        If a line before the last one does not parse: that is not a torn write and cannot be repaired here.
    """
    if not journal.is_file():
        return
    data = journal.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete < len(data):
        backup = journal.with_name(f"{journal.name}.torn-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.copy2(journal, backup)
        with open(journal, "r+b") as file:
            file.truncate(complete)
            os.fsync(file.fileno())
        log.warning("%s: cut off its torn last line (%d bytes of a write cut short); the file as it was is in %s",
                    journal, len(data) - complete, backup)
    for number, line in enumerate(data[:complete].splitlines(), start=1):
        try:
            json.loads(line)
        except ValueError:
            raise StateDirError(
                f"Optuna journal {journal} is corrupt at line {number} (not a torn last line); restore it from a "
                f"backup, or move it aside and run the sweep under a new --sweep-id (the finished trials' results "
                f"stay in {journal.parent})") from None


def open_storage_url(url: str) -> optuna.storages.RDBStorage:
    """The Optuna RDB storage at ``url``, or ``StorageUnavailableError`` (password hidden) when it does not answer."""
    from sqlalchemy.engine import make_url

    try:
        return optuna.storages.RDBStorage(url)
    except Exception as error:  # noqa: BLE001 - drivers raise their own types (ImportError, OperationalError...)
        try:
            shown = make_url(url).render_as_string(hide_password=True)
        except Exception:  # noqa: BLE001 - an unparsable URL is shown as the user wrote it, less any password
            shown = url.split("@")[-1]
        reason = one_line(error)
        raise StorageUnavailableError(f"Optuna storage {shown} cannot be opened ({type(error).__name__}: {reason}); "
                                      "start it or fix storage.url / --storage-url") from None


@dataclass
class OpenTrial:
    """A trial whose MLflow run is open; ``asked_s``: driver seconds spent opening it; ``trial``: its Optuna
    trial (None in the test stage)."""

    request: TrialRequest
    run_id: str
    asked_s: float
    trial: optuna.Trial | None = None


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
    """The driver's own record of finished trials: ``<state>/<sweep>/<folder>/<key>.json``, one folder a stage
    (``trials/3.json``, ``screen/0.json``, ``test/eviction_only@0.88.json``)."""

    FOLDERS = {FULL_STAGE: "trials", SCREEN_STAGE: "screen", TEST_STAGE: "test"}

    def __init__(self, root: Path, sweep_id: str):
        self.root = Path(root) / sweep_id

    def create(self) -> None:
        """Create the folders and prove a file can be written there, or raise ``StateDirError``."""
        created = None if self.root.exists() else self.root
        while created is not None and not created.parent.exists():
            created = created.parent
        try:
            for folder in self.FOLDERS.values():
                (self.root / folder).mkdir(parents=True, exist_ok=True)
            probe = self.root / ".write-probe"
            with open(probe, "wb") as file:
                file.write(b"grkv")
                os.fsync(file.fileno())
            probe.unlink()
        except OSError as error:
            if created is not None:  # nothing half-created: the folders this call made go again
                shutil.rmtree(created, ignore_errors=True)
            raise StateDirError(self.unwritable(error)) from None

    def unwritable(self, error: OSError) -> str:
        return (f"state dir {self.root} cannot be written ({error.strerror or error}); free space or fix "
                "storage.state_dir / --state-dir")

    def path(self, stage: str, key: str) -> Path:
        return self.root / self.FOLDERS[stage] / f"{key}.json"

    @property
    def kvpress(self) -> Path:
        """The test stage's results in kvpress's evaluation layout, a folder per test item (``kvpress/<test_of>/``;
        ``grkv leaderboard`` reads them beside kvpress's own)."""
        return self.root / KVPRESS_FOLDER

    def kvpress_folder(self, outcome: TrialOutcome) -> Path | None:
        """Where ``save`` wrote ``outcome``'s runs in kvpress's layout; None if it has none."""
        return self.kvpress / outcome.key if outcome.kvpress_runs else None

    def save(self, outcome: TrialOutcome) -> None:
        try:
            write_atomically(self.path(outcome.stage, outcome.key), json.dumps(outcome.to_dict()))
            for run in outcome.kvpress_runs:
                write_run(self.kvpress_folder(outcome), KvpressRun.from_dict(run))
        except OSError as error:
            raise StateDirError(self.unwritable(error)) from None

    def load(self, stage: str, key: str) -> TrialOutcome | None:
        path = self.path(stage, key)
        return TrialOutcome.from_dict(json.loads(path.read_text())) if path.exists() else None

    @property
    def journal(self) -> Path:
        return self.root / "optuna.journal"

    @property
    def checkpoints(self) -> str:
        """Where workers keep the per-sample results of the trials they are evaluating (``TrialRequest``)."""
        return str(self.root / "checkpoints")

    def journal_storage(self) -> optuna.storages.JournalStorage:
        """The Optuna storage of the journal, repaired first (``repair_journal``).

        NOTE: only the lease holder calls this, so a journal lock file left here is a dead driver's: removed at
        once rather than waited on (Optuna forces a stale lock only after 30 s).
        """
        repair_journal(self.journal)
        lock = self.journal.with_name(self.journal.name + ".lock")
        if os.path.lexists(lock):
            os.unlink(lock)
            log.info("%s: removed a dead driver's journal lock", lock)
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(self.journal)))


class SweepRecords:
    """What every stage of a sweep writes to: the state directory, the Optuna storage and the MLflow runs.

    The ledgers register themselves in ``ledgers`` (by stage); the parent run carries their progress.
    """

    def __init__(self, config: SweepConfig, sweep_id: str):
        self.config = config
        self.sweep_id = sweep_id
        self.overhead = Overhead()
        self.ledgers: dict[str, TrialLedger | HeldOutLedger] = {}
        self.state = StateDir(Path(config.storage.state_dir).expanduser(), sweep_id)
        self.lease = SweepLease(self.state.root, sweep_id)
        # NOTE: set once an MLflow call has failed for good; from then on nothing more is sent to MLflow and the
        # runs left open are closed by the resume (``close_leftovers``).
        self.tracking_lost = False

    def check_services(self) -> None:
        """Fail fast, in one line, when the MLflow server or the Optuna storage URL does not answer.

        NOTE: called before anything of the sweep is created, so a sweep that cannot run leaves no study, no
        state directory and no half-made runs behind.
        """
        check_tracking_server(self.config.tracking.tracking_uri)
        self.storage = open_storage_url(self.config.storage.url) if self.config.storage.url else None

    def open(self) -> None:
        """After ``check_services``: create the state directory, take the sweep's lease, open the Optuna storage
        and the MLflow parent run. NOTE: nothing of the sweep is written before its lease is held."""
        tracking = self.config.tracking
        self.state.create()
        self.lease.acquire()
        try:
            self.storage = self.storage or self.state.journal_storage()
            self.tracker = SweepTracker.open(tracking.tracking_uri, tracking.experiment, self.sweep_id,
                                             self.config.model_dump(mode="json"),
                                             RetryPolicy(tracking.retries, tracking.retry_backoff_s))
        except BaseException:
            self.lease.release()
            raise

    def write(self, open_trial: OpenTrial, outcome: TrialOutcome, dispatch_s: float, attempts: int,
              started: float) -> dict[str, float] | None:
        """Write an outcome to the state directory, then to its MLflow run; the timing logged if it finished."""
        self.state.save(outcome)
        if not outcome.ok:
            self.tracker.fail_trial(open_trial.run_id, outcome)
            log.warning("%s failed: %s", outcome, outcome.error)
            return None
        timing = outcome.worker_timing()
        # NOTE: the per-trial figure is logged with the run's other metrics, before it is closed, so a crash
        # never leaves a finished run without it; it therefore leaves out its own MLflow write and the Optuna
        # tell that follow. The sweep-level total on the parent run (``count``) includes them.
        timing.update(trial_dispatch_s=dispatch_s, worker_attempts=attempts,
                      service_overhead_s=open_trial.asked_s + dispatch_s + (time.perf_counter() - started))
        self.tracker.finish_trial(open_trial.run_id, outcome, timing, self.state.kvpress_folder(outcome))
        return timing

    def count(self, open_trial: OpenTrial, timing: dict[str, float], dispatch_s: float, started: float) -> None:
        """Add a finished trial, fully recorded, to the service overhead."""
        self.overhead.evaluation_s += timing["trial_eval_s"]
        self.overhead.service_s += open_trial.asked_s + dispatch_s + (time.perf_counter() - started)
        self.overhead.trials += 1

    def start(self, item: TrialRequest | TrialOutcome, sampler_params: dict | None = None,
              user_attrs: dict | None = None) -> str:
        """Open the MLflow run of a request (or of a recovered outcome); the Optuna user attributes that name a
        baseline or a promotion become tags."""
        user_attrs = user_attrs or {}
        tags = {PROMOTED_FROM_TAG: str(user_attrs[PROMOTED_FROM_TAG])} if PROMOTED_FROM_TAG in user_attrs else {}
        return self.tracker.start_trial(item.trial_number, sampler_params or {}, user_attrs.get(BASELINE_TAG),
                                        stage=item.stage, test_of=item.test_of, tags=tags)

    def recover(self, outcome: TrialOutcome, sampler_params: dict | None = None,
                user_attrs: dict | None = None) -> None:
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
        if self.tracking_lost:
            return
        try:
            self.tracker.fail_trial(open_trial.run_id, TrialOutcome.unfinished(open_trial.request, "sweep stopped"),
                                    status="KILLED")
        except TrackingUnavailableError:
            self.tracking_lost = True

    def update_parent(self) -> None:
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
            exported = export_press(self.tracker.client, self.sweep_id, path,
                                    experiment=self.config.tracking.experiment)
        except ValueError as error:  # no finished run carries the objective's metric
            log.warning("sweep %s: no press to recommend (%s)", self.sweep_id, error)
            return
        log.info("sweep %s: recommends %s (%s); press file %s, also %s on the parent run", self.sweep_id,
                 exported.choice.configuration, exported.choice.how, path, PRESS_ARTIFACT)

    def close(self, status: str) -> None:
        """Close the parent run with ``status`` (when MLflow still answers) and give the lease back."""
        try:
            if not self.tracking_lost:
                self.update_parent()
                self.tracker.close(status, {
                    f"{'study' if ledger.stage == FULL_STAGE else ledger.stage}_trials.csv":
                        ledger.study.trials_dataframe().to_csv(index=False)
                    for ledger in self.ledgers.values() if isinstance(ledger, TrialLedger)})
        except TrackingUnavailableError:
            self.tracking_lost = True
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
        records.ledgers[stage] = self

    def open(self) -> None:
        self.study = optuna.create_study(study_name=self.study_name, storage=self.records.storage,
                                         load_if_exists=True, directions=self.directions,
                                         sampler=make_sampler(self.records.config, self.seed))
        self.reconcile()
        for frozen in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if REUSES_ATTR not in frozen.user_attrs:
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
        done = sum(REUSES_ATTR not in trial.user_attrs
                   and (trial.state == optuna.trial.TrialState.COMPLETE
                        or (trial.state == optuna.trial.TrialState.FAIL and trial.number not in requeued))
                   for trial in trials)
        return max(self.budget - done, 0)

    @property
    def reused(self) -> int:
        """Proposals not evaluated because their configuration was."""
        return sum(REUSES_ATTR in trial.user_attrs for trial in self.study.get_trials(deepcopy=False))

    @property
    def exhausted(self) -> bool:
        return self.duplicates_in_a_row >= EXHAUSTED_AFTER_DUPLICATES

    def open_trials(self, count: int) -> list[OpenTrial]:
        """The next ``count`` new configurations: asked of Optuna, turned into press configurations, their MLflow
        runs opened. Fewer only when the space is exhausted; proposals of configurations already evaluated or
        being evaluated are told as reused on the way."""
        opened = []
        while len(opened) < count and not self.exhausted:
            started = time.perf_counter()
            stuck = self.duplicates_in_a_row >= RANDOM_AFTER_DUPLICATES
            with proposing_at_random(self.study, self.seed + len(self.study.get_trials(deepcopy=False))) if stuck \
                    else contextlib.nullcontext():
                trial = self.study.ask()
                press = suggest_press(trial, self.records.config)
            key = configuration_key(press)
            self.duplicates_in_a_row += 1
            original = self.evaluated.get(key, self.in_flight[key].trial.number if key in self.in_flight else None)
            if original is not None:
                trial.set_user_attr(REUSES_ATTR, original)
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                log.info("%s trial %d: the configuration of trial %d, not evaluated again", self.stage, trial.number,
                         original)
            else:
                self.duplicates_in_a_row = 0
                request = TrialRequest(trial.number, press, self.stage, checkpoint_dir=self.records.state.checkpoints)
                run_id = self.records.start(request, trial.params, trial.user_attrs)
                self.in_flight[key] = OpenTrial(request, run_id, time.perf_counter() - started, trial)
                opened.append(self.in_flight[key])
        if self.exhausted:
            log.warning("%s stage: the sampler proposed %d configurations in a row that were already evaluated; "
                        "the search space looks exhausted, so the stage ends", self.stage, self.duplicates_in_a_row)
        return opened

    def record(self, open_trial: OpenTrial, outcome: TrialOutcome, dispatch_s: float, attempts: int) -> None:
        """Write a trial's outcome: state directory, then MLflow, then Optuna, then the parent run's summary.

        A finished trial whose objectives were not all measured is recorded as failed.
        """
        started = time.perf_counter()
        values = self._objective_values(outcome) if outcome.ok else None
        if outcome.ok and values is None:
            missing = [name for name in self.metrics if name not in trial_metrics(outcome.summary)]
            outcome = replace(outcome, status=FAILED, error=f"objective(s) {missing} not measured")
        timing = self.records.write(open_trial, outcome, dispatch_s, attempts, started)
        discard_checkpoint(outcome, open_trial.request)
        key = configuration_key(open_trial.request.press)
        del self.in_flight[key]
        if outcome.ok:
            self.study.tell(open_trial.trial, values)
            self.evaluated[key] = open_trial.trial.number
            self.records.count(open_trial, timing, dispatch_s, started)
            log.info("%s: %s -> %s", outcome, open_trial.trial.params, dict(zip(self.metrics, values)))
        else:
            self.study.tell(open_trial.trial, state=optuna.trial.TrialState.FAIL)
        self.records.update_parent()

    def abandon(self, open_trial: OpenTrial) -> None:
        """On a stop: close the trial's run as KILLED and hand its parameters to the next run of the sweep."""
        self.records.abandon(open_trial)
        del self.in_flight[configuration_key(open_trial.request.press)]
        self._requeue(open_trial.trial.number, open_trial.trial.params, open_trial.trial.user_attrs)

    def completed(self) -> int:
        """Trials evaluated to the end (reused proposals left out)."""
        return sum(t.state == optuna.trial.TrialState.COMPLETE and REUSES_ATTR not in t.user_attrs
                   for t in self.study.get_trials(deepcopy=False))

    def progress(self) -> dict[str, float]:
        """The parent run's counts of this stage: ``completed_trials`` and ``reused_proposals`` (full), or
        ``completed_screen_trials`` and ``reused_screen_proposals``."""
        infix = "" if self.stage == FULL_STAGE else f"{self.stage}_"
        return {f"completed_{infix}trials": self.completed(), f"reused_{infix}proposals": self.reused}

    def best(self) -> list[dict]:
        if not self.completed():
            return []
        return [{"number": t.number, "values": t.values, "params": t.params} for t in self.study.best_trials[:5]]

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

    def __init__(self, records: SweepRecords, presses: list[tuple[str, PressConfig]]):
        self.records = records
        self.presses = presses
        self.pending: list[TrialRequest] = []
        self.finished = 0
        records.ledgers[TEST_STAGE] = self

    def open(self) -> None:
        finished = {test_of: self.records.close_leftovers(runs)
                    for test_of, runs in self.records.tracker.child_runs(TEST_STAGE).items()}
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
        """The next ``count`` test evaluations, their MLflow runs opened."""
        opened = []
        for request in self.pending[:count]:
            started = time.perf_counter()
            run_id = self.records.start(request)
            opened.append(OpenTrial(request, run_id, time.perf_counter() - started))
        del self.pending[:count]
        return opened

    def record(self, open_trial: OpenTrial, outcome: TrialOutcome, dispatch_s: float, attempts: int) -> None:
        """Write a test evaluation's outcome: state directory, then MLflow, then the parent run's summary."""
        started = time.perf_counter()
        timing = self.records.write(open_trial, outcome, dispatch_s, attempts, started)
        discard_checkpoint(outcome, open_trial.request)
        if timing is not None:
            self.finished += 1
            self.records.count(open_trial, timing, dispatch_s, started)
            log.info("%s: %s", outcome, outcome.summary["mean_score"])
        self.records.update_parent()

    def abandon(self, open_trial: OpenTrial) -> None:
        """Close the run as KILLED and put the evaluation back: this run of the sweep does it again (its worker
        was lost) or the next one (on a stop)."""
        self.records.abandon(open_trial)
        self.pending.append(open_trial.request)

    def progress(self) -> dict[str, float]:
        return {"finished_test_runs": self.finished}

