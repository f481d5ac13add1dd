"""The sweep's Optuna storage: a journal file in the state directory, repaired after its writer died mid-write,
or a database at ``storage.url`` (``sweeps.state.rdb_storage``), opened with a one-line error when it cannot be."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import optuna

from sweeps.state.rdb_storage import RetryingRDBStorage, StorageUnavailableError, shown_url
from sweeps.state.state_dir import StateDirError
from tracking.retry import one_line

log = logging.getLogger("grkv.sweep")

# The Optuna releases (from, up to but excluding) the sweep's storage is tested with: it overrides and calls Optuna's
# private storage internals (``rdb_storage.py``), which change between releases (4.6 added ``_get_best_trial_id``;
# its cache wrote parameters through the public method, past the retried override). tests/test_optuna_internals.py
# pins their signatures and holds pyproject.toml's range to this one.
TESTED_OPTUNA = ((5, 0), (5, 1))


def optuna_outside_tested_range(version: str = optuna.__version__) -> str | None:
    """Why a sweep must not run on Optuna ``version``, in one line; None within ``TESTED_OPTUNA``."""
    (low, high), release = TESTED_OPTUNA, tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if low <= release < high:
        return None
    tested = f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    return (
        f"Optuna {version} is outside the tested range {tested} (the sweep's storage relies on Optuna's private "
        f"internals, which change between releases); install 'optuna{tested}'"
    )


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
        log.warning(
            "%s: cut off its torn last line (%d bytes of a write cut short); the file as it was is in %s",
            journal,
            len(data) - complete,
            backup,
        )
    for number, line in enumerate(data[:complete].splitlines(), start=1):
        try:
            json.loads(line)
        except ValueError:
            raise StateDirError(
                f"Optuna journal {journal} is corrupt at line {number} (not a torn last line); restore it from a "
                f"backup, or move it aside and run the sweep under a new --sweep-id (the finished trials' results "
                f"stay in {journal.parent})"
            ) from None


def open_journal(journal: Path) -> optuna.storages.JournalStorage:
    """The Optuna storage of the journal file ``journal``, repaired first (``repair_journal``).

    NOTE: only the lease holder calls this, so a journal lock file left here is a dead driver's: removed at
    once rather than waited on (Optuna forces a stale lock only after 30 s).
    """
    repair_journal(journal)
    lock = journal.with_name(journal.name + ".lock")
    if os.path.lexists(lock):
        os.unlink(lock)
        log.info("%s: removed a dead driver's journal lock", lock)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))


# NOTE: the PyPI package that brings each database driver SQLAlchemy may import (its module name); psycopg2 is the
# driver the project declares (the ``postgres`` extra), the others are named for a URL that asks for them.
DRIVER_PACKAGES = {
    "psycopg2": "psycopg2-binary (pip install 'grkv[postgres]')",
    "psycopg": "psycopg[binary], or write the URL as postgresql+psycopg2://... and pip install 'grkv[postgres]'",
    "pymysql": "PyMySQL",
    "MySQLdb": "mysqlclient, or write the URL as mysql+pymysql://... and pip install PyMySQL",
}


def missing_driver(error: BaseException) -> str | None:
    """What to install when ``error`` (or its cause) is a database driver that could not be imported, else None."""
    for cause in (error, error.__cause__, error.__context__):
        if isinstance(cause, ModuleNotFoundError) and cause.name:
            module = cause.name.split(".")[0]
            return f"its driver module {module} is not installed: install {DRIVER_PACKAGES.get(module, module)}"
    return None


def open_storage_url(url: str, outage_s: float = 0.0) -> RetryingRDBStorage:
    """The Optuna RDB storage at ``url`` (its calls retried through outages of up to ``outage_s``), or
    ``StorageUnavailableError`` (password hidden) when it does not answer or its driver is not installed (then naming
    the package).

    NOTE: ``pool_pre_ping`` tests each pooled connection before use: a database restarted mid-sweep leaves the pool's
    connections dead, and without it the first query on each fails although the server is back.
    """
    try:
        return RetryingRDBStorage(url, outage_s, engine_kwargs={"pool_pre_ping": True})
    except Exception as error:  # noqa: BLE001 - drivers raise their own types (ImportError, OperationalError...)
        driver = missing_driver(error)
        if driver is not None:
            raise StorageUnavailableError(f"Optuna storage {shown_url(url)} cannot be opened: {driver}") from None
        reason = one_line(error)
        raise StorageUnavailableError(
            f"Optuna storage {shown_url(url)} cannot be opened ({type(error).__name__}: {reason}); "
            "start it or fix storage.url / --storage-url"
        ) from None
