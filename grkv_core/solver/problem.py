"""The state one ``grkv_merge`` call shares between its value and key steps, and how it addresses rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SolverOrder:
    """Each head's kept rows reordered so that its free (refitted) rows come first.

    ``order`` (P, c) long: per head, the positions in the kept order of its free rows, then of its fixed ones
    (a permutation); ``restore`` (P, c) its inverse; ``free_valid`` (P, 1, F), F the largest free count of any
    head, float 0/1, marks the leading rows that are free in that head (the rest of the first F are fixed rows
    of heads with fewer free rows).

    NOTE: with the free rows leading, every step reads them as the slice ``[:F]`` (rows of a (P, c, d) tensor,
    columns of a (P, M, c) one) times ``free_valid``: no gather or scatter inside the solver, one permutation
    on the way in and its inverse on the way out.
    """

    order: torch.Tensor
    restore: torch.Tensor
    free_valid: torch.Tensor

    @classmethod
    def of(cls, fixed: torch.Tensor) -> SolverOrder:
        """From (P, c) bool ``fixed``."""
        order = torch.argsort(fixed.to(torch.uint8), dim=-1, stable=True)
        restore = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device)
                                                   .expand_as(order))
        free_count = (~fixed).sum(dim=-1, keepdim=True)
        valid = torch.arange(int(free_count.max()), device=fixed.device) < free_count
        return cls(order=order, restore=restore, free_valid=valid.unsqueeze(-2).to(torch.float32))


@dataclass(frozen=True)
class MergeProblem:
    """Float32 tensors shared by the value and key steps of one call, batch and heads flattened (P = B·H).

    Shapes: ``queries_scaled`` (P, M, d) already multiplied by the softmax scale; ``target`` (P, M, d);
    ``keys0``/``values0`` (P, c, d) in ``SolverOrder`` (the free rows of each head first); ``free_valid``
    (P, 1, F), see ``SolverOrder``; ``logit_mask`` (P, M, c) float, 0 where a query may see a kept key and
    −inf where not (None without causal positions); ``sees_nothing`` (P, M, 1) bool, rows that see no kept key
    at all (None when there is none); ``row_scale`` (P, M, 1) the square roots of the query rows' weights in the
    loss Σ_r w_r ‖y_r − a_r V‖² (None: every row weighs 1).

    NOTE: a weighted least-squares problem is the unweighted one on rows scaled by √w: the steps scale the
    residual rows (and the Jacobian's output rows) by ``row_scale`` and leave everything else as it is.

    NOTE: every product is a ``bmm`` on 3-D tensors: 4-D ``matmul`` re-plans (expands and reshapes, copies
    a transposed operand) on every call, which costs as much as the arithmetic at these sizes.
    """

    queries_scaled: torch.Tensor
    target: torch.Tensor
    keys0: torch.Tensor
    values0: torch.Tensor
    free_valid: torch.Tensor
    logit_mask: torch.Tensor | None
    sees_nothing: torch.Tensor | None
    row_scale: torch.Tensor | None = None

    @property
    def free_width(self) -> int:
        return self.free_valid.shape[-1]

    def logits(self, keys: torch.Tensor) -> torch.Tensor:
        """(P, M, c) masked logits of the queries over ``keys`` (P, c, d); the mask rides in the product."""
        if self.logit_mask is None:
            return torch.bmm(self.queries_scaled, keys.mT)
        return torch.baddbmm(self.logit_mask, self.queries_scaled, keys.mT)

    def softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """(P, M, c) attention weights from masked ``logits`` (left intact); rows that see nothing are zero."""
        weights = torch.softmax(logits, dim=-1)
        if self.sees_nothing is not None:
            weights = weights.masked_fill_(self.sees_nothing, 0.0)
        return weights

    def attention(self, keys: torch.Tensor) -> torch.Tensor:
        """(P, M, c) attention weights of the queries over ``keys`` (P, c, d)."""
        return self.softmax(self.logits(keys))

    def free_columns(self, attention: torch.Tensor) -> torch.Tensor:
        """(P, M, c) -> (P, M, F): the attention on the free rows, zero on padding."""
        return attention[..., :self.free_width] * self.free_valid

    def free_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """(P, c, X) -> (P, F, X): the leading rows (padding holds some fixed row)."""
        return tensor[:, :self.free_width]

    def add_to_free_rows(self, tensor: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
        """``tensor`` (P, c, X) with ``change`` (P, F, X), zero on padding rows, added to its free rows."""
        return torch.cat([tensor[:, :self.free_width] + change, tensor[:, self.free_width:]], dim=1)

    def weighted(self, rows: torch.Tensor) -> torch.Tensor:
        """(P, M, X) rows scaled by ``row_scale`` (``scale_rows``)."""
        return scale_rows(rows, self.row_scale)

    def window_error(self, attention: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(P,) Σ_r w_r ‖y_r − a_r V‖² over the window for attention weights ``attention`` and ``values``."""
        return self.weighted(torch.baddbmm(self.target, attention, values, alpha=-1.0)).square_().sum(dim=(-2, -1))


def scale_rows(rows: torch.Tensor, row_scale: torch.Tensor | None) -> torch.Tensor:
    """(P, M, X) query rows times (P, M, 1) ``row_scale``; the rows themselves when it is None (every row 1)."""
    return rows if row_scale is None else rows * row_scale


def gather_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, H, n, d) rows picked per head by (B, H, c) ``index`` -> (B, H, c, d).

    One ``index_select`` over the (B·H·n, d) rows with per-head offsets: 2x faster on the CPU than advanced
    indexing with broadcast batch and head indices, and 2-3x faster than ``gather`` with an expanded index.
    """
    batch, heads, length, head_dim = tensor.shape
    offsets = torch.arange(0, batch * heads * length, length, device=tensor.device).view(batch, heads, 1)
    rows = tensor.reshape(batch * heads * length, head_dim).index_select(0, (index.long() + offsets).flatten())
    return rows.view(batch, heads, -1, head_dim)
