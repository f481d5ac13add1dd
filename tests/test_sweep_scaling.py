"""The driver's per-trial work does not grow with the study: what a trial costs at trial 100 it cost at trial 20.

A sweep of hundreds of trials (docs/results/sweep-scale.md) stays fast only while opening and recording a trial reads
no more of the Optuna storage, and calls MLflow no more often, than it did early on. These run a stage's ledger with
a real Optuna storage (an RDB on a SQLite file, behind Optuna's cache as in a sweep) and an MLflow client that
counts its calls, no service, and fail if a per-trial cost becomes proportional to the number of trials again.
"""

import contextlib
import math
from collections import Counter
from types import SimpleNamespace

import optuna
import pytest
import yaml
from conftest import REPO

from sweeps.config import load_config
from sweeps.space import baseline_params, make_sampler, suggest_press, trials_read_once
from sweeps.state.ledgers import TrialLedger
from sweeps.state.optuna_storage import open_storage_url
from sweeps.state.rdb_storage import parameters_in_one_commit
from sweeps.state.records import SweepRecords
from tracking.mlflow_tracker import SweepTracker
from workers.names import BASELINE_TAG, FULL_STAGE
from workers.protocol import OK, TrialOutcome, WorkerIdentity, configuration_key

BATCH = 4
WORKER = WorkerIdentity(pid=1, node_id="node", actor_id="actor", model_loads=1, trials_evaluated=1, samples=1)


class CountingClient:
    """An ``MlflowClient`` that stores nothing and counts its calls by method; its runs have numbered ids."""

    def __init__(self):
        self.calls = Counter()

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls[name] += 1
            if name == "search_runs":
                return []
            info = SimpleNamespace(
                run_id=f"run-{sum(self.calls.values())}", run_name="run", status="RUNNING", artifact_uri="file:///runs"
            )
            return SimpleNamespace(info=info)

        return call


class Reads:
    """Trials handed out by the study's storage (Optuna's cache: what the ledger and the sampler walk through) and
    trials read from the database behind it."""

    def __init__(self, study: optuna.Study, backend: optuna.storages.RDBStorage):
        self.cached = self.database = 0
        self._wrap(study._storage, "get_all_trials", "cached")
        self._wrap(backend, "_get_trials", "database")

    def _wrap(self, storage, method: str, counter: str) -> None:
        original = getattr(storage, method)

        def counting(*args, **kwargs):
            trials = original(*args, **kwargs)
            setattr(self, counter, getattr(self, counter) + len(trials))
            return trials

        setattr(storage, method, counting)


def outcome_of(request) -> TrialOutcome:
    """A finished outcome whose score repeats every 11 trials, so that the best is tied between several."""
    summary = {"mean_score": float(request.trial_number * 7 % 11), "tasks": {}}
    return TrialOutcome.of(request, OK, started_at=0.0, finished_at=1.0, worker=WORKER, summary=summary)


@pytest.fixture
def ledger(tmp_path):
    """The full stage of a sweep with a random sampler (its asks read no trials, so what is counted is the
    ledger's own), its storage a SQLite database file, its MLflow calls counted by a ``CountingClient``."""
    config = yaml.safe_load((REPO / "sweeps" / "configs" / "smoke.yaml").read_text())
    config.update(trials=1000, sampler={"type": "random", "seed": 0}, storage={"state_dir": str(tmp_path)})
    del config["screening"], config["test"], config["data"]["test"]
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    config = load_config(path)
    records = SweepRecords(config, "scaling")
    records.storage = open_storage_url(f"sqlite:///{tmp_path / 'optuna.db'}")
    records.tracker = SweepTracker(CountingClient(), "0", "scaling", "parent", tuple(config.search_space))
    records.state.create()
    records.parent_every_s = math.inf  # the parent run updated once, at the first trial
    ledger = TrialLedger(records, FULL_STAGE)
    ledger.open()
    return ledger


def run_batches(ledger: TrialLedger, trials: int) -> None:
    """Open and record ``trials`` trials, ``BATCH`` at a time, as the driver does, the writer caught up after each
    batch (the trials it has yet to tell are read as unfinished: as many as the driver hands it, not the study's)."""
    for _ in range(trials // BATCH):
        for open_trial in ledger.open_trials(BATCH):
            ledger.record(open_trial, outcome_of(open_trial.request), 0.0, 1)
        ledger.records.writer.drain()


def test_a_trial_reads_as_much_of_the_storage_at_trial_100_as_at_trial_20(ledger):
    reads = Reads(ledger.study, ledger.records.storage)
    run_batches(ledger, 20)
    early = reads.cached, reads.database
    run_batches(ledger, 80)
    before_late = reads.cached, reads.database
    run_batches(ledger, 20)
    late = [now - before for now, before in zip((reads.cached, reads.database), before_late)]
    assert ledger.completed() == 120 and ledger.reused == 0
    assert ledger.best() == [
        {"number": t.number, "values": t.values, "params": t.params} for t in ledger.study.best_trials[:5]
    ]
    resumed = TrialLedger(ledger.records, FULL_STAGE)  # counts and best trials read back from the study
    resumed.open()
    assert (resumed.completed(), resumed.reused, resumed.best()) == (120, 0, ledger.best())
    # NOTE: per 20 trials, from the database: the same reads late as early (a few trials in flight each time), where
    # one scan of the study per trial would read 20 x 100 trials late against 20 x 10 early. From Optuna's cache (in
    # memory): the study once per trial, the one read its ask and its sampler share (``trials_read_once``), no more.
    assert late[1] <= early[1] + 20, (early, late)
    assert late[0] <= sum(range(101, 121)), (early, late)


def test_a_trial_calls_mlflow_a_fixed_number_of_times_and_never_reads_it(ledger):
    run_batches(ledger, 20)
    client = ledger.records.tracker.client
    early = Counter(client.calls)
    run_batches(ledger, 20)
    # NOTE: per trial: its run created, its results with its sampler's params (no predictions here) and its close;
    # no search, no run read back. The parent run's progress is not a trial's: at most every ``parent_every_s``.
    assert client.calls - early == Counter(create_run=20, log_batch=20, set_terminated=20)
    ledger.records.parent_every_s = 0.0
    run_batches(ledger, 4)
    assert client.calls - early == Counter(create_run=24, log_batch=24 + 4, set_terminated=24)


def test_reading_the_trials_once_per_ask_and_writing_its_parameters_at_once_proposes_and_stores_the_same(tmp_path):
    """TPE with a constant liar (the sweeps' sampler), batches of trials in flight, the baselines enqueued first: the
    same proposals, and the same trials read back from the database, whether a trial's ask and suggestions read the
    sweep's storage once and write its parameters in one transaction (as the ledger asks), or Optuna's own storage is
    read and written at every call."""
    config = load_config(REPO / "sweeps" / "configs" / "smoke.yaml")
    proposals, stored = {}, {}
    for once in (False, True):
        url = f"sqlite:///{tmp_path / f'once-{once}.db'}"
        storage = open_storage_url(url) if once else optuna.storages.RDBStorage(url)  # the reference: Optuna's
        study = optuna.create_study(storage=storage, sampler=make_sampler(config, 0), direction="maximize")
        for name, params in baseline_params(config):
            study.enqueue_trial(params, user_attrs={BASELINE_TAG: name})
        proposed = []
        for _ in range(10):
            batch = []
            for _ in range(BATCH):
                with (
                    trials_read_once(study) if once else contextlib.nullcontext(),
                    parameters_in_one_commit(storage) if once else contextlib.nullcontext(),
                ):
                    batch.append(study.ask())
                    proposed.append(configuration_key(suggest_press(batch[-1], config)))
            for trial in batch:
                study.tell(trial, float(trial.number * 7 % 11))
        proposals[once] = proposed
        reread = optuna.load_study(study_name=study.study_name, storage=url)
        stored[once] = [(trial.params, trial.distributions, trial.values) for trial in reread.trials]
    assert proposals[True] == proposals[False] and len(set(proposals[True])) == 10 * BATCH
    assert stored[True] == stored[False]


def test_the_trials_a_storage_created_and_wrote_are_read_as_the_database_has_them(tmp_path):
    """``RetryingRDBStorage`` answers reads of the running trials it created from what it wrote, and a finished
    trial it read back once from that read: the same trials as Optuna's own reads of the database (the reference),
    whatever is asked; a trial written otherwise (an attribute, its state) is read from the database again."""
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    storage, reference = open_storage_url(url), optuna.storages.RDBStorage(url)
    study = optuna.create_study(study_name="known", storage=storage)
    study.enqueue_trial({"x": 0.5})
    for number in range(12):
        with parameters_in_one_commit(storage):
            trial = study.ask()
            trial.suggest_float("x", 0.0, 1.0)
            if number % 2:
                trial.suggest_int("n", 1, 3)
        if number % 3 == 0:
            study.tell(trial, float(number))
        elif number == 4:
            trial.set_user_attr("seen", True)
    study.enqueue_trial({"x": 0.25})
    study_id, trials = study._study_id, reference.get_all_trials(study._study_id)
    running = [t._trial_id for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert len(running) == 8 and len(storage._running) == 7  # the one with an attribute is read again
    asked = [
        (states, included, after)
        for states in (None, (optuna.trial.TrialState.RUNNING,), (optuna.trial.TrialState.WAITING,))
        for included, after in ((set(running[:3]), running[2]), (set(), -1), (set(running), trials[5]._trial_id))
    ]
    expected = [reference._get_trials(study_id, *arguments) for arguments in asked]
    read_from_database = set()
    read = optuna.storages.RDBStorage._get_trials

    def recording(self, *args):
        found = read(self, *args)
        read_from_database.update(trial._trial_id for trial in found)
        return found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optuna.storages.RDBStorage, "_get_trials", recording)
        assert [storage._get_trials(study_id, *arguments) for arguments in asked] == expected
        for trial_id in running:
            assert storage.get_trial(trial_id) == reference.get_trial(trial_id)
    assert read_from_database and read_from_database.isdisjoint(storage._running)
    study.tell(study.trials[running[0] - 1].number, 1.0)  # which reads the trial back, finished
    read_from_database.clear()
    asked = (study_id, None, set(running), running[-1])
    expected = reference._get_trials(*asked)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optuna.storages.RDBStorage, "_get_trials", recording)
        assert storage._get_trials(*asked) == expected
        assert running[0] not in read_from_database  # handed out as read back, once
        assert storage._get_trials(*asked) == expected
        assert running[0] in read_from_database
    assert storage.get_trial(running[0]) == reference.get_trial(running[0])
    assert storage.get_trial(running[0]).state == optuna.trial.TrialState.COMPLETE
