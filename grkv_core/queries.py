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
        (m,) the prompt positions whose hidden states produced the rows (``"expected"``: the future positions the
        draws are rotated to).
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
    prompt_projections: torch.Tensor | None = None,
    memo: PolicyRowsMemo | None = None,
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
    policy : {"window", "stratified", "mixture", "expected"}
        ``"window"`` (the paper): the last ``n_queries`` prompt tokens, RoPE at their true positions,
        causal. ``"stratified"`` (the authors' released code): ``n_queries`` tokens at the midpoints of
        equal strata of the prompt, pre-RoPE queries rotated as if at the last position, non-causal.
        ``"mixture"``: the last ⌈m/2⌉ tokens as the window policy's, and ⌊m/2⌋ strata midpoints of the prompt
        before them as the stratified policy's (which see every key). ``"expected"``: ``n_queries`` queries drawn
        from the Gaussian that kvpress's ``ExpectedAttentionPress`` fits, the mean and covariance of the pre-RoPE
        queries of the prompt after its first ``EXPECTED_SINKS`` tokens (at most ``EXPECTED_STATISTICS_TOKENS`` of
        them, evenly strided), each draw rotated to one of the next ``EXPECTED_FUTURE_POSITIONS`` positions,
        non-causal. Every policy but the window weights each row 6/``n_queries`` (the authors' code's weight for
        its non-causal rows).
    n_queries : int
        m, the number of query rows per query head: at most the prompt's length, but for ``"expected"``, any number.
    prompt_projections : torch.Tensor, optional
        (B, r, H_q·d) the ``q_proj`` outputs of the prompt rows the policy reads (``prompt_rows``), kept from the
        prefill's own forward: the queries are then built from them instead of projecting the hidden states again.
    memo : PolicyRowsMemo, optional
        Where the rows that every layer of one prefill shares (RoPE rows, positions) are kept: computed at the first
        layer, reused by the rest. None: computed anew.
    """
    if policy not in QUERY_POLICIES:
        raise ValueError(f"query_policy must be one of {QUERY_POLICIES}, got {policy!r}")
    length = hidden_states.shape[1]
    m = n_queries if policy == "expected" else min(n_queries, length)
    groups = module.config.num_attention_heads // module.config.num_key_value_heads
    rows = (PolicyRowsMemo() if memo is None else memo).rows(position_embeddings, policy, m, length, groups)
    if prompt_projections is not None and prompt_projections.shape[:2] == (hidden_states.shape[0], rows.read_count):
        queries = _prerope_from_projections(module, prompt_projections)
    else:
        # NOTE: a slice (the window's, the expected policy's strided statistics) reads a view, not an index copy.
        queries = get_prerope_query_states(module, hidden_states[:, rows.read])
    if policy == "expected":
        queries = _expected_draws(queries, rows.draws)
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


# The expected policy's statistics and future positions: kvpress's ExpectedAttentionPress's defaults (its n_sink and
# n_future_positions); its statistics read every prompt token, these at most 1,024 of them, evenly strided.
EXPECTED_SINKS = 4
EXPECTED_FUTURE_POSITIONS = 512
EXPECTED_STATISTICS_TOKENS = 1024
EXPECTED_DRAWS_SEED = 0


def _expected_draws(statistics_queries: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """(B, H_q, N, d) pre-RoPE queries -> (B, H_q, m, d) draws from the Gaussian of their mean and covariance.

    NOTE: with the centred queries X (N, d) per head, μ + Xᵀw/√N for w ~ N(0, I_N) has mean μ and covariance
    XᵀX/N, the queries' own: no factorisation of the covariance, one matmul.
    """
    mean = statistics_queries.mean(dim=2, keepdim=True)
    return mean + draws.to(statistics_queries.dtype) @ (statistics_queries - mean)


@dataclass(frozen=True)
class _PolicyRows:
    """What one prefill's surrogate queries share across layers: the rows of the RoPE tables, the positions, and
    (expected policy) the tokens whose queries give the statistics and the standard normal draws."""

    cos: torch.Tensor  # (B, 1, m, d)
    signed_sin: torch.Tensor  # (B, 1, m, d), the first half negated
    token_positions: torch.Tensor  # (m,) the prompt positions of the rows' tokens (expected: the future positions)
    positions: torch.Tensor | None  # (groups·m,) or None (non-causal)
    read: slice | torch.Tensor  # the prompt rows whose queries the policy reads (``prompt_rows``)
    read_count: int  # how many
    draws: torch.Tensor | None = None  # (m, N) ``standard_draws``


class PolicyRowsMemo:
    """The last prefill's ``_PolicyRows``, for the layers after its first (one per press context).

    NOTE: every layer of a prefill receives the same (cos, sin) tensors, so the rows built for the first layer serve the
    rest: one entry, keyed by those tensors' identity (and the policy's shape), replaced at the next prefill. Every
    layer then also shares one ``positions`` tensor, which lets a stacked solve see them equal without reading them.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._rows: _PolicyRows | None = None

    def rows(
        self, position_embeddings: tuple[torch.Tensor, torch.Tensor], policy: str, m: int, length: int, groups: int
    ) -> _PolicyRows:
        cos, sin = position_embeddings
        key = (policy, m, length, groups)
        if self._key is not None and self._key[0] is cos and self._key[1] is sin and self._key[2:] == key:
            return self._rows
        self._rows = _policy_rows(cos, sin, policy, m, length, groups)
        self._key = (cos, sin, *key)
        return self._rows


def prompt_rows(policy: str, m: int, length: int, device: torch.device) -> tuple[slice | torch.Tensor, int]:
    """The prompt rows whose pre-RoPE queries ``policy`` reads with m queries from a ``length``-token prompt (an index
    of the prompt axis: a slice, or a (r,) tensor), and how many: the window's last m, the strata midpoints, both
    (``"mixture"``), or the tokens of the expected policy's statistics."""
    if policy == "window":
        return slice(length - m, length), m
    if policy == "stratified":
        return _strata_midpoints(m, length, device), m
    if policy == "mixture":
        window, strata = (m + 1) // 2, m // 2
        rows = torch.cat(
            [torch.arange(length - window, length, device=device), _strata_midpoints(strata, length - window, device)]
        )
        return rows, m
    skipped = min(EXPECTED_SINKS, length - 1)
    statistics = slice(skipped, length, -(-(length - skipped) // EXPECTED_STATISTICS_TOKENS))
    return statistics, len(range(length)[statistics])


def _policy_rows(cos: torch.Tensor, sin: torch.Tensor, policy: str, m: int, length: int, groups: int) -> _PolicyRows:
    device = cos.device
    last = length - 1
    read, read_count = prompt_rows(policy, m, length, device)
    draws = None
    if policy == "window":
        token_positions = torch.arange(length - m, length, device=device)
        cos_rows, sin_rows = cos[:, length - m :], sin[:, length - m :]
        positions = token_positions.repeat(groups)
    elif policy == "stratified":
        token_positions = read
        cos_rows, sin_rows = cos[:, last:].expand(-1, m, -1), sin[:, last:].expand(-1, m, -1)
        positions = None
    elif policy == "mixture":
        window, strata = (m + 1) // 2, m // 2
        token_positions = read
        cos_rows = torch.cat([cos[:, length - window :], cos[:, last:].expand(-1, strata, -1)], dim=1)
        sin_rows = torch.cat([sin[:, length - window :], sin[:, last:].expand(-1, strata, -1)], dim=1)
        # NOTE: a stratum's row sits at the last position, so the causal mask lets it see every key.
        positions = torch.cat([token_positions[:window], torch.full((strata,), last, device=device)]).repeat(groups)
    else:
        offsets = _future_offsets(m, length, device)
        token_positions = last + offsets
        cos_rows, sin_rows = _rotation_sum(cos, sin, last, offsets)
        positions = None
        draws = standard_draws(m, read_count)
        # NOTE: from pinned memory the copy to a GPU is asynchronous: no synchronisation of the host with the device.
        draws = (draws.pin_memory() if device.type == "cuda" else draws).to(device, non_blocking=True)
    half = sin_rows.shape[-1] // 2
    signed_sin = torch.cat([-sin_rows[..., :half], sin_rows[..., half:]], dim=-1)
    return _PolicyRows(
        cos_rows.unsqueeze(1), signed_sin.unsqueeze(1), token_positions, positions, read, read_count, draws
    )


def standard_draws(m: int, tokens: int) -> torch.Tensor:
    """(m, ``tokens``) the expected policy's fixed weights, N(0, 1/``tokens``) each (``EXPECTED_DRAWS_SEED``): the
    same draws at every layer and prefill, so a merge is reproducible."""
    generator = torch.Generator().manual_seed(EXPECTED_DRAWS_SEED)
    return torch.randn(m, tokens, generator=generator) / tokens**0.5


def _strata_midpoints(count: int, length: int, device: torch.device) -> torch.Tensor:
    """(count,) the midpoints of ``count`` equal strata of positions 0 … ``length`` − 1."""
    return ((torch.arange(count, device=device) * 2 + 1) * length) // (2 * count)


def _future_offsets(m: int, length: int, device: torch.device) -> torch.Tensor:
    """(m,) offsets in 1 … min(``EXPECTED_FUTURE_POSITIONS``, ``length`` − 1), spread evenly: how far past the
    prompt's last position each expected draw is rotated (the offset's RoPE row must lie in the prompt's table)."""
    future = max(1, min(EXPECTED_FUTURE_POSITIONS, length - 1))
    return ((torch.arange(m, device=device) + 1) * future + m - 1) // m


def _rotation_sum(
    cos: torch.Tensor, sin: torch.Tensor, position: int, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, m, d) cos and sin of the RoPE angles of ``position`` + ``offsets``, from the table rows of both terms:
    cos(a + b) = cos a cos b − sin a sin b, sin(a + b) = sin a cos b + cos a sin b.

    NOTE: the tables hold s·cos and s·sin (s the RoPE type's attention scaling, 1 but for YaRN-like types), so the
    products hold s²; row 0 (position 0) holds s itself, which divides them back.
    """
    cos_a, sin_a = cos[:, position : position + 1], sin[:, position : position + 1]
    cos_b, sin_b = cos[:, offsets], sin[:, offsets]
    scaling = cos[:, :1, :1]
    return (cos_a * cos_b - sin_a * sin_b) / scaling, (sin_a * cos_b + cos_a * sin_b) / scaling


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
