"""The typed boundary between the sweep driver and its Ray workers: what a trial asks for, what it returns.

Both cross the Ray boundary as they are (Ray pickles dataclasses) and round-trip exactly through JSON
(``to_dict``/``from_dict``), which is how the driver's state directory keeps finished outcomes.

A request belongs to a stage (``workers.names.STAGES``): a screening trial (losses and answer metrics, nothing
generated) or a full trial, both numbered in their own Optuna study, or a held-out test evaluation, named by
what it confirms (``test_of``: a trial number or a baseline name) and numbered in no study.

NOTE: imports nothing heavy, so the driver's bookkeeping and the tracker can read outcomes without torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from grkv_core.config import PressConfig
from workers.names import FULL_STAGE, STAGES, TEST_STAGE

OK = "ok"
FAILED = "failed"


def check_identity(trial_number: int | None, stage: str, test_of: str | None) -> None:
    """Raise a ValueError unless ``stage`` is known and the item is named the way its stage names items."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if stage == TEST_STAGE and (test_of is None or trial_number is not None):
        raise ValueError("a test-stage item names what it tests (test_of) and has no trial number")
    if stage != TEST_STAGE and (trial_number is None or test_of is not None):
        raise ValueError(f"a {stage}-stage item has a trial number and no test_of")


def describe(trial_number: int | None, stage: str, test_of: str | None) -> str:
    """How logs name a trial: ``full trial 3``, ``screen trial 0`` or ``test of eviction_only@0.88``."""
    return f"test of {test_of}" if stage == TEST_STAGE else f"{stage} trial {trial_number}"


def resolved_settings(press: PressConfig) -> dict[str, Any]:
    """``grkv_core.presses.from_config.resolved``. NOTE: resolving builds the press (torch, kvpress), so that module is
    imported when a driver first resolves one, never by reading outcomes (the tracker, the reports)."""
    from grkv_core.presses.from_config import resolved

    return resolved(press)


def configuration_key(press: PressConfig) -> str:
    """What identifies a configuration: its canonical form (``PressConfig.canonical``), so two proposals that encode
    one press differently are one configuration, evaluated once and checkpointed in one file. Nothing is built: the
    press is built once, on the worker that runs it.

    NOTE: a changed default leaves the key as it was; the checkpoint's own resolved settings catch it
    (``ResultStore``).
    """
    return json.dumps(press.canonical(), sort_keys=True)


@dataclass(frozen=True)
class TrialRequest:
    """One trial for a worker: its identity (number or ``test_of``, and stage) and the press to evaluate.

    ``checkpoint_dir``: where the worker keeps the trial's per-sample results while it runs (the state directory's
    ``checkpoints/``, a path on the worker's own node unless every node mounts the state directory there, and moved
    by the node's ``GRKV_CHECKPOINT_DIR``: ``workers.trial_worker.CHECKPOINT_DIR_ENV``), so a trial evaluated again
    with the same press, after an interruption, resumes at the sample it had reached there; None keeps nothing.
    """

    trial_number: int | None
    press: PressConfig
    stage: str = FULL_STAGE
    test_of: str | None = None
    checkpoint_dir: str | None = None

    def __post_init__(self) -> None:
        check_identity(self.trial_number, self.stage, self.test_of)

    def __str__(self) -> str:
        return describe(self.trial_number, self.stage, self.test_of)

    @property
    def key(self) -> str:
        """The item's name within its stage: its trial number, or what a test-stage item tests."""
        return self.test_of if self.stage == TEST_STAGE else str(self.trial_number)

    @property
    def checkpoint(self) -> Path | None:
        """The file of the trial's per-sample results: one per stage and press (every setting resolved), so the
        same press asked again under another number finds it."""
        if self.checkpoint_dir is None:
            return None
        digest = hashlib.sha1(configuration_key(self.press).encode()).hexdigest()
        return Path(self.checkpoint_dir) / self.stage / f"{digest[:20]}.json"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialRequest:
        return cls(
            data["trial_number"],
            PressConfig(**data["press"]),
            data.get("stage", FULL_STAGE),
            data.get("test_of"),
            data.get("checkpoint_dir"),
        )


@dataclass(frozen=True)
class WorkerIdentity:
    """Which actor evaluated a trial, and how much it had done (``model_loads`` > 1 means it was restarted), and on
    what: the device and dtype its model actually runs in (``dtype="auto"`` resolves per device) and the GPUs Ray
    gave it (``CUDA_VISIBLE_DEVICES``; None: not set)."""

    pid: int
    node_id: str
    actor_id: str
    model_loads: int
    trials_evaluated: int
    samples: int
    device: str = "unknown"
    dtype: str = "unknown"
    visible_devices: str | None = None


@dataclass(frozen=True)
class TrialOutcome:
    """A trial's result, from the worker (finished or failed) or from the driver (its worker is gone).

    Attributes
    ----------
    trial_number, stage, test_of :
        The request's identity (see ``TrialRequest``); outcomes written before stages existed read as full
        trials.
    status : str
        ``"ok"`` or ``"failed"`` (then ``error``, and ``traceback`` when the worker caught it).
    started_at, finished_at : float or None
        Wall-clock seconds (``time.time()``) on the worker, of the whole batch the trial was evaluated in;
        None when no worker ran it to the end.
    batch_trials : int
        How many trials the worker evaluated together with this one (itself included).
    resumed_samples : int
        How many of ``samples`` the worker read from the trial's checkpoint instead of evaluating them (a trial
        re-queued after an interruption, on a node that can read the checkpoint its first attempt wrote).
    resolved_press : dict
        ``grkv_core.presses.from_config.resolved`` of the press the worker built: every field, defaults included.
    summary : dict or None
        ``grkv_core.evaluation.results.summarize`` of the samples (per-task scores, ``mean_score``, mean costs).
    samples : list of dict
        One ``SampleResult`` as a dict per evaluated sample (predictions, scores, costs).
    kvpress_runs : list of dict
        A test-stage evaluation's results in kvpress's evaluation layout
        (``grkv_core.evaluation.kvpress_layout.KvpressRun`` as dicts), which the driver writes to its state directory
        and MLflow; empty in the other stages.
    """

    trial_number: int | None
    status: str
    error: str | None = None
    traceback: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    worker: WorkerIdentity | None = None
    resolved_press: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)
    stage: str = FULL_STAGE
    test_of: str | None = None
    batch_trials: int = 1
    kvpress_runs: list[dict[str, Any]] = field(default_factory=list)
    resumed_samples: int = 0

    def __post_init__(self) -> None:
        check_identity(self.trial_number, self.stage, self.test_of)
        if self.status not in (OK, FAILED):
            raise ValueError(f"trial outcome status must be {OK!r} or {FAILED!r}, got {self.status!r}")
        if self.status == OK and (self.summary is None or self.worker is None or self.finished_at is None):
            raise ValueError("a finished trial outcome needs its summary, worker and timestamps")

    def __str__(self) -> str:
        return describe(self.trial_number, self.stage, self.test_of)

    @property
    def key(self) -> str:
        """The item's name within its stage: its trial number, or what a test-stage item tests."""
        return self.test_of if self.stage == TEST_STAGE else str(self.trial_number)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @classmethod
    def of(cls, request: TrialRequest, status: str, **fields) -> TrialOutcome:
        """An outcome of ``request`` (its identity copied)."""
        return cls(request.trial_number, status, stage=request.stage, test_of=request.test_of, **fields)

    @classmethod
    def lost(cls, trial_number: int, error: str) -> TrialOutcome:
        """A full trial whose worker could not finish it (the driver's verdict, nothing measured)."""
        return cls(trial_number, FAILED, error=error)

    @classmethod
    def unfinished(cls, request: TrialRequest, error: str) -> TrialOutcome:
        """``request`` no worker finished (the driver's verdict): nothing measured, the press it was to run
        resolved (so its run names it too)."""
        return cls.of(request, FAILED, error=error, resolved_press=resolved_settings(request.press))

    def worker_timing(self) -> dict[str, float]:
        """What the worker itself measured of a finished trial; ``trial_eval_s`` is the trial's share of its
        batch's wall time, so the shares of a batch add up to it."""
        return {
            "trial_eval_s": (self.finished_at - self.started_at) / self.batch_trials,
            "batch_trials": self.batch_trials,
            "worker_model_loads": self.worker.model_loads,
            "resumed_samples": self.resumed_samples,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialOutcome:
        data = dict(data)
        if data.get("worker") is not None:
            data["worker"] = WorkerIdentity(**data["worker"])
        return cls(**data)
