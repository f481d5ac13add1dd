"""Draws from the prompt's query distribution at future positions, as kvpress's ``ExpectedAttentionPress`` models it."""

from __future__ import annotations

import torch

from grkv_core.presses.query_policies.base import AUTHORS_LOSS_WEIGHT, QueryPolicy, QueryRows

# The statistics and future positions: kvpress's ExpectedAttentionPress's defaults (its n_sink and n_future_positions);
# its statistics read every prompt token, these at most 1,024 of them, evenly strided.
EXPECTED_SINKS = 4
EXPECTED_FUTURE_POSITIONS = 512
EXPECTED_STATISTICS_TOKENS = 1024
EXPECTED_DRAWS_SEED = 0


class ExpectedQueries(QueryPolicy):
    """``"expected"``: m pre-RoPE queries drawn from the Gaussian that kvpress's ``ExpectedAttentionPress`` fits, the
    mean and covariance of the pre-RoPE queries of the prompt after its first ``EXPECTED_SINKS`` tokens (at most
    ``EXPECTED_STATISTICS_TOKENS`` of them, evenly strided), each draw rotated to one of the next
    ``EXPECTED_FUTURE_POSITIONS`` positions, non-causal; any number of rows, even more than the prompt's tokens; each
    row weighs 6/m, as the authors' code's strata.

    NOTE: the draws are fixed (``standard_draws``), the same at every layer and prefill, so a merge is reproducible;
    an instance keeps the last ones on their device (one instance per press context).
    """

    name = "expected"

    def __init__(self) -> None:
        self._draws: tuple[tuple, torch.Tensor] | None = None

    def row_count(self, n_queries: int, length: int) -> int:
        return n_queries

    def prompt_rows(self, m: int, length: int, device: torch.device) -> tuple[slice, int]:
        skipped = min(EXPECTED_SINKS, length - 1)
        statistics = slice(skipped, length, -(-(length - skipped) // EXPECTED_STATISTICS_TOKENS))
        return statistics, len(range(length)[statistics])

    def rope_rows(self, cos: torch.Tensor, sin: torch.Tensor, m: int, length: int) -> QueryRows:
        offsets = _future_offsets(m, length, cos.device)
        return QueryRows(*_rotation_sum(cos, sin, length - 1, offsets), length - 1 + offsets, None)

    def queries_from(self, prompt_queries: torch.Tensor, m: int) -> torch.Tensor:
        """(B, H_q, N, d) pre-RoPE queries -> (B, H_q, m, d) draws from the Gaussian of their mean and covariance.

        NOTE: with the centred queries X (N, d) per head, μ + Xᵀw/√N for w ~ N(0, I_N) has mean μ and covariance
        XᵀX/N, the queries' own: no factorisation of the covariance, one matmul.
        """
        mean = prompt_queries.mean(dim=2, keepdim=True)
        draws = self._standard_draws(m, prompt_queries.shape[2], prompt_queries.device)
        return mean + draws.to(prompt_queries.dtype) @ (prompt_queries - mean)

    def _standard_draws(self, m: int, tokens: int, device: torch.device) -> torch.Tensor:
        key = (m, tokens, device)
        if self._draws is None or self._draws[0] != key:
            draws = standard_draws(m, tokens)
            # NOTE: from pinned memory the copy to a GPU is asynchronous: no synchronisation of the host with the
            # device.
            draws = (draws.pin_memory() if device.type == "cuda" else draws).to(device, non_blocking=True)
            self._draws = (key, draws)
        return self._draws[1]

    def row_weight(self, m: int) -> float:
        return AUTHORS_LOSS_WEIGHT / m


def standard_draws(m: int, tokens: int) -> torch.Tensor:
    """(m, ``tokens``) the expected policy's fixed weights, N(0, 1/``tokens``) each (``EXPECTED_DRAWS_SEED``)."""
    generator = torch.Generator().manual_seed(EXPECTED_DRAWS_SEED)
    return torch.randn(m, tokens, generator=generator) / tokens**0.5


def _future_offsets(m: int, length: int, device: torch.device) -> torch.Tensor:
    """(m,) offsets in 1 … min(``EXPECTED_FUTURE_POSITIONS``, ``length`` − 1), spread evenly: how far past the
    prompt's last position each draw is rotated (the offset's RoPE row must lie in the prompt's table)."""
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
