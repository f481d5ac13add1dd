"""The driver's own seconds per evaluation, by part, as a sweep at a cluster's scale is measured
(``benchmarks.sweep_scale``, docs/results/sweep-scale.md).

Each recorded evaluation appends one JSON line to ``<state>/<sweep>/driver_times.jsonl`` (``StateDir.log_times``):
its stage and key, the seconds of each part of ``PARTS`` the driver spent on it (``ask_s``…: wall clock, the waits for
the services included; ``ask_cpu_s``…: the driver thread's own CPU), the share of its batch's Ray round trip
(``dispatch_s``, waiting, not the driver's work) and the wall clock (``at``).

NOTE: a file, not MLflow metrics: the parts that follow a run's close (the close itself, Optuna's tell, the parent
run's update) could reach the run only through one more MLflow call per trial, which would be measured too.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

# ask: the sampler's proposals until a new configuration (duplicates' asks and tells included); mlflow: the trial's
# run opened, logged and closed; state: its result written to the state directory; tell: Optuna told; parent: the
# parent run's progress (the study's counts and best trials read, one MLflow write).
PARTS = ("ask", "mlflow", "state", "tell", "parent")


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
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
            self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + time.thread_time() - cpu_started

    def row(self, stage: str, key: str, dispatch_s: float) -> dict:
        """The JSON line of this evaluation."""
        parts = {f"{name}_s": self.seconds.get(name, 0.0) for name in PARTS}
        parts.update({f"{name}_cpu_s": self.cpu_seconds.get(name, 0.0) for name in PARTS})
        return {"stage": stage, "key": key, **parts, "dispatch_s": dispatch_s, "at": time.time()}
