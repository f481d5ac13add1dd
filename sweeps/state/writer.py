"""The driver's writer: threads of its own ("lanes") that write what the driver records of each trial in MLflow and
Optuna, a trial's writes on one lane in the order handed over, while the driver goes on asking the sampler and
dispatching trials.

NOTE: what reaches the writer is already safe: a trial's outcome is written to the state directory (on the driver's
thread) before its MLflow run and its Optuna tell are handed over, so a writer that stops (MLflow or the database
lost, the driver killed) loses nothing finished: the resume logs and tells what the state directory holds
(``TrialLedger.reconcile``). Each trial is still written state directory, then MLflow, then Optuna.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger("grkv.sweep")

# NOTE: the writes a driver may hand over before it waits for the writer: a few batches of every worker; a writer
# slower than the trials' returns holds the driver back here rather than let its queue grow without bound (the
# trials it has yet to tell are running to the sampler, which would propose from ever older news).
MAX_PENDING = 64
# NOTE: two trials' MLflow requests at a time: one trial's are made one after another, each waiting on the server,
# and one lane could not keep up with 8 workers (docs/results/sweep-scale.md: the driver waited 72 ms a trial for it).
WRITER_LANES = 2


class Skipped(RuntimeError):
    """A write not made because one before it failed (the error the driver is given is that one's)."""


class RecordWriter:
    """Runs the calls handed to it (``submit``) on ``lanes`` threads of its own, those of one lane one after another.

    The first call to fail stops the writer: the calls after it, in every lane, are skipped, and the driver's next
    ``check``, ``submit`` or ``drain`` raises its error, so the driver stops as it would have had it made the call
    itself.
    """

    def __init__(self, lanes: int = 1, max_pending: int = MAX_PENDING):
        self.max_pending = max_pending
        self.error: BaseException | None = None
        self._lanes = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"grkv-writer-{lane}") for lane in range(lanes)
        ]
        self._pending: deque[Future] = deque()

    def submit(self, call: Callable, *args, lane: int = 0) -> tuple[Future, float]:
        """Hand ``call(*args)`` to the writer, after the calls handed to the same ``lane`` (taken modulo the lanes);
        returns its future and the seconds the driver waited for room."""
        started = time.perf_counter()
        self.check()
        while len(self._pending) >= self.max_pending:
            self._pending[0].exception()
            self.check()
        future = self._lanes[lane % len(self._lanes)].submit(self._run, call, args)
        self._pending.append(future)
        return future, time.perf_counter() - started

    def check(self) -> None:
        """Raise the error of a failed call, if one failed."""
        while self._pending and self._pending[0].done():
            self._pending.popleft()
        if self.error is not None:
            raise self.error

    def drain(self) -> None:
        """Wait until every call handed over is made (or skipped); then ``check``."""
        for future in list(self._pending):
            future.exception()
        self.check()

    def settle(self) -> BaseException | None:
        """Wait as ``drain`` does, for a driver that is stopping anyway: returns the error rather than raising it."""
        try:
            self.drain()
        except BaseException as error:  # noqa: BLE001 - handed back to the stopping driver, which classifies it
            return error
        return None

    def close(self) -> None:
        """Stop the threads once the calls handed over are made."""
        for lane in self._lanes:
            lane.shutdown(wait=True)

    def _run(self, call: Callable, args: tuple):
        if self.error is not None:
            raise Skipped("an earlier write failed")
        try:
            return call(*args)
        except BaseException as error:
            self.error = error
            raise
