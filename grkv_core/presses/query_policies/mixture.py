"""Half window, half strata: the paper's last tokens and the authors' code's strata of the prompt before them."""

from __future__ import annotations

import torch

from grkv_core.presses.query_policies.base import QueryPolicy, QueryRows
from grkv_core.presses.query_policies.stratified import StratifiedQueries, at_last_position, strata_midpoints
from grkv_core.presses.query_policies.window import WindowQueries, last_positions


class MixtureQueries(QueryPolicy):
    """``"mixture"``: the last ⌈m/2⌉ prompt tokens as ``WindowQueries``' rows, and ⌊m/2⌋ strata midpoints of the
    prompt before them as ``StratifiedQueries``' (rotated to the last position, seeing every key); each row weighs 6/m,
    as the stratified policy's."""

    name = "mixture"

    def prompt_rows(self, m: int, length: int, device: torch.device) -> tuple[torch.Tensor, int]:
        window, strata = _halves(m)
        return torch.cat([last_positions(window, length, device), strata_midpoints(strata, length - window, device)]), m

    def rope_rows(self, cos: torch.Tensor, sin: torch.Tensor, m: int, length: int) -> QueryRows:
        window, strata = _halves(m)
        recent = WindowQueries().rope_rows(cos, sin, window, length)
        strata_cos, strata_sin = at_last_position(cos, sin, strata, length)
        midpoints = strata_midpoints(strata, length - window, cos.device)
        # NOTE: a stratum's row sits at the last position, so the causal mask lets it see every key.
        at_last = torch.full((strata,), length - 1, device=cos.device)
        return QueryRows(
            torch.cat([recent.cos, strata_cos], dim=1),
            torch.cat([recent.sin, strata_sin], dim=1),
            torch.cat([recent.token_positions, midpoints]),
            torch.cat([recent.causal_positions, at_last]),
        )

    row_weight = StratifiedQueries.row_weight


def _halves(m: int) -> tuple[int, int]:
    """How many of m rows are the window's (⌈m/2⌉) and the strata's (⌊m/2⌋)."""
    return (m + 1) // 2, m // 2
