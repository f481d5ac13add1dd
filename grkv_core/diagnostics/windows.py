"""Window summaries and their cross-window consistency (paper Sec. 3.2, App. C): how alike the full cache's
attention outputs are from one window of queries to the next."""

from __future__ import annotations

import math

import torch

from grkv_core.options import PAPER_WINDOW
from grkv_core.solver.attention import masked_softmax


def window_output_summaries(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    window: int = PAPER_WINDOW,
    scale: float | None = None,
) -> torch.Tensor:
    """Window summaries s_W = (1/m) Σ_{i∈W} A_i^(full) V_full (paper Sec. 3.2, App. C).

    Parameters
    ----------
    queries : torch.Tensor
        (..., T, d) post-RoPE queries of the tokens at positions 0..T−1 (one query head, or heads on the
        leading axes with their KV heads already repeated); query t attends causally to keys 0..t.
    keys, values : torch.Tensor
        (..., T, d) the full cache.
    window : int
        m, the window length; the tokens are cut into ⌊T/m⌋ consecutive windows, a trailing partial window is
        left out.
    scale : float, optional
        Softmax scale, 1/sqrt(d) by default.

    Returns
    -------
    torch.Tensor
        (..., ⌊T/m⌋, d) float32 window summaries.
    """
    if queries.shape[-2] != keys.shape[-2] or keys.shape != values.shape:
        raise ValueError("queries, keys and values must all be (..., T, d) over the same T tokens")
    if not isinstance(window, int) or window < 1 or window > queries.shape[-2]:
        raise ValueError(f"window must be an integer in [1, T={queries.shape[-2]}], got {window!r}")
    length = keys.shape[-2]
    scale = 1.0 / math.sqrt(keys.shape[-1]) if scale is None else scale
    causal = torch.ones(length, length, dtype=torch.bool, device=keys.device).tril()
    outputs = masked_softmax((queries.float() * scale) @ keys.float().transpose(-1, -2), causal) @ values.float()
    n_windows = length // window
    return outputs[..., : n_windows * window, :].unflatten(-2, (n_windows, window)).mean(dim=-2)


def cross_window_similarity(summaries: torch.Tensor) -> torch.Tensor:
    """(..., W, W) cosine similarity cos(s_{W_u}, s_{W_v}) between the window summaries (..., W, d)."""
    unit = torch.nn.functional.normalize(summaries.float(), dim=-1)
    return unit @ unit.transpose(-1, -2)
