"""Reconstruction discrepancy of a compressed cache: how far its attention outputs drift from the full cache's."""

from __future__ import annotations

import math

import torch

from grkv_core.solver.attention import full_cache_outputs, masked_softmax


def reconstruction_loss(
    queries: torch.Tensor,
    full_keys: torch.Tensor,
    full_values: torch.Tensor,
    compressed_keys: torch.Tensor,
    compressed_values: torch.Tensor,
    *,
    query_positions: torch.Tensor | None = None,
    compressed_positions: torch.Tensor | None = None,
    scale: float | None = None,
) -> float:
    """The paper's normalised discrepancy Σ‖Y_full − Y_comp‖² / Σ‖Y_full‖² over all queries and heads.

    Parameters
    ----------
    queries : torch.Tensor
        (B, H_kv, M, d) post-RoPE queries (GQA groups stacked along M): the surrogate window, or held-out
        queries such as those of the first generated tokens.
    full_keys, full_values : torch.Tensor
        (B, H_kv, n, d) the uncompressed cache; key i sits at position i.
    compressed_keys, compressed_values : torch.Tensor
        (B, H_kv, c, d) the compressed (evicted or merged) cache.
    query_positions : torch.Tensor, optional
        (M,) positions of the query rows; when given attention is causal on both caches.
    compressed_positions : torch.Tensor, optional
        (B, H_kv, c) original positions of the compressed entries; required with ``query_positions``.
    scale : float, optional
        Softmax scale, 1/sqrt(d) by default.

    Returns
    -------
    float
        The normalised discrepancy (0 means the compressed cache reproduces the full outputs exactly).
    """
    error, reference = discrepancy_per_head(
        queries,
        full_keys,
        full_values,
        compressed_keys,
        compressed_values,
        query_positions=query_positions,
        compressed_positions=compressed_positions,
        scale=scale,
    )
    return float(error.sum() / reference.sum().clamp_min(1e-30))


def discrepancy_per_head(
    queries: torch.Tensor,
    full_keys: torch.Tensor,
    full_values: torch.Tensor,
    compressed_keys: torch.Tensor,
    compressed_values: torch.Tensor,
    *,
    query_positions: torch.Tensor | None = None,
    compressed_positions: torch.Tensor | None = None,
    compressed_mask: torch.Tensor | None = None,
    scale: float | None = None,
    full_outputs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(batch, head) Σ‖Y_full − Y_comp‖² and Σ‖Y_full‖², each (B, H_kv) float32.

    Arguments as in ``reconstruction_loss``, plus ``compressed_mask`` (B, H_kv, c) bool: False entries of the
    compressed cache are invisible (per-head budgets realised by masking, e.g. AdaKV); and ``full_outputs``
    (B, H_kv, M, d): Y_full when the caller already has it (``solver.full_cache_outputs``), to compare several
    compressed caches against one full-cache pass.
    """
    if queries.ndim != 4 or full_keys.ndim != 4 or compressed_keys.ndim != 4:
        raise ValueError("queries, full_keys and compressed_keys must all be 4-D (B, H_kv, length, d)")
    if full_values.shape != full_keys.shape or compressed_values.shape != compressed_keys.shape:
        raise ValueError("values must have the same shape as their keys")
    if query_positions is not None and compressed_positions is None:
        raise ValueError("compressed_positions is required when query_positions is given")
    if full_outputs is not None and full_outputs.shape != queries.shape:
        raise ValueError(
            f"full_outputs must have the shape of queries {tuple(queries.shape)}, got {tuple(full_outputs.shape)}"
        )
    scale = 1.0 / math.sqrt(full_keys.shape[-1]) if scale is None else scale
    compressed_visible = None
    if query_positions is not None:
        positions = query_positions.to(full_keys.device).long()
        compressed_visible = compressed_positions.long()[:, :, None, :] <= positions[None, None, :, None]
    if compressed_mask is not None:
        mask = compressed_mask[:, :, None, :]
        compressed_visible = mask if compressed_visible is None else compressed_visible & mask
    if full_outputs is None:
        full_outputs = full_cache_outputs(queries, full_keys, full_values, query_positions=query_positions, scale=scale)
    full_out = full_outputs.float()
    comp_out = (
        masked_softmax((queries.float() * scale) @ compressed_keys.float().transpose(-1, -2), compressed_visible)
        @ compressed_values.float()
    )
    return (full_out - comp_out).square().sum(dim=(-2, -1)), full_out.square().sum(dim=(-2, -1))


def recover_kept_positions(compressed_keys: torch.Tensor, full_keys: torch.Tensor) -> torch.Tensor:
    """Positions in the full cache of the rows of a plainly evicted cache, found by exact row match.

    Parameters
    ----------
    compressed_keys : torch.Tensor
        (B, H_kv, c, d) rows copied verbatim from ``full_keys`` (any order).
    full_keys : torch.Tensor
        (B, H_kv, n, d).

    Returns
    -------
    torch.Tensor
        (B, H_kv, c) long positions.

    Raises
    ------
    ValueError
        If some compressed row is not a row of the full cache (e.g. the cache was merged).
    """
    # NOTE: a row's fingerprint is a weighted sum of its raw bit patterns in wrapping int64 arithmetic, which
    # is exact and independent of summation order: identical rows get identical fingerprints whatever the
    # shapes of the two calls (a floating-point dot product is not: its rounding follows the GEMV blocking).
    # Every candidate is then confirmed by an exact comparison.
    full_prints, compressed_prints = _row_fingerprints(full_keys), _row_fingerprints(compressed_keys)
    order = full_prints.argsort(dim=-1)
    sorted_prints = full_prints.gather(-1, order)
    slot = torch.searchsorted(sorted_prints.contiguous(), compressed_prints.contiguous()).clamp(
        max=full_keys.shape[2] - 1
    )
    positions = order.gather(-1, slot)
    matched = full_keys.gather(2, positions.unsqueeze(-1).expand_as(compressed_keys))
    if not torch.equal(matched, compressed_keys):
        raise ValueError("compressed rows are not verbatim rows of the full cache (was it merged?)")
    return positions


_INTEGER_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _row_fingerprints(rows: torch.Tensor) -> torch.Tensor:
    """(..., d) float rows -> (...) int64 fingerprints that are equal for bit-identical rows."""
    bits = rows.contiguous().view(_INTEGER_OF_WIDTH[rows.element_size()]).long()
    generator = torch.Generator().manual_seed(0)
    weights = torch.randint(1, 2**62, (rows.shape[-1],), generator=generator, dtype=torch.int64) * 2 + 1
    return (bits * weights.to(rows.device)).sum(dim=-1)
