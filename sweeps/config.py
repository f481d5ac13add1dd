"""Sweep configuration: one YAML file, validated on load, every error reported on one line naming the field."""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from grkv_core.catalog import (
    EVICTION_PRESSES,
    NO_MERGER,
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
    PER_HEAD_CACHE_SPEC,
    PROTOCOLS,
    EvalConfig,
    PressConfig,
    StreamConfig,
    stream_min_tokens,
)
from grkv_core.datasets.long_texts import LONG_TEXT_DOMAINS
from grkv_core.metrics import ANSWER_METRICS, STREAM_METRICS
from grkv_core.option_specs import OptionSpec, option_specs
from grkv_core.options import GRKV_PRESETS, PAPER_GRKV_OPTIONS
from grkv_core.stream_options import STREAM_ANSWER, STREAM_NLL, STREAM_PROTOCOLS, DecodingOptions
from sweeps.params import CategoricalParam, Param, Strict, can_fix, range_problem
from sweeps.search_sections import Objective, SamplerSection, ScreeningSection, TestSection
from sweeps.service_sections import StorageSection, TrackingSection, WorkerSection
from workers.names import BASELINES, BOUNDED_SIZES, BUDGET_PARAMS, PAPER_DEFAULT


def _defaults(config_class) -> dict[str, Any]:
    """The fields of a library configuration that have a plain default, with it."""
    return {field.name: field.default for field in fields(config_class) if field.default is not MISSING}


# NOTE: the sections below take the library's defaults (a sweep left at its defaults evaluates what ``grkv eval``
# does), except ``model.device``, which follows the workers' GPUs when unset.
EVAL_DEFAULTS = _defaults(EvalConfig)
PRESS_DEFAULTS = _defaults(PressConfig)
STREAM_DEFAULTS = _defaults(StreamConfig)
# What a sweep under each bounded-cache protocol may optimise: what the protocol measures, and the cache's bytes.
STREAM_OBJECTIVES = {STREAM_NLL: ("stream_nll", "kv_bytes"), STREAM_ANSWER: (*ANSWER_METRICS, "kv_bytes")}


def searchable_specs() -> dict[str, OptionSpec]:
    """What a sweep may search: the budget (a bounded cache's sizes under a bounded-cache protocol) and every
    registered merger's options (each applied to the mergers that take it)."""
    return {
        "compression_ratio": COMPRESSION_RATIO_SPEC,
        **{name: option_specs(DecodingOptions)[name] for name in BOUNDED_SIZES},
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
    protocol: Literal[PROTOCOLS + STREAM_PROTOCOLS] = Field(
        default=EVAL_DEFAULTS["protocol"],
        description=(
            "question_agnostic: the context compressed alone (kvpress's pipeline); query_aware: with its question "
            "(kvpress's evaluation query_aware); stream_nll, stream_answer: a cache kept bounded over a stream "
            "(press.target_size every press.compression_interval tokens), scored on every token of long texts "
            "(data.texts; context_length cuts them) or on a benchmark's answer after its streamed context"
        ),
    )
    texts: Literal[LONG_TEXT_DOMAINS] = Field(
        default=STREAM_DEFAULTS["source"],
        description="stream_nll's long texts: tuning texts from their tune split, test texts from their eval split",
    )
    # NOTE: loaded in one call with the tuning samples and split per task, so the two sets are disjoint.
    test: TestSamplesSection = TestSamplesSection()


class PressSection(Strict):
    """The eviction press the merger sits behind, and its budget (the ratio may also be searched)."""

    name: str = PRESS_DEFAULTS["press"]
    compression_ratio: float = PRESS_DEFAULTS["compression_ratio"]
    target_size: int = Field(
        default=STREAM_DEFAULTS["target_size"],
        description="bounded-cache protocols: " + option_specs(DecodingOptions)["target_size"].help,
    )
    compression_interval: int = Field(
        default=STREAM_DEFAULTS["compression_interval"],
        description="bounded-cache protocols: " + option_specs(DecodingOptions)["compression_interval"].help,
    )
    per_head_cache: bool = Field(default=PRESS_DEFAULTS["per_head_cache"], description=PER_HEAD_CACHE_SPEC.help)

    @field_validator("target_size", "compression_interval")
    @classmethod
    def _size(cls, value, info):
        option_specs(DecodingOptions)[info.field_name].check(info.field_name, value)
        return value

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
            if name not in BUDGET_PARAMS and not set(mergers_taking(name)) & set(self.merge):
                raise ValueError(
                    f"search_space.{name}: an option of {mergers_taking(name)}, none of them among merge {self.merge}"
                )
        self._check_protocol_fit()
        if self.press.per_head_cache:
            try:
                self.sweep_press()
            except ValueError as error:
                raise ValueError(f"press.per_head_cache: {error}") from None
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
        for name in BUDGET_PARAMS:
            param, value = self.search_space.get(name), getattr(self.press, name)
            if param is not None and self.baselines and not can_fix(param, value):
                raise ValueError(
                    f"press.{name}: the baselines run at {value}, not among the choices of search_space.{name}"
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

    def _check_protocol_fit(self) -> None:
        """A bounded-cache sweep's budget is a size in tokens, it has no screening stage and optimises what its
        protocol measures; a prefill sweep's budget is a ratio and its objectives are the prefill's metrics."""
        searched = set(self.search_space)
        if not self.bounded:
            wrong = [f"search_space.{name}" for name in sorted(searched & set(BOUNDED_SIZES))] or (
                ["test.eviction_sizes"] if self.test.eviction_sizes else []
            )
            stream = [o.metric for o in self.objectives if o.metric in STREAM_METRICS]
            if wrong or stream:
                raise ValueError(
                    f"{(wrong or stream)[0]}: only a bounded-cache sweep (data.protocol: stream_nll or stream_answer) "
                    "has it"
                )
            return
        protocol = self.data.protocol
        if "compression_ratio" in searched or self.test.eviction_ratios:
            raise ValueError(
                f"data.protocol {protocol} bounds the cache by press.target_size: search target_size and set "
                "test.eviction_sizes instead of compression_ratio and test.eviction_ratios"
            )
        if self.screening.trials:
            raise ValueError(f"screening.trials: data.protocol {protocol} has no screening stage; set it to 0")
        allowed = STREAM_OBJECTIVES[protocol]
        for objective in self.objectives:
            if objective.metric not in allowed:
                raise ValueError(
                    f"objectives: data.protocol {protocol} measures {list(allowed)}, not {objective.metric}"
                )
        small = [size for size in self.test.eviction_sizes if size <= self.press.target_size]
        if small or len(set(self.test.eviction_sizes)) != len(self.test.eviction_sizes):
            raise ValueError(
                f"test.eviction_sizes: {self.test.eviction_sizes} must differ and exceed press.target_size "
                f"({self.press.target_size}): eviction-only is compared at a larger cache"
            )
        if self.test.eviction_sizes and not self.data.test.samples:
            raise ValueError("test.eviction_sizes: a test stage needs held-out samples; set data.test.samples")

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
    def bounded(self) -> bool:
        """A bounded-cache sweep (``data.protocol`` stream_nll or stream_answer)."""
        return self.data.protocol in STREAM_PROTOCOLS

    def sweep_press(self, merge: str = NO_MERGER, **budget) -> PressConfig:
        """The base press at the sweep's budget (``budget`` overrides it: ``compression_ratio``, or a bounded cache's
        ``target_size`` and ``compression_interval``) behind ``merge`` with its defaults."""
        if not self.bounded:
            ratio = budget.get("compression_ratio", self.press.compression_ratio)
            return PressConfig(self.press.name, ratio, merge, per_head_cache=self.press.per_head_cache)
        sizes = {name: budget.get(name, getattr(self.press, name)) for name in BOUNDED_SIZES}
        return PressConfig(self.press.name, 0.0, merge, decoding=sizes, per_head_cache=self.press.per_head_cache)

    def worker_config(self) -> dict:
        """What each worker loads and evaluates every trial with (each trial replaces its press):
        ``stream_config()`` of a bounded-cache sweep, else ``eval_config()``, as a dict."""
        return (self.stream_config() if self.bounded else self.eval_config()).to_dict()

    def stream_config(self) -> StreamConfig:
        """A bounded-cache sweep's evaluation on its tuning texts (``stream_nll``: the tune split of ``data.texts``;
        ``stream_answer``: the first ``data.samples`` per task, the test samples after them)."""
        nll = self.data.protocol == STREAM_NLL
        length = self.data.context_length or STREAM_DEFAULTS["max_tokens"]
        return StreamConfig(
            protocol=self.data.protocol,
            press=PressConfig(self.press.name, 0.0),
            target_size=self.press.target_size,
            compression_interval=self.press.compression_interval,
            model=self.model.name,
            source=self.data.texts if nll else self.data.dataset,
            split="tune",
            samples=self.data.samples,
            min_tokens=stream_min_tokens(self.data.protocol, length),
            max_tokens=length,
            tasks=None if nll or not self.data.tasks else tuple(self.data.tasks),
            seed=self.data.seed,
            dtype=self.model.dtype,
            device=self.model.device or ("cuda" if self.workers.num_gpus > 0 else "cpu"),
            data_dir=self.data.data_dir,
        )

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
                "press": PressConfig(
                    self.press.name, self.press.compression_ratio, per_head_cache=self.press.per_head_cache
                ),
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
