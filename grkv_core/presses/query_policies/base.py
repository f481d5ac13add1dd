"""``QueryPolicy``: what a surrogate-query policy states (paper Sec. 3.2), and ``QueryRows``, the rows it builds."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

# The authors' released code weighs each of its Q non-causal query rows 6/Q in the reconstruction loss; the policies
# that follow it keep that weight (``QueryPolicy.row_weight``).
AUTHORS_LOSS_WEIGHT = 6.0


@dataclass(frozen=True)
class QueryRows:
    """A policy's m query rows of a prompt, before any layer's queries: where each is rotated to and attends from.

    Attributes
    ----------
    cos, sin : torch.Tensor
        (B, m, d) the RoPE table rows each query row is rotated with (rows of the prompt's tables, or built from them).
    token_positions : torch.Tensor
        (m,) the position each row stands for: the prompt position of its token, or the position it is rotated to.
    causal_positions : torch.Tensor or None
        (m,) the position each row attends from, causally (keys after it masked); None: every row sees every key.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    token_positions: torch.Tensor
    causal_positions: torch.Tensor | None


class QueryPolicy(ABC):
    """Which queries stand in for the unknown future queries in GRKV's regression (``GRKVOptions.query_policy``).

    A policy builds its m rows per query head from the pre-RoPE queries of some prompt rows (``prompt_rows``),
    mapped to its m rows (``queries_from``, by default the rows themselves) and rotated by ``rope_rows``. It is
    registered by name in ``grkv_core.catalog.QUERY_POLICIES`` (its class; one instance per press context), which
    makes it a ``--query-policy`` choice and a sweep's ``query_policy`` value with nothing else to edit::

        class FirstTokens(QueryPolicy):
            name = "first"

            def prompt_rows(self, m, length, device):
                return slice(0, m), m

            def rope_rows(self, cos, sin, m, length):
                positions = torch.arange(m, device=cos.device)
                return QueryRows(cos[:, :m], sin[:, :m], positions, positions)

        QUERY_POLICIES.register("first", FirstTokens)

    NOTE: a policy is called once per prefill for its rows (the layers share them, ``PolicyRowsMemo``) and once per
    layer for ``queries_from``; it reads no tensor on the host.
    """

    name: ClassVar[str]
    target_in_forward: ClassVar[bool] = False
    """Whether the prefill's own attention outputs of its prompt rows are its regression target (its rows are those
    tokens' queries at their positions, causal): then, with ``target_from_forward``, they are kept from the forward
    instead of recomputed."""

    def row_count(self, n_queries: int, length: int) -> int:
        """m, how many rows per query head it builds when asked for ``n_queries`` from a ``length``-token prompt: by
        default at most one per prompt token."""
        return min(n_queries, length)

    @abstractmethod
    def prompt_rows(self, m: int, length: int, device: torch.device) -> tuple[slice | torch.Tensor, int]:
        """The prompt rows whose pre-RoPE queries it reads for m rows of a ``length``-token prompt: an index of the
        prompt axis (a slice, read as a view, or an (r,) tensor) and r, how many."""

    @abstractmethod
    def rope_rows(self, cos: torch.Tensor, sin: torch.Tensor, m: int, length: int) -> QueryRows:
        """Its m rows' rotations and positions, from the prompt's (B, ``length``, d) RoPE tables."""

    def queries_from(self, prompt_queries: torch.Tensor, m: int) -> torch.Tensor:
        """(B, H_q, r, d) pre-RoPE queries of its prompt rows -> (B, H_q, m, d) pre-RoPE queries of its rows: by
        default the prompt rows' own (r = m)."""
        return prompt_queries

    def row_weight(self, m: int) -> float:
        """The weight of each of its m rows in the reconstruction loss (the ridge terms are unweighted): 1 by default.

        NOTE: the regression minimises w·‖target − attention‖² + λ‖update‖², i.e. the plain loss with the ridge λ/w
        (``GRKVPress`` passes the solver λ/w): the same ``lambda_k`` and ``lambda_v`` are an effective ridge 1/w
        times larger under a policy weighing its rows w. The authors' code's weight is 6/m (``AUTHORS_LOSS_WEIGHT``):
        an effective ridge m/6 times λ (5.3× at m = 32, 10.7× at m = 64).
        """
        return 1.0
