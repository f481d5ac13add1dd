"""A bounded cache over a per-head layer: ``MergingDecodingPress``'s compression when each head holds its own rows.

Under ``PerHeadCachePress`` (or behind a head-adaptive decoding press) a layer's heads hold different numbers of rows
(``grkv_core.cache.per_head``). A compression while decoding treats every head as its own cache: it renders the heads
right-aligned (``PerHeadRows.right_aligned``: the rows appended since the last compression, shared by every head, end
at the same place, so a scoring window over the most recent tokens holds for every head), scores each head's rows as
the base press would score that head alone, and keeps

* with a press that keeps the same number in every head, each head's ``min(rows, target)`` best rows;
* with ``AdaKVPress``, kvpress's rule over every head of a batch row at once: each head's safeguard share of
  ``target`` first, then the best rows of all heads, ``heads × target`` rows in all (the budget moves between heads).

Scoring a head alone is exact for the presses served here: ``KnormPress`` scores each row by itself,
``StreamingLLMPress`` keeps each head's own first ``n_sink`` rows and its most recent ones, and ``SnapKVPress`` (and
``PyramidKVPress``) attend from the window over each head's real rows only (the rows before a shorter head's first
are hidden from the softmax, and weigh zero in the pooling as kvpress's zero padding does at a sequence's start).
Other presses are refused in one line (``check_per_head_decoding``); so are mergers, whose regression has no
per-head form here yet.
"""

from __future__ import annotations

import math

import torch
from kvpress import AdaKVPress, BasePress, KnormPress, SnapKVPress, StreamingLLMPress
from kvpress.utils import get_prerope_query_states
from torch import nn
from transformers.models.llama.modeling_llama import repeat_kv, rotate_half

from grkv_core.cache.per_head import PerHeadLayer
from grkv_core.presses.merging import BaseMergerPress

PER_HEAD_SCORERS = (KnormPress, StreamingLLMPress, SnapKVPress)
PER_HEAD_DECODING_PRESSES = "KnormPress, StreamingLLMPress, SnapKVPress or PyramidKVPress, alone or inside AdaKVPress"


def per_head_refusal(base_press: BasePress) -> str | None:
    """Why ``base_press`` cannot bound a per-head cache while decoding, or None when it can."""
    if isinstance(base_press, BaseMergerPress):
        return (
            f"a per-head cache is bounded while decoding by eviction only ({type(base_press).__name__} merges into "
            f"a uniform cache): use {type(base_press.press).__name__} alone (no merger)"
        )
    scorer = base_press.press if isinstance(base_press, AdaKVPress) else base_press
    if not isinstance(scorer, PER_HEAD_SCORERS):
        return (
            f"a per-head cache is bounded while decoding by {PER_HEAD_DECODING_PRESSES}; got "
            f"{type(base_press).__name__}"
        )
    return None


def masked_window_attention(
    module: nn.Module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    real: torch.Tensor,
    window: int,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """kvpress's ``SnapKVPress.compute_window_attention`` over rows of which only ``real`` are a head's own.

    Parameters
    ----------
    module : nn.Module
        The attention layer.
    hidden_states : torch.Tensor
        (B, n, hidden), n > ``window``: the recent tokens, the last ``window`` of which attend.
    keys : torch.Tensor
        (B, H_kv, L, D) the right-aligned rows, the window's own rows last.
    real : torch.Tensor
        (B, H_kv, L) bool, False where a row is only padding.
    window : int
        The window's size.
    position_embeddings : tuple of torch.Tensor
        (cos, sin), each (B, n, D).

    Returns
    -------
    torch.Tensor
        (B, H_q, window, L − window) the window's attention weights over the rows before it (zero on padding).
    """
    length = keys.shape[2]
    groups = module.config.num_attention_heads // keys.shape[1]
    queries = get_prerope_query_states(module, hidden_states[:, -window:])
    cos, sin = (table[:, -window:].unsqueeze(1) for table in position_embeddings)
    queries = queries * cos + rotate_half(queries) * sin
    logits = queries @ repeat_kv(keys, groups).transpose(2, 3) / math.sqrt(module.head_dim)
    ahead = torch.ones(window, length, dtype=torch.bool, device=keys.device).triu(length - window + 1)
    hidden = ahead | ~real.repeat_interleave(groups, dim=1)[:, :, None, :]
    weights = logits.masked_fill(hidden, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(queries.dtype)
    return weights[..., :-window]


def per_head_scores(
    scorer: BasePress,
    module: nn.Module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    real: torch.Tensor,
    kwargs: dict,
) -> torch.Tensor:
    """(B, H_kv, L) float32: each head's rows scored as ``scorer`` scores that head alone; −inf on padding, and a
    real row ranks above padding whatever its score.

    ``keys``, ``values`` (B, H_kv, L, D) and ``real`` (B, H_kv, L) as ``PerHeadRows.right_aligned`` gives them;
    ``hidden_states`` and ``kwargs["position_embeddings"]`` the recent tokens', as ``MergingDecodingPress`` scores.
    """
    if isinstance(scorer, StreamingLLMPress):
        # Each head's own first n_sink rows, then its most recent ones (the rows are in stream order).
        rank_in_head = real.cumsum(dim=-1) - 1
        recency = torch.arange(keys.shape[2], device=keys.device, dtype=torch.float32).expand(real.shape)
        scores = torch.where(rank_in_head < scorer.n_sink, float(keys.shape[2]), recency)
    else:
        attentions = None
        if isinstance(scorer, SnapKVPress):
            weights = masked_window_attention(
                module, hidden_states, keys, real, scorer.window_size, kwargs["position_embeddings"]
            )
            # NOTE: kvpress's score reads attentions[..., -window:, :-window]; the window's own columns are padding.
            attentions = nn.functional.pad(weights, (0, scorer.window_size))
        scores = scorer.score(module, hidden_states, keys, values, attentions, kwargs).float()
    lowest = torch.finfo(torch.float32).min
    return torch.where(real, scores.nan_to_num(nan=lowest, neginf=lowest), float("-inf"))


def kept_per_head(base_press: BasePress, scores: torch.Tensor, target: int) -> torch.Tensor:
    """(B, H_kv, L) bool: the rows a compression to ``target`` rows per head keeps, from ``per_head_scores``.

    A uniform press keeps each head's ``min(rows, target)`` best; ``AdaKVPress`` keeps ``H_kv × target`` rows of each
    batch row (all of them when it holds fewer), each head's best ``int(target × alpha_safeguard)`` first (at least
    one), as kvpress's ``AdaKVPress.compress`` keeps its per-head budgets.
    """
    batch, heads, length = scores.shape
    real = scores > float("-inf")
    kept = torch.zeros_like(real)
    if not isinstance(base_press, AdaKVPress):
        kept.scatter_(-1, scores.topk(min(target, length), dim=-1).indices, True)
        return kept & real
    safe = int(target * base_press.alpha_safeguard)
    if base_press.alpha_safeguard > 0:
        safe = max(1, safe)
    scores = scores.clone()
    if safe:
        top = scores.topk(min(safe, length), dim=-1).indices
        scores.scatter_(-1, top, torch.where(real.gather(-1, top), torch.finfo(torch.float32).max, float("-inf")))
    flat = kept.view(batch, heads * length)
    flat.scatter_(-1, scores.view(batch, -1).topk(min(heads * target, heads * length), dim=-1).indices, True)
    return kept & real


def compress_per_head_layer(
    base_press: BasePress,
    module: nn.Module,
    layer: PerHeadLayer,
    hidden_states: torch.Tensor,
    kwargs: dict,
    target: int,
) -> PerHeadLayer:
    """``layer`` brought back to ``target`` rows per head (``H_kv × target`` per batch row under ``AdaKVPress``),
    the rows kept in stream order; ``layer`` itself when no head holds more.

    NOTE: the new per-head counts are host integers: computed from the old ones for a uniform press, read from the
    device once under ``AdaKVPress`` (one synchronisation per layer and compression).
    """
    rows = [length + layer.keys.tail.shape[2] for length in layer.keys.lengths]
    adaptive = isinstance(base_press, AdaKVPress)
    heads = layer.keys.tail.shape[1]
    over = [sum(rows[start : start + heads]) > heads * target for start in range(0, len(rows), heads)]
    if not (any(over) if adaptive else max(rows) > target):
        return layer
    keys, real = layer.keys.right_aligned()
    values, _ = layer.values.right_aligned()
    scorer = base_press.press if adaptive else base_press
    scores = per_head_scores(scorer, module, hidden_states, keys, values, real, kwargs)
    kept = kept_per_head(base_press, scores, target)
    lengths = tuple(kept.sum(dim=-1).flatten().tolist()) if adaptive else tuple(min(n, target) for n in rows)
    return PerHeadLayer.from_kept(keys, values, kept, lengths, length=max(lengths))
