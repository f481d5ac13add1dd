"""Surrogate-query policies: which queries stand in for the unknown future queries (paper Sec. 3.2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvpress.utils import get_prerope_query_states
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention
from transformers.models.llama.modeling_llama import rotate_half
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from grkv_core.config import PAPER_WINDOW, QUERY_POLICIES



@dataclass(frozen=True)
class SurrogateQueries:
    """Queries for one layer, grouped by KV head.

    Attributes
    ----------
    queries : torch.Tensor
        (B, H_kv, groups·m, d) post-RoPE queries; the ``groups`` query heads sharing a KV head are stacked
        along the third axis (group-major), as ``grkv_merge`` expects.
    positions : torch.Tensor or None
        (groups·m,) positions of the query rows for causal attention; None for non-causal policies.
    token_positions : torch.Tensor
        (m,) the prompt positions whose hidden states produced the queries.
    loss_weight : float
        Per-row weight of the reconstruction term (the ridge terms are unweighted).
    """

    queries: torch.Tensor
    positions: torch.Tensor | None
    token_positions: torch.Tensor
    loss_weight: float


def surrogate_queries(
    module: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    *,
    policy: str = "window",
    n_queries: int = PAPER_WINDOW,
    window_projections: torch.Tensor | None = None,
) -> SurrogateQueries:
    """Build the surrogate queries of one attention layer.

    Parameters
    ----------
    module : nn.Module
        The attention layer (Llama-like: ``q_proj``, optional ``q_norm``).
    hidden_states : torch.Tensor
        (B, n, hidden) the layer's input over the whole prompt.
    position_embeddings : tuple of torch.Tensor
        (cos, sin), each (B, n, d): the RoPE tables of the prompt positions.
    policy : {"window", "stratified"}
        ``"window"`` (the paper): the last ``n_queries`` prompt tokens, RoPE at their true positions,
        causal. ``"stratified"`` (the authors' released code): ``n_queries`` tokens at the midpoints of
        equal strata of the prompt, pre-RoPE queries rotated as if at the last position, non-causal,
        each row weighted 6/``n_queries``.
    n_queries : int
        m, the number of prompt tokens used.
    window_projections : torch.Tensor, optional
        (B, m, H_q·d) the ``q_proj`` outputs of the window's tokens, kept from the prefill's own forward
        (window policy only): the queries are then built from them instead of projecting the hidden states
        again.
    """
    if policy not in QUERY_POLICIES:
        raise ValueError(f"query_policy must be one of {QUERY_POLICIES}, got {policy!r}")
    length = hidden_states.shape[1]
    m = min(n_queries, length)
    device = hidden_states.device
    cos, sin = position_embeddings
    if policy == "window":
        # NOTE: slices (views), not index copies: the window is the prompt's last m tokens.
        token_positions = torch.arange(length - m, length, device=device)
        hidden = hidden_states[:, length - m:]
        cos, sin = cos[:, length - m:], sin[:, length - m:]
    else:
        token_positions = ((torch.arange(m, device=device) * 2 + 1) * length) // (2 * m)
        hidden = hidden_states[:, token_positions]
        cos, sin = cos[:, length - 1:].expand(-1, m, -1), sin[:, length - 1:].expand(-1, m, -1)
    if window_projections is not None and policy == "window" and window_projections.shape[:2] == hidden.shape[:2]:
        queries = _prerope_from_projections(module, window_projections)
    else:
        queries = get_prerope_query_states(module, hidden)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    queries = queries * cos + rotate_half(queries) * sin
    batch, query_heads, _, head_dim = queries.shape
    kv_heads = module.config.num_key_value_heads
    groups = query_heads // kv_heads
    # NOTE: query head h·groups + g reads KV head h (transformers' repeat_kv layout), so a plain view
    # stacks each KV head's group contiguously.
    stacked = queries.reshape(batch, kv_heads, groups * m, head_dim)
    if policy == "window":
        return SurrogateQueries(stacked, token_positions.repeat(groups), token_positions, loss_weight=1.0)
    return SurrogateQueries(stacked, None, token_positions, loss_weight=6.0 / m)


def _prerope_from_projections(module: nn.Module, projections: torch.Tensor) -> torch.Tensor:
    """(B, m, H_q·d) ``q_proj`` outputs -> (B, H_q, m, d) pre-RoPE queries, as ``get_prerope_query_states``.

    NOTE: mirrors kvpress's ``get_prerope_query_states`` after its projection (the reshape, then the QK norm of
    Qwen3 and Gemma3), so both paths give the same queries.
    """
    batch, length, _ = projections.shape
    queries = projections.view(batch, length, module.config.num_attention_heads, module.head_dim).transpose(1, 2)
    if isinstance(module, (Qwen3Attention, Gemma3Attention)):
        queries = module.q_norm(queries)
    return queries
