"""How a sweep searches and what it confirms: its objectives, sampler, screening stage and held-out test stage (sections
of ``sweeps.config.SweepConfig``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from grkv_core.catalog import MERGERS
from grkv_core.config import COMPRESSION_RATIO_SPEC
from grkv_core.metrics import HIGHER_IS_BETTER, OBJECTIVE_METRICS, SCREENING_METRICS
from sweeps.params import Strict


class Objective(Strict):
    """A metric to optimise; its direction follows from the metric (``HIGHER_IS_BETTER``) and may be left out."""

    metric: Literal[OBJECTIVE_METRICS]
    direction: Literal["maximize", "minimize"]

    @model_validator(mode="before")
    @classmethod
    def _direction(cls, data):
        if isinstance(data, dict) and data.get("metric") in OBJECTIVE_METRICS:
            better = "maximize" if data["metric"] in HIGHER_IS_BETTER else "minimize"
            given = data.setdefault("direction", better)
            if given != better:
                raise ValueError(
                    f"{data['metric']} is better {'higher' if better == 'maximize' else 'lower'}: "
                    f"direction must be {better}, got {given!r}"
                )
        return data


class SamplerSection(Strict):
    type: Literal["tpe", "nsga2", "gp", "grid", "random", "one_at_a_time"] = Field(
        default="tpe",
        description=(
            "one_at_a_time: the paper's ablation design, each searched option at each of its choices with every other "
            "at the paper default's value (the rows are enqueued after the baselines; trials must count them all)"
        ),
    )
    seed: int = 0
    n_startup_trials: int = Field(default=8, ge=0)
    together: list[list[str]] = Field(
        default_factory=list,
        description=(
            "one_at_a_time: options varied together as one factor, e.g. [[lambda_k, lambda_v]] for the paper's λ"
        ),
    )


_MIN_DISTANCE = (
    "skip a configuration closer than this to a better one already chosen: the largest difference over its "
    "parameters, each as a fraction of its searched range (log scale where searched so), a different categorical "
    "choice 1 (0: skip only repeats; e.g. 0.1 keeps the sampler's near-copies of one configuration out)"
)


class ScreeningSection(Strict):
    """A cheap first stage: trials ranked by a reconstruction loss, nothing generated; the best are promoted."""

    trials: int = Field(default=0, ge=0, description="screening trials before the full ones (0: no screening)")
    promote: int = Field(default=4, ge=1, description="best screened configurations run first as full trials")
    metric: Literal[SCREENING_METRICS] = "question_loss"
    min_distance: float = Field(default=0.0, ge=0, le=1, description=_MIN_DISTANCE)


class TestSection(Strict):
    """What the held-out test stage confirms (on ``data.test.samples`` samples per task)."""

    top_k: int = Field(default=3, ge=1, description="best full trials tested (the Pareto set, capped)")
    min_distance: float = Field(default=0.0, ge=0, le=1, description=_MIN_DISTANCE)
    eviction_ratios: list[float] = Field(
        default_factory=list,
        description=(
            "eviction-only at these compression ratios too: the base press at a larger budget than the sweep's"
        ),
    )
    mergers: list[str] = Field(
        default_factory=list,
        description=(
            "other mergers behind the base press at the sweep's budget, with their defaults (e.g. kvpress_merging: "
            "kvpress's own MergingPress)"
        ),
    )
    eviction_sizes: list[int] = Field(
        default_factory=list,
        description=(
            "bounded-cache protocols: eviction-only at these target sizes too, each above press.target_size "
            "(test.eviction_ratios' counterpart)"
        ),
    )

    @field_validator("mergers")
    @classmethod
    def _other_mergers(cls, mergers):
        unknown = [name for name in mergers if name not in MERGERS]
        if unknown:
            raise ValueError(f"unknown merger(s) {unknown}; choose from {sorted(MERGERS)}")
        if len(set(mergers)) != len(mergers):
            raise ValueError(f"mergers must differ, got {mergers}")
        return mergers

    @field_validator("eviction_ratios")
    @classmethod
    def _ratios(cls, ratios):
        for ratio in ratios:
            COMPRESSION_RATIO_SPEC.check("each ratio", ratio)
        if len(set(ratios)) != len(ratios):
            raise ValueError(f"ratios must differ, got {ratios}")
        return ratios
