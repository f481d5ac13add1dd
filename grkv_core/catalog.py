"""What the library offers by name: eviction presses, mergers and surrogate-query policies, each registered once.

Everything that lists them derives from these three registries: the command line's choices, a sweep config's
validation, the options a merger takes (its flags, searchable parameters and MLflow params), the press a
configuration builds and the kvpress compatibility tests. The library's own entries are lazy (a name, the
``"module:attribute"`` that defines it and, for a merger, its options dataclass), so listing and validating them
imports no torch; the object is imported the first time something builds it. A user's own entry registers the object
itself, beside its definition, with nothing else to edit::

    @dataclass
    class ToyOptions:
        strength: float = option(0.5, OptionSpec("how much to merge", float, low=0.0))

    @MERGERS.register("toy", options=ToyOptions)
    @dataclass
    class ToyMerger(BaseMergerPress, ToyOptions): ...

NOTE: imports nothing heavy, like ``grkv_core.options`` and ``grkv_core.config``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from grkv_core.option_specs import option_specs

# The merger name of "no merger": the eviction press alone. NOTE: not an entry (nothing to build), but a valid choice
# wherever a merger is chosen.
NO_MERGER = "none"

# Traits of an eviction press that decide the attention implementation it runs under.
NEEDS_EAGER = "needs_eager"  # reads the attention matrix (H2O)
REFUSES_EAGER = "refuses_eager"  # masks per head through the attention mask (AdaKV), which eager attention ignores


def _resolve(target: Any) -> Any:
    """``target`` itself, or the attribute a ``"module:attribute"`` string names."""
    if not isinstance(target, str):
        return target
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Entry:
    """One registered thing.

    ``target`` is the object (a press class, a press factory, a query-policy class) or the ``"module:attribute"``
    that defines it; ``options`` the same for a merger's options dataclass (its fields are ``OptionSpec`` options),
    None where it takes none; ``traits`` free-form flags (``NEEDS_EAGER``...).
    """

    name: str
    target: Any
    options: Any = None
    traits: frozenset[str] = frozenset()

    def load(self) -> Any:
        return _resolve(self.target)

    def options_type(self) -> type | None:
        return _resolve(self.options)


class Registry(Mapping[str, Entry]):
    """Entries by name, in registration order; a mapping, so ``name in registry`` and ``list(registry)`` (the names)
    work, and argparse and ``OptionSpec`` take it as live choices."""

    def __init__(self, kind: str, entries: tuple[Entry, ...] = ()) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        for entry in entries:
            self._add(entry)

    def _add(self, entry: Entry) -> None:
        if entry.name == NO_MERGER:
            raise ValueError(f"{NO_MERGER!r} means no merger wherever one is chosen; give the {self.kind} another name")
        if entry.name in self._entries:
            raise ValueError(f"{self.kind} {entry.name!r} is already registered")
        self._entries[entry.name] = entry

    def register(self, name: str, target: Any = None, *, options: Any = None, traits: frozenset[str] = frozenset()):
        """Register ``target`` under ``name``; without ``target``, a decorator that registers what it decorates."""
        if target is None:

            def decorate(obj):
                self._add(Entry(name, obj, options, frozenset(traits)))
                return obj

            return decorate
        self._add(Entry(name, target, options, frozenset(traits)))
        return target

    def unregister(self, name: str) -> None:
        self._entries.pop(name)

    def check(self, name: str) -> Entry:
        """The entry of ``name``, or a one-line ValueError listing the valid names."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; choose from {list(self._entries)}")
        return self._entries[name]

    def __getitem__(self, name: str) -> Entry:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return repr(tuple(self._entries))


EVICTION_PRESSES = Registry(
    "press",
    (
        Entry("snapkv", "grkv_core.presses.eviction:snapkv"),
        Entry("pyramidkv", "kvpress:PyramidKVPress"),
        Entry("streamingllm", "kvpress:StreamingLLMPress"),
        Entry("h2o", "kvpress:ObservedAttentionPress", traits=frozenset({NEEDS_EAGER})),
        Entry("expected_attention", "kvpress:ExpectedAttentionPress"),
        Entry("knorm", "kvpress:KnormPress"),
        Entry("criticalkv", "grkv_core.presses.eviction:criticalkv"),
        Entry("adakv", "grkv_core.presses.eviction:adakv", traits=frozenset({REFUSES_EAGER})),
        Entry("criticaladakv", "grkv_core.presses.eviction:criticaladakv", traits=frozenset({REFUSES_EAGER})),
    ),
)
"""Eviction presses: each target is called as ``target(compression_ratio=ratio)`` and returns a kvpress press."""

MERGERS = Registry(
    "merge",
    (
        Entry("grkv", "grkv_core.presses.grkv:GRKVPress", "grkv_core.options:GRKVOptions"),
        Entry("cam", "grkv_core.presses.cam:CaMPress", "grkv_core.options:CaMOptions"),
        Entry("d2o", "grkv_core.presses.d2o:D2OPress", "grkv_core.options:D2OOptions"),
        Entry("asymkv", "grkv_core.presses.asymkv:AsymKVPress"),
        Entry("kvmerger", "grkv_core.presses.kvmerger:KVMergerPress", "grkv_core.options:KVMergerOptions"),
        # NOTE: kvpress's own merger (0.5.4+): each evicted value folded into its most key-similar survivor, keys kept.
        Entry("kvpress_merging", "kvpress:MergingPress", "grkv_core.options:KVPressMergingOptions"),
    ),
)
"""Mergers: each target is called as ``target(press=eviction_press, **options)``."""

QUERY_POLICIES = Registry(
    "query policy",
    (
        Entry("window", "grkv_core.presses.query_policies:WindowQueries"),
        Entry("stratified", "grkv_core.presses.query_policies:StratifiedQueries"),
        Entry("mixture", "grkv_core.presses.query_policies:MixtureQueries"),
        Entry("expected", "grkv_core.presses.query_policies:ExpectedQueries"),
    ),
)
"""GRKV's surrogate-query policies (``GRKVOptions.query_policy``): each target a ``QueryPolicy`` class."""


def _options_type(merge: str) -> type | None:
    """The options dataclass of a merger (None for ``NO_MERGER`` and a merger without options)."""
    return None if merge == NO_MERGER else MERGERS.check(merge).options_type()


def merger_names() -> tuple[str, ...]:
    """Every merger choice: ``NO_MERGER`` and the registered mergers."""
    return (NO_MERGER, *MERGERS)


def merger_option_specs(merge: str) -> dict[str, Any]:
    """``{option: OptionSpec}`` of a merger (none for ``NO_MERGER`` and a merger without options)."""
    options = _options_type(merge)
    return option_specs(options) if options is not None else {}


def merger_option_defaults(merge: str) -> dict[str, Any]:
    """``{option: default}`` of a merger, in the order of its options."""
    options = _options_type(merge)
    return {item.name: item.default for item in fields(options)} if options is not None else {}


def merger_option_names() -> tuple[str, ...]:
    """Each merger option name once, in the mergers' order. NOTE: a name two mergers share means the same kind of
    value in both (``window_size``: GRKV's m and CaM's window), so one spec checks it; a test holds them to that."""
    return tuple(dict.fromkeys(name for merge in MERGERS for name in merger_option_specs(merge)))


def mergers_taking(name: str) -> list[str]:
    """The mergers that have an option ``name``."""
    return [merge for merge in MERGERS if name in merger_option_specs(merge)]


def merger_option_spec(name: str) -> Any:
    """The spec of option ``name``: that of the first merger taking it."""
    return merger_option_specs(mergers_taking(name)[0])[name]
