"""Attention over a per-head cache layer, behind transformers' attention interface.

``serve_per_head_rows`` wraps every function registered in transformers' ``ALL_ATTENTION_FUNCTIONS`` (sdpa, flash
attention, ...): a call whose keys are ``PerHeadRows`` is answered here, any other goes to the function as before. So
a model loaded with sdpa or flash attention attends over a per-head cache with no change to the model, to
``model.generate`` or to kvpress's pipeline. Eager attention is not registered there (transformers calls it
directly): a per-head cache refuses it when the press enters the model (``PerHeadCachePress``).

On CUDA in half precision with flash-attn importable, flash-attn's variable-length kernel serves it
(``varlen_attention``): each (batch row, KV head) is one sequence, its query heads (GQA groups) the heads of that
sequence. Elsewhere the reference path, exact on any device: for each KV head, its query heads attend over the head's
prefix rows and the tail, one softmax over both, in float32 (float64 for a float64 model). The new tokens are the last
rows of every head's tail, so a chunk of several tokens is causal within itself and sees every earlier row.
"""

from __future__ import annotations

import functools

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from grkv_core.cache.per_head import PerHeadRows


def per_head_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: PerHeadRows,
    value: PerHeadRows,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` (B, H_q, q, D) over a per-head layer's rows; (B, q, H_q, D) as transformers' functions.

    ``attention_mask`` is not read: a per-head cache serves unpadded batches (padding is refused before any layer
    runs), where the mask is causal, which this builds itself over each head's rows.
    """
    if dropout:
        raise ValueError("a per-head cache serves inference only (attention dropout must be 0: call model.eval())")
    if sliding_window is not None:
        raise ValueError("a per-head cache cannot serve a sliding-window layer (those layers stay whole)")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    flash = _flash_varlen() if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else None
    if flash is not None:
        return varlen_attention(query, key, value, scale, flash), None
    batch, query_heads, steps, dim = query.shape
    kv_heads = key.tail.shape[1]
    groups = query_heads // kv_heads
    compute = torch.promote_types(query.dtype, torch.float32)
    # (B, H, G * q, D): a KV head's query heads one after the other, each with its q tokens.
    queries = query.to(compute).reshape(batch, kv_heads, groups * steps, dim)
    tail_keys, tail_values = key.tail.to(compute), value.tail.to(compute)
    tail_scores = queries @ tail_keys.transpose(-1, -2) * scale  # (B, H, G * q, t)
    tail_rows = tail_scores.shape[-1]
    # Token i of the q new ones (the tail's last q rows) sees the tail up to its own row.
    visible = torch.arange(tail_rows, device=query.device) <= (
        torch.arange(steps, device=query.device)[:, None] + tail_rows - steps
    )
    tail_scores = tail_scores.masked_fill(~visible.repeat(groups, 1), float("-inf"))
    outputs = []
    for head, (head_keys, head_values) in enumerate(zip(key.heads(), value.heads())):
        row, kv_head = divmod(head, kv_heads)
        scores = torch.cat([queries[row, kv_head] @ head_keys.to(compute).T * scale, tail_scores[row, kv_head]], -1)
        weights = scores.softmax(dim=-1)
        prefix_rows = head_keys.shape[0]
        outputs.append(
            weights[:, :prefix_rows] @ head_values.to(compute) + weights[:, prefix_rows:] @ tail_values[row, kv_head]
        )
    output = torch.stack(outputs).view(batch, query_heads, steps, dim).to(query.dtype)
    return output.transpose(1, 2).contiguous(), None


def _flash_varlen():
    """flash-attn's ``flash_attn_varlen_func``, or None where flash-attn is not importable."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def varlen_attention(query: torch.Tensor, key: PerHeadRows, value: PerHeadRows, scale: float, attend) -> torch.Tensor:
    """``per_head_attention`` through a variable-length kernel ``attend`` with flash-attn's ``flash_attn_varlen_func``
    signature; (B, q, H_q, D).

    Each (batch row, KV head) ``s`` is one sequence: its q tokens with the G query heads of that KV head, against its
    prefix rows followed by its tail (one KV head); flash-attn's causal mask is aligned to the end of each sequence, so
    the new tokens see every earlier row and are causal among themselves.
    """
    batch, query_heads, steps, dim = query.shape
    kv_heads, tail_rows = key.tail.shape[1], key.tail.shape[2]
    groups = query_heads // kv_heads
    sequences = batch * kv_heads
    queries = query.view(batch, kv_heads, groups, steps, dim).transpose(2, 3).reshape(sequences * steps, groups, dim)

    def packed(rows: PerHeadRows) -> torch.Tensor:
        tails = rows.tail.reshape(sequences, tail_rows, dim)
        return torch.cat([part for head, tail in zip(rows.heads(), tails) for part in (head, tail)])[:, None]

    lengths = [length + tail_rows for length in key.lengths]
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    cu_keys = torch.tensor(offsets, dtype=torch.int32, device=query.device)
    cu_queries = torch.arange(0, (sequences + 1) * steps, steps, dtype=torch.int32, device=query.device)
    output = attend(
        queries,
        packed(key),
        packed(value),
        cu_queries,
        cu_keys,
        steps,
        max(lengths),
        softmax_scale=scale,
        causal=True,
    )
    return output.view(batch, kv_heads, steps, groups, dim).transpose(1, 2).reshape(batch, steps, query_heads, dim)


def serving_per_head_rows(attention):
    """``attention`` (a transformers attention function) that hands a per-head layer's rows to
    ``per_head_attention``."""

    @functools.wraps(attention)
    def attend(module, query, key, value, attention_mask, *args, **kwargs):
        if isinstance(key, PerHeadRows):
            return per_head_attention(module, query, key, value, attention_mask, *args, **kwargs)
        return attention(module, query, key, value, attention_mask, *args, **kwargs)

    attend.serves_per_head_rows = True
    return attend


def serve_per_head_rows() -> None:
    """Wrap every registered attention function once (idempotent; kvpress's own patch, applied when kvpress is
    imported, stays inside)."""
    for name, attention in list(ALL_ATTENTION_FUNCTIONS.items()):
        if not getattr(attention, "serves_per_head_rows", False):
            ALL_ATTENTION_FUNCTIONS[name] = serving_per_head_rows(attention)
