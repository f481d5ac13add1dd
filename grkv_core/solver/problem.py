"""The state one ``grkv_merge`` call shares between its value and key steps, and how it addresses rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grkv_core.solver.attention import fused_masked_softmax


@dataclass(frozen=True)
class FreeRows:
    """The free (refitted) rows of each head as the leading part of a permutation of its c kept rows.

    ``index`` (B, H, F) long: per head, the free rows first, then fixed ones, cut at F = the largest free
    count of any head; ``valid`` (B, H, 1, F) float 0/1 marks the entries that are free rows. NOTE: ``index``
    never repeats a row within a head (a permutation prefix), so scattering back cannot collide.
    """

    index: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, fixed: torch.Tensor) -> FreeRows:
        free_count = (~fixed).sum(dim=-1, keepdim=True)
        width = int(free_count.max())
        index = torch.argsort(fixed.to(torch.uint8), dim=-1, stable=True)[..., :width]
        valid = torch.arange(width, device=fixed.device) < free_count
        return cls(index=index, valid=valid.unsqueeze(-2).to(torch.float32))

    def columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B, H, X, c) -> (B, H, X, F): the free columns, zero on padding."""
        index = self.index.unsqueeze(-2).expand(-1, -1, tensor.shape[-2], -1)
        return tensor.gather(-1, index) * self.valid

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B, H, c, X) -> (B, H, F, X): the free rows (padding holds some fixed row)."""
        return gather_rows(tensor, self.index)

    def scatter_rows(self, rows: torch.Tensor, length: int) -> torch.Tensor:
        """(B, H, F, X) -> (B, H, c, X) with zeros on every row outside the free set."""
        scattered = rows.new_zeros(*rows.shape[:2], length, rows.shape[-1])
        scattered[(*_batch_head_index(rows), self.index)] = rows * self.valid.transpose(-1, -2)
        return scattered


@dataclass(frozen=True)
class MergeProblem:
    """Float32 tensors shared by the value and key steps of one call.

    Shapes: ``queries_scaled`` (B, H, M, d) already multiplied by the softmax scale; ``target`` (B, H, M, d);
    ``keys0``/``values0`` (B, H, c, d); ``free`` (B, H, c, 1) float 0/1 and ``free_rows`` the same rows as
    indices; ``hidden`` (B, H, M, c) bool, True where a query may not see a kept key (None without causal
    positions); ``sees_nothing`` (B, H, M, 1) bool, rows that see no kept key at all (None when there is none).
    """

    queries_scaled: torch.Tensor
    target: torch.Tensor
    keys0: torch.Tensor
    values0: torch.Tensor
    free: torch.Tensor
    free_rows: FreeRows
    hidden: torch.Tensor | None
    sees_nothing: torch.Tensor | None

    def attention(self, keys: torch.Tensor) -> torch.Tensor:
        """(B, H, M, c) attention weights of the queries over ``keys`` (B, H, c, d)."""
        return fused_masked_softmax(self.queries_scaled @ keys.transpose(-1, -2), self.hidden, self.sees_nothing)

    def window_error(self, attention: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(B, H) Σ‖Y − A V‖² over the window for attention weights ``attention`` and ``values``."""
        return (self.target - attention @ values).square_().sum(dim=(-2, -1))


def gather_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, H, n, d) rows picked per head by (B, H, c) ``index`` -> (B, H, c, d).

    Advanced indexing rather than ``gather`` with an expanded index, which is 2-3x slower on the CPU.
    """
    return tensor[(*_batch_head_index(tensor), index.long())]


def _batch_head_index(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 1, 1) and (1, H, 1) aranges that, with a (B, H, c) row index, address rows of a (B, H, n, ...) tensor."""
    batch = torch.arange(tensor.shape[0], device=tensor.device)[:, None, None]
    head = torch.arange(tensor.shape[1], device=tensor.device)[None, :, None]
    return batch, head
