"""Which cached tokens a kvpress eviction press keeps, and how it scores them, without evicting anything.

Merging presses (GRKV and the baselines) need the base press's decision as data: the kept positions and
the scores (to pick the top-beta fixed tokens). kvpress exposes that decision in three shapes, all
handled here: score-then-top-k with one budget per layer (every ``ScorerPress``), a per-layer budget
(``PyramidKVPress``), and per-head budgets realised by masking (``AdaKVPress``, ``CriticalAdaKVPress``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from kvpress import (AdaKVPress, BasePress, CriticalAdaKVPress, ExpectedAttentionPress, PyramidKVPress, ScorerPress,
                     SnapKVPress)
from kvpress.utils import compute_n_kept
from torch import nn

from grkv_core.config import is_number

MASKING_PRESSES = (AdaKVPress, CriticalAdaKVPress)


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
    scores = press.score(module, hidden_states, keys, values, attentions, kwargs)
    if isinstance(press, PyramidKVPress):
        budget = press.get_layer_budget(module, length)
    else:
        budget = compute_n_kept(length, press.compression_ratio)
    budget = min(max(budget, 1), length)
    kept_mask = torch.zeros(batch, heads, length, dtype=torch.bool, device=keys.device)
    kept_mask.scatter_(-1, scores.topk(budget, dim=-1).indices, True)
    return TokenSelection(scores=scores.float(), kept_mask=kept_mask, uniform_budget=budget)


@dataclass
class MergingPress(BasePress):
    """Base of every press that keeps a base eviction press's tokens and merges the evicted ones into them.

    It owns the base press: validates it, forwards model set-up, and exposes its ``compression_ratio``.
    Subclasses implement ``compress`` (typically ``select_tokens`` and then their merge rule).

    NOTE: a merged cache no longer reveals which positions its rows came from; with a uniform budget a
    merging press records them as ``module.kept_positions`` (B, H_kv, c) for diagnostics.

    Parameters
    ----------
    press : BasePress
        The eviction press (SnapKV, PyramidKV, StreamingLLM, ObservedAttention, ExpectedAttention, Knorm,
        CriticalKV, AdaKV, CriticalAdaKV). Its ``compression_ratio`` sets the budget.
    """

    press: BasePress = None

    def __post_init__(self) -> None:
        if self.press is None or not is_supported_base_press(self.press):
            raise ValueError("press must be a kvpress ScorerPress, AdaKVPress or CriticalAdaKVPress, "
                             f"got {type(self.press).__name__}")

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
