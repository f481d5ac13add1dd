"""The configurations, as plain validated data: what compresses the cache (``PressConfig``), what an evaluation runs
(``EvalConfig``) and what a bounded-cache evaluation runs (``StreamConfig``), with the protocols and the other choices
they name.

A configuration checks its names against the catalog (``grkv_core.catalog``) and its merger options against their
specs (``grkv_core.options``) when it is made, so a bad one fails in one line before anything is loaded; a press is
built from it by ``grkv_core.presses.from_config.build``.

NOTE: this module imports nothing heavy (no torch, kvpress or transformers), so validating a sweep config or
parsing a command line stays instant.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from grkv_core.catalog import (
    EVICTION_PRESSES,
    MERGERS,
    NEEDS_EAGER,
    NO_MERGER,
    merger_option_defaults,
    merger_option_specs,
)
from grkv_core.option_specs import OptionSpec, option_specs
from grkv_core.options import PAPER_WINDOW
from grkv_core.stream_options import STREAM_NLL, STREAM_PROTOCOL_SPEC, DecodingOptions, check_decoding

FULL_CACHE = "full"
# "ruler": the offline generator; "ruler-hub": simonjegou/ruler; "longbench": Xnhyacinth/LongBench (both hub
# copies pinned to a revision).
DATASETS = ("ruler", "ruler-hub", "longbench")
DTYPES = ("auto", "bfloat16", "float16", "float32", "float64")  # float64: a numerical reference, on the CPU
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

PER_HEAD_CACHE_SPEC = OptionSpec(
    "keep each head's kept rows only (real memory for head-adaptive presses such as AdaKV) instead of kvpress's "
    "masked layout, which keeps every row",
    bool,
)

COMPRESSION_RATIO_SPEC = OptionSpec(
    "fraction of the context's KV pairs removed", float, low=0.0, high=1.0, high_open=True
)


@dataclass(frozen=True)
class PressConfig:
    """What compresses the cache: an eviction press by name, its budget, and an optional merger.

    ``decoding`` (``DecodingOptions``: ``target_size``, ``compression_interval``...) makes it a bounded cache: the press
    is built into a ``MergingDecodingPress`` that brings the cache back to its target every interval, and
    ``compression_ratio`` is unused (the decoding press sets it at each compression). Empty: a prefill press.

    ``per_head_cache`` leaves each compressed layer with each head's kept rows only (``PerHeadCachePress``): what a
    head-adaptive press (AdaKV) really saves, where kvpress masks the evicted rows and keeps them in memory.
    """

    press: str = "snapkv"
    compression_ratio: float = 0.9
    merge: str = NO_MERGER
    merge_options: dict[str, Any] = field(default_factory=dict)
    variant: str | None = None
    decoding: dict[str, Any] = field(default_factory=dict)
    per_head_cache: bool = False

    def __post_init__(self) -> None:
        """Check every name and option against its spec (nothing is built, nothing heavy imported)."""
        PER_HEAD_CACHE_SPEC.check("per_head_cache", self.per_head_cache)
        if self.press == FULL_CACHE:
            if self.merge != NO_MERGER or self.merge_options or self.decoding or self.per_head_cache:
                raise ValueError(
                    "press 'full' keeps the whole cache: it takes no merger, merger, decoding or per_head_cache options"
                )
            return
        check_decoding(self.decoding)
        if self.decoding and self.per_head_cache:
            raise ValueError(
                "per_head_cache is for prefill presses: a bounded cache (decoding options) holds each head's own rows "
                "under press 'adakv' by itself, and one count in every head under the others"
            )
        if self.press not in EVICTION_PRESSES:
            raise ValueError(f"unknown press {self.press!r}; choose from {[FULL_CACHE, *EVICTION_PRESSES]}")
        if self.per_head_cache and NEEDS_EAGER in EVICTION_PRESSES[self.press].traits:
            raise ValueError(
                f"per_head_cache needs sdpa or flash attention; press {self.press!r} needs eager attention"
            )
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
        behaviour) changes no configuration's canonical form; so is an empty ``decoding`` (a prefill press's form is
        what it was before bounded caches).
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
            **({"decoding": dict(sorted(self.decoding.items()))} if self.decoding else {}),
            **({"per_head_cache": True} if self.per_head_cache else {}),
        }

    @property
    def bounded(self) -> bool:
        """A bounded cache (``decoding`` set), kept at its target while the text streams."""
        return bool(self.decoding)

    @property
    def label(self) -> str:
        """``snapkv 10% + grkv`` (the fraction kept), or for a bounded cache ``snapkv 512 + grkv`` (its size in
        tokens; ``snapkv 10%/stream`` with ``target_compression_ratio``)."""
        if self.press == FULL_CACHE:
            return FULL_CACHE
        budget = f"{1 - self.compression_ratio:.0%}"
        if self.bounded:
            ratio = self.decoding.get("target_compression_ratio")
            size = self.decoding.get("target_size", DecodingOptions.target_size)
            budget = f"{1 - ratio:.0%}/stream" if ratio is not None else f"{size}"
        merger = "" if self.merge == NO_MERGER else f" + {self.variant or self.merge}"
        layout = " (per-head)" if self.per_head_cache else ""
        return f"{self.press} {budget}{merger}{layout}"


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


def stream_min_tokens(protocol: str, max_tokens: int) -> int:
    """The shortest text a bounded-cache evaluation keeps: ``stream_nll``'s long texts of at least 4,096 tokens (or
    ``max_tokens`` when smaller), any benchmark context for ``stream_answer``."""
    return min(4096, max_tokens) if protocol == STREAM_NLL else 1


@dataclass(frozen=True)
class StreamConfig:
    """Everything that determines a bounded-cache evaluation's results (and so whether it can be resumed).

    ``press`` names the base press and merger (its ``compression_ratio`` is unused: the cache's size is
    ``target_size``, brought back every ``compression_interval`` tokens). ``source``: a long-text domain
    (``grkv_core.datasets.long_texts.LONG_TEXT_DOMAINS``) for ``stream_nll``, a dataset (``ruler``...) for
    ``stream_answer``; ``split`` the long texts' (``eval`` for reports, ``tune`` for sweeps); ``max_tokens`` cuts
    each text (and is RULER's context length). ``prefill_tokens``: None prefills ``target_size`` tokens.
    """

    protocol: str = STREAM_NLL
    press: PressConfig = field(default_factory=lambda: PressConfig("streamingllm", 0.0))
    target_size: int = 512
    compression_interval: int = 128
    model: str = "smollm2-135m"
    source: str = "essays"
    split: str = "eval"
    samples: int = 3
    min_tokens: int = 4096
    max_tokens: int = 8192
    prefill_tokens: int | None = None
    tasks: tuple[str, ...] | None = None
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"
    data_dir: str | None = None

    def __post_init__(self) -> None:
        STREAM_PROTOCOL_SPEC.check("protocol", self.protocol)
        for name in ("target_size", "compression_interval"):
            option_specs(DecodingOptions)[name].check(name, getattr(self, name))
        if self.press.bounded:
            raise ValueError(
                "a StreamConfig's press takes no decoding: its cache is bounded by the config's target_size and "
                "compression_interval (StreamConfig.with_press reads them from a bounded press)"
            )
        if self.samples < 1 or self.min_tokens < 1 or self.max_tokens < self.min_tokens:
            raise ValueError(
                f"samples and min_tokens must be >= 1 and max_tokens >= min_tokens, got {self.samples}, "
                f"{self.min_tokens}, {self.max_tokens}"
            )

    @property
    def bounded_press(self) -> PressConfig:
        """The press as it streams: the base press and merger kept at ``target_size`` every ``compression_interval``
        tokens (the full cache as it is)."""
        if self.press.press == FULL_CACHE:
            return self.press
        sizes = {"target_size": self.target_size, "compression_interval": self.compression_interval}
        return replace(self.press, compression_ratio=0.0, decoding=sizes)

    def with_press(self, press: PressConfig) -> StreamConfig:
        """This evaluation with a bounded ``press`` (its target size and interval, the config's where it names none;
        a sweep's trial) or the full cache."""
        other = set(press.decoding) - {"target_size", "compression_interval"}
        if other:
            raise ValueError(f"a bounded-cache evaluation sets target_size and compression_interval only, not {other}")
        return replace(
            self,
            press=replace(press, decoding={}),
            target_size=press.decoding.get("target_size", self.target_size),
            compression_interval=press.decoding.get("compression_interval", self.compression_interval),
        )

    @property
    def label(self) -> str:
        return self.bounded_press.label

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StreamConfig:
        data = {**data, "press": PressConfig(**data.get("press", {}))}
        if data.get("tasks") is not None:
            data["tasks"] = tuple(data["tasks"])
        return cls(**data)
