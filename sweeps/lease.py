"""One driver per sweep: a lease in the sweep's state directory that the driver holds for as long as it runs.

The lease is an exclusive ``flock`` on ``<state>/<sweep>/driver.lease``, a file that names its holder (host,
pid, process start time, Ray job submission id). The kernel drops the lock when its holder dies, however it
dies, so a dead driver's lease is taken over at once and a live one's never is.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("grkv.sweep")

# NOTE: `ray job submit` hands the driver its job's metadata, the submission id among it, in this variable.
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


class SweepBusyError(RuntimeError):
    """Another live driver holds the sweep's lease; ``holder`` says which, in words."""

    def __init__(self, message: str, holder: str):
        super().__init__(message)
        self.holder = holder


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


class SweepLease:
    """The lease of sweep ``sweep_id`` in ``directory``; ``acquire`` it before writing anything of the sweep."""

    def __init__(self, directory: Path, sweep_id: str):
        self.path = Path(directory) / "driver.lease"
        self.sweep_id = sweep_id
        self.file = None

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
                named = holder.describe() if holder else "unknown"
                raise SweepBusyError(
                    f"sweep {self.sweep_id} is already being run by another driver ({named}); wait for it or stop it",
                    named,
                ) from None
        previous = self._holder(lease)
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

    def release(self) -> None:
        """Give the lease back; emptied first, so the next driver knows its holder ended cleanly."""
        if self.file is None:
            return
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
