"""Diagnostics of a compressed cache: how far its attention outputs drift from the full cache's."""

from __future__ import annotations

import math

import torch

from grkv_core.solver import masked_softmax


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
        queries, full_keys, full_values, compressed_keys, compressed_values,
        query_positions=query_positions, compressed_positions=compressed_positions, scale=scale,
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
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(batch, head) Σ‖Y_full − Y_comp‖² and Σ‖Y_full‖², each (B, H_kv) float32.

    Arguments as in ``reconstruction_loss``.
    """
    if queries.ndim != 4 or full_keys.ndim != 4 or compressed_keys.ndim != 4:
        raise ValueError("queries, full_keys and compressed_keys must all be 4-D (B, H_kv, length, d)")
    if full_values.shape != full_keys.shape or compressed_values.shape != compressed_keys.shape:
        raise ValueError("values must have the same shape as their keys")
    if query_positions is not None and compressed_positions is None:
        raise ValueError("compressed_positions is required when query_positions is given")
    scale = 1.0 / math.sqrt(full_keys.shape[-1]) if scale is None else scale
    scaled = queries.float() * scale
    full_visible = compressed_visible = None
    if query_positions is not None:
        positions = query_positions.to(full_keys.device).long()
        full_visible = torch.arange(full_keys.shape[2], device=full_keys.device) <= positions[:, None]
        compressed_visible = compressed_positions.long()[:, :, None, :] <= positions[None, None, :, None]
    full_out = masked_softmax(scaled @ full_keys.float().transpose(-1, -2), full_visible) @ full_values.float()
    comp_out = (
        masked_softmax(scaled @ compressed_keys.float().transpose(-1, -2), compressed_visible)
        @ compressed_values.float()
    )
    return (full_out - comp_out).square().sum(dim=(-2, -1)), full_out.square().sum(dim=(-2, -1))
