"""Sweep configuration: one YAML file, validated on load, every error reported on one line naming the field."""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from grkv_core.catalog import (
    EVICTION_PRESSES,
    MERGERS,
    merger_names,
    merger_option_names,
    merger_option_spec,
    mergers_taking,
)
from grkv_core.config import (
    ATTN_IMPLEMENTATIONS,
    COMPRESSION_RATIO_SPEC,
    DATASETS,
    DEVICES,
    DTYPES,
    PROTOCOLS,
    EvalConfig,
    PressConfig,
)
from grkv_core.metrics import HIGHER_IS_BETTER, OBJECTIVE_METRICS, SCREENING_METRICS
from grkv_core.options import GRKV_PRESETS, PAPER_GRKV_OPTIONS, OptionSpec
from sweeps.entry_points import GRKV_HOME
from sweeps.params import CategoricalParam, Param, Strict, can_fix, range_problem
from workers.names import BASELINES, PAPER_DEFAULT


def _defaults(config_class) -> dict[str, Any]:
    """The fields of a library configuration that have a plain default, with it."""
    return {field.name: field.default for field in fields(config_class) if field.default is not MISSING}


# NOTE: the sections below take the library's defaults (a sweep left at its defaults evaluates what ``grkv eval``
# does), except ``model.device``, which follows the workers' GPUs when unset.
EVAL_DEFAULTS = _defaults(EvalConfig)
PRESS_DEFAULTS = _defaults(PressConfig)


def searchable_specs() -> dict[str, OptionSpec]:
    """What a sweep may search: the budget and every registered merger's options (each applied to the mergers that
    take it)."""
    return {
        "compression_ratio": COMPRESSION_RATIO_SPEC,
        **{name: merger_option_spec(name) for name in merger_option_names()},
    }


class ConfigError(ValueError):
    """A sweep config that cannot be used; the message is one line and names the field."""


class ModelSection(Strict):
    name: str = EVAL_DEFAULTS["model"]
    dtype: Literal[DTYPES] = EVAL_DEFAULTS["dtype"]
    attn_implementation: Literal[ATTN_IMPLEMENTATIONS] | None = EVAL_DEFAULTS["attn_implementation"]
    device: Literal[DEVICES] | None = Field(
        default=None, description=("where each worker runs its model; unset: cuda when workers.num_gpus > 0, else cpu")
    )


class TestSamplesSection(Strict):
    samples: int = Field(default=0, ge=0, description="held-out samples per task for the test stage (0: none)")


class DataSection(Strict):
    dataset: Literal[DATASETS] = EVAL_DEFAULTS["dataset"]
    tasks: list[str] | None = EVAL_DEFAULTS["tasks"]
    context_length: int | None = EVAL_DEFAULTS["context_length"]
    samples: int = Field(
        default=EVAL_DEFAULTS["samples"], ge=1, description="tuning samples per task (screening and full trials)"
    )
    seed: int = EVAL_DEFAULTS["seed"]
    data_dir: str | None = EVAL_DEFAULTS["data_dir"]
    protocol: Literal[PROTOCOLS] = Field(
        default=EVAL_DEFAULTS["protocol"],
        description=(
            "question_agnostic: the context compressed alone (kvpress's pipeline); query_aware: with its question "
            "(kvpress's evaluation query_aware)"
        ),
    )
    # NOTE: loaded in one call with the tuning samples and split per task, so the two sets are disjoint.
    test: TestSamplesSection = TestSamplesSection()


class PressSection(Strict):
    """The eviction press the merger sits behind, and its budget (the ratio may also be searched)."""

    name: str = PRESS_DEFAULTS["press"]
    compression_ratio: float = PRESS_DEFAULTS["compression_ratio"]

    @field_validator("name")
    @classmethod
    def _known(cls, name):
        EVICTION_PRESSES.check(name)
        return name

    @field_validator("compression_ratio")
    @classmethod
    def _budget(cls, ratio):
        COMPRESSION_RATIO_SPEC.check("compression_ratio", ratio)
        return ratio


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


class SweepConfig(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    press: PressSection = PressSection()
    merge: list[str] = Field(default_factory=lambda: ["grkv"], min_length=1)
    search_space: dict[str, Param]
    preset: Literal[tuple(GRKV_PRESETS)] | None = Field(
        default=None,
        description=(
            "GRKV's options a trial does not search come from this preset (grkv_core.options.GRKV_PRESETS) instead "
            "of GRKVPress's defaults; the baselines keep theirs"
        ),
    )
    objectives: list[Objective] = Field(
        default_factory=lambda: [Objective(metric="mean_score", direction="maximize")], min_length=1
    )
    sampler: SamplerSection = SamplerSection()
    trials: int = Field(ge=1)
    screening: ScreeningSection = ScreeningSection()
    test: TestSection = TestSection()
    # NOTE: eviction-only is a fixed reference run, whatever the merge choices; "none" among them makes it a
    # searched choice too, and the ledger evaluates it once however often it is proposed.
    baselines: list[Literal[BASELINES]] = Field(default_factory=lambda: list(BASELINES))
    workers: WorkerSection = WorkerSection()
    tracking: TrackingSection = TrackingSection()
    storage: StorageSection = StorageSection()

    @field_validator("merge")
    @classmethod
    def _mergers(cls, merge):
        unknown = [name for name in merge if name not in merger_names()]
        if unknown:
            raise ValueError(f"unknown merger(s) {unknown}; choose from {sorted(merger_names())}")
        return merge

    @model_validator(mode="after")
    def _consistent(self):
        searchable = searchable_specs()
        unknown = sorted(set(self.search_space) - set(searchable))
        if unknown:
            raise ValueError(f"search_space: unknown parameter(s) {unknown}; searchable: {sorted(searchable)}")
        for name, param in self.search_space.items():
            problem = range_problem(param, searchable[name])
            if problem:
                raise ValueError(f"search_space.{name}: {problem}")
            if name != "compression_ratio" and not set(mergers_taking(name)) & set(self.merge):
                raise ValueError(
                    f"search_space.{name}: an option of {mergers_taking(name)}, none of them among merge {self.merge}"
                )
        if self.sampler.type in ("grid", "one_at_a_time") and any(
            not isinstance(p, CategoricalParam) for p in self.search_space.values()
        ):
            raise ValueError(f"sampler: {self.sampler.type} needs every search_space parameter to be categorical")
        if self.sampler.type == "one_at_a_time":
            self._check_one_at_a_time()
        if self.preset and "grkv" not in self.merge:
            raise ValueError(
                f"preset: {self.preset} is a set of GRKV's options, and grkv is not among merge {self.merge}"
            )
        ratio = self.search_space.get("compression_ratio")
        if ratio is not None and self.baselines and not can_fix(ratio, self.press.compression_ratio):
            raise ValueError(
                f"press.compression_ratio: the baselines run at {self.press.compression_ratio}, not "
                "among the choices of search_space.compression_ratio"
            )
        screening = self.screening
        if screening.trials and screening.promote > screening.trials:
            raise ValueError(f"screening.promote: {screening.promote} exceeds screening.trials ({screening.trials})")
        if screening.trials and screening.promote + len(self.baselines) > self.trials:
            raise ValueError(
                f"screening.promote: {screening.promote} promoted plus {len(self.baselines)} baseline(s) "
                f"exceed trials ({self.trials})"
            )
        for field_name in ("eviction_ratios", "mergers"):
            if getattr(self.test, field_name) and not self.data.test.samples:
                raise ValueError(f"test.{field_name}: a test stage needs held-out samples; set data.test.samples")
        no_larger_budget = [r for r in self.test.eviction_ratios if r >= self.press.compression_ratio]
        if no_larger_budget:
            raise ValueError(
                f"test.eviction_ratios: {no_larger_budget} must be below press.compression_ratio "
                f"({self.press.compression_ratio}): eviction-only is compared at a larger budget"
            )
        return self

    def _check_one_at_a_time(self) -> None:
        if "grkv" not in self.merge or PAPER_DEFAULT not in self.baselines or "compression_ratio" in self.search_space:
            raise ValueError(
                "sampler: one_at_a_time varies GRKV's options around the paper default: it needs merge "
                "grkv, the paper_default baseline and a fixed press.compression_ratio"
            )
        grouped = [name for group in self.sampler.together for name in group]
        if len(grouped) != len(set(grouped)) or not set(grouped) <= set(self.search_space):
            raise ValueError(
                f"sampler.together: groups must name distinct search_space options, got {self.sampler.together}"
            )
        for group in self.sampler.together:
            if any(self.search_space[name].choices != self.search_space[group[0]].choices for name in group):
                raise ValueError(f"sampler.together: {group} are varied together, so they need the same choices")
        for name, param in self.search_space.items():
            if PAPER_GRKV_OPTIONS.get(name) not in param.choices:
                raise ValueError(
                    f"search_space.{name}: one_at_a_time holds it at the paper default "
                    f"{PAPER_GRKV_OPTIONS.get(name)!r}, which must be among its choices"
                )
        expected = len(self.baselines) + len(self.one_at_a_time_rows())
        if self.trials != expected:
            raise ValueError(
                f"trials: the one-at-a-time design has {expected - len(self.baselines)} rows plus "
                f"{len(self.baselines)} baseline(s); set trials: {expected}"
            )

    def one_at_a_time_rows(self) -> list[dict[str, Any]]:
        """The one-factor-at-a-time design's rows besides the paper default, as ``{option: value}`` changes from it:
        each factor (a ``sampler.together`` group, else one searched option) at each of its choices."""
        grouped = [name for group in self.sampler.together for name in group]
        factors = [*self.sampler.together, *([name] for name in self.search_space if name not in grouped)]
        rows = []
        for factor in factors:
            for choice in self.search_space[factor[0]].choices:
                if any(choice != PAPER_GRKV_OPTIONS[name] for name in factor):
                    rows.append({name: choice for name in factor})
        return rows

    @property
    def test_stage(self) -> bool:
        return self.data.test.samples > 0

    @property
    def directions(self) -> list[str]:
        return [objective.direction for objective in self.objectives]

    def eval_config(self) -> EvalConfig:
        """The evaluation every trial of the sweep runs (each trial replaces its press): the fields of
        ``EvalConfig`` that the model and data sections name alike, then those the sweep spells its own way."""
        alike = {
            name: getattr(section, name)
            for section in (self.model, self.data)
            for name in type(section).model_fields
            if name in EVAL_DEFAULTS
        }
        return EvalConfig(
            **{
                **alike,
                "model": self.model.name,
                "tasks": tuple(self.data.tasks) if self.data.tasks else None,
                # NOTE: only the offline generator builds contexts of a given length; the hub datasets come as they are.
                "context_length": self.data.context_length if self.data.dataset == "ruler" else None,
                "device": self.model.device or ("cuda" if self.workers.num_gpus > 0 else "cpu"),
                "press": PressConfig(self.press.name, self.press.compression_ratio),
            }
        )


def _one_line(error: ValidationError) -> str:
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{location}: {message}{more}" if location else f"{message}{more}"


def load_config(path: str | Path) -> SweepConfig:
    """Read and validate a sweep YAML file; raise ConfigError with a one-line message on any problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of fields")
    try:
        return SweepConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(f"{path}: {_one_line(error)}") from None
