"""Which cached tokens a kvpress eviction press keeps, and how it scores them, without evicting anything.

Merging presses (GRKV and the baselines) need the base press's decision as data: the kept positions and
the scores (to pick the top-beta fixed tokens). kvpress exposes that decision in these shapes, all handled
here: score-then-top-k with one budget per layer (every ``ScorerPress``), a per-layer budget
(``PyramidKVPress``, ``PerLayerCompressionPress``), a top-k per chunk of the prompt (``ChunkPress``), and
per-head budgets realised by masking (``AdaKVPress``, ``CriticalAdaKVPress``). Other kvpress presses are
refused with the reason (``unsupported_base_press_reason``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from kvpress import (
    AdaKVPress,
    BasePress,
    ChunkKVPress,
    ChunkPress,
    ComposedPress,
    CriticalAdaKVPress,
    DecodingPress,
    ExpectedAttentionPress,
    KeyRerotationPress,
    PerLayerCompressionPress,
    PrefillDecodingPress,
    PyramidKVPress,
    ScorerPress,
    SnapKVPress,
)
from kvpress.utils import compute_n_kept
from torch import nn

from grkv_core.option_specs import is_number

MASKING_PRESSES = (AdaKVPress, CriticalAdaKVPress)
# NOTE: wrappers whose token selection is reproduced here around their inner ScorerPress (kvpress asserts it is one).
SELECTION_WRAPPERS = (PerLayerCompressionPress, ChunkPress)
SUPPORTED_BASE_PRESSES = (
    "a kvpress ScorerPress (SnapKV, PyramidKV, StreamingLLM, ObservedAttention, "
    "ExpectedAttention, Knorm, CriticalKV), AdaKVPress, CriticalAdaKVPress, or "
    "PerLayerCompressionPress or ChunkPress around a ScorerPress"
)
# Why the kvpress wrappers that do not merely select tokens cannot be a merger's base press (first match wins).
_REFUSED_BASE_PRESSES: tuple[tuple[type, str], ...] = (
    (
        PrefillDecodingPress,
        "it switches presses between prefill and decoding; compose the other way round: "
        "PrefillDecodingPress(prefilling_press=<merger>, decoding_press=...)",
    ),
    (
        DecodingPress,
        "it compresses while decoding on its own; to merge while decoding use "
        "MergingDecodingPress(<merger>, target_size=..., compression_interval=...)",
    ),
    (
        KeyRerotationPress,
        "it moves the kept keys to new positions while a merge fits them at their own, and kvpress's "
        "pipeline re-positions the question only when KeyRerotationPress is the outermost press",
    ),
    (
        ComposedPress,
        "a chain of presses has no single selection over the full cache to merge into; put the merger "
        "first inside it instead: ComposedPress([<merger>, ...])",
    ),
    (
        ChunkKVPress,
        "it chooses its chunks inside its compress, so the choice cannot be read as data; ChunkPress is supported",
    ),
)

# Scores already computed in the current shared prefill, by (layer, the base press's repr); None outside one.
_SHARED_SCORES: ContextVar[dict | None] = ContextVar("grkv_shared_scores", default=None)


@contextmanager
def sharing_scores() -> Iterator[None]:
    """Within one forward, base presses configured alike score each layer once.

    NOTE: a base press's scores are a function of the layer's inputs and of the press's configuration (its
    dataclass repr: every field, wrapped presses included), so merging presses that share a prefill and a base
    press configuration get the very tensor each would compute alone. Nothing mutates scores in place.
    """
    token = _SHARED_SCORES.set({})
    try:
        yield
    finally:
        _SHARED_SCORES.reset(token)


def _scores(press: ScorerPress, module: nn.Module, *inputs, chunk_start: int | None = None) -> torch.Tensor:
    memo = _SHARED_SCORES.get()
    if memo is None:
        return press.score(module, *inputs)
    key = (module.layer_idx, repr(press), chunk_start)
    if key not in memo:
        memo[key] = press.score(module, *inputs)
    return memo[key]


@dataclass(frozen=True)
class TokenSelection:
    """The base press's choice for one layer.

    Attributes
    ----------
    scores : torch.Tensor
        (B, H_kv, n) the base press's importance scores (higher = more important).
    kept_mask : torch.Tensor or None
        (B, H_kv, n) bool, True where the base press keeps the token; None when the choice is given by ``kept``
        (``mask()`` builds it then).
    uniform_budget : int or None
        The number of kept tokens per head when every head keeps the same number (the cache can then be
        physically compacted); None for per-head budgets, which kvpress realises by masking.
    kept : torch.Tensor or None
        (B, H_kv, c) long kept positions in increasing order, for a uniform budget (from ``kept_mask`` when None).
    """

    scores: torch.Tensor
    kept_mask: torch.Tensor | None
    uniform_budget: int | None
    kept: torch.Tensor | None = None

    @classmethod
    def of_top(cls, scores: torch.Tensor, budget: int) -> TokenSelection:
        """The ``budget`` top-scored positions of each (batch, head) of (B, H_kv, n) ``scores``, as kvpress's
        ``ScorerPress`` keeps them; ties go to the earlier position, as in ``topk``."""
        return cls(
            scores=scores,
            kept_mask=None,
            uniform_budget=budget,
            kept=scores.topk(budget, dim=-1).indices.sort(dim=-1).values,
        )

    def kept_positions(self) -> torch.Tensor:
        """(B, H_kv, c) kept positions in increasing order; only defined for a uniform budget.

        NOTE: from a mask, computed once per selection, by a stable sort that puts the kept positions first in their
        order (the same positions as ``kept_mask.nonzero()``, which would wait for the GPU at every call and layer).
        """
        if self.uniform_budget is None:
            raise ValueError("per-head budgets have no rectangular (B, H_kv, c) kept-position tensor")
        if self.kept is not None:
            return self.kept
        cached = self.__dict__.get("_kept_positions")
        if cached is None:
            evicted_first_key = (~self.kept_mask).to(torch.uint8)
            cached = evicted_first_key.argsort(dim=-1, stable=True)[..., : self.uniform_budget]
            self.__dict__["_kept_positions"] = cached  # NOTE: a cache, not state: frozen fields stay untouched
        return cached

    def mask(self) -> torch.Tensor:
        """(B, H_kv, n) bool, True where the base press keeps the token (``kept_mask``, or built from ``kept``)."""
        if self.kept_mask is not None:
            return self.kept_mask
        cached = self.__dict__.get("_kept_mask")
        if cached is None:
            cached = torch.zeros(self.scores.shape, dtype=torch.bool, device=self.scores.device)
            cached.scatter_(-1, self.kept, True)
            self.__dict__["_kept_mask"] = cached  # NOTE: a cache, as above
        return cached

    def keeps_every_position(self) -> bool:
        """Whether nothing is evicted (e.g. a layer whose ratio is 0).

        NOTE: a uniform budget says so from its size alone, with no GPU synchronisation.
        """
        if self.uniform_budget is not None:
            return self.uniform_budget == self.scores.shape[-1]
        return bool(self.kept_mask.all())

    def of_head(self, batch_index: int, head_index: int) -> TokenSelection:
        """The choice for one (batch, head), as a (1, 1, n) selection with a uniform budget (its kept count)."""
        kept_mask = self.kept_mask[batch_index : batch_index + 1, head_index : head_index + 1]
        return TokenSelection(
            scores=self.scores[batch_index : batch_index + 1, head_index : head_index + 1],
            kept_mask=kept_mask,
            uniform_budget=int(kept_mask.sum()),
        )


def forced_score_ranges(press: BasePress, length: int) -> list[range]:
    """The ranges of positions of an ``length``-token prompt that the base press scores artificially high.

    SnapKV-style presses (SnapKV, PyramidKV, and the presses wrapping them) keep their observation window by
    scoring it max + 1; ExpectedAttention does the same for its first ``n_sink`` positions. Those scores say
    "always keep", not "important", so rankings by importance must leave these positions out. ``ChunkPress``
    runs its inner press on each chunk alone, so each chunk has its own forced positions.

    NOTE: ranges of host integers: a test against them costs a comparison per range, and no mask to index on the
    device.
    """
    forced = []
    if isinstance(press, ChunkPress):
        for start in range(0, length, press.chunk_length):
            end = min(start + press.chunk_length, length)
            forced += [
                range(start + inner.start, start + inner.stop)
                for inner in forced_score_ranges(press.press, end - start)
            ]
        return forced
    if isinstance(press, SnapKVPress):
        forced.append(range(max(length - press.window_size, 0), length))
    if isinstance(press, ExpectedAttentionPress):
        forced.append(range(0, min(press.n_sink, length)))
    inner = getattr(press, "press", None)
    return forced + forced_score_ranges(inner, length) if inner is not None else forced


def unsupported_base_press_reason(kind: type) -> str | None:
    """Why a press of class ``kind`` cannot be the base press of a merger, or None when it can (see
    ``SUPPORTED_BASE_PRESSES``)."""
    if issubclass(kind, (ScorerPress, *MASKING_PRESSES, *SELECTION_WRAPPERS)):
        return None
    for refused, reason in _REFUSED_BASE_PRESSES:
        if issubclass(kind, refused):
            return reason
    return "it does not expose its token selection as data, which a merger reads"


def compression_ratio_of(press: BasePress) -> float:
    return float(getattr(press, "compression_ratio", 0.0))


def check_compression_ratio(value, owner: str) -> float:
    """``value`` if it is a compression ratio in [0, 1] (1 keeps no token, as kvpress's ``compute_n_kept``), else a
    one-line ValueError naming ``owner``'s ``compression_ratio``."""
    if not is_number(value) or not 0 <= value <= 1:
        raise ValueError(
            f"{owner}.compression_ratio must be a number in [0, 1] (1 keeps no token, as in kvpress), got {value!r}"
        )
    return value


def select_tokens(
    press: BasePress,
    module: nn.Module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attentions: torch.Tensor | None,
    kwargs: dict,
) -> TokenSelection:
    """Run the base press's scoring for one attention layer and return its decision.

    Parameters
    ----------
    press : BasePress
        A ``ScorerPress`` (SnapKV, StreamingLLM, ObservedAttention, ExpectedAttention, Knorm, CriticalKV,
        PyramidKV, ...), a masking press (AdaKV, CriticalAdaKV), or ``PerLayerCompressionPress`` or
        ``ChunkPress`` around a ``ScorerPress``.
    module, hidden_states, keys, values, attentions, kwargs
        As passed to ``BasePress.compress``; keys and values are (B, H_kv, n, d).

    Returns
    -------
    TokenSelection
    """
    batch, heads, length, _ = keys.shape
    check_compression_ratio(press.compression_ratio, type(press).__name__)
    if isinstance(press, PerLayerCompressionPress):
        # NOTE: kvpress's own PerLayerCompressionPress sets its inner press's ratio for the layer the same way.
        inner_ratio = press.press.compression_ratio
        press.press.compression_ratio = press.compression_ratios[module.layer_idx]
        try:
            return select_tokens(press.press, module, hidden_states, keys, values, attentions, kwargs)
        finally:
            press.press.compression_ratio = inner_ratio
    if isinstance(press, ChunkPress):
        return _select_per_chunk(press, module, hidden_states, keys, values, attentions, kwargs)
    if isinstance(press, MASKING_PRESSES):
        # NOTE: the masking press computes its per-head budgets and records the evicted (batch, head,
        # position) triples on the module; kvpress's attention patch reads them at decoding time.
        press.compress(module, hidden_states, keys, values, attentions, kwargs)
        scores = press.press.score(module, hidden_states, keys, values, attentions, kwargs)
        kept_mask = torch.ones(batch, heads, length, dtype=torch.bool, device=keys.device)
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:
            batch_index, head_index, position_index = (index.to(keys.device) for index in masked)
            kept_mask[batch_index, head_index, position_index] = False
        return TokenSelection(scores=scores.float(), kept_mask=kept_mask, uniform_budget=None)
    reason = unsupported_base_press_reason(type(press))
    if reason is not None:
        raise ValueError(
            f"{type(press).__name__} is not supported as a base press ({reason}): use {SUPPORTED_BASE_PRESSES}"
        )
    scores = _scores(press, module, hidden_states, keys, values, attentions, kwargs)
    if isinstance(press, PyramidKVPress):
        budget = press.get_layer_budget(module, length)
    else:
        budget = compute_n_kept(length, press.compression_ratio)
    budget = min(budget, length)  # NOTE: 0 at a ratio of 1, as kvpress (``compute_n_kept``)
    return TokenSelection.of_top(scores.float(), budget)


def _select_per_chunk(
    press: ChunkPress,
    module: nn.Module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attentions: torch.Tensor | None,
    kwargs: dict,
) -> TokenSelection:
    """``ChunkPress``'s decision: its inner press scores each chunk of the prompt alone and keeps its top share.

    The rule is kvpress's ``ChunkPress.compress`` (a chunk of length l keeps max(1, int(l·(1 − ratio))) tokens);
    the scores are the per-chunk ones it ranks by. Arguments and result as in ``select_tokens``.
    """
    if attentions is not None:
        raise ValueError(
            "ChunkPress scores chunks without attention weights: run the model with sdpa or flash attention, not eager"
        )
    batch, heads, length, _ = keys.shape
    scorer = press.press
    scores = torch.empty(batch, heads, length, dtype=torch.float32, device=keys.device)
    kept_mask = torch.zeros(batch, heads, length, dtype=torch.bool, device=keys.device)
    for start in range(0, length, press.chunk_length):
        chunk = slice(start, start + press.chunk_length)
        chunk_scores = _scores(
            scorer,
            module,
            hidden_states[:, chunk],
            keys[:, :, chunk],
            values[:, :, chunk],
            attentions,
            kwargs,
            chunk_start=start,
        )
        n_kept = max(1, int(chunk_scores.shape[-1] * (1 - scorer.compression_ratio)))
        scores[..., chunk] = chunk_scores.float()
        kept_mask[..., chunk].scatter_(-1, chunk_scores.topk(n_kept, dim=-1).indices, True)
    return TokenSelection(scores=scores, kept_mask=kept_mask, uniform_budget=int(kept_mask[0, 0].sum()))
