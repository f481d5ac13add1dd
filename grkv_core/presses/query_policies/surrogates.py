"""The surrogate queries of one attention layer under any ``QueryPolicy``, and what a prefill's layers share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvpress.utils import get_prerope_query_states
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from grkv_core.catalog import QUERY_POLICIES
from grkv_core.options import PAPER_WINDOW
from grkv_core.presses.query_policies.base import QueryPolicy
from grkv_core.presses.query_policies.window import WindowQueries


def query_policy(name: str) -> QueryPolicy:
    """A new instance of the policy registered as ``name`` (``QUERY_POLICIES``); a one-line ValueError for any other
    name."""
    return QUERY_POLICIES.check(name).load()()


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
        (m,) the positions the rows stand for (``QueryRows.token_positions``).
    loss_weight : float
        Per-row weight of the reconstruction term (``QueryPolicy.row_weight``; the ridge terms are unweighted).
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
    policy: QueryPolicy | None = None,
    n_queries: int = PAPER_WINDOW,
    prompt_projections: torch.Tensor | None = None,
    memo: PolicyRowsMemo | None = None,
    cache_rows: int | None = None,
) -> SurrogateQueries:
    """Build the surrogate queries of one attention layer.

    Parameters
    ----------
    module : nn.Module
        The attention layer (Llama-like: ``q_proj``, optional ``q_norm``).
    hidden_states : torch.Tensor
        (B, n, hidden) the layer's input over the whole prompt.
    position_embeddings : tuple of torch.Tensor
        (cos, sin), each (B, n, d): the RoPE tables of the prompt positions 0 … n − 1.
    policy : QueryPolicy, optional
        Which queries (``query_policy(name)``); None: the paper's, ``WindowQueries``.
    n_queries : int
        The m asked for (the policy's ``row_count`` decides how many it builds).
    prompt_projections : torch.Tensor, optional
        (B, r, H_q·d) the ``q_proj`` outputs of the prompt rows the policy reads (``QueryPolicy.prompt_rows``), kept
        from the prefill's own forward: the queries are then built from them instead of projecting the hidden states
        again.
    memo : PolicyRowsMemo, optional
        Where the rows that every layer of one prefill shares (RoPE rows, positions) are kept: computed at the first
        layer, reused by the rest. None: computed anew.
    cache_rows : int, optional
        The rows of the cache the queries attend to, when ``hidden_states`` are only its last tokens (a compression
        while decoding): the positions are then cache rows, ``cache_rows - n`` after the tokens' own. None: n.
    """
    policy = WindowQueries() if policy is None else policy
    length = hidden_states.shape[1]
    m = policy.row_count(n_queries, length)
    groups = module.config.num_attention_heads // module.config.num_key_value_heads
    rows = (PolicyRowsMemo() if memo is None else memo).rows(position_embeddings, policy, m, length, groups)
    if prompt_projections is not None and prompt_projections.shape[:2] == (hidden_states.shape[0], rows.read_count):
        queries = _prerope_from_projections(module, prompt_projections)
    else:
        # NOTE: a slice (the window's, the expected policy's strided statistics) reads a view, not an index copy.
        queries = get_prerope_query_states(module, hidden_states[:, rows.read])
    queries = policy.queries_from(queries, m)
    # NOTE: RoPE as q·cos + rotate_half(q)·sin, with rotate_half(q)·sin = roll(q)·sin' (sin' the sine with its first
    # half negated): the same products, one operation instead of four.
    queries = queries * rows.cos + queries.roll(queries.shape[-1] // 2, dims=-1) * rows.signed_sin
    batch, _, _, head_dim = queries.shape
    # NOTE: query head h·groups + g reads KV head h (transformers' repeat_kv layout), so a plain view
    # stacks each KV head's group contiguously.
    stacked = queries.reshape(batch, module.config.num_key_value_heads, -1, head_dim)
    positions, token_positions = rows.positions, rows.token_positions
    if cache_rows is not None and cache_rows != length:
        # NOTE: the tokens are the cache's last rows (rows in stream order): causality between rows is shifted alike.
        offset = cache_rows - length
        positions = None if positions is None else positions + offset
        token_positions = token_positions + offset
    return SurrogateQueries(stacked, positions, token_positions, loss_weight=policy.row_weight(m))


@dataclass(frozen=True)
class _PolicyRows:
    """What one prefill's surrogate queries share across layers: the rows of the RoPE tables, the positions, and the
    prompt rows read."""

    cos: torch.Tensor  # (B, 1, m, d)
    signed_sin: torch.Tensor  # (B, 1, m, d), the first half negated
    token_positions: torch.Tensor  # (m,) ``QueryRows.token_positions``
    positions: torch.Tensor | None  # (groups·m,) or None (non-causal)
    read: slice | torch.Tensor  # the prompt rows whose queries the policy reads (``QueryPolicy.prompt_rows``)
    read_count: int  # how many


class PolicyRowsMemo:
    """The last prefill's ``_PolicyRows``, for the layers after its first (one per press context).

    NOTE: every layer of a prefill receives the same (cos, sin) tensors, so the rows built for the first layer serve the
    rest: one entry, keyed by those tensors' identity (and the policy's identity and shape), replaced at the next
    prefill. Every layer then also shares one ``positions`` tensor, which lets a stacked solve see them equal without
    reading them.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._rows: _PolicyRows | None = None

    def rows(
        self,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        policy: QueryPolicy,
        m: int,
        length: int,
        groups: int,
    ) -> _PolicyRows:
        cos, sin = position_embeddings
        key = (policy, m, length, groups)
        if self._key is not None and self._key[0] is cos and self._key[1] is sin and self._key[2:] == key:
            return self._rows
        self._rows = _policy_rows(cos, sin, policy, m, length, groups)
        self._key = (cos, sin, *key)
        return self._rows


def _policy_rows(
    cos: torch.Tensor, sin: torch.Tensor, policy: QueryPolicy, m: int, length: int, groups: int
) -> _PolicyRows:
    read, read_count = policy.prompt_rows(m, length, cos.device)
    rows = policy.rope_rows(cos, sin, m, length)
    half = rows.sin.shape[-1] // 2
    signed_sin = torch.cat([-rows.sin[..., :half], rows.sin[..., half:]], dim=-1)
    positions = None if rows.causal_positions is None else rows.causal_positions.repeat(groups)
    return _PolicyRows(
        rows.cos.unsqueeze(1), signed_sin.unsqueeze(1), rows.token_positions, positions, read, read_count
    )


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
