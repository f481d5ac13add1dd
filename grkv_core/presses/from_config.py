"""Presses from configurations, for the CLI, configs and sweeps: an eviction press by name, optionally behind a
merger (``build``, ``BuiltPress``), and press files (``press_from_file``)."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from kvpress import BasePress, ScorerPress
from kvpress import MergingPress as KVPressMergingPress

from grkv_core.catalog import EVICTION_PRESSES, MERGERS, NEEDS_EAGER, NO_MERGER, REFUSES_EAGER
from grkv_core.config import FULL_CACHE, PROTOCOL_SPEC, PressConfig
from grkv_core.option_specs import option_specs
from grkv_core.stream_options import STREAM_PROTOCOLS, DecodingOptions


def _traits(press_name: str) -> frozenset[str]:
    """An eviction press's traits (none for the full cache)."""
    return frozenset() if press_name == FULL_CACHE else EVICTION_PRESSES.check(press_name).traits


def required_attention(press_name: str) -> str | None:
    """The attention implementation a press needs ("eager"), or None when sdpa/flash work."""
    return "eager" if NEEDS_EAGER in _traits(press_name) else None


def refuses_eager(press_name: str) -> bool:
    """Whether a press masks per head through the attention mask, which eager attention ignores (AdaKV)."""
    return REFUSES_EAGER in _traits(press_name)


def merging_types() -> tuple[type, ...]:
    """The classes of every registered merger."""
    return tuple(entry.load() for entry in MERGERS.values())


def protected_window(press: BasePress | None) -> int:
    """How many last prefill positions ``press`` always keeps: the observation window of the eviction press it is
    or wraps (SnapKV's 32 here), 0 for a press without one and for the full cache (which keeps everything)."""
    mergers = merging_types()
    while press is not None:
        window = getattr(press, "window_size", None)
        # NOTE: a merger's ``window_size`` (GRKV's m) is its own surrogate window, not positions its base press keeps.
        if isinstance(window, int) and not isinstance(press, mergers):
            return window
        press = getattr(press, "press", None)
    return 0


def build_press(
    press: str = "snapkv",
    compression_ratio: float = 0.9,
    merge: str = NO_MERGER,
    **merge_options: Any,
) -> BasePress | None:
    """Build an eviction press by name, optionally wrapped by a merger: ``build`` of that ``PressConfig``.

    Parameters
    ----------
    press : str
        "full" (no compression: returns None) or one of ``grkv_core.catalog.EVICTION_PRESSES``.
    compression_ratio : float
        Fraction of the context's KV pairs removed, in [0, 1).
    merge : str
        "none" or one of ``grkv_core.catalog.MERGERS``.
    **merge_options
        Fields of the merger press (e.g. ``lambda_k=1e-2, beta=0.1`` for GRKV).
    """
    return build(PressConfig(press, compression_ratio, merge, merge_options))


def build(config: PressConfig) -> BasePress | None:
    """The press a configuration describes (None for the full cache); its names and options were checked when the
    configuration was made. A bounded one (``decoding``) is the ``MergingDecodingPress`` around the press."""
    if config.press == FULL_CACHE:
        return None
    if config.per_head_cache:
        from grkv_core.presses.per_head_cache import PerHeadCachePress

        return PerHeadCachePress(build(replace(config, per_head_cache=False)))
    if config.bounded:
        from grkv_core.presses.decoding import MergingDecodingPress

        return MergingDecodingPress(build(replace(config, decoding={})), **config.decoding)
    base = EVICTION_PRESSES[config.press].load()(compression_ratio=float(config.compression_ratio))
    if config.merge == NO_MERGER:
        return base
    merger = MERGERS[config.merge].load()
    if merger is KVPressMergingPress and not isinstance(base, ScorerPress):
        raise ValueError(
            f"merge {config.merge!r} (kvpress's MergingPress) takes a kvpress ScorerPress; press "
            f"{config.press!r} ({type(base).__name__}) is not one"
        )
    return merger(press=base, **config.merge_options)


@dataclass(frozen=True)
class BuiltPress:
    """A configuration and the press it describes, built once (on the machine that runs it), with every setting of
    that press (``settings``: what ``resolved`` gives)."""

    config: PressConfig
    press: BasePress | None
    settings: dict[str, Any]

    @classmethod
    def of(cls, config: PressConfig) -> BuiltPress:
        press = build(config)
        settings: dict[str, Any] = {
            "press": config.press,
            "compression_ratio": config.compression_ratio,
            "merge": config.merge,
            "per_head_cache": config.per_head_cache,
        }
        compressing = press.press if config.per_head_cache else press
        if config.bounded:
            settings.update({name: getattr(press, name) for name in option_specs(DecodingOptions)})
            compressing = press.base_press
        eviction = compressing
        if compressing is not None and config.merge != NO_MERGER:
            merger = _scalar_fields(compressing)
            merger.pop("class")
            settings.update(merger)
            eviction = compressing.press
        if eviction is not None:
            settings.update({f"press.{name}": value for name, value in _scalar_fields(eviction).items()})
        return cls(config, press, settings)


def resolved(config: PressConfig) -> dict[str, Any]:
    """Every setting of the press ``config`` builds, flat and JSON-ready: the names and the budget, every field of
    the merger (all of GRKV's options, defaults included), every scalar field of the eviction press under
    ``press.`` (``press.class``, ``press.window_size``...; a wrapped press under ``press.press.``), and for a bounded
    cache every ``DecodingOptions`` field (``target_size``, ``compression_interval``...).

    What MLflow logs and the reports read, so nothing depends on how a sampler encoded its proposals. Builds the
    press: where it is built anyway, take ``BuiltPress.settings``.
    """
    return BuiltPress.of(config).settings


def _scalar_fields(press) -> dict[str, Any]:
    """``{"class": name, field: value}`` for a dataclass press's scalar fields, nested presses prefixed."""
    found: dict[str, Any] = {"class": type(press).__name__}
    for item in fields(press):
        value = getattr(press, item.name)
        if is_dataclass(value):
            found.update({f"{item.name}.{name}": inner for name, inner in _scalar_fields(value).items()})
        elif value is None or isinstance(value, (bool, int, float, str)):
            found[item.name] = value
    return found


# NOTE: a press file holds a ``PressConfig``'s fields but its display label, so the file means exactly what
# the configuration that wrote it means (a bounded cache's sizes under ``decoding``), and optionally the protocol the
# press was chosen under (``PROTOCOL_FIELD``); ``grkv export`` writes one, ``grkv eval --press-config`` reads one.
PROTOCOL_FIELD = "protocol"
PRESS_FILE_FIELDS = (*(item.name for item in fields(PressConfig) if item.name != "variant"), PROTOCOL_FIELD)


def load_press_config(path: str | Path) -> PressConfig:
    """The press configuration of a press file (YAML: ``press``, ``compression_ratio``, ``merge``,
    ``merge_options``, optionally ``decoding`` and ``protocol``), validated; a ValueError (FileNotFoundError if absent)
    names the file and the problem."""
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
        if protocol is not None and protocol not in STREAM_PROTOCOLS:
            PROTOCOL_SPEC.check(PROTOCOL_FIELD, protocol)
        return PressConfig(**data), protocol
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None


def press_from_file(path: str | Path) -> BasePress | None:
    """The ready press a press file describes (None for the full cache), e.g. one ``grkv export`` wrote::

    press = press_from_file("press.yaml")
    with press(model):
        model.model(input_ids=context_ids, past_key_values=cache)

    A file with ``decoding`` (``target_size``, ``compression_interval``...) gives the ``MergingDecodingPress`` that
    keeps a cache bounded with the press behind it.
    """
    return build(load_press_config(path))
