"""The authors' trust-region caps: a head's update shrunk to a fraction of its kept rows' norm."""

from __future__ import annotations

import torch


def cap_update(start: torch.Tensor, merged: torch.Tensor, max_relative: float | None) -> torch.Tensor:
    """Shrink each head's update so that ‖merged − start‖_F ≤ max_relative·‖start‖_F (no-op when None).

    ``start`` and ``merged`` are (..., c, d), one head per leading index; the result has ``merged``'s dtype.

    NOTE: a head whose cap binds gets start + factor·(merged − start); every other head gets ``merged`` itself, bit
    for bit. A head whose rows hold a NaN or inf has a NaN factor (its norms are not finite), which binds nothing, so
    it keeps ``merged`` as it is: the solver hands such a head back unmerged, i.e. exactly as eviction leaves it.
    """
    if max_relative is None:
        return merged
    update = merged.float() - start.float()
    limit = start.float().norm(dim=(-2, -1), keepdim=True).mul_(max_relative)
    factor = limit.div_(update.norm(dim=(-2, -1), keepdim=True).clamp_min_(1e-30))
    return torch.where(factor < 1.0, torch.addcmul(start.float(), factor, update).to(merged.dtype), merged)
