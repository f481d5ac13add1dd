"""Where a sweep runs: its Ray workers, its MLflow server, its storage (sections of ``sweeps.config.SweepConfig``)."""

from __future__ import annotations

from pydantic import Field

from sweeps.entry_points import GRKV_HOME
from sweeps.params import Strict


class WorkerSection(Strict):
    count: int = Field(default=1, ge=1)
    num_cpus: float = Field(default=1.0, gt=0)
    num_gpus: float = Field(default=0.0, ge=0)
    max_retries: int = Field(
        default=2,
        ge=0,
        description=(
            "restarts of a worker that died (its batch re-runs each time); a worker that dies more often is retired, "
            "and with none left the sweep stops"
        ),
    )
    node_wait_s: float = Field(
        default=120.0,
        gt=0,
        description=(
            "how long a batch waits for a node that can hold its worker (after nodes were lost) before the sweep stops"
        ),
    )
    batch_size: int = Field(
        default=8,
        ge=1,
        description=(
            "most trials a worker evaluates together (one prefill per sample for all of them); a batch of K holds "
            "K compressed caches plus one full cache in memory"
        ),
    )


class TrackingSection(Strict):
    tracking_uri: str = "http://127.0.0.1:5000"
    experiment: str = "grkv-sweeps"
    retries: int = Field(
        default=5,
        ge=0,
        description=("re-tries of an MLflow call that found the server unreachable before the driver stops"),
    )
    retry_backoff_s: float = Field(
        default=2.0,
        ge=0,
        description=(
            "wait before the first re-try, doubled before each next one (5 re-tries from 2 s: about a minute)"
        ),
    )


class StorageSection(Strict):
    """Optuna storage (only the driver writes it) and the driver's own state directory."""

    url: str | None = Field(
        default=None, description="RDB URL (postgresql+psycopg2://..., the postgres extra) or None for a journal file"
    )
    outage_s: float = Field(
        default=60.0,
        ge=0,
        description=(
            "how long the database at url may be away mid-sweep (a restart, a failover): its calls are retried "
            "that long before the driver stops in one line (exit 3)"
        ),
    )
    # NOTE: absolute by default: `ray job submit --working-dir` runs the driver in a fresh copy of the
    # tree, so a relative path would lose the state a resumed sweep needs.
    state_dir: str = str(GRKV_HOME / "sweeps")
