"""The authors' released code's surrogate queries: strata midpoints of the prompt, rotated to its last position."""

from __future__ import annotations

import torch

from grkv_core.presses.query_policies.base import AUTHORS_LOSS_WEIGHT, QueryPolicy, QueryRows


class StratifiedQueries(QueryPolicy):
    """``"stratified"`` (the authors' released code): the pre-RoPE queries of the tokens at the midpoints of m equal
    strata of the prompt, each rotated as if at the prompt's last position, non-causal (each sees every key); each row
    weighs 6/m, the authors' code's weight."""

    name = "stratified"

    def prompt_rows(self, m: int, length: int, device: torch.device) -> tuple[torch.Tensor, int]:
        return strata_midpoints(m, length, device), m

    def rope_rows(self, cos: torch.Tensor, sin: torch.Tensor, m: int, length: int) -> QueryRows:
        return QueryRows(*at_last_position(cos, sin, m, length), strata_midpoints(m, length, cos.device), None)

    def row_weight(self, m: int) -> float:
        return AUTHORS_LOSS_WEIGHT / m


def strata_midpoints(count: int, length: int, device: torch.device) -> torch.Tensor:
    """(count,) the midpoints of ``count`` equal strata of positions 0 … ``length`` − 1."""
    return ((torch.arange(count, device=device) * 2 + 1) * length) // (2 * count)


def at_last_position(
    cos: torch.Tensor, sin: torch.Tensor, count: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, count, d) cos and sin of a ``length``-token prompt's last position, repeated ``count`` times (a view)."""
    return cos[:, length - 1 :].expand(-1, count, -1), sin[:, length - 1 :].expand(-1, count, -1)
