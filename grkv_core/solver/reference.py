"""A deliberately naive GRKV: Alg. 1 written line by line, per head, with an explicit Jacobian.

It is the yardstick for ``grkv_core.solver.grkv_merge``: the tests compare the fast solver against it in
float64, and ``benchmarks/solver_cost.py`` times it to report the fast solver's speed-up. It forms the
(M·d) × (c_G·d) Jacobian with ``torch.func.jacrev`` and solves every system directly, so it is only
usable at small sizes.
"""

from __future__ import annotations

import math

import torch
from torch.func import jacrev

from grkv_core.solver.attention import masked_softmax
from grkv_core.solver.merge import EARLY_STOP_TOL
from grkv_core.solver.safeguard import MAX_HALVINGS


def grkv_merge_reference(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    fixed: torch.Tensor,
    *,
    lambda_k: float = 1e-2,
    lambda_v: float = 1e-2,
    steps: int = 1,
    components: str = "kv",
    query_positions: torch.Tensor | None = None,
    scale: float | None = None,
    safeguard: bool = True,
    ridge_scale: str = "absolute",
    row_weights: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``grkv_merge`` (minus the CG knobs); returns tensors in ``dtype``."""
    batch, heads, _, head_dim = keys.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    merged_keys = torch.empty(batch, heads, kept.shape[2], head_dim, dtype=dtype)
    merged_values = torch.empty_like(merged_keys)
    for b in range(batch):
        for h in range(heads):
            weights = torch.ones(queries.shape[2], dtype=dtype) if row_weights is None else row_weights[b, h].to(dtype)
            merged_keys[b, h], merged_values[b, h] = _merge_one_head(
                queries[b, h].to(dtype),
                keys[b, h].to(dtype),
                values[b, h].to(dtype),
                kept[b, h],
                fixed[b, h],
                lambda_k,
                lambda_v,
                steps,
                components,
                query_positions,
                scale,
                safeguard,
                ridge_scale,
                weights,
            )
    return merged_keys, merged_values


def _merge_one_head(
    queries,
    keys,
    values,
    kept,
    fixed,
    lambda_k,
    lambda_v,
    steps,
    components,
    query_positions,
    scale,
    safeguard,
    ridge_scale,
    weights,
):
    """One head; the loss is Σ_r w_r ‖y_r − a_r V‖², i.e. every row of the regression multiplied by √w_r."""
    n_queries, head_dim = queries.shape
    root = weights.sqrt()[:, None]  # (M, 1): scales a query row (of attention weights or outputs)
    root_flat = weights.sqrt().repeat_interleave(head_dim)  # (M·d,): scales the Jacobian's rows
    if query_positions is None:
        full_visible = kept_visible = None
    else:
        full_visible = torch.arange(keys.shape[0])[None, :] <= query_positions[:, None]
        kept_visible = kept[None, :] <= query_positions[:, None]

    def attend(k, v, visible):
        return masked_softmax(scale * queries @ k.T, visible) @ v

    target = attend(keys, values, full_visible)
    keys0, values0 = keys[kept], values[kept]
    free = ~fixed
    k_t, v_t = keys0.clone(), values0.clone()
    for _ in range(steps):
        k_old, v_old = k_t, v_t
        if components in ("kv", "v"):
            x = masked_softmax(scale * queries @ k_t.T, kept_visible)
            x_free = root * x[:, free]
            residual = root * (target - x @ values0)
            ridge = lambda_v * ((x_free**2).sum() / n_queries if ridge_scale == "relative" else 1.0)
            v_new = values0.clone()
            v_new[free] = values0[free] + _ridge_refit(x_free, residual, ridge)
        else:
            v_new = v_t
        if components in ("kv", "k"):

            def f_free(free_keys):
                k = k_t.clone()
                k[free] = free_keys
                return attend(k, v_new, kept_visible)

            jacobian = root_flat[:, None] * jacrev(f_free)(k_t[free]).reshape(n_queries * head_dim, -1)
            error = root_flat * (target - attend(k_t, v_new, kept_visible)).reshape(-1)
            offset = (k_t[free] - keys0[free]).reshape(-1)
            rhs = error + jacobian @ offset
            ridge = lambda_k * ((jacobian**2).sum() / jacobian.shape[0] if ridge_scale == "relative" else 1.0)
            k_new = keys0.clone()
            k_new[free] = keys0[free] + _ridge_refit(jacobian, rhs[:, None], ridge).reshape(-1, head_dim)
            if safeguard:

                def window_error(k):
                    return (root * (target - attend(k, v_new, kept_visible))).square().sum()

                bar = window_error(k_t)
                lengths = [0.5**i for i in range(MAX_HALVINGS + 1)]
                length = next((t for t in lengths if window_error(k_t + t * (k_new - k_t)) <= bar), 0.0)
                k_new = k_t + length * (k_new - k_t)
        else:
            k_new = k_t
        k_t, v_t = k_new, v_new
        if max((k_t - k_old).abs().max(), (v_t - v_old).abs().max()) <= EARLY_STOP_TOL:
            break
    return k_t, v_t


def _ridge_refit(design: torch.Tensor, rhs: torch.Tensor, ridge: float | torch.Tensor) -> torch.Tensor:
    """designᵀ(design designᵀ + ridge·I)⁻¹ rhs for a (rows, columns) ``design`` and (rows, k) ``rhs``.

    NOTE: at ridge = 0 the minimum-norm least-squares solution is taken from the design matrix itself (SVD driver):
    through the Gram matrix, whose condition number is the square of the design's, a pivoted QR misjudges the rank
    and drops genuine directions once there are more rows than columns.
    """
    if ridge == 0:
        return torch.linalg.lstsq(design, rhs, driver="gelsd").solution
    gram = design @ design.T + ridge * torch.eye(design.shape[0], dtype=design.dtype)
    return design.T @ torch.linalg.solve(gram, rhs)
