"""The base of every merging press: it wraps an eviction press and owns the ``compress`` template.

A merging press keeps the tokens its base press chooses and merges the evicted ones into them. The template
(``BaseMergerPress.compress``) runs the base press's selection, then the press's own ``merge_selected`` step: once
for the whole layer with a uniform budget (the cache is physically compacted), else once per (batch, head)
with per-head budgets (kvpress masks the evicted entries; the merged kept rows are written back in place).
A press supplies only ``merge_selected`` and, when its merge reads more than the cache (surrogate queries,
attention weights), ``layer_context`` and ``head_context``.

Composition with kvpress's wrappers. A merger is a ``BasePress``, not a ``ScorerPress``: it has no scores of its
own (its choice is its base press's) and keeps no top-k of them, so kvpress's wrappers that select tokens from a
press's ``score`` (``AdaKVPress``, ``ChunkPress``, ``KeyRerotationPress``, ``MergingPress``...) and ``DecodingPress``
refuse it when they are built (they assert that their press is a ``ScorerPress``); ``MergingDecodingPress``
(``decoding``) runs a merger while decoding, through ``compress_recent``. Its ``compression_ratio`` is its
base press's budget. Wrappers that run a press's own hook over the whole prompt work around a merger:
``ComposedPress([merger, ...])`` (the merger first), ``PrefillDecodingPress(prefilling_press=merger, ...)`` and this
package's ``PerLayerCompressionPress`` (``per_layer``; kvpress's own asserts a ``ScorerPress``). ``DMSPress``, a
``ComposedPress`` with the merger after another press and ``PrefillDecodingPress(decoding_press=merger)`` check
nothing when built; the merger refuses them in one line when they enter a model (``post_init_from_model``), before
any layer runs. As the base press, inside the merger, ``ChunkPress``, ``AdaKVPress`` and kvpress's
``PerLayerCompressionPress`` work; other base presses are refused with the reason
(``selection.unsupported_base_press_reason``).
"""

from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from kvpress import BasePress, ComposedPress, DecodingPress, PerLayerCompressionPress, PrefillDecodingPress, ScorerPress
from kvpress import MergingPress as KVPressMergingPress
from torch import nn

from grkv_core import options
from grkv_core.presses.padding import padding_refused
from grkv_core.presses.selection import (
    MASKING_PRESSES,
    SELECTION_WRAPPERS,
    SUPPORTED_BASE_PRESSES,
    TokenSelection,
    check_compression_ratio,
    compression_ratio_of,
    select_tokens,
    unsupported_base_press_reason,
)
from grkv_core.presses.sliding_layers import unhook_sliding_layers
from grkv_core.solver.problem import gather_rows

# kvpress's own merger: like ours, it keeps a ScorerPress's tokens and merges the evicted ones into them.
KVPRESS_MERGERS = (KVPressMergingPress,)


@dataclass
class BaseMergerPress(BasePress):
    """Base of every press that keeps a base eviction press's tokens and merges the evicted ones into them.

    It owns the base press (validates it, forwards model set-up, exposes its ``compression_ratio``) and the
    ``compress`` template; subclasses implement ``merge_selected`` (and ``layer_context``/``head_context`` when
    their merge reads more than the cache).

    NOTE: a merger is not a kvpress ``ScorerPress``, which would promise scores whose top-k is the cache it keeps;
    kvpress's wrappers that rely on that promise test for ``ScorerPress`` and so refuse a merger when built.

    NOTE: a merged cache no longer reveals which positions its rows came from; with a uniform budget a
    merging press records them as ``module.kept_positions`` (B, H_kv, c) for diagnostics.

    NOTE: with a uniform budget the merged rows come in increasing position order (``module.kept_positions``),
    while kvpress's ``ScorerPress`` leaves the rows it keeps in its top-k (score) order. Both caches hold the same
    kept tokens; attention does not depend on the order of the cached rows (the keys carry their positions), so
    align rows by position, not by index, to compare a merged cache with kvpress's eviction.

    NOTE: a merging press changes the cache, never the forward: hooks a subclass adds in ``__call__`` only observe,
    and keep what they observe on the press, not on the shared modules. The trial engine relies on it to let
    several presses share one prefill (``grkv_core.evaluation.shared_prefill``).

    NOTE: options are checked when the press is built and again whenever it compresses (``check_options``), so an
    option changed after construction is refused in one line instead of failing deep in a merge.

    Parameters
    ----------
    press : BasePress
        The eviction press, one of ``grkv_core.presses.selection.SUPPORTED_BASE_PRESSES``. Its ``compression_ratio``
        sets the budget.
    compression_ratio : float, optional
        The base press's ``compression_ratio``, read and written through (keyword only); given, it sets the base
        press's. A number in [0, 1]: 1 keeps no token of a layer, as in kvpress.
    """

    # NOTE: keyword-only, so that ``press`` is the first positional argument; declared first, so that the dataclass
    # __init__ assigns it before ``press``, when the setter only records it (``__post_init__`` applies a given ratio,
    # None leaves the base press's). The property assigned after the class replaces it as an attribute (a
    # ``PerLayerCompressionPress`` looks for the parameter, then sets the attribute layer by layer).
    compression_ratio: float | None = field(default=None, kw_only=True, repr=False, compare=False)
    press: BasePress = None
    # Whether ``compress`` gives every (batch, head) whose full cache holds a NaN or inf its kept rows unmerged (a
    # merge that reads the whole cache would spread the bad entry); a merger whose own merge guards it says False.
    unmerges_non_finite_caches: ClassVar[bool] = True

    def __post_init__(self) -> None:
        inner, reason = self.press, None
        while inner is not None and reason is None:
            if isinstance(inner, (BaseMergerPress, KVPRESS_MERGERS)):
                reason = "a merger keeps the tokens an eviction press selects, and a merger selects none"
            inner = getattr(inner, "press", None)
        reason = reason or unsupported_base_press_reason(type(self.press))
        if reason is not None:
            raise ValueError(f"press must be {SUPPORTED_BASE_PRESSES}; got {type(self.press).__name__}: {reason}")
        requested_ratio = vars(self).pop("_requested_compression_ratio", None)
        if requested_ratio is not None:
            self.compression_ratio = requested_ratio
        self.check_options()

    def check_options(self) -> None:
        """Raise a ValueError naming the first option whose value its spec (``grkv_core.options``) does not accept."""
        options.check_options(self)

    def post_init_from_model(self, model) -> None:
        """Forward the model set-up to the base press, refusing a kvpress wrapper around this merger that would not
        run the merger's own compression over the whole prompt.

        NOTE: the earliest point a merger can refuse a kvpress wrapper that checks nothing when built (``DMSPress``,
        and ``ComposedPress`` or ``PrefillDecodingPress`` holding the merger elsewhere than first or as the prefilling
        press): kvpress's wrappers forward the set-up to their press when they enter a model, before any layer runs.
        """
        wrapper = _calling_press(self)
        if wrapper is not None:
            what = _wrapper_misuse(wrapper, self)
            if what is not None:
                raise ValueError(_wrapper_refusal(self, what, wrapper))
        self.press.post_init_from_model(model)

    def reset(self) -> None:
        """Nothing to reset: kvpress's decoding presses keep state between steps, a merger none between prefills.

        NOTE: kvpress's ``PrefillDecodingPress`` resets its decoding press when it leaves a model, even when entering
        failed: a merger put there is refused on entering (``post_init_from_model``), and without this method an
        AttributeError would hide that refusal.
        """

    def score(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor,
        kwargs: dict,
    ) -> torch.Tensor:
        """Refused: a merger has no scores (its choice is its base press's; wrap that instead).

        NOTE: a kvpress wrapper that asks its press for scores refuses a merger when built, or is refused when it
        enters a model (``post_init_from_model``); this refuses, at its first layer, one that skipped both: its
        assert gone under ``python -O`` and its set-up never called (inside kvpress's ``PerLayerCompressionPress``,
        which calls no set-up).
        """
        raise ValueError(_wrapper_refusal(self, _SELECTS_ITSELF))

    @contextmanager
    def __call__(self, model):
        """kvpress's context manager, refusing bad options and padded batches before any layer runs; sliding-window
        layers are left whole (``sliding_layers``)."""
        self.check_options()
        with padding_refused(model), super().__call__(model):
            unhook_sliding_layers(self, model)
            yield

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output: list):
        # NOTE: compression never builds an autograd graph, whether or not the caller's forward runs in grad
        # mode (a model fresh from `from_pretrained` does): the merged cache is data, not a differentiable output.
        with torch.no_grad():
            return super().forward_hook(module, input, kwargs, output)

    def layer_context(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, kwargs: dict) -> Any:
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
        self.check_options()
        # NOTE: told from the shapes, not from ``cache_position``'s values (kvpress's ``is_prefilling``, a GPU
        # synchronisation): a prefill from an empty cache caches exactly its tokens, and a decoding step (or a later
        # prefill chunk) adds its tokens to those already cached.
        if keys.shape[2] > hidden_states.shape[1]:
            raise ValueError(_wrapper_refusal(self, _COMPRESSES_DECODING))
        if self.compression_ratio == 0:
            return keys, values
        if keys.shape[2] != hidden_states.shape[1]:
            raise ValueError(
                f"{type(self).__name__} merges the whole prompt's cache, but layer {module.layer_idx} caches "
                f"{keys.shape[2]} entries for {hidden_states.shape[1]} prompt tokens: a press before it already "
                "compressed the cache (put the merger first in a ComposedPress)"
            )
        return self._compress_rows(module, hidden_states, keys, values, attentions, kwargs)

    def compress_recent(
        self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compress a cache of which only the most recent tokens' hidden states are at hand (``MergingDecodingPress``).

        Parameters
        ----------
        hidden_states : torch.Tensor
            (B, r, hidden) the layer's input of the cache's last r rows' tokens (r <= n), the base press's scoring
            window and the source of the surrogate queries; ``kwargs["position_embeddings"]`` their RoPE tables.
        keys, values : torch.Tensor
            (B, H_kv, n, d) the cache, rows in stream order (a row stands for its position in the cache, whatever
            the position its key was rotated to).

        Returns
        -------
        keys, values : torch.Tensor
            As ``compress``: the kept rows merged, in row order; ``module.kept_positions`` the cache rows kept.
        """
        self.check_options()
        if hidden_states.shape[1] > keys.shape[2]:
            raise ValueError(
                f"{type(self).__name__}: {hidden_states.shape[1]} recent tokens for a cache of {keys.shape[2]} rows"
            )
        return self._compress_rows(module, hidden_states, keys, values, None, kwargs)

    @contextmanager
    def merging_state(self):
        """What a merger keeps for one stretch of compressions (a prefill, a generation), outside its own hooks: none
        by default."""
        yield

    def _compress_rows(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``compress`` once the cache is known to end with ``hidden_states``' tokens (all of them at the prefill)."""
        selection = select_tokens(self.press, module, hidden_states, keys, values, attentions, kwargs)
        if selection.uniform_budget is not None:
            module.kept_positions = selection.kept_positions()
        if selection.keeps_every_position():
            return keys, values
        if selection.uniform_budget == 0:
            # NOTE: a ratio of 1 keeps no token (kvpress empties the layer): there is nothing to merge into.
            return keys[:, :, :0], values[:, :, :0]
        context = self.layer_context(module, hidden_states, keys, kwargs)
        if selection.uniform_budget is not None:
            merged_keys, merged_values = self.merge_selected(keys, values, selection, context)
        else:
            merged_keys, merged_values = self._merge_per_head(keys, values, selection, context)
        if self.unmerges_non_finite_caches:
            self._unmerge_non_finite_heads(keys, values, selection, merged_keys, merged_values)
        return merged_keys.to(keys.dtype), merged_values.to(values.dtype)

    def _unmerge_non_finite_heads(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        selection: TokenSelection,
        merged_keys: torch.Tensor,
        merged_values: torch.Tensor,
    ) -> None:
        """Give every (batch, head) whose cache holds a NaN or inf its kept rows unmerged (what eviction leaves), in
        place, with a warning: a merge would spread the bad entry over the kept rows (CaM: over 32 of them).

        ``merged_keys``/``merged_values`` are (B, H_kv, c, d) for a uniform budget, else (B, H_kv, n, d).
        NOTE: in place, because GRKV may hand back rows that it merges later, in place (``layers_per_solve``).
        """
        finite = _finite_heads(keys, values)
        if bool(finite.all()):
            return
        # NOTE: one message per press class (not per layer or head), so Python's warning filter shows it once.
        warnings.warn(
            f"{type(self).__name__}: some (batch, head) caches hold a NaN or inf; those heads keep the base "
            "press's rows unmerged, as eviction leaves them",
            RuntimeWarning,
            stacklevel=3,
        )
        if selection.uniform_budget is not None:
            keys, values = gather_rows(selection.kept_positions(), keys, values)
        merged_keys[~finite] = keys[~finite].to(merged_keys.dtype)
        merged_values[~finite] = values[~finite].to(merged_values.dtype)

    def _merge_per_head(
        self, keys: torch.Tensor, values: torch.Tensor, selection: TokenSelection, context: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: per-head budgets give ragged kept sets, so this path merges one (batch, head) at a time.
        merged_keys, merged_values = keys.clone(), values.clone()
        for b in range(keys.shape[0]):
            for h in range(keys.shape[1]):
                head = (slice(b, b + 1), slice(h, h + 1))
                head_selection = selection.of_head(b, h)
                new_keys, new_values = self.merge_selected(
                    keys[head], values[head], head_selection, self.head_context(context, b, h)
                )
                kept = head_selection.kept_positions()[0, 0]
                merged_keys[b, h, kept] = new_keys[0, 0].to(keys.dtype)
                merged_values[b, h, kept] = new_values[0, 0].to(values.dtype)
        return merged_keys, merged_values

    def _base_compression_ratio(self) -> float:
        return compression_ratio_of(self.press)

    def _set_base_compression_ratio(self, value: float | None) -> None:
        if self.press is None:
            # NOTE: the dataclass __init__ assigns this field (declared first) before ``press``: ``__post_init__``
            # applies a requested ratio once the base press is in place.
            vars(self)["_requested_compression_ratio"] = value
            return
        self.press.compression_ratio = check_compression_ratio(value, type(self).__name__)


BaseMergerPress.compression_ratio = property(
    BaseMergerPress._base_compression_ratio, BaseMergerPress._set_base_compression_ratio
)


def _finite_heads(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(B, H_kv) bool: every key and value of that (batch, head) is finite (a NaN or inf propagates into the sum)."""
    return torch.isfinite(keys.sum(dim=(-2, -1), dtype=torch.float32) + values.sum(dim=(-2, -1), dtype=torch.float32))


_SELECTS_ITSELF = "would select tokens itself, without merging them"
_COMPRESSES_DECODING = "would compress the cache while decoding"


def _calling_press(merger: BaseMergerPress) -> BasePress | None:
    """The press whose method called into ``merger``: the caller of the outermost of ``merger``'s methods on the stack,
    or None when that caller is no press (the merger entered a model itself, or a hook of the model called it).

    NOTE: kvpress's wrappers call ``press.post_init_from_model``, ``press.forward_hook``, ``press.compress`` or
    ``press.score`` from their own methods, so the wrapper is the frame just past the merger's own.
    """
    frame = sys._getframe(1)
    while frame is not None and frame.f_locals.get("self") is not merger:
        frame = frame.f_back
    while frame is not None and frame.f_locals.get("self") is merger:
        frame = frame.f_back
    caller = frame.f_locals.get("self") if frame is not None else None
    return caller if isinstance(caller, BasePress) else None


def _wrapper_misuse(wrapper: BasePress, merger: BaseMergerPress) -> str | None:
    """What ``wrapper`` would do with ``merger`` that a merger cannot take part in, or None when it runs the merger's
    own hook over the whole prompt (``PerLayerCompressionPress``, the first press of a ``ComposedPress``, the
    prefilling press of a ``PrefillDecodingPress``)."""
    if isinstance(wrapper, PerLayerCompressionPress):
        return None
    if isinstance(wrapper, ComposedPress):
        return (
            None
            if wrapper.presses[0] is merger
            else "would run the merger on a cache that another press already compressed"
        )
    if isinstance(wrapper, PrefillDecodingPress):
        return None if wrapper.prefilling_press is merger else _COMPRESSES_DECODING
    if getattr(wrapper, "merges_while_decoding", False):
        return None
    return _COMPRESSES_DECODING if isinstance(wrapper, DecodingPress) else _SELECTS_ITSELF


def _wrapper_refusal(merger: BaseMergerPress, what: str, wrapper: BasePress | None = None) -> str:
    """One line: the kvpress wrapper (``wrapper``, else the one that called ``merger``) that ``what``, and the spelling
    that works instead."""
    name = type(merger).__name__
    wrapper = wrapper if wrapper is not None else _calling_press(merger)
    if wrapper is None:
        return f"a press around {name} {what}; wrap the eviction press instead: {name}(<wrapper>(<eviction press>))"
    kind = type(wrapper).__name__
    if what == _COMPRESSES_DECODING:
        advice = (
            f"to merge while decoding use grkv_core.presses.MergingDecodingPress({name}(<eviction press>), "
            "target_size=..., compression_interval=...)"
        )
    elif isinstance(wrapper, (BaseMergerPress, KVPRESS_MERGERS)):
        advice = "a merger cannot wrap another merger"
    elif isinstance(wrapper, (ScorerPress, *MASKING_PRESSES, *SELECTION_WRAPPERS)):
        advice = f"use {name}({kind}(...))"
    else:
        advice = f"{name} cannot wrap it either: {unsupported_base_press_reason(type(wrapper))}"
    return f"{kind}({name}(...)) {what}; {advice}"
