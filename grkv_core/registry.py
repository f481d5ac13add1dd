"""Presses by name, for the CLI, configs and sweeps: an eviction press, optionally behind a merger."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

import yaml

from kvpress import (
    AdaKVPress,
    BasePress,
    CriticalAdaKVPress,
    CriticalKVPress,
    ExpectedAttentionPress,
    KnormPress,
    ObservedAttentionPress,
    PyramidKVPress,
    ScorerPress,
    SnapKVPress,
    StreamingLLMPress,
)
from kvpress import MergingPress as KVPressMergingPress

from grkv_core.config import PAPER_WINDOW, PROTOCOL_SPEC, OptionSpec, PressConfig
from grkv_core.presses import AsymKVPress, CaMPress, D2OPress, GRKVPress, KVMergerPress

# NOTE: the paper pairs GRKV with SnapKV's 32-token observation window and pooling kernel 5 (Sec. 4.1, "as in
# prior KV-cache eviction methods"; the authors' code: window 32, kernel 5), so SnapKV and the presses built
# on it (CriticalKV, AdaKV, CriticalAdaKV) use it here instead of kvpress's window of 64. The paper gives no
# window for PyramidKV, which keeps kvpress's default.
PAPER_SNAPKV_WINDOW = dict(window_size=PAPER_WINDOW, kernel_size=5)


def _snapkv(ratio: float) -> SnapKVPress:
    return SnapKVPress(compression_ratio=ratio, **PAPER_SNAPKV_WINDOW)


EVICTION_PRESSES: dict[str, Callable[[float], BasePress]] = {
    "snapkv": _snapkv,
    "pyramidkv": lambda ratio: PyramidKVPress(compression_ratio=ratio),
    "streamingllm": lambda ratio: StreamingLLMPress(compression_ratio=ratio),
    "h2o": lambda ratio: ObservedAttentionPress(compression_ratio=ratio),
    "expected_attention": lambda ratio: ExpectedAttentionPress(compression_ratio=ratio),
    "knorm": lambda ratio: KnormPress(compression_ratio=ratio),
    "criticalkv": lambda ratio: CriticalKVPress(_snapkv(ratio)),
    "adakv": lambda ratio: AdaKVPress(_snapkv(ratio)),
    "criticaladakv": lambda ratio: CriticalAdaKVPress(_snapkv(ratio)),
}

# NOTE: presses that read the attention matrix need eager attention; masking presses refuse it.
EAGER_ONLY = frozenset({"h2o"})
NOT_EAGER = frozenset({"adakv", "criticaladakv"})

MERGERS: dict[str, type[BasePress] | None] = {
    "none": None,
    "grkv": GRKVPress,
    "cam": CaMPress,
    "d2o": D2OPress,
    "asymkv": AsymKVPress,
    "kvmerger": KVMergerPress,
    # NOTE: kvpress's own merger (0.5.4+): each evicted value folded into its most key-similar survivor, keys kept.
    "kvpress_merging": KVPressMergingPress,
}

# NOTE: kvpress's MergingPress checks its options with asserts and takes a ScorerPress only; these specs (and
# build_press's base check) refuse bad values in one line, as our mergers do.
MERGER_OPTION_SPECS: dict[str, dict[str, OptionSpec]] = {
    "kvpress_merging": {
        "similarity_threshold": OptionSpec("minimum key cosine similarity of an evicted token to its survivor for its "
                                           "value to be merged", float, low=0.0, high=1.0),
        "merge_fraction": OptionSpec("fraction of the evicted tokens, most similar first, whose values are merged",
                                     float, low=0.0, high=1.0, low_open=True),
    },
}


# NOTE: a merger's ``window_size`` (GRKV's m) is its own surrogate window, not positions its base press keeps.
MERGING_TYPES = tuple(merger for merger in MERGERS.values() if merger is not None)


def merger_option_names(merge: str) -> list[str]:
    """The options of a merger by name: its fields but the base press and the budget (the base press's)."""
    merger = MERGERS[merge]
    return [item.name for item in fields(merger) if item.name not in ("press", "compression_ratio")] if merger else []


def required_attention(press_name: str) -> str | None:
    """The attention implementation a press needs ("eager"), or None when sdpa/flash work."""
    return "eager" if press_name in EAGER_ONLY else None


def protected_window(press: BasePress | None) -> int:
    """How many last prefill positions ``press`` always keeps: the observation window of the eviction press it is
    or wraps (SnapKV's 32 here), 0 for a press without one and for the full cache (which keeps everything)."""
    while press is not None:
        window = getattr(press, "window_size", None)
        if isinstance(window, int) and not isinstance(press, MERGING_TYPES):
            return window
        press = getattr(press, "press", None)
    return 0


def build_press(
    press: str = "snapkv",
    compression_ratio: float = 0.9,
    merge: str = "none",
    **merge_options: Any,
) -> BasePress | None:
    """Build an eviction press by name, optionally wrapped by a merger.

    Parameters
    ----------
    press : str
        "full" (no compression: returns None) or one of ``EVICTION_PRESSES``.
    compression_ratio : float
        Fraction of the context's KV pairs removed, in [0, 1).
    merge : str
        "none" or one of ``MERGERS``.
    **merge_options
        Fields of the merger press (e.g. ``lambda_k=1e-2, beta=0.1`` for GRKV).
    """
    if press == "full":
        if merge != "none" or merge_options:
            raise ValueError("press 'full' keeps the whole cache: it takes no merger or merger options")
        return None
    if press not in EVICTION_PRESSES:
        raise ValueError(f"unknown press {press!r}; choose from {['full', *EVICTION_PRESSES]}")
    if not isinstance(compression_ratio, (int, float)) or not 0 <= compression_ratio < 1:
        raise ValueError(f"compression_ratio must be in [0, 1), got {compression_ratio!r}")
    if merge not in MERGERS:
        raise ValueError(f"unknown merge {merge!r}; choose from {list(MERGERS)}")
    base = EVICTION_PRESSES[press](float(compression_ratio))
    merger = MERGERS[merge]
    if merger is None:
        if merge_options:
            raise ValueError(f"merge 'none' takes no options, got {sorted(merge_options)}")
        return base
    allowed = set(merger_option_names(merge))
    unknown = set(merge_options) - allowed
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} for merge {merge!r}; valid: {sorted(allowed)}")
    for name, spec in MERGER_OPTION_SPECS.get(merge, {}).items():
        if name in merge_options:
            spec.check(name, merge_options[name])
    if merger is KVPressMergingPress and not isinstance(base, ScorerPress):
        raise ValueError(f"merge {merge!r} (kvpress's MergingPress) takes a kvpress ScorerPress; press {press!r} "
                         f"({type(base).__name__}) is not one")
    return merger(press=base, **merge_options)


# NOTE: a press file holds a ``PressConfig``'s fields but its display label, so the file means exactly what
# the configuration that wrote it means, and optionally the protocol the press was chosen under
# (``PROTOCOL_FIELD``); ``grkv export`` writes one, ``grkv eval --press-config`` reads one.
PROTOCOL_FIELD = "protocol"
PRESS_FILE_FIELDS = (*(item.name for item in fields(PressConfig) if item.name != "variant"), PROTOCOL_FIELD)


def load_press_config(path: str | Path) -> PressConfig:
    """The press configuration of a press file (YAML: ``press``, ``compression_ratio``, ``merge``,
    ``merge_options``, optionally ``protocol``), validated; a ValueError (FileNotFoundError if absent) names the file
    and the problem."""
    return load_press_file(path)[0]


def load_press_file(path: str | Path) -> tuple[PressConfig, str | None]:
    """A press file's press configuration and the protocol it names (None if it names none); see
    ``load_press_config``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"press file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        raise ValueError(f"{path}: not valid YAML") from None
    if not isinstance(data, dict) or "press" not in data:
        raise ValueError(f"{path}: expected a mapping with at least 'press' (fields: {list(PRESS_FILE_FIELDS)})")
    unknown = sorted(set(data) - set(PRESS_FILE_FIELDS))
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {unknown}; a press file has {list(PRESS_FILE_FIELDS)}")
    if not isinstance(data.get("merge_options", {}), dict):
        raise ValueError(f"{path}: merge_options must be a mapping of option: value")
    protocol = data.pop(PROTOCOL_FIELD, None)
    try:
        if protocol is not None:
            PROTOCOL_SPEC.check(PROTOCOL_FIELD, protocol)
        return PressConfig(**data), protocol
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None


def press_from_file(path: str | Path) -> BasePress | None:
    """The ready press a press file describes (None for the full cache), e.g. one ``grkv export`` wrote::

        press = press_from_file("press.yaml")
        with press(model):
            model.model(input_ids=context_ids, past_key_values=cache)
    """
    return load_press_config(path).build()
