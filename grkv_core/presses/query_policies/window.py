"""The paper's surrogate queries: the last m prompt tokens at their own positions, causal."""

from __future__ import annotations

import torch

from grkv_core.presses.query_policies.base import QueryPolicy, QueryRows


class WindowQueries(QueryPolicy):
    """``"window"`` (the paper): the queries of the last m prompt tokens, rotated at their true positions and causal
    (each sees the keys up to its own position); each row weighs 1, so λ is the ridge as given. Its regression target,
    their attention outputs over the full cache, is what the prefill's forward computes for those tokens."""

    name = "window"
    target_in_forward = True

    def prompt_rows(self, m: int, length: int, device: torch.device) -> tuple[slice, int]:
        return slice(length - m, length), m

    def rope_rows(self, cos: torch.Tensor, sin: torch.Tensor, m: int, length: int) -> QueryRows:
        positions = last_positions(m, length, cos.device)
        return QueryRows(cos[:, length - m :], sin[:, length - m :], positions, positions)


def last_positions(m: int, length: int, device: torch.device) -> torch.Tensor:
    """(m,) the last m positions of a ``length``-token prompt."""
    return torch.arange(length - m, length, device=device)
