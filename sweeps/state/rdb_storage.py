"""The sweep's Optuna database storage (``storage.url``): Optuna's RDB storage whose calls ride out an outage of up to
``storage.outage_s``, and which reads back from memory what only the driver holding the sweep's lease can have
written (``RetryingRDBStorage``)."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import time
from collections.abc import Callable

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import RDBStorage
from optuna.storages._rdb import models
from optuna.storages._rdb.storage import _create_scoped_session

from tracking.retry import one_line

log = logging.getLogger("grkv.sweep")


class StorageUnavailableError(RuntimeError):
    """The Optuna storage URL (``storage.url``) does not answer: at the start, or for longer than
    ``storage.outage_s`` mid-sweep."""


def shown_url(url: str) -> str:
    """``url`` as it may be shown: its password hidden."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - an unparsable URL is shown as the user wrote it, less any password
        return url.split("@")[-1]


def parameters_in_one_commit(storage: optuna.storages.BaseStorage):
    """``storage``'s ``RetryingRDBStorage.parameters_in_one_commit``, or nothing for a storage that writes no
    transactions (a journal file)."""
    if isinstance(storage, RetryingRDBStorage):
        return storage.parameters_in_one_commit()
    return contextlib.nullcontext()


def is_outage(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) says the database cannot be reached, not that the request was wrong.

    NOTE: Optuna turns a failed session into ``StorageInternalError`` (from SQLAlchemy's error); a lost or refused
    connection is an ``OperationalError`` or ``InterfaceError`` of SQLAlchemy, or a ``DBAPIError`` that invalidated
    its connection.
    """
    from sqlalchemy import exc

    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, (exc.OperationalError, exc.InterfaceError)) or (
            isinstance(error, exc.DBAPIError) and error.connection_invalidated
        ):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def root_cause(error: BaseException) -> str:
    """The innermost error's first line: the driver's own words ("connection refused")."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return one_line(error)


# NOTE: the finished trials read back and not yet handed out that a storage keeps at most (see ``_finished``).
MAX_FINISHED_KEPT = 1024


class RetryingRDBStorage(RDBStorage):
    """Optuna's RDB storage whose every call is retried while the database is away, up to ``outage_s`` seconds of
    outage (``storage.outage_s``); then ``StorageUnavailableError`` in one line.

    The outage is counted from its first failed call to the next call that succeeds, whatever calls fail in between:
    once it is longer than ``outage_s`` each call fails after one try, so a driver stopping goes quickly.
    NOTE: a retried write whose first try committed although its answer was lost must not be applied twice: a new
    trial is looked for before it is created again (``_create_new_trial``), and a re-tried tell that finds its trial
    already finished in the state it was to set succeeds (``set_trial_state_values``). The other writes Optuna makes
    are idempotent (attributes are set, not appended), and parameters written together are looked for before a
    re-try (``parameters_in_one_commit``). Optuna's own re-tries of a trial creation that failed on commit (meant for
    deadlocks) are beyond this check: a copy they made would be a trial never proposed, left RUNNING until a resume
    re-queues it, or a second copy of an enqueued configuration, which the ledgers do not evaluate twice.
    """

    RETRY_WAIT_S = 1.0

    def __init__(self, url: str, outage_s: float, **kwargs):
        # NOTE: per thread: the parameters set within ``parameters_in_one_commit`` (None outside it).
        self._local = threading.local()
        # NOTE: the trials this storage created and has not seen change but by their parameters, as it wrote them
        # (trial id -> study id, trial): read from here, not from the database (``_get_trials``, ``get_trial``).
        # Only the driver holding the sweep's lease writes its studies, so nothing else changes them; any other
        # write to one (an attribute, its state) takes it out first.
        self._running: dict[int, tuple[int, optuna.trial.FrozenTrial]] = {}
        # NOTE: and the finished trials it read back (``Study.tell`` does), until a read of the study hands them out
        # once: a finished trial does not change, and Optuna's cache reads it once.
        self._finished: dict[int, optuna.trial.FrozenTrial] = {}
        self._running_lock = threading.Lock()
        self.outage_s = outage_s
        self.shown = shown_url(url)
        self.outage_since: float | None = None
        super().__init__(url, **kwargs)

    @contextlib.contextmanager
    def parameters_in_one_commit(self):
        """Within the block, the parameters this thread sets on trials are written at its end, in one transaction.

        NOTE: for a trial being suggested: each parameter was a transaction of its own (four round trips), eight a
        trial. Nothing reads them before the block ends: the trial's own ``Trial`` keeps what it suggested, and the
        sampler leaves the trial it suggests out of what it reads. A distribution incompatible with the study's is
        refused at its suggestion when the study's is known (Optuna's cache passes it), else when written.
        """
        self._local.params = pending = []
        try:
            yield
        finally:
            self._local.params = None
        if pending:
            self._retrying(functools.partial(self._write_params, pending, [0]))
            with self._running_lock:
                for trial_id, name, value, distribution, _ in pending:
                    if trial_id in self._running:
                        trial = self._running[trial_id][1]
                        trial.params = {**trial.params, name: distribution.to_external_repr(value)}
                        trial.distributions = {**trial.distributions, name: distribution}

    def _set_trial_param(self, trial_id, param_name, param_value_internal, distribution, previous_distribution):
        pending = getattr(self._local, "params", None)
        if pending is None:
            self._forget(trial_id)
            self._retrying(
                functools.partial(
                    RDBStorage._set_trial_param,
                    self,
                    trial_id,
                    param_name,
                    param_value_internal,
                    distribution,
                    previous_distribution,
                )
            )
            return
        if previous_distribution is not None:
            optuna.distributions.check_distribution_compatibility(previous_distribution, distribution)
        pending.append((trial_id, param_name, param_value_internal, distribution, previous_distribution))

    def _write_params(self, pending: list[tuple], tries: list[int]) -> None:
        """Write ``pending`` parameters in one transaction, each trial looked up once (Optuna's own write looks it up
        for each parameter); a re-try whose first try committed writes nothing."""
        tries[0] += 1
        if tries[0] > 1:
            written = {trial_id: RDBStorage.get_trial(self, trial_id).params for trial_id, *_ in pending}
            if all(name in written[trial_id] for trial_id, name, *_ in pending):
                return
        with _create_scoped_session(self.scoped_session, True) as session, session.no_autoflush:
            for trial_id in dict.fromkeys(trial_id for trial_id, *_ in pending):
                self.check_trial_is_updatable(trial_id, models.TrialModel.find_or_raise_by_id(trial_id, session).state)
            for trial_id, name, value, distribution, previous in pending:
                if previous is None:  # Optuna's own write, which compares it with the study's first of that name
                    self._set_trial_param_without_commit(session, trial_id, name, value, distribution)
                    continue
                as_json = optuna.distributions.distribution_to_json(distribution)
                session.add(
                    models.TrialParamModel(
                        trial_id=trial_id, param_name=name, param_value=value, distribution_json=as_json
                    )
                )

    def get_trial(self, trial_id: int):
        with self._running_lock:
            if trial_id in self._running:
                return _copied(self._running[trial_id][1])
        trial = self._retrying(functools.partial(RDBStorage.get_trial, self, trial_id))
        if trial.state.is_finished():
            with self._running_lock:
                self._finished[trial_id] = _copied(trial)
                while len(self._finished) > MAX_FINISHED_KEPT:
                    del self._finished[next(iter(self._finished))]
        return trial

    def _get_trials(self, study_id: int, states, included_trial_ids: set[int], trial_id_greater_than: int):
        """Optuna's read of a study's trials (its cache's: the unfinished ones and those after the last finished),
        the trials this storage knows answered from what it has (``_running`` where the database still has them
        running, ``_finished`` once), the others read from the database."""
        with self._running_lock:
            known = {trial_id: trial for trial_id, (study, trial) in self._running.items() if study == study_id}
        if not known and not self._finished:
            return self._retrying(
                functools.partial(
                    RDBStorage._get_trials, self, study_id, states, included_trial_ids, trial_id_greater_than
                )
            )
        return self._retrying(
            functools.partial(self._read_unknown, study_id, states, included_trial_ids, trial_id_greater_than, known)
        )

    def _read_unknown(self, study_id, states, included_trial_ids, trial_id_greater_than, known) -> list:
        """``_get_trials`` with ``known`` trials: the ids and states of the trials asked for read first (one small
        query), then the trials neither known and running nor read back finished (``_finished``), read as Optuna
        reads them."""
        from sqlalchemy import bindparam, text

        query = text(
            "SELECT trial_id, state FROM trials WHERE study_id = :study AND (trial_id IN :ids OR trial_id > :after)"
        ).bindparams(bindparam("ids", expanding=True))
        with self.engine.connect() as connection:
            rows = connection.execute(
                query, {"study": study_id, "ids": sorted(included_trial_ids), "after": trial_id_greater_than}
            ).all()
        wanted = {
            trial_id: state for trial_id, state in rows if states is None or optuna.trial.TrialState[state] in states
        }
        with self._running_lock:
            mine = [
                _copied(known[trial_id])
                for trial_id, state in wanted.items()
                if trial_id in known and state == "RUNNING"
            ]
            mine += [
                self._finished.pop(trial_id)
                for trial_id, state in wanted.items()
                if trial_id in self._finished and self._finished[trial_id].state.name == state
            ]
        trials = mine
        unknown = set(wanted) - {trial._trial_id for trial in mine}
        if unknown:
            # NOTE: Optuna's query for the trials ``unknown``, and for none after the greatest one found here.
            trials += RDBStorage._get_trials(self, study_id, states, unknown, max(wanted))
        return sorted(trials, key=lambda trial: trial._trial_id)

    def _forget(self, trial_id: int) -> None:
        """Take ``trial_id`` out of the trials read from what this storage wrote: it is about to change otherwise."""
        with self._running_lock:
            self._running.pop(trial_id, None)

    def _retrying(self, call: Callable):
        """``call()``, retried while the database is away (``outage_s``)."""
        while True:
            try:
                result = call()
            except Exception as error:
                if not is_outage(error):
                    raise
                now = time.monotonic()
                if self.outage_since is None:
                    self.outage_since = now
                    log.warning("Optuna storage %s does not answer (%s); retrying", self.shown, root_cause(error))
                away = now - self.outage_since
                if away >= self.outage_s:
                    raise StorageUnavailableError(
                        f"Optuna storage {self.shown} did not answer for {away:.0f} s (storage.outage_s "
                        f"{self.outage_s:g}; {root_cause(error)})"
                    ) from None
                time.sleep(min(self.RETRY_WAIT_S, self.outage_s - away))
                continue
            if self.outage_since is not None:
                log.warning(
                    "Optuna storage %s answers again after %.0f s",
                    self.shown,
                    time.monotonic() - self.outage_since,
                )
                self.outage_since = None
            return result

    def _count_trials(self, study_id: int) -> int:
        """How many trials the study has, read from Optuna's table ``trials``."""
        from sqlalchemy import text

        with self.engine.connect() as connection:
            return connection.execute(
                text("SELECT count(*) FROM trials WHERE study_id = :study"), {"study": study_id}
            ).scalar_one()

    def _create_new_trial(self, study_id: int, template_trial=None):
        # NOTE: one driver writes a study (it holds the sweep's lease) and a new trial's number is the study's count
        # of trials before it, so a trial numbered ``before`` found on a re-try is the one the lost answer created.
        before = self._retrying(functools.partial(self._count_trials, study_id))
        tries = 0

        def create():
            nonlocal tries
            tries += 1
            if tries > 1 and self._count_trials(study_id) > before:
                log.info("Optuna storage %s: trial %d was created before the connection was lost", self.shown, before)
                return RDBStorage.get_trial(
                    self, RDBStorage.get_trial_id_from_study_id_trial_number(self, study_id, before)
                )
            return RDBStorage._create_new_trial(self, study_id, template_trial)

        trial = self._retrying(create)
        if trial.state == optuna.trial.TrialState.RUNNING:
            with self._running_lock:
                self._running[trial._trial_id] = (study_id, _copied(trial))
        return trial

    def set_trial_state_values(self, trial_id: int, state, values=None) -> bool:
        self._forget(trial_id)
        tries = 0

        def tell():
            nonlocal tries
            tries += 1
            try:
                return RDBStorage.set_trial_state_values(self, trial_id, state, values)
            except UpdateFinishedTrialError:
                # NOTE: a re-try finding its trial finished as it was to be: the first try committed.
                if tries > 1 and RDBStorage.get_trial(self, trial_id).state == state:
                    return True
                raise

        return self._retrying(tell)


def _copied(trial: optuna.trial.FrozenTrial) -> optuna.trial.FrozenTrial:
    """A copy of a running ``trial`` whose containers are its own. NOTE: what Optuna changes in the trials it reads
    are those containers (``Trial`` adds its suggestions to its trial's), so a ``deepcopy`` of the values in them is
    work for nothing, a trial's worth of it for every running trial at every ask."""
    twin = copy.copy(trial)
    twin._params, twin._distributions = dict(trial.params), dict(trial.distributions)
    twin._user_attrs, twin._system_attrs = dict(trial.user_attrs), dict(trial.system_attrs)
    twin.intermediate_values = dict(trial.intermediate_values)
    twin._values = None if trial.values is None else list(trial.values)
    return twin


def _retried(method: Callable) -> Callable:
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return self._retrying(functools.partial(method, self, *args, **kwargs))

    return call


def _retried_trial_write(method: Callable) -> Callable:
    """``_retried``, for a write to a trial (its first argument): the trial is read from the database after it."""

    @functools.wraps(method)
    def call(self, trial_id, *args, **kwargs):
        self._forget(trial_id)
        return self._retrying(functools.partial(method, self, trial_id, *args, **kwargs))

    return call


# NOTE: every method of RDBStorage that opens a session and is called from outside it (by Optuna's study, its cache
# ``_CachedStorage`` or the ledgers); those that only call these are left as they are, so no call is retried twice
# over.
for _name in (
    "create_new_study",
    "delete_study",
    "set_study_user_attr",
    "set_study_system_attr",
    "get_study_id_from_name",
    "get_study_name_from_id",
    "get_study_directions",
    "get_study_user_attrs",
    "get_study_system_attrs",
    "get_trial_user_attrs",
    "get_trial_system_attrs",
    "get_all_studies",
    "get_trial_param",
    "get_trial_id_from_study_id_trial_number",
    "_get_best_trial_id",
    "record_heartbeat",
    "_get_stale_trial_ids",
):
    setattr(RetryingRDBStorage, _name, _retried(getattr(RDBStorage, _name)))
for _name in ("set_trial_intermediate_value", "set_trial_user_attr", "set_trial_system_attr"):
    setattr(RetryingRDBStorage, _name, _retried_trial_write(getattr(RDBStorage, _name)))
