"""The state one ``grkv_merge`` call shares between its value and key steps, and how it addresses rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MergeProblem:
    """Float32 tensors shared by the value and key steps of one call, batch and heads flattened (P = B·H).

    Shapes: ``queries_scaled`` (P, M, d) already multiplied by the softmax scale; ``target`` (P, M, d);
    ``keys0``/``values0`` (P, c, d) the kept rows; ``free`` (P, 1, c) float, 1 on the rows the merge refits and 0 on
    the fixed ones; ``logit_mask`` (P, M, c) float, 0 where a query may see a kept key and
    −inf where not (None without causal positions); ``sees_nothing`` (P, M, 1) bool, rows that see no kept key
    at all (None when there is none); ``row_scale`` (P, M, 1) the square roots of the query rows' weights in the
    loss Σ_r w_r ‖y_r − a_r V‖² (None: every row weighs 1).

    NOTE: a weighted least-squares problem is the unweighted one on rows scaled by √w: the steps scale the
    residual rows (and the Jacobian's output rows) by ``row_scale`` and leave everything else as it is.

    NOTE: the free rows are a mask over all c kept rows, not a gathered slice: their number varies per head with the
    data, and a shape read from the data would wait for the device (a GPU synchronisation) and change the kernels'
    shapes from one call to the next, which a captured CUDA graph cannot. A fixed row's column of attention is zeroed
    (``free_columns``), so no step moves it.

    NOTE: every product is a ``bmm`` on 3-D tensors: 4-D ``matmul`` re-plans (expands and reshapes, copies
    a transposed operand) on every call, which costs as much as the arithmetic at these sizes.
    """

    queries_scaled: torch.Tensor
    target: torch.Tensor
    keys0: torch.Tensor
    values0: torch.Tensor
    free: torch.Tensor
    logit_mask: torch.Tensor | None
    sees_nothing: torch.Tensor | None
    row_scale: torch.Tensor | None = None

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
        """(P, M, c) attention with the fixed rows' columns zeroed."""
        return attention * self.free

    def weighted(self, rows: torch.Tensor) -> torch.Tensor:
        """(P, M, X) rows scaled by ``row_scale`` (``scale_rows``)."""
        return scale_rows(rows, self.row_scale)

    def window_error(self, attention: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(P,) Σ_r w_r ‖y_r − a_r V‖² over the window for attention weights ``attention`` and ``values``."""
        return self.weighted(torch.baddbmm(self.target, attention, values, alpha=-1.0)).square_().sum(dim=(-2, -1))


def reads_are_free(tensor: torch.Tensor) -> bool:
    """Whether reading a flag of ``tensor`` on the host costs nothing: on the CPU, outside ``torch.compile``. There the
    solver's loops end once every head has stopped (the same results as running their fixed count: a stopped head's
    steps are zero); on a GPU such a read would wait for the device, and a captured graph cannot hold one."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def scale_rows(rows: torch.Tensor, row_scale: torch.Tensor | None) -> torch.Tensor:
    """(P, M, X) query rows times (P, M, 1) ``row_scale``; the rows themselves when it is None (every row 1)."""
    return rows if row_scale is None else rows * row_scale


def gather_rows(index: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of ``tensors`` (..., n, d) with the rows (..., c, d) that ``index`` (..., c) picks, per leading index.

    NOTE: one expanded index serves every tensor (keys and values alike): an unsqueeze, an expand and one ``gather``
    per tensor, a fixed handful of operations whatever the shapes (the dispatch, not the copy, is what costs at these
    sizes, and what a GPU waits on).
    """
    rows = index.unsqueeze(-1).expand(*index.shape, tensors[0].shape[-1])
    return tuple(tensor.gather(-2, rows) for tensor in tensors)
