"""Which cached tokens a kvpress eviction press keeps, and how it scores them, without evicting anything.

Merging presses (GRKV and the baselines) need the base press's decision as data: the kept positions and
the scores (to pick the top-beta fixed tokens). kvpress exposes that decision in three shapes, all
handled here: score-then-top-k with one budget per layer (every ``ScorerPress``), a per-layer budget
(``PyramidKVPress``), and per-head budgets realised by masking (``AdaKVPress``, ``CriticalAdaKVPress``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from kvpress import (AdaKVPress, BasePress, CriticalAdaKVPress, ExpectedAttentionPress, PyramidKVPress, ScorerPress,
                     SnapKVPress)
from kvpress.utils import compute_n_kept
from torch import nn

MASKING_PRESSES = (AdaKVPress, CriticalAdaKVPress)

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


def _scores(press: ScorerPress, module: nn.Module, *inputs) -> torch.Tensor:
    memo = _SHARED_SCORES.get()
    if memo is None:
        return press.score(module, *inputs)
    key = (module.layer_idx, repr(press))
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
    kept_mask : torch.Tensor
        (B, H_kv, n) bool, True where the base press keeps the token.
    uniform_budget : int or None
        The number of kept tokens per head when every head keeps the same number (the cache can then be
        physically compacted); None for per-head budgets, which kvpress realises by masking.
    """

    scores: torch.Tensor
    kept_mask: torch.Tensor
    uniform_budget: int | None

    def kept_positions(self) -> torch.Tensor:
        """(B, H_kv, c) kept positions in increasing order; only defined for a uniform budget."""
        if self.uniform_budget is None:
            raise ValueError("per-head budgets have no rectangular (B, H_kv, c) kept-position tensor")
        batch, heads, _ = self.kept_mask.shape
        return self.kept_mask.nonzero()[:, 2].view(batch, heads, self.uniform_budget)

    def of_head(self, batch_index: int, head_index: int) -> TokenSelection:
        """The choice for one (batch, head), as a (1, 1, n) selection with a uniform budget (its kept count)."""
        kept_mask = self.kept_mask[batch_index : batch_index + 1, head_index : head_index + 1]
        return TokenSelection(
            scores=self.scores[batch_index : batch_index + 1, head_index : head_index + 1],
            kept_mask=kept_mask,
            uniform_budget=int(kept_mask.sum()),
        )


def forced_score_span(press: BasePress) -> tuple[int, int]:
    """(head, tail): the base press gives its first ``head`` and last ``tail`` positions an artificial top score.

    SnapKV-style presses (SnapKV, PyramidKV, and the presses wrapping them) keep their observation window by
    scoring it max + 1; ExpectedAttention does the same for its first ``n_sink`` positions. Those scores say
    "always keep", not "important", so rankings by importance must leave these positions out.
    """
    head = tail = 0
    while press is not None:
        if isinstance(press, SnapKVPress):
            tail = max(tail, press.window_size)
        if isinstance(press, ExpectedAttentionPress):
            head = max(head, press.n_sink)
        press = getattr(press, "press", None)
    return head, tail


def is_supported_base_press(press: BasePress) -> bool:
    return isinstance(press, (ScorerPress, *MASKING_PRESSES))


def compression_ratio_of(press: BasePress) -> float:
    return float(getattr(press, "compression_ratio", 0.0))


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
        PyramidKV, ...) or a masking press (AdaKV, CriticalAdaKV).
    module, hidden_states, keys, values, attentions, kwargs
        As passed to ``BasePress.compress``; keys and values are (B, H_kv, n, d).

    Returns
    -------
    TokenSelection
    """
    batch, heads, length, _ = keys.shape
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
    if not isinstance(press, ScorerPress):
        raise ValueError(
            f"{type(press).__name__} is not supported as a base press: use a kvpress ScorerPress "
            "(SnapKV, PyramidKV, StreamingLLM, ObservedAttention, ExpectedAttention, Knorm, CriticalKV) "
            "or AdaKVPress / CriticalAdaKVPress"
        )
    scores = _scores(press, module, hidden_states, keys, values, attentions, kwargs)
    if isinstance(press, PyramidKVPress):
        budget = press.get_layer_budget(module, length)
    else:
        budget = compute_n_kept(length, press.compression_ratio)
    budget = min(max(budget, 1), length)
    kept_mask = torch.zeros(batch, heads, length, dtype=torch.bool, device=keys.device)
    kept_mask.scatter_(-1, scores.topk(budget, dim=-1).indices, True)
    return TokenSelection(scores=scores.float(), kept_mask=kept_mask, uniform_budget=budget)
