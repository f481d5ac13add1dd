"""``PerHeadCachePress``: any press's cache left with each head's kept rows only (``grkv_core.cache.per_head``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice

import torch
from kvpress import BasePress, DecodingPress, PrefillDecodingPress
from torch import nn
from transformers.cache_utils import DynamicLayer

from grkv_core.cache.per_head import PerHeadLayer, kept_rows, refuse_eager
from grkv_core.presses.decoding import MergingDecodingPress
from grkv_core.presses.padding import padding_refused
from grkv_core.presses.per_head_decoding import per_head_refusal
from grkv_core.presses.sliding_layers import language_model, sliding_layer_indices, unhook_sliding_layers

PER_HEAD_PADDING = (
    "a per-head cache does not support padded batches: its attention builds a causal mask over each head's rows, "
    "which knows no padding"
)


@dataclass
class PerHeadCachePress(BasePress):
    """Run ``press`` and leave each compressed layer holding, per (batch row, KV head), the rows that head keeps.

    A head-adaptive press (kvpress's ``AdaKVPress``, ``CriticalAdaKVPress``, or a merger behind one) keeps a different
    number of tokens in each head; kvpress keeps every row and masks the evicted ones, so the cache's memory is the
    full cache's. Behind this press, at the end of each layer's prefill, the layer becomes a ``PerHeadLayer`` of the
    kept rows only (the merged ones, behind a merger) and its mask is dropped; attention then runs over each head's
    rows (``grkv_core.cache.per_head_attention``), giving the masked layout's answers. A press that keeps the same
    count in every head gives the uniform case. Sliding-window layers stay whole, as under every press here.

    A cache bounded while decoding works on it too: ``press`` may be a ``MergingDecodingPress`` around an eviction
    press, or kvpress's ``PrefillDecodingPress`` with one as its decoding press (behind any prefill press, AdaKV's
    among them); every ``compression_interval`` tokens each head is brought back to ``target_size`` rows of its own
    (``grkv_core.presses.per_head_decoding``).

    Parameters
    ----------
    press : BasePress
        The press that compresses the prefill (any prefill press of kvpress or of this package), or one of the
        decoding presses above.

    Raises
    ------
    ValueError
        When built: ``press`` is kvpress's ``DecodingPress`` (its compression gathers one count of rows in every head),
        or a decoding press whose base press cannot bound a per-head cache (``per_head_refusal``). When it enters a
        model: eager attention (transformers calls it directly, not through the attention interface this serves). In
        a forward: a padded batch, a cache whose layers are not ``DynamicLayer`` (quantized caches).
    """

    press: BasePress

    def __post_init__(self) -> None:
        if not isinstance(self.press, BasePress):
            raise ValueError(f"press must be a kvpress press, got {type(self.press).__name__}")
        decoding = self.press.decoding_press if isinstance(self.press, PrefillDecodingPress) else self.press
        if isinstance(decoding, MergingDecodingPress):
            reason = per_head_refusal(decoding.base_press)
            if reason is not None:
                raise ValueError(f"per_head_cache: {reason}")
        elif isinstance(decoding, DecodingPress):
            raise ValueError(
                f"per_head_cache: kvpress's {type(decoding).__name__} keeps one count of rows in every head, which a "
                "per-head cache does not hold; use MergingDecodingPress(<eviction press>, target_size=..., "
                "compression_interval=...)"
            )

    @property
    def compression_ratio(self) -> float:
        return self.press.compression_ratio

    @compression_ratio.setter
    def compression_ratio(self, value: float) -> None:
        self.press.compression_ratio = value

    def post_init_from_model(self, model) -> None:
        self.press.post_init_from_model(model)

    @contextmanager
    def __call__(self, model):
        refuse_eager(model)
        decoder = language_model(model)
        with padding_refused(model, PER_HEAD_PADDING), self.press(model):
            unhook_sliding_layers(self.press, model)
            handle = decoder.register_forward_hook(self.forward_hook, with_kwargs=True)
            try:
                yield
            finally:
                handle.remove()

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output):
        """After the decoder's forward: each layer still in kvpress's layout (its prefill) becomes a
        ``PerHeadLayer``.

        NOTE: after the whole forward, not after each layer's attention: a merger may finish a layer's merge later in
        the forward, in place (``grkv_core.presses.layer_groups``), and the per-head layer is a copy.
        """
        cache = output.past_key_values
        if cache is not None:
            attentions = [layer.self_attn for layer in module.layers]
            convert_layers(cache, sliding_layer_indices(module), lambda index: _taken(attentions[index]))
        return output


def _taken(attention: nn.Module) -> tuple | None:
    """The attention module's ``masked_key_indices``, cleared there (a per-head layer's attention reads none)."""
    masked = getattr(attention, "masked_key_indices", None)
    attention.masked_key_indices = None
    return masked


def convert_layers(cache, sliding: frozenset[int], take_masked: Callable[[int], tuple | None]) -> None:
    """Each layer of ``cache`` still in kvpress's layout, sliding-window ones aside, as a ``PerHeadLayer``;
    ``take_masked(index)`` gives that layer's ``masked_key_indices`` (None: nothing masked).

    NOTE: every layer's per-head counts reach the host in one read (one device synchronisation per prefill).
    """
    converted = {}
    for index, layer in enumerate(cache.layers):
        if index in sliding or isinstance(layer, PerHeadLayer):
            continue
        if type(layer) is not DynamicLayer:
            raise ValueError(
                f"per_head_cache replaces a DynamicCache's layers; this cache's layer {index} is a "
                f"{type(layer).__name__} (use a DynamicCache)"
            )
        converted[index] = kept_rows(layer.keys, take_masked(index))
    if not converted:
        return
    counts = iter(torch.cat([kept.sum(dim=-1).flatten() for kept in converted.values()]).tolist())
    for index, kept in converted.items():
        lengths = tuple(islice(counts, kept.shape[0] * kept.shape[1]))
        layer = cache.layers[index]
        cache.layers[index] = PerHeadLayer.from_kept(layer.keys, layer.values, kept, lengths)
