"""How an option is declared: its ``OptionSpec`` (the values it takes, checked, described and turned into flags), the
``option`` field that carries one, and what reads them off an options dataclass.

NOTE: a leaf: imports nothing of grkv_core, so the catalog, the options and the configurations all build on it.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field, fields


def is_number(value) -> bool:
    """A real number given as int or float (bool excluded, although it subclasses int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class OptionSpec:
    """What values one option takes, for checks, command-line flags and sweep validation.

    ``kind`` is float, int, bool or str (then ``choices`` lists the values). Numbers are bounded by ``low`` and
    ``high`` (inclusive unless ``low_open``/``high_open``); ``nullable`` also admits None. ``symbol`` is how tables
    and figures name the option (the paper's letter where it has one, else the option's name).
    """

    help: str
    kind: type
    choices: tuple = ()
    symbol: str | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    nullable: bool = False

    def accepts(self, value) -> bool:
        if value is None:
            return self.nullable
        if self.kind is bool:
            return isinstance(value, bool)
        if self.kind is str:
            return value in self.choices
        if self.kind is int and not (isinstance(value, int) and not isinstance(value, bool)):
            return False
        if not is_number(value) or not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self) -> str:
        """The accepted values in words, e.g. "an integer >= 1" or "one of ('kv', 'k', 'v')"."""
        if self.kind is bool:
            text = "True or False"
        elif self.kind is str:
            text = f"one of {self.choices}"
        else:
            noun = "an integer" if self.kind is int else "a finite number"
            if self.low is not None and self.high is not None:
                text = (
                    f"{noun} in {'(' if self.low_open else '['}{self.low:g}, "
                    f"{self.high:g}{')' if self.high_open else ']'}"
                )
            elif self.low is not None:
                text = f"{noun} {'>' if self.low_open else '>='} {self.low:g}"
            elif self.high is not None:
                text = f"{noun} {'<' if self.high_open else '<='} {self.high:g}"
            else:
                text = noun
        return f"None or {text}" if self.nullable else text

    def check(self, name: str, value) -> None:
        if not self.accepts(value):
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")


def option(default, spec: OptionSpec):
    """A field of an options dataclass: its default and the spec that checks it (``option_specs`` reads it)."""
    return field(default=default, metadata={"spec": spec})


def option_specs(options: type) -> dict[str, OptionSpec]:
    """``{name: spec}`` of an options dataclass's fields (those declared with ``_option``), in field order."""
    return {item.name: item.metadata["spec"] for item in fields(options) if "spec" in item.metadata}


def check_options(options) -> None:
    """Raise a ValueError naming the first option of ``options`` (a dataclass instance, e.g. a merger press) whose
    value its spec does not accept."""
    for name, spec in option_specs(type(options)).items():
        spec.check(name, getattr(options, name))


def options_docstring(options: type, indent: int = 4) -> str:
    """NumPy-style parameter entries of an options dataclass's ``OptionSpec`` fields (name, values, default, help),
    indented by ``indent`` spaces: a press documents its options where they are defined."""
    margin = " " * indent
    entries = []
    for item in fields(options):
        spec = item.metadata.get("spec")
        if spec is not None:
            entries.append(
                f"{margin}{item.name} : {spec.describe()}, default {item.default!r}\n"
                + textwrap.fill(
                    spec.help.rstrip(".") + ".", width=120, initial_indent=margin * 2, subsequent_indent=margin * 2
                )
                + "\n"
            )
    return "".join(entries) + margin
