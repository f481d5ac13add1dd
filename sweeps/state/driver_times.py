"""The driver's own seconds per evaluation, by part, as a sweep at a cluster's scale is measured
(``benchmarks.sweep_scale``, docs/results/sweep-scale.md).

Each recorded evaluation appends one JSON line to ``<state>/<sweep>/driver_times.jsonl`` (``StateDir.log_times``):
its stage and key, the seconds of each part of ``PARTS`` the driver spent on it (``ask_s``…: wall clock, the waits for
the services included; ``ask_cpu_s``…: the CPU of the thread it ran on), the share of its batch's Ray round trip
(``dispatch_s``, waiting, not the driver's work) and the wall clock (``at``).

NOTE: a file, not MLflow metrics: the parts that follow a run's close (the close itself, Optuna's tell, the parent
run's update) could reach the run only through one more MLflow call per trial, which would be measured too.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

# On the driver's loop, the parts the trials wait for: ask, the sampler's proposals until a new configuration
# (duplicates' asks and tells included); state, its result written to the state directory; wait, the driver waiting
# for room on the writer. On the writer (``sweeps.state.writer``): mlflow, the trial's run opened, logged and closed;
# tell, Optuna told; parent, the parent run's progress (one MLflow write, at most every few seconds).
LOOP_PARTS = ("ask", "state", "wait")
WRITER_PARTS = ("mlflow", "tell", "parent")
PARTS = LOOP_PARTS + WRITER_PARTS


@dataclass
class DriverTimes:
    """Seconds by part (``PARTS``) the driver spent on one evaluation: wall clock and its thread's CPU."""

    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def part(self, name: str):
        """Add the block's seconds to ``name``."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started, time.thread_time() - cpu_started)

    def add(self, name: str, seconds: float, cpu_seconds: float = 0.0) -> None:
        """Add ``seconds`` of wall clock and ``cpu_seconds`` of CPU to ``name``."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + cpu_seconds

    @property
    def total_s(self) -> float:
        """The wall clock of every part so far."""
        return sum(self.seconds.values())

    def row(self, stage: str, key: str, dispatch_s: float) -> dict:
        """The JSON line of this evaluation."""
        parts = {f"{name}_s": self.seconds.get(name, 0.0) for name in PARTS}
        parts.update({f"{name}_cpu_s": self.cpu_seconds.get(name, 0.0) for name in PARTS})
        return {"stage": stage, "key": key, **parts, "dispatch_s": dispatch_s, "at": time.time()}
