"""One prefill, many presses: every press compresses the same layer inputs into its own cache.

kvpress compresses a layer's cache in a forward hook that runs *after* the layer's attention has used the full
cache, and its hook changes the cache, never the layer's output. So the hidden states of a prefill do not
depend on the press, and one forward can serve any number of presses: around each layer, the full keys and
values are set aside, each press's own hook compresses them in turn, and its result is moved into that press's
cache before the next press sees the full cache again. Base presses configured alike score each layer once
(``grkv_core.presses.selection.sharing_scores``). Each press runs through its own context manager
(``press(model)``), exactly as when it is used alone, so the caches are identical to one prefill per press.

A ``PerHeadCachePress`` shares its press's prefill: its conversion of each layer to each head's kept rows is done on
that press's result (``convert_layers``, what its own hook does), after the forward.

A press that does more than that standard hook (it overrides ``forward_hook`` or, unless it is a
``BaseMergerPress``, ``__call__``, so it might change what the next layer sees) never shares a prefill: it is run
alone, by rule (``shares_prefill``).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from kvpress import BasePress
from transformers import DynamicCache, PreTrainedModel

from grkv_core.cache.per_head import PerHeadLayer
from grkv_core.presses.merging import BaseMergerPress
from grkv_core.presses.per_head_cache import PerHeadCachePress, convert_layers
from grkv_core.presses.selection import sharing_scores
from grkv_core.presses.sliding_layers import compressing, language_model, sliding_layer_indices

# NOTE: state a press leaves on an attention module for the decoding that follows its prefill: kvpress's
# masking presses (AdaKV) mark evicted entries in ``masked_key_indices``, which kvpress's attention patch reads
# at every decoding step; merging presses record ``kept_positions`` for diagnostics. With several presses on
# one model, each press's state is kept with its cache and put back on the modules when that cache is used.
PER_CACHE_MODULE_STATE = ("masked_key_indices", "kept_positions")
# NOTE: a per-head cache keeps its masking press's indices under this name, for diagnostics only (the probe): its
# attention reads none, and kvpress's patch must find none.
PER_HEAD_MASKED = "per_head_masked_key_indices"


def compressing_press(press: BasePress | None) -> BasePress | None:
    """The press that compresses the prefill: ``press``, or the one a ``PerHeadCachePress`` holds."""
    return press.press if isinstance(press, PerHeadCachePress) else press


def shares_prefill(press: BasePress | None) -> bool:
    """Whether ``press`` compresses only through kvpress's standard hook (cache out, layer output untouched).

    That is a kvpress press using ``BasePress``'s own hook and context manager, or a ``BaseMergerPress`` using its
    hook (its context manager may add hooks that observe, by the contract of ``BaseMergerPress``).
    """
    press = compressing_press(press)
    if press is None:
        return True
    kind = type(press)
    if isinstance(press, BaseMergerPress):
        return kind.forward_hook is BaseMergerPress.forward_hook
    return kind.forward_hook is BasePress.forward_hook and kind.__call__ is BasePress.__call__


@dataclass
class PressedCache:
    """The cache one press left after a prefill, with the module state its decoding needs.

    Attributes
    ----------
    cache : DynamicCache
        The compressed cache: per layer (1, H_kv, c, d) keys and values (c may differ between layers).
    module_state : list of dict
        Per layer, the values of ``PER_CACHE_MODULE_STATE`` the press left on that layer's attention module.
    compress_s : float
        Seconds spent in the press's hooks (0 for no press).
    prefill_s : float
        What this press's prefill costs alone: the forward without any press's hooks, plus its own hooks.
    """

    cache: DynamicCache
    module_state: list[dict[str, Any]]
    compress_s: float
    prefill_s: float

    def lengths(self) -> tuple[int, ...]:
        return tuple(layer.keys.shape[2] for layer in self.cache.layers)

    @property
    def per_head(self) -> bool:
        """Whether the cache holds each head's kept rows only (``PerHeadCachePress``)."""
        return any(isinstance(layer, PerHeadLayer) for layer in self.cache.layers)

    @property
    def masked(self) -> bool:
        """Whether a masking press (AdaKV) left evicted entries in place for kvpress's attention patch to hide."""
        return any(state.get("masked_key_indices") is not None for state in self.module_state)

    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.cache.layers)


@dataclass
class SharedPrefill:
    """What a shared prefill produced: the full cache and one ``PressedCache`` per press, in order.

    Attributes
    ----------
    full : list of (torch.Tensor, torch.Tensor)
        Per layer, the uncompressed (1, H_kv, n, d) keys and values.
    pressed : list of PressedCache
    forwards : int
        Forward passes run: 1, plus one per press that could not share it.
    """

    full: list[tuple[torch.Tensor, torch.Tensor]]
    pressed: list[PressedCache]
    forwards: int


def attention_modules(model: PreTrainedModel) -> list:
    """The model's attention modules, one per layer: where kvpress's hooks and the engine's go."""
    return [layer.self_attn for layer in language_model(model).layers]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _FanOut:
    """The hooks around the presses' own: set the full cache aside, then after each press take its result."""

    def __init__(self, model: PreTrainedModel, count: int):
        self.device = model.device
        layers = len(attention_modules(model))
        self.full: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layers
        self.results: list[list[tuple | None]] = [[None] * layers for _ in range(count)]
        self.states: list[list[dict | None]] = [[None] * layers for _ in range(count)]
        self.seconds = [0.0] * count
        self.clock = 0.0

    def set_aside(self, module, args, kwargs, output):
        cache_layer = kwargs["past_key_values"].layers[module.layer_idx]
        self.full[module.layer_idx] = (cache_layer.keys, cache_layer.values)
        for name in PER_CACHE_MODULE_STATE:
            setattr(module, name, None)
        _synchronize(self.device)
        self.clock = time.perf_counter()

    def taker(self, index: int):
        def take(module, args, kwargs, output):
            _synchronize(self.device)
            now = time.perf_counter()
            self.seconds[index] += now - self.clock
            layer = module.layer_idx
            cache_layer = kwargs["past_key_values"].layers[layer]
            self.results[index][layer] = (cache_layer.keys, cache_layer.values)
            self.states[index][layer] = {name: getattr(module, name, None) for name in PER_CACHE_MODULE_STATE}
            for name in PER_CACHE_MODULE_STATE:
                setattr(module, name, None)
            cache_layer.keys, cache_layer.values = self.full[layer]
            self.clock = time.perf_counter()

        return take


def prefill_shared(model: PreTrainedModel, context_ids: torch.Tensor, presses: list[BasePress | None]) -> SharedPrefill:
    """Prefill ``context_ids`` (1, n) once and compress it with every press; ``None`` keeps the full cache.

    Presses that ``shares_prefill`` rejects are each prefilled alone (their own forward), so the result is the
    same whatever the mix.

    NOTE: memory holds the full cache plus every press's compressed cache at once.
    """
    if context_ids.ndim != 2 or context_ids.shape[0] != 1 or context_ids.shape[1] == 0:
        raise ValueError(
            f"context_ids must be (1, n) with n >= 1 (an empty context has nothing to prefill), got shape "
            f"{tuple(context_ids.shape)}"
        )
    if not presses:
        raise ValueError("prefill_shared needs at least one press (None for the full cache)")
    shared = [index for index, press in enumerate(presses) if shares_prefill(press)]
    groups = ([shared] if shared else []) + [[index] for index in range(len(presses)) if index not in shared]
    pressed: list[PressedCache | None] = [None] * len(presses)
    full = None
    for group in groups:
        group_full, group_pressed = _prefill_group(model, context_ids, [presses[index] for index in group])
        full = full or group_full
        for index, cache in zip(group, group_pressed):
            pressed[index] = cache
    return SharedPrefill(full=full, pressed=pressed, forwards=len(groups))


def _prefill_group(model: PreTrainedModel, context_ids: torch.Tensor, presses: list) -> tuple[list, list[PressedCache]]:
    fan_out = _FanOut(model, len(presses))
    handles = []
    with ExitStack() as stack, torch.inference_mode():
        stack.callback(lambda: [handle.remove() for handle in handles])
        stack.enter_context(sharing_scores())
        attentions = attention_modules(model)
        handles += [attention.register_forward_hook(fan_out.set_aside, with_kwargs=True) for attention in attentions]
        for index, press in enumerate(presses):
            stack.enter_context(compressing(compressing_press(press), model))
            handles += [
                attention.register_forward_hook(fan_out.taker(index), with_kwargs=True) for attention in attentions
            ]
        _synchronize(model.device)
        started = time.perf_counter()
        model.model(input_ids=context_ids.to(model.device), past_key_values=DynamicCache())
        _synchronize(model.device)
        forward_s = time.perf_counter() - started - sum(fan_out.seconds)
        caches = [DynamicCache(ddp_cache_data=results) for results in fan_out.results]
        for index, (press, cache) in enumerate(zip(presses, caches)):
            if isinstance(press, PerHeadCachePress):
                converting = time.perf_counter()
                _to_per_head(model, cache, fan_out.states[index])
                _synchronize(model.device)
                fan_out.seconds[index] += time.perf_counter() - converting
    seconds = [spent if press is not None else 0.0 for press, spent in zip(presses, fan_out.seconds)]
    pressed = [
        PressedCache(cache, states, spent, forward_s + spent)
        for cache, states, spent in zip(caches, fan_out.states, seconds)
    ]
    return list(fan_out.full), pressed


def _to_per_head(model: PreTrainedModel, cache: DynamicCache, states: list[dict]) -> None:
    """Each compressed layer of ``cache`` as ``PerHeadCachePress``'s hook leaves it (sliding-window layers whole); the
    masking press's indices stay in ``states`` under ``PER_HEAD_MASKED``, for the probe."""

    def take_masked(index: int) -> tuple | None:
        state = states[index]
        state[PER_HEAD_MASKED] = state.pop("masked_key_indices", None)
        return state[PER_HEAD_MASKED]

    convert_layers(cache, sliding_layer_indices(model), take_masked)
