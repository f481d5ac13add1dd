"""A sweep's searchable parameters as its YAML states them (float, int, categorical ranges), checked against the
options they set (``grkv_core.options.OptionSpec``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from grkv_core.option_specs import OptionSpec, is_number


class Strict(BaseModel):
    """A config section: unknown fields refused, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class FloatParam(Strict):
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


class IntParam(Strict):
    type: Literal["int"]
    low: int
    high: int
    log: bool = False

    @model_validator(mode="after")
    def _check(self):
        if not self.low <= self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
        return self


class CategoricalParam(Strict):
    type: Literal["categorical"]
    choices: list[Any] = Field(min_length=1)


Param = Annotated[Union[FloatParam, IntParam, CategoricalParam], Field(discriminator="type")]


def range_problem(param, spec: OptionSpec) -> str | None:
    """Why a search-space parameter can propose a value its option does not accept, or None."""
    if isinstance(param, CategoricalParam):
        rejected = [choice for choice in param.choices if not spec.accepts(choice)]
        return f"choice(s) {rejected} rejected: must be {spec.describe()}" if rejected else None
    if spec.kind not in (int, float) or (isinstance(param, FloatParam) and spec.kind is int):
        return f"type: {param.type} cannot set it: must be {spec.describe()} (use type: categorical)"
    ends = [param.low, param.high, *([0.0] if isinstance(param, FloatParam) and param.include_zero else [])]
    rejected = [end for end in ends if not spec.accepts(end)]
    return f"bound(s) {rejected} rejected: must be {spec.describe()}" if rejected else None


def can_fix(param, value) -> bool:
    """Whether an enqueued trial (a baseline) can fix a searched parameter at ``value``: a categorical one only
    at one of its choices; a numeric one at any number (outside its range Optuna warns and uses it)."""
    return value in param.choices if isinstance(param, CategoricalParam) else is_number(value)
