"""The base of every merging press: it wraps an eviction press and owns the ``compress`` template.

A merging press keeps the tokens its base press chooses and merges the evicted ones into them. The template
(``MergingPress.compress``) runs the base press's selection, then the press's own ``merge_selected`` step: once
for the whole layer with a uniform budget (the cache is physically compacted), else once per (batch, head)
with per-head budgets (kvpress masks the evicted entries; the merged kept rows are written back in place).
A press supplies only ``merge_selected`` and, when its merge reads more than the cache (surrogate queries,
attention weights), ``layer_context`` and ``head_context``.

Composition with kvpress's wrappers: a merger wraps its base press, never the other way round (kvpress's
wrappers accept only a ``ScorerPress`` and refuse a merger when they are built). As the base,
``PerLayerCompressionPress`` (per-layer ratios) and ``ChunkPress`` work; around a merger,
``ComposedPress([merger, ...])`` (the merger first) and ``PrefillDecodingPress(prefilling_press=merger, ...)``
work. The other wrappers are refused with the reason (``selection.unsupported_base_press_reason``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from kvpress import BasePress
from torch import nn

from grkv_core.config import is_number
from grkv_core.presses.selection import (SUPPORTED_BASE_PRESSES, TokenSelection, compression_ratio_of, select_tokens,
                                         unsupported_base_press_reason)


@dataclass
class MergingPress(BasePress):
    """Base of every press that keeps a base eviction press's tokens and merges the evicted ones into them.

    It owns the base press (validates it, forwards model set-up, exposes its ``compression_ratio``) and the
    ``compress`` template; subclasses implement ``merge_selected`` (and ``layer_context``/``head_context`` when
    their merge reads more than the cache).

    NOTE: a merged cache no longer reveals which positions its rows came from; with a uniform budget a
    merging press records them as ``module.kept_positions`` (B, H_kv, c) for diagnostics.

    NOTE: with a uniform budget the merged rows come in increasing position order (``module.kept_positions``),
    while kvpress's ``ScorerPress`` leaves the rows it keeps in its top-k (score) order. Both caches hold the same
    kept tokens; attention does not depend on the order of the cached rows (the keys carry their positions), so
    align rows by position, not by index, to compare a merged cache with kvpress's eviction.

    NOTE: a merging press changes the cache, never the forward: hooks a subclass adds in ``__call__`` only observe,
    and keep what they observe on the press, not on the shared modules. The trial engine relies on it to let
    several presses share one prefill (``grkv_core.shared_prefill``).

    Parameters
    ----------
    press : BasePress
        The eviction press (SnapKV, PyramidKV, StreamingLLM, ObservedAttention, ExpectedAttention, Knorm,
        CriticalKV, AdaKV, CriticalAdaKV), or ``PerLayerCompressionPress`` or ``ChunkPress`` around one of the
        first seven. Its ``compression_ratio`` sets the budget.
    """

    press: BasePress = None

    def __post_init__(self) -> None:
        if isinstance(self.press, MergingPress):
            reason = "a merger keeps the tokens an eviction press selects, and a merger selects none"
        else:
            reason = unsupported_base_press_reason(self.press)
        if reason is not None:
            raise ValueError(f"press must be {SUPPORTED_BASE_PRESSES}; got {type(self.press).__name__}: {reason}")

    def post_init_from_model(self, model) -> None:
        self.press.post_init_from_model(model)

    @contextmanager
    def __call__(self, model):
        """kvpress's context manager, refusing padded batches before any layer runs."""
        language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
        guard = language_model.register_forward_pre_hook(_refuse_padding, with_kwargs=True)
        try:
            with super().__call__(model):
                yield
        finally:
            guard.remove()

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output: list):
        # NOTE: compression never builds an autograd graph, whether or not the caller's forward runs in grad
        # mode (a model fresh from `from_pretrained` does): the merged cache is data, not a differentiable output.
        with torch.no_grad():
            return super().forward_hook(module, input, kwargs, output)

    def layer_context(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                      kwargs: dict) -> Any:
        """What ``merge_selected`` reads besides the cache and the selection, computed once per layer.

        Parameters
        ----------
        module, hidden_states, kwargs
            As passed to ``BasePress.compress``.
        keys : torch.Tensor
            (B, H_kv, n, d) the layer's full keys.

        Returns
        -------
        object or None
            None by default (the merge reads the cache only).
        """
        return None

    def head_context(self, context: Any, batch_index: int, head_index: int) -> Any:
        """``context`` restricted to one (batch, head), for per-head budgets; None stays None."""
        if context is not None:
            raise NotImplementedError(f"{type(self).__name__} must restrict its layer context to one head")
        return None

    def merge_selected(
        self, keys: torch.Tensor, values: torch.Tensor, selection: TokenSelection, context: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge the evicted rows into the kept ones for a selection with a uniform budget.

        Parameters
        ----------
        keys, values : torch.Tensor
            (B, H_kv, n, d) the full cache (one (batch, head) when called per head).
        selection : TokenSelection
            The base press's choice, ``uniform_budget`` = c set.
        context : object
            From ``layer_context`` (or ``head_context`` per head).

        Returns
        -------
        keys, values : torch.Tensor
            (B, H_kv, c, d) merged kept rows, in the order of ``selection.kept_positions()``.
        """
        raise NotImplementedError

    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Select with the base press, merge, and return the new cache of one layer.

        Returns (B, H_kv, c, d) tensors for a uniform budget, rows in increasing position order, else
        (B, H_kv, n, d) with the kept rows merged (evicted rows stay in place, masked by kvpress's attention patch).
        """
        if self.compression_ratio == 0:
            return keys, values
        if keys.shape[2] != hidden_states.shape[1]:
            raise ValueError(
                f"{type(self).__name__} merges the whole prompt's cache, but layer {module.layer_idx} caches "
                f"{keys.shape[2]} entries for {hidden_states.shape[1]} prompt tokens: a press before it already "
                "compressed the cache (put the merger first in a ComposedPress) or it was called while decoding"
            )
        selection = select_tokens(self.press, module, hidden_states, keys, values, attentions, kwargs)
        if selection.uniform_budget is not None:
            module.kept_positions = selection.kept_positions()
        if bool(selection.kept_mask.all()):  # nothing evicted at this layer (e.g. its per-layer ratio is 0)
            return keys, values
        context = self.layer_context(module, hidden_states, keys, kwargs)
        if selection.uniform_budget is not None:
            merged_keys, merged_values = self.merge_selected(keys, values, selection, context)
            return merged_keys.to(keys.dtype), merged_values.to(values.dtype)
        return self._merge_per_head(keys, values, selection, context)

    def _merge_per_head(
        self, keys: torch.Tensor, values: torch.Tensor, selection: TokenSelection, context: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: per-head budgets give ragged kept sets, so this path merges one (batch, head) at a time.
        merged_keys, merged_values = keys.clone(), values.clone()
        for b in range(keys.shape[0]):
            for h in range(keys.shape[1]):
                head = (slice(b, b + 1), slice(h, h + 1))
                head_selection = selection.of_head(b, h)
                new_keys, new_values = self.merge_selected(keys[head], values[head], head_selection,
                                                           self.head_context(context, b, h))
                kept = head_selection.kept_positions()[0, 0]
                merged_keys[b, h, kept] = new_keys[0, 0].to(keys.dtype)
                merged_values[b, h, kept] = new_values[0, 0].to(values.dtype)
        return merged_keys, merged_values

    @property
    def compression_ratio(self) -> float:
        return compression_ratio_of(self.press)

    @compression_ratio.setter
    def compression_ratio(self, value: float) -> None:
        if not is_number(value) or not 0 <= value < 1:
            raise ValueError(f"compression_ratio must be a number in [0, 1), got {value!r}")
        self.press.compression_ratio = value


def _refuse_padding(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: a merging press fits every query and key of the prompt, so pad tokens would be fitted."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and not bool(mask.all()):
        raise ValueError("merging presses do not support padded batches: the attention_mask marks padding, which "
                         "would be merged into the cache; compress each sequence on its own (batch 1) or batch "
                         "sequences of equal length without padding")
