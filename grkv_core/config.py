"""The configurations, as plain validated data: what compresses the cache (``PressConfig``) and what an evaluation
runs (``EvalConfig``), with the protocols and the other choices they name.

A configuration checks its names against the catalog (``grkv_core.catalog``) and its merger options against their
specs (``grkv_core.options``) when it is made, so a bad one fails in one line before anything is loaded; a press is
built from it by ``grkv_core.presses.from_config.build``.

NOTE: this module imports nothing heavy (no torch, kvpress or transformers), so validating a sweep config or
parsing a command line stays instant.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from grkv_core.catalog import EVICTION_PRESSES, MERGERS, NO_MERGER, merger_option_defaults, merger_option_specs
from grkv_core.options import PAPER_WINDOW, OptionSpec

FULL_CACHE = "full"
# "ruler": the offline generator; "ruler-hub": simonjegou/ruler; "longbench": Xnhyacinth/LongBench (both hub
# copies pinned to a revision).
DATASETS = ("ruler", "ruler-hub", "longbench")
DTYPES = ("auto", "bfloat16", "float16", "float32")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
DEVICES = ("auto", "cpu", "cuda")


# The evaluation protocols (kvpress's): the context compressed alone, then the question appended to the
# compressed cache (kvpress's pipeline), or the question compressed together with the context (kvpress's
# evaluation ``query_aware``: context + question is the prefill, only the chat template's tail and the answer
# prefix follow), so the press's observation window and GRKV's surrogate queries are the question's.
QUESTION_AGNOSTIC = "question_agnostic"
QUERY_AWARE = "query_aware"
PROTOCOLS = (QUESTION_AGNOSTIC, QUERY_AWARE)

# What a prefill holds (``PROTOCOLS``): checked wherever a protocol enters (configs, the evaluator, press files).
PROTOCOL_SPEC = OptionSpec(
    "the evaluation protocol: the context compressed alone (kvpress's pipeline) or with "
    "its question (kvpress's evaluation query_aware)",
    str,
    choices=PROTOCOLS,
)

COMPRESSION_RATIO_SPEC = OptionSpec(
    "fraction of the context's KV pairs removed", float, low=0.0, high=1.0, high_open=True
)


@dataclass(frozen=True)
class PressConfig:
    """What compresses the cache: an eviction press by name, its budget, and an optional merger."""

    press: str = "snapkv"
    compression_ratio: float = 0.9
    merge: str = NO_MERGER
    merge_options: dict[str, Any] = field(default_factory=dict)
    variant: str | None = None

    def __post_init__(self) -> None:
        """Check every name and option against its spec (nothing is built, nothing heavy imported)."""
        if self.press == FULL_CACHE:
            if self.merge != NO_MERGER or self.merge_options:
                raise ValueError("press 'full' keeps the whole cache: it takes no merger or merger options")
            return
        if self.press not in EVICTION_PRESSES:
            raise ValueError(f"unknown press {self.press!r}; choose from {[FULL_CACHE, *EVICTION_PRESSES]}")
        COMPRESSION_RATIO_SPEC.check("compression_ratio", self.compression_ratio)
        if self.merge != NO_MERGER:
            MERGERS.check(self.merge)
        specs = merger_option_specs(self.merge)
        unknown = set(self.merge_options) - set(specs)
        if unknown:
            valid = f"valid: {sorted(specs)}" if specs else "it takes none"
            raise ValueError(f"unknown option(s) {sorted(unknown)} for merge {self.merge!r}; {valid}")
        for name, value in self.merge_options.items():
            specs[name].check(name, value)

    def canonical(self) -> dict[str, Any]:
        """One form per press: the names, the budget, and the merger options off the merger's defaults, a float
        option's value as a float (λ = 1 and 1.0 are one press). It identifies a configuration without building it
        (a sweep's ledger, a checkpoint's name).

        NOTE: an option at its default is left out, so an option added later (at a default that keeps the old
        behaviour) changes no configuration's canonical form.
        """
        defaults, specs = merger_option_defaults(self.merge), merger_option_specs(self.merge)
        options = {
            name: float(value) if specs[name].kind is float and value is not None else value
            for name, value in self.merge_options.items()
        }
        return {
            "press": self.press,
            "compression_ratio": float(self.compression_ratio),
            "merge": self.merge,
            **{name: value for name, value in options.items() if value != defaults[name]},
        }

    @property
    def label(self) -> str:
        if self.press == FULL_CACHE:
            return FULL_CACHE
        budget = f"{1 - self.compression_ratio:.0%}"
        merger = "" if self.merge == NO_MERGER else f" + {self.variant or self.merge}"
        return f"{self.press} {budget}{merger}"


@dataclass(frozen=True)
class EvalConfig:
    """Everything that determines an evaluation's results (and so whether a run can be resumed).

    ``loss_window`` is the number of last prompt positions whose queries measure the window discrepancy,
    and ``heldout_tokens`` the number of first generated tokens whose queries measure the held-out one.
    ``protocol`` is one of ``PROTOCOLS``; files written before it existed were question-agnostic.
    ``decode``: answers are generated and scored; False: only what needs no generation (the reference answer's
    metrics, the window and question losses, the costs of the prefill), about a tenth of the time.
    NOTE: ``loss_window`` is the probe's, not the press's surrogate window (GRKV's ``window_size``, m): it
    stays fixed while a sweep searches m, so every trial's window loss is measured on the same queries.
    """

    model: str = "smollm2-135m"
    dataset: str = "ruler"
    tasks: tuple[str, ...] | None = None
    context_length: int | None = 2048
    samples: int = 5
    seed: int = 0
    press: PressConfig = field(default_factory=PressConfig)
    dtype: str = "auto"
    attn_implementation: str | None = None
    device: str = "auto"
    data_dir: str | None = None
    loss_window: int = PAPER_WINDOW
    heldout_tokens: int = 8
    protocol: str = QUESTION_AGNOSTIC
    decode: bool = True

    def __post_init__(self) -> None:
        PROTOCOL_SPEC.check("protocol", self.protocol)
        if not isinstance(self.decode, bool):
            raise ValueError(f"decode must be True or False, got {self.decode!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> EvalConfig:
        known = {f.name for f in fields(cls)} | {"window_size"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown evaluation config field(s): {sorted(unknown)}")
        data = dict(data)
        if "window_size" in data:  # NOTE: result files written before the rename (same meaning)
            data["loss_window"] = data.pop("window_size")
        data["press"] = PressConfig(**data.get("press", {}))
        if data.get("tasks") is not None:
            data["tasks"] = tuple(data["tasks"])
        return cls(**data)

    def resume_key(self) -> dict:
        """The fields a resumed run must share with the stored one (more samples may be added)."""
        key = self.to_dict()
        key.pop("samples")
        key["tasks"] = list(key["tasks"]) if key["tasks"] is not None else None
        return key
