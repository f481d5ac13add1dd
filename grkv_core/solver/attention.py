"""Attention over a cache with causal or arbitrary masks: the full cache's outputs (the regression target) and
masked softmaxes."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def full_cache_outputs(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    query_positions: torch.Tensor | None = None,
    scale: float | None = None,
    in_cache_dtype: bool = False,
) -> torch.Tensor:
    """(B, H_kv, M, d) float32 attention outputs softmax(scale·Q Kᵀ) V of ``queries`` over a whole cache.

    ``keys``/``values`` (B, H_kv, n, d) with key i at position i; with ``query_positions`` (M,) attention is
    causal. One fused attention kernel: the (M, n) weights are never materialised.

    The attention runs in float32, or with ``in_cache_dtype`` in the cache's dtype (then widened), as the model's own
    attention runs: a half-precision cache is then neither copied nor cast, tensor cores serve it (the fused kernels
    accumulate in float32), and the outputs are as precise as the window's, which the forward computes (``GRKVPress``'s
    target). The queries of a KV head's query heads are stacked along M, so grouped-query attention needs no repeated
    K/V either way.
    """
    scale = 1.0 / math.sqrt(keys.shape[-1]) if scale is None else float(scale)
    dtype = keys.dtype if in_cache_dtype else torch.float32
    mask = None
    if query_positions is not None:
        mask = _causal_additive_mask(query_positions.to(device=keys.device, dtype=torch.long), keys.shape[2], dtype)
    return F.scaled_dot_product_attention(
        queries.to(dtype), keys.to(dtype), values.to(dtype), attn_mask=mask, scale=scale
    ).float()


def _causal_additive_mask(query_positions: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """(M, length) ``dtype`` mask, 0 where key position p <= query_positions[i] and -inf elsewhere.

    NOTE: no row is all -inf (key 0 is visible to every query position >= 0), so the fused attention kernel never
    meets an empty row. A float mask also spares SDPA its own bool-to-float pass. Built from the positions on the
    device, never read on the host (a GPU synchronisation).
    """
    keys = torch.arange(length, device=query_positions.device)
    return torch.where(keys[None, :] <= query_positions[:, None], 0.0, float("-inf")).to(dtype)


def masked_softmax(logits: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis restricted to ``visible`` entries; rows that see nothing are all zero.

    Parameters
    ----------
    logits : torch.Tensor
        (..., M, n) attention logits.
    visible : torch.Tensor or None
        Boolean mask broadcastable to ``logits``; None means every entry is visible.
    """
    if visible is None:
        return torch.softmax(logits, dim=-1)
    logits = logits.masked_fill(~visible, float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)
    weights = torch.exp(logits - row_max)
    return weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
