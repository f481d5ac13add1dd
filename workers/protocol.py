"""The typed boundary between the sweep driver and its Ray workers: what a trial asks for, what it returns.

Both cross the Ray boundary as they are (Ray pickles dataclasses) and round-trip exactly through JSON
(``to_dict``/``from_dict``), which is how the driver's state directory keeps finished outcomes.

NOTE: imports nothing heavy, so the driver's bookkeeping and the tracker can read outcomes without torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from grkv_core.config import PressConfig

OK = "ok"
FAILED = "failed"


@dataclass(frozen=True)
class TrialRequest:
    """One trial for a worker: its number in the study and the press configuration to evaluate."""

    trial_number: int
    press: PressConfig

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialRequest:
        return cls(int(data["trial_number"]), PressConfig(**data["press"]))


@dataclass(frozen=True)
class WorkerIdentity:
    """Which actor evaluated a trial, and how much it had done (``model_loads`` > 1 means it was restarted)."""

    pid: int
    node_id: str
    actor_id: str
    model_loads: int
    trials_evaluated: int
    samples: int


@dataclass(frozen=True)
class TrialOutcome:
    """A trial's result, from the worker (finished or failed) or from the driver (its worker is gone).

    Attributes
    ----------
    status : str
        ``"ok"`` or ``"failed"`` (then ``error``, and ``traceback`` when the worker caught it).
    started_at, finished_at : float or None
        Wall-clock seconds (``time.time()``) on the worker; None when no worker ran it to the end.
    resolved_press : dict
        ``PressConfig.resolved()`` of the press the worker built: every field, defaults included.
    summary : dict or None
        ``grkv_core.evaluate.summarize`` of the samples (per-task scores, ``mean_score``, mean costs).
    samples : list of dict
        One ``SampleResult`` as a dict per evaluated sample (predictions, scores, costs).
    """

    trial_number: int
    status: str
    error: str | None = None
    traceback: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    worker: WorkerIdentity | None = None
    resolved_press: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.status not in (OK, FAILED):
            raise ValueError(f"trial outcome status must be {OK!r} or {FAILED!r}, got {self.status!r}")
        if self.status == OK and (self.summary is None or self.worker is None or self.finished_at is None):
            raise ValueError("a finished trial outcome needs its summary, worker and timestamps")

    @property
    def ok(self) -> bool:
        return self.status == OK

    @classmethod
    def lost(cls, trial_number: int, error: str) -> TrialOutcome:
        """A trial whose worker could not finish it (the driver's verdict, nothing measured)."""
        return cls(trial_number, FAILED, error=error)

    def worker_timing(self) -> dict[str, float]:
        """What the worker itself measured of a finished trial."""
        return {"trial_eval_s": self.finished_at - self.started_at, "worker_model_loads": self.worker.model_loads}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialOutcome:
        data = dict(data)
        if data.get("worker") is not None:
            data["worker"] = WorkerIdentity(**data["worker"])
        return cls(**data)
