"""One driver per sweep: a lease that the driver holds for as long as it runs.

The lease is an exclusive ``flock`` on ``<state>/<sweep>/driver.lease``, a file that names its holder (host,
pid, process start time, Ray job submission id). The kernel drops the lock when its holder dies, however it
dies, so a dead driver's lease is taken over at once and a live one's never is.

A file lock holds on one machine's disk only. When the sweep's Optuna storage is a PostgreSQL database, which
drivers on other machines reach too, the lease is also held there (``DatabaseLease``): a session advisory lock keyed
by the sweep id, on a connection of its own, and the holder's name in the table ``grkv_sweep_leases``. The server
drops the lock when that connection closes: at once when the driver dies, within ``KEEPALIVE_BOUND_S`` when its
machine vanishes (TCP keepalives), and when the server itself restarts, after which the driver takes it again
(``DatabaseLease``) or, if another driver took it meanwhile, stops (``LeaseLostError``). Other storages (a
journal file, SQLite) have the file lock only.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("grkv.sweep")
# NOTE: the server probes an idle lease connection after KEEPALIVE_IDLE_S, then every KEEPALIVE_INTERVAL_S, and
# drops it (and the lock) after KEEPALIVE_COUNT unanswered probes; the client probes the server alike.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 30, 10, 3
KEEPALIVE_BOUND_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT
# How often a driver's lease thread makes sure it still holds its database lock (a server restart drops it).
CHECK_EVERY_S = 2.0

# NOTE: `ray job submit` hands the driver its job's metadata, the submission id among it, in this variable.
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


class SweepBusyError(RuntimeError):
    """Another live driver holds the sweep's lease; ``holder`` says which, in words."""

    def __init__(self, message: str, holder: str):
        super().__init__(message)
        self.holder = holder


class LeaseLostError(SweepBusyError):
    """Mid-sweep: another driver took the sweep's database lock while this one had lost it (the server restarted);
    this driver must write nothing more of the sweep."""


@dataclass(frozen=True)
class DriverIdentity:
    host: str
    pid: int
    started: str
    ray_job: str | None = None

    @classmethod
    def current(cls) -> "DriverIdentity":
        job_config = json.loads(os.environ.get(RAY_JOB_CONFIG_ENV) or "{}")
        return cls(
            socket.gethostname(),
            os.getpid(),
            time.strftime("%Y-%m-%d %H:%M:%S"),
            job_config.get("metadata", {}).get("job_submission_id"),
        )

    def describe(self, alive: bool = True) -> str:
        """Who the driver is; for a live one, how to stop it (a dead one's Ray job has nothing left to stop)."""
        job = f", Ray job {self.ray_job}" if self.ray_job else ""
        if self.ray_job and alive:
            job += f" (stop it with `ray job stop {self.ray_job}`)"
        return f"pid {self.pid} on {self.host}, started {self.started}{job}"


def busy(sweep_id: str, holder: DriverIdentity | None) -> SweepBusyError:
    named = holder.describe() if holder else "unknown"
    return SweepBusyError(
        f"sweep {sweep_id} is already being run by another driver ({named}); wait for it or stop it", named
    )


class SweepLease:
    """The lease of sweep ``sweep_id`` in ``directory``, and in its Optuna database when ``storage_url`` is a
    PostgreSQL one; ``acquire`` it before writing anything of the sweep."""

    def __init__(self, directory: Path, sweep_id: str, storage_url: str | None = None):
        self.path = Path(directory) / "driver.lease"
        self.sweep_id = sweep_id
        self.file = None
        self.database = DatabaseLease(storage_url, sweep_id) if is_postgresql(storage_url) else None

    @property
    def lost(self) -> bool:
        return self.database is not None and self.database.lost is not None

    def acquire(self, wait_s: float = 0.0, announce: bool = True) -> None:
        """Take the lease, waiting up to ``wait_s`` for its holder to end, or raise ``SweepBusyError`` naming the
        driver that holds it; with ``announce``, log the takeover of a driver that died holding it."""
        lease = open(self.path, "a+")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                holder = self._holder(lease)
                lease.close()
                raise busy(self.sweep_id, holder) from None
        previous = self._holder(lease)
        if self.database is not None:
            try:
                # NOTE: the database names the last holder on any machine; the file only this machine's.
                previous = self.database.acquire(max(deadline - time.monotonic(), 0.0)) or previous
            except BaseException:
                lease.close()
                raise
        if previous is not None and announce:
            # NOTE: nothing is left to stop, and nothing for the user to do: the driver taking over closes what the
            # dead one left open (``TrialLedger.reconcile``).
            log.warning(
                "sweep %s: taking over the lease of a driver that died (%s); this run closes its runs left "
                "RUNNING as KILLED and re-queues its trials in flight",
                self.sweep_id,
                previous.describe(alive=False),
            )
        lease.seek(0)
        lease.truncate()
        lease.write(json.dumps(asdict(DriverIdentity.current())))
        lease.flush()
        os.fsync(lease.fileno())
        self.file = lease

    def check(self) -> None:
        """``LeaseLostError`` when another driver took the database lock while this one had lost it (it is taken
        again after a server restart, ``DatabaseLease``); checked before each trial is opened or recorded."""
        if self.database is not None:
            self.database.check()

    def release(self) -> None:
        """Give the lease back; emptied first, so the next driver knows its holder ended cleanly."""
        if self.file is None:
            return
        if self.database is not None:
            self.database.release()
        self.file.truncate(0)
        self.file.close()
        self.file = None

    @staticmethod
    def _holder(lease) -> DriverIdentity | None:
        lease.seek(0)
        text = lease.read().strip()
        try:
            return DriverIdentity(**json.loads(text)) if text else None
        except (ValueError, TypeError):
            return None


def is_postgresql(url: str | None) -> bool:
    """Whether ``url`` is a PostgreSQL one; a URL that does not parse is not (opening it reports it, in one line)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return url is not None and make_url(url).get_backend_name() == "postgresql"
    except ArgumentError:
        return False


class DatabaseLease:
    """The sweep's lease in its PostgreSQL database: ``pg_try_advisory_lock`` on a connection held for the driver's
    life, and the holder's ``DriverIdentity`` in ``grkv_sweep_leases`` for a refused driver to name.

    A thread keeps the lock: every ``CHECK_EVERY_S`` it makes sure the connection still lives, and when it does not
    (the server restarted, dropping the lock with it) takes the lock again as soon as the server answers, whatever
    the driver is doing meanwhile (waiting on MLflow, say). If another driver took it first, the lease is ``lost``
    and the driver's next ``check`` raises ``LeaseLostError``.
    NOTE: the lock is the lease; the row only names its holder. A row left behind (its driver died, or lost the
    lock in a server restart) is the previous holder's, read by the next driver to take the lock.
    """

    def __init__(self, url: str, sweep_id: str):
        self.url = url
        self.sweep_id = sweep_id
        # NOTE: a signed 64-bit key from the sweep id: advisory locks are per database, so only this database's
        # sweeps share the key space.
        self.key = int.from_bytes(hashlib.sha256(f"grkv.sweep:{sweep_id}".encode()).digest()[:8], "big", signed=True)
        self.engine = None
        self.identity: DriverIdentity | None = None
        self.connection = None
        self.lost: str | None = None  # the driver that took the lock from this one, in words
        self.stopping = threading.Event()
        self.keeper: threading.Thread | None = None

    def acquire(self, wait_s: float = 0.0) -> DriverIdentity | None:
        """Take the lock (waiting up to ``wait_s`` for its holder to end), write this driver's name and start keeping
        it; return the previous holder's name if it left one, or raise ``SweepBusyError`` naming the driver holding
        the lock."""
        from sqlalchemy import create_engine
        from sqlalchemy.pool import NullPool

        # NOTE: made here, not with the lease: the storage, opened first, reports a URL or driver that cannot be used.
        self.engine = create_engine(
            self.url,
            poolclass=NullPool,
            isolation_level="AUTOCOMMIT",
            connect_args={
                "connect_timeout": KEEPALIVE_INTERVAL_S,
                "keepalives": 1,
                "keepalives_idle": KEEPALIVE_IDLE_S,
                "keepalives_interval": KEEPALIVE_INTERVAL_S,
                "keepalives_count": KEEPALIVE_COUNT,
            },
        )
        self.identity = DriverIdentity.current()
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.connection, previous = self._take()
                break
            except SweepBusyError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
        self.keeper = threading.Thread(target=self._keep, name=f"lease {self.sweep_id}", daemon=True)
        self.keeper.start()
        return previous

    def check(self) -> None:
        if self.lost is not None:
            raise LeaseLostError(
                f"sweep {self.sweep_id} was taken over by another driver ({self.lost}) while this one's database "
                "connection was lost; this driver stops and leaves the sweep to it",
                self.lost,
            )

    def release(self) -> None:
        """Stop keeping the lock, clear this driver's name (never another's) and give the lock back."""
        from sqlalchemy import text
        from sqlalchemy.exc import DBAPIError

        if self.keeper is None:
            return
        self.stopping.set()
        self.keeper.join()
        self.keeper = None
        try:
            with self.engine.connect() as connection:
                connection.execute(
                    text("DELETE FROM grkv_sweep_leases WHERE sweep_id = :sweep AND holder = :holder"),
                    {"sweep": self.sweep_id, "holder": self._named()},
                )
        except DBAPIError as error:
            log.warning("sweep %s: could not clear its name in the database (%s)", self.sweep_id, error.orig)
        finally:
            if self.connection is not None:
                self.connection.close()  # the lock goes with its session
                self.connection = None

    def _named(self) -> str:
        return json.dumps(asdict(self.identity))

    def _take(self):
        """A new connection holding the lock, and the previous holder's name; or ``SweepBusyError``."""
        from sqlalchemy import text

        connection = self.engine.connect()
        try:
            for setting, value in (
                ("tcp_keepalives_idle", KEEPALIVE_IDLE_S),
                ("tcp_keepalives_interval", KEEPALIVE_INTERVAL_S),
                ("tcp_keepalives_count", KEEPALIVE_COUNT),
            ):
                connection.execute(text(f"SET {setting} = {value}"))
            connection.execute(
                text("CREATE TABLE IF NOT EXISTS grkv_sweep_leases (sweep_id text PRIMARY KEY, holder text NOT NULL)")
            )
            taken = connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": self.key}).scalar_one()
            row = connection.execute(
                text("SELECT holder FROM grkv_sweep_leases WHERE sweep_id = :sweep"), {"sweep": self.sweep_id}
            ).scalar_one_or_none()
            previous = DriverIdentity(**json.loads(row)) if row and row != self._named() else None
            if not taken:
                raise busy(self.sweep_id, previous)
            connection.execute(
                text(
                    "INSERT INTO grkv_sweep_leases VALUES (:sweep, :holder) "
                    "ON CONFLICT (sweep_id) DO UPDATE SET holder = excluded.holder"
                ),
                {"sweep": self.sweep_id, "holder": self._named()},
            )
        except BaseException:
            connection.close()
            raise
        return connection, previous

    def _keep(self) -> None:
        """The keeper thread: the lock held, or taken again, until ``release`` (or until another driver took it)."""
        from sqlalchemy import text
        from sqlalchemy.exc import DBAPIError

        while not self.stopping.wait(CHECK_EVERY_S):
            if self.connection is not None:
                try:
                    self.connection.execute(text("SELECT 1"))
                    continue
                except DBAPIError:
                    # NOTE: dropped, never used again: SQLAlchemy would reconnect it on its next use, a session
                    # without the lock that would answer as if it held it.
                    self.connection.invalidate()
                    self.connection.close()
                    self.connection = None
            try:
                self.connection, _ = self._take()
            except SweepBusyError as error:
                self.lost = error.holder
                return
            except DBAPIError:
                continue  # the server is still away: the next round tries again
            log.warning("sweep %s: took its database lease again after its connection was lost", self.sweep_id)
