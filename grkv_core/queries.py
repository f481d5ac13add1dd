"""Surrogate-query policies: which queries stand in for the unknown future queries (paper Sec. 3.2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvpress.utils import get_prerope_query_states
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from grkv_core.options import PAPER_WINDOW, QUERY_POLICIES


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
    rows = _rope_rows(
        position_embeddings,
        policy,
        min(n_queries, length),
        length,
        module.config.num_attention_heads // module.config.num_key_value_heads,
    )
    if (
        window_projections is not None
        and policy == "window"
        and window_projections.shape[:2] == (hidden_states.shape[0], rows.token_positions.numel())
    ):
        queries = _prerope_from_projections(module, window_projections)
    elif policy == "window":
        # NOTE: a slice (a view), not an index copy: the window is the prompt's last m tokens.
        queries = get_prerope_query_states(module, hidden_states[:, length - rows.token_positions.numel() :])
    else:
        queries = get_prerope_query_states(module, hidden_states[:, rows.token_positions])
    # NOTE: RoPE as q·cos + rotate_half(q)·sin, with rotate_half(q)·sin = roll(q)·sin' (sin' the sine with its first
    # half negated): the same products, one operation instead of four.
    queries = queries * rows.cos + queries.roll(queries.shape[-1] // 2, dims=-1) * rows.signed_sin
    batch, query_heads, m, head_dim = queries.shape
    # NOTE: query head h·groups + g reads KV head h (transformers' repeat_kv layout), so a plain view
    # stacks each KV head's group contiguously.
    stacked = queries.reshape(batch, module.config.num_key_value_heads, -1, head_dim)
    return SurrogateQueries(
        stacked, rows.positions, rows.token_positions, loss_weight=1.0 if policy == "window" else 6.0 / m
    )


@dataclass(frozen=True)
class _RopeRows:
    """The rows of the RoPE tables and the positions that one prefill's surrogate queries share across layers."""

    cos: torch.Tensor  # (B, 1, m, d)
    signed_sin: torch.Tensor  # (B, 1, m, d), the first half negated
    token_positions: torch.Tensor  # (m,)
    positions: torch.Tensor | None  # (groups·m,) or None (non-causal)


# NOTE: every layer of a prefill receives the same (cos, sin) tensors, so the rows built for the first layer serve the
# rest: one entry, keyed by those tensors' identity (and the policy's shape), replaced at the next prefill. Every
# layer then also shares one ``positions`` tensor, which lets ``KeptRegression.stacks_with`` see them equal without
# reading them.
_LAST_ROPE_ROWS: list = [None, None]


def _rope_rows(
    position_embeddings: tuple[torch.Tensor, torch.Tensor], policy: str, m: int, length: int, groups: int
) -> _RopeRows:
    cos, sin = position_embeddings
    key = (policy, m, length, groups)
    cached_key, cached = _LAST_ROPE_ROWS
    if cached_key is not None and cached_key[0] is cos and cached_key[1] is sin and cached_key[2:] == key:
        return cached
    device = cos.device
    if policy == "window":
        token_positions = torch.arange(length - m, length, device=device)
        cos_rows, sin_rows = cos[:, length - m :], sin[:, length - m :]
        positions = token_positions.repeat(groups)
    else:
        token_positions = ((torch.arange(m, device=device) * 2 + 1) * length) // (2 * m)
        cos_rows, sin_rows = cos[:, length - 1 :].expand(-1, m, -1), sin[:, length - 1 :].expand(-1, m, -1)
        positions = None
    half = sin_rows.shape[-1] // 2
    signed_sin = torch.cat([-sin_rows[..., :half], sin_rows[..., half:]], dim=-1)
    rows = _RopeRows(cos_rows.unsqueeze(1), signed_sin.unsqueeze(1), token_positions, positions)
    _LAST_ROPE_ROWS[:] = [(cos, sin, *key), rows]
    return rows


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
