"""What GRKV does with a merge once solved: the acceptance rules (the trust-region caps are the solver's,
``grkv_core.solver.trust_region``).

Each takes a solved merge and the evicted cache it started from, per (batch, KV head); ``accept="always"`` (the
paper) uses the merge as it is.
"""

from __future__ import annotations

from typing import Callable

import torch

from grkv_core.options import SolverOptions
from grkv_core.solver.losses import discrepancy_per_head
from grkv_core.solver.regression import KeptRegression

# (regression, options) -> (B, H_kv, c, d) merged keys and values: the solve, caps included.
Solve = Callable[[KeptRegression, SolverOptions], tuple[torch.Tensor, torch.Tensor]]


def passes_validation(
    regression: KeptRegression,
    options: SolverOptions,
    solve: Solve,
    keys: torch.Tensor,
    values: torch.Tensor,
    full_outputs: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """(B, H_kv) bool (``accept="validation"``): the heads where a merge fitted on the ``window`` surrogate tokens of
    even index has a lower loss than the evicted cache on those of odd index (every query head's rows of them: the
    rows of a KV head repeat the window once per query head)."""
    fit, held_out = 0, 1

    def rows(tensor: torch.Tensor | None, parity: int) -> torch.Tensor | None:
        """The query rows of ``tensor`` ((..., M, d), (..., M) or (M,)) whose token has index ``parity`` modulo 2.

        NOTE: by a strided view of the (groups, window) row layout, not a boolean mask, whose selection's shape
        would be read on the host (a GPU synchronisation)."""
        if tensor is None:
            return None
        axis = tensor.ndim - 2 if tensor.ndim == 4 else tensor.ndim - 1
        every_other = (slice(None),) * (axis + 1) + (slice(parity, None, 2),)
        return tensor.unflatten(axis, (-1, window))[every_other].flatten(axis, axis + 1)

    positions = regression.query_positions
    fitted = KeptRegression.of(
        rows(regression.queries, fit),
        keys,
        values,
        regression.kept,
        regression.fixed,
        query_positions=rows(positions, fit),
        scale=regression.scale,
        full_outputs=rows(full_outputs, fit),
        row_weights=rows(regression.row_weights, fit),
        check_values=False,
    )
    candidates = [(regression.kept_keys, regression.kept_values), solve(fitted, options)]
    evicted, merged = (
        discrepancy_per_head(
            rows(regression.queries, held_out),
            keys,
            values,
            k,
            v,
            query_positions=rows(positions, held_out),
            compressed_positions=regression.kept,
            scale=regression.scale,
            full_outputs=rows(full_outputs, held_out),
        )[0]
        for k, v in candidates
    )
    return merged < evicted


def lowest_window_loss(
    candidates: list[tuple[torch.Tensor, torch.Tensor]],
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    query_positions: torch.Tensor | None,
    scale: float,
    full_outputs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, the (keys, values) candidate with the lowest window discrepancy (``accept="objective"``, the
    authors' code: of the evicted cache, the values-only merge and the full merge); ties go to the earlier one."""
    errors = torch.stack(
        [
            discrepancy_per_head(
                queries,
                keys,
                values,
                k,
                v,
                query_positions=query_positions,
                compressed_positions=kept,
                scale=scale,
                full_outputs=full_outputs,
            )[0]
            for k, v in candidates
        ]
    )
    best = errors.argmin(dim=0)[..., None, None]

    def choose(options: list[torch.Tensor]) -> torch.Tensor:
        chosen = options[-1]
        for index in range(len(options) - 2, -1, -1):
            chosen = torch.where(best == index, options[index], chosen)
        return chosen

    return choose([k for k, _ in candidates]), choose([v for _, v in candidates])
