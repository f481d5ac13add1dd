"""The project's vocabulary, defined once: names, GRKV's options with their checks, the paper's defaults, and
the press and evaluation configurations.

Everything else derives from this module: ``GRKVPress`` takes its fields from ``GRKVOptions``, the ``grkv``
command line builds one flag per option, a sweep's searchable parameters and their validation come from
``GRKV_OPTION_SPECS``, and MLflow logs the resolved options. A new GRKV option added here is reachable from the
command line and from a sweep config without touching either.

NOTE: this module imports nothing heavy (no torch, kvpress or transformers), so validating a sweep config or
parsing a command line stays instant; presses are built from a ``PressConfig`` by ``grkv_core.registry.build``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from grkv_core.options import (
    MERGER_OPTION_NAMES,
    MERGER_OPTION_SPECS,
    PAPER_WINDOW,
    OptionSpec,
    mergers_taking,
)

# Names: the registry (grkv_core.registry) maps each to its implementation; a test checks the two agree.
EVICTION_PRESS_NAMES = (
    "snapkv",
    "pyramidkv",
    "streamingllm",
    "h2o",
    "expected_attention",
    "knorm",
    "criticalkv",
    "adakv",
    "criticaladakv",
)
FULL_CACHE = "full"
MERGER_NAMES = ("none", "grkv", "cam", "d2o", "asymkv", "kvmerger", "kvpress_merging")
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

# A sweep searches the budget and every merger's options (each applied to the mergers that take it).
COMPRESSION_RATIO_SPEC = OptionSpec(
    "fraction of the context's KV pairs removed", float, low=0.0, high=1.0, high_open=True
)
SEARCHABLE_SPECS: dict[str, OptionSpec] = {
    "compression_ratio": COMPRESSION_RATIO_SPEC,
    **{name: MERGER_OPTION_SPECS[mergers_taking(name)[0]][name] for name in MERGER_OPTION_NAMES},
}


@dataclass(frozen=True)
class PressConfig:
    """What compresses the cache: an eviction press by name, its budget, and an optional merger."""

    press: str = "snapkv"
    compression_ratio: float = 0.9
    merge: str = "none"
    merge_options: dict[str, Any] = field(default_factory=dict)
    variant: str | None = None

    def __post_init__(self) -> None:
        """Check every name and option against its spec (nothing is built, nothing heavy imported)."""
        if self.press == FULL_CACHE:
            if self.merge != "none" or self.merge_options:
                raise ValueError("press 'full' keeps the whole cache: it takes no merger or merger options")
            return
        if self.press not in EVICTION_PRESS_NAMES:
            raise ValueError(f"unknown press {self.press!r}; choose from {[FULL_CACHE, *EVICTION_PRESS_NAMES]}")
        COMPRESSION_RATIO_SPEC.check("compression_ratio", self.compression_ratio)
        if self.merge not in MERGER_NAMES:
            raise ValueError(f"unknown merge {self.merge!r}; choose from {list(MERGER_NAMES)}")
        specs = MERGER_OPTION_SPECS[self.merge]
        unknown = set(self.merge_options) - set(specs)
        if unknown:
            valid = f"valid: {sorted(specs)}" if specs else "it takes none"
            raise ValueError(f"unknown option(s) {sorted(unknown)} for merge {self.merge!r}; {valid}")
        for name, value in self.merge_options.items():
            specs[name].check(name, value)

    @property
    def label(self) -> str:
        if self.press == FULL_CACHE:
            return FULL_CACHE
        budget = f"{1 - self.compression_ratio:.0%}"
        merger = "" if self.merge == "none" else f" + {self.variant or self.merge}"
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


def parse_merge_variant(text: str) -> tuple[str, str, dict]:
    """``NAME=MERGE[:key=value,...]`` -> (name, merger, options); values parsed as JSON where they can be."""
    name, _, spec = text.partition("=")
    merge, _, option_text = spec.partition(":")
    if not name or not merge:
        raise ValueError(f"--merge-variant {text!r}: expected NAME=MERGE[:key=value,...]")
    options = {}
    for item in filter(None, option_text.split(",")):
        key, separator, value = item.partition("=")
        if not separator:
            raise ValueError(f"--merge-variant {text!r}: option {item!r} is not key=value")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return name, merge, options
