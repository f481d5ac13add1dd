"""Sweep configuration: one YAML file, validated on load, every error reported on one line naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from grkv_core.registry import EVICTION_PRESSES, MERGERS


class ConfigError(ValueError):
    """A sweep config that cannot be used; the message is one line and names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FloatParam(_Strict):
    """A float, uniform or log-uniform; ``include_zero`` adds an exact 0 (the paper's no-ridge ablation)."""

    type: Literal["float"]
    low: float
    high: float
    log: bool = False
    include_zero: bool = False

    @model_validator(mode="after")
    def _check(self):
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be < high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError("low must be > 0 for a log-uniform range (use include_zero for an exact 0)")
        return self


class IntParam(_Strict):
    type: Literal["int"]
    low: int
    high: int
    log: bool = False

    @model_validator(mode="after")
    def _check(self):
        if not self.low <= self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
        return self


class CategoricalParam(_Strict):
    type: Literal["categorical"]
    choices: list[Any] = Field(min_length=1)


Param = Annotated[Union[FloatParam, IntParam, CategoricalParam], Field(discriminator="type")]


class ModelSection(_Strict):
    name: str = "smollm2-135m"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = None


class DataSection(_Strict):
    dataset: Literal["ruler", "ruler-hub", "longbench"] = "ruler"
    tasks: list[str] | None = None
    context_length: int | None = 2048
    samples: int = Field(default=5, ge=1)
    seed: int = 0
    data_dir: str | None = None


class PressSection(_Strict):
    """The eviction press the merger sits behind, and its budget (the ratio may also be searched)."""

    name: str = "snapkv"
    compression_ratio: float = Field(default=0.9, ge=0.0, lt=1.0)

    @field_validator("name")
    @classmethod
    def _known(cls, name):
        if name not in EVICTION_PRESSES:
            raise ValueError(f"unknown press {name!r}; choose from {sorted(EVICTION_PRESSES)}")
        return name


class Objective(_Strict):
    metric: Literal["mean_score", "ttft_s", "window_loss", "heldout_loss", "kv_bytes", "decode_ms_per_token"]
    direction: Literal["maximize", "minimize"]


class SamplerSection(_Strict):
    type: Literal["tpe", "nsga2", "gp", "grid", "random"] = "tpe"
    seed: int = 0
    n_startup_trials: int = Field(default=8, ge=0)


class WorkerSection(_Strict):
    count: int = Field(default=1, ge=1)
    num_cpus: float = Field(default=1.0, gt=0)
    num_gpus: float = Field(default=0.0, ge=0)
    max_retries: int = Field(default=2, ge=0, description="re-runs of a trial whose worker died")


class TrackingSection(_Strict):
    tracking_uri: str = "http://127.0.0.1:5000"
    experiment: str = "grkv-sweeps"


class StorageSection(_Strict):
    """Optuna storage (only the driver writes it) and the driver's own state directory."""

    url: str | None = Field(default=None, description="RDB URL (postgresql://...) or None for a journal file")
    # NOTE: absolute by default: `ray job submit --working-dir` runs the driver in a fresh copy of the
    # tree, so a relative path would lose the state a resumed sweep needs.
    state_dir: str = "~/.grkv/sweeps"


BASELINES = ("paper_default", "eviction_only")

# The paper's defaults (Sec. 4.1), enqueued first so every sweep is anchored to them. The paper's Alg. 1 has no
# safeguard, an absolute ridge and solves the key step exactly (CG to convergence); a sweep that does not
# search those options runs GRKVPress's defaults instead.
PAPER_DEFAULTS = {"lambda_k": 1e-2, "lambda_v": 1e-2, "beta": 0.1, "window_size": 32, "steps": 1,
                  "components": "kv", "query_policy": "window", "accept": "always", "safeguard": False,
                  "ridge_scale": "absolute", "cg_max_iter": 200}


class SweepConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    press: PressSection = PressSection()
    merge: list[str] = Field(default_factory=lambda: ["grkv"], min_length=1)
    search_space: dict[str, Param]
    objectives: list[Objective] = Field(default_factory=lambda: [Objective(metric="mean_score", direction="maximize")],
                                        min_length=1)
    sampler: SamplerSection = SamplerSection()
    trials: int = Field(ge=1)
    baselines: list[Literal["paper_default", "eviction_only"]] = Field(default_factory=lambda: list(BASELINES))
    workers: WorkerSection = WorkerSection()
    tracking: TrackingSection = TrackingSection()
    storage: StorageSection = StorageSection()

    @field_validator("merge")
    @classmethod
    def _mergers(cls, merge):
        unknown = [name for name in merge if name not in MERGERS]
        if unknown:
            raise ValueError(f"unknown merger(s) {unknown}; choose from {sorted(MERGERS)}")
        return merge

    @model_validator(mode="after")
    def _consistent(self):
        searchable = {"compression_ratio", "max_rel_update_k", "max_rel_update_v", *PAPER_DEFAULTS, "n_sink"}
        unknown = sorted(set(self.search_space) - searchable)
        if unknown:
            raise ValueError(f"search_space: unknown parameter(s) {unknown}; searchable: {sorted(searchable)}")
        if "eviction_only" in self.baselines and "none" not in self.merge:
            raise ValueError("baselines: 'eviction_only' needs 'none' among merge choices")
        if self.sampler.type == "grid" and any(not isinstance(p, CategoricalParam) for p in self.search_space.values()):
            raise ValueError("sampler: grid search needs every search_space parameter to be categorical")
        return self

    @property
    def directions(self) -> list[str]:
        return [objective.direction for objective in self.objectives]


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
