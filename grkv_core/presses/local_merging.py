"""What the local merging baselines share: their press base, MergeInputs, evicted -> carrier matching, merge rules.

Every baseline here follows the same shape (paper App. A, "Local KV Merging and Carrier Support"): the base
eviction press decides which tokens stay, each evicted token is matched to one or a few kept *carriers* by
a local rule, and the carriers' keys/values absorb the evicted ones:

    x_i* = (s_i x_i + Σ_{j→i} w_j x_j) / (s_i + Σ_{j→i} w_j)      (weighted-mean rules: D2O, AsymKV, KVMerger)
    x_i* =  x_i + Σ_{j→i} w_j x_j                                  (additive rule: CaM)

A rule file only says which carrier(s) each evicted token goes to (``assign_carriers``) and with which
weights (``merge``); ``LocalMergePress`` and the ``BaseMergerPress.compress`` template do the rest, for uniform
budgets (physical compaction) and for per-head budgets (AdaKV-style masking: merged in place, no memory saved).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from grkv_core.presses.merging import BaseMergerPress
from grkv_core.presses.selection import TokenSelection

# NOTE: cosine similarity of a zero vector is defined as 0 (torch's convention), never NaN.
_NORM_FLOOR = 1e-12


@dataclass(frozen=True)
class MergeInputs:
    """One layer's cache and the base press's decision, in the shape every merge rule reads.

    Attributes
    ----------
    keys, values : torch.Tensor
        (B, H_kv, n, d) the full cache; row i sits at position i.
    kept : torch.Tensor
        (B, H_kv, c) kept positions, increasing along the last axis.
    evicted : torch.Tensor
        (B, H_kv, e) evicted positions, increasing along the last axis (e = n - c).
    token_attention : torch.Tensor or None
        (B, H_kv, n) attention each token receives, for rules that weight by attention (CaM); None otherwise.
    """

    keys: torch.Tensor
    values: torch.Tensor
    kept: torch.Tensor
    evicted: torch.Tensor
    token_attention: torch.Tensor | None = None

    @classmethod
    def from_kept_mask(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        kept_mask: torch.Tensor,
        token_attention: torch.Tensor | None = None,
    ) -> MergeInputs:
        """Build the inputs from a (B, H_kv, n) bool mask that keeps the same number of tokens in every head.

        Raises
        ------
        ValueError
            If shapes disagree, or heads keep different numbers of tokens (use one (batch, head) at a time).
        """
        if keys.ndim != 4 or values.shape != keys.shape:
            raise ValueError(
                f"keys and values must both be (B, H_kv, n, d), got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if kept_mask.shape != keys.shape[:3] or kept_mask.dtype != torch.bool:
            raise ValueError(
                f"kept_mask must be a bool tensor of shape {tuple(keys.shape[:3])}, "
                f"got {kept_mask.dtype} {tuple(kept_mask.shape)}"
            )
        if token_attention is not None and token_attention.shape != keys.shape[:3]:
            raise ValueError(
                f"token_attention must have shape {tuple(keys.shape[:3])}, got {tuple(token_attention.shape)}"
            )
        counts = kept_mask.sum(dim=-1)
        n_kept = int(counts.flatten()[0])
        if not bool((counts == n_kept).all()):
            raise ValueError(
                "every (batch, head) must keep the same number of tokens; merge ragged "
                "(per-head) selections one (batch, head) at a time"
            )
        if n_kept == 0:
            raise ValueError("the base press kept no token: there is no carrier to merge into")
        # NOTE: one stable sort puts each head's kept positions first and its evicted ones after, both increasing
        # (as two nonzero() calls would list them, with one GPU synchronisation fewer).
        order = (~kept_mask).to(torch.uint8).argsort(dim=-1, stable=True)
        return cls(keys, values, order[..., :n_kept], order[..., n_kept:], token_attention)

    def rows(self, tensor: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Float32 rows of a (B, H_kv, n, d) ``tensor`` at (B, H_kv, p) ``positions`` -> (B, H_kv, p, d)."""
        return tensor.gather(2, positions.unsqueeze(-1).expand(-1, -1, -1, tensor.shape[-1])).float()

    def kept_keys(self) -> torch.Tensor:
        return self.rows(self.keys, self.kept)

    def kept_values(self) -> torch.Tensor:
        return self.rows(self.values, self.kept)

    def evicted_keys(self) -> torch.Tensor:
        return self.rows(self.keys, self.evicted)

    def evicted_values(self) -> torch.Tensor:
        return self.rows(self.values, self.evicted)


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise cosine similarity in float32: (..., p, d) x (..., q, d) -> (..., p, q)."""
    a = a.float() / a.float().norm(dim=-1, keepdim=True).clamp_min(_NORM_FLOOR)
    b = b.float() / b.float().norm(dim=-1, keepdim=True).clamp_min(_NORM_FLOOR)
    return a @ b.transpose(-1, -2)


def rowwise_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of matching rows in float32: (..., d) x (..., d) -> (...)."""
    a, b = a.float(), b.float()
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(_NORM_FLOOR)


def carrier_rows(rows: torch.Tensor, carrier: torch.Tensor) -> torch.Tensor:
    """Rows of (B, H, c, d) ``rows`` picked by (B, H, s) carrier indices (-1 is read as 0) -> (B, H, s, d)."""
    index = carrier.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, rows.shape[-1])
    return rows.gather(2, index)


def adjacent_carriers(kept: torch.Tensor, evicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept tokens that bound each evicted token's gap: the nearest kept one before and after it.

    Parameters
    ----------
    kept, evicted : torch.Tensor
        (B, H, c) and (B, H, e) increasing positions.

    Returns
    -------
    previous, following : torch.Tensor
        (B, H, e) long indices into ``kept`` (not positions); -1 where no kept token lies on that side.
    """
    following = torch.searchsorted(kept.contiguous(), evicted.contiguous())
    previous = following - 1
    following = following.masked_fill(following == kept.shape[-1], -1)
    return previous, following


def merge_into_carriers(
    carriers: torch.Tensor,
    sources: torch.Tensor,
    carrier: torch.Tensor,
    source_weight: torch.Tensor,
    carrier_weight: torch.Tensor | None,
) -> torch.Tensor:
    """Fold source rows into their carriers: a weighted mean, or a plain weighted sum when no carrier weight.

    Parameters
    ----------
    carriers : torch.Tensor
        (B, H, c, d) kept rows (float32).
    sources : torch.Tensor
        (B, H, s, d) rows to merge in (float32); a source may appear several times (CaM's windows).
    carrier : torch.Tensor
        (B, H, s) long index into ``carriers`` of each source's carrier; -1 drops the source.
    source_weight : torch.Tensor
        (B, H, s) weight w_j of each source.
    carrier_weight : torch.Tensor or None
        (B, H, c) self-weight s_i of each carrier: the result is (s_i x_i + Σ w_j x_j) / (s_i + Σ w_j). None:
        the result is x_i + Σ w_j x_j.

    Returns
    -------
    torch.Tensor
        (B, H, c, d) merged carrier rows; carriers that receive nothing are returned unchanged.
    """
    weight = torch.where(carrier >= 0, source_weight.float(), torch.zeros_like(source_weight, dtype=torch.float32))
    index = carrier.clamp_min(0)
    absorbed = torch.zeros_like(carriers).scatter_add_(
        2, index.unsqueeze(-1).expand(-1, -1, -1, carriers.shape[-1]), weight.unsqueeze(-1) * sources
    )
    if carrier_weight is None:
        return carriers + absorbed
    carrier_weight = carrier_weight.float()
    total = carrier_weight.scatter_add(2, index, weight)
    return (carrier_weight.unsqueeze(-1) * carriers + absorbed) / total.unsqueeze(-1)


def weighted_mean_merge(
    inputs: MergeInputs, carrier: torch.Tensor, source_weight: torch.Tensor, carrier_weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every evicted token into its single carrier by the same weighted mean for keys and values.

    Parameters
    ----------
    inputs : MergeInputs
    carrier : torch.Tensor
        (B, H, e) index into ``inputs.kept`` per evicted token; -1 drops it.
    source_weight : torch.Tensor
        (B, H, e) weight of each evicted token.
    carrier_weight : float
        The self-weight s_i shared by every carrier.

    Returns
    -------
    keys, values : torch.Tensor
        (B, H, c, d) float32 merged kept rows.
    """
    kept_keys = inputs.kept_keys()
    self_weight = torch.full(kept_keys.shape[:3], float(carrier_weight), device=kept_keys.device)
    keys = merge_into_carriers(kept_keys, inputs.evicted_keys(), carrier, source_weight, self_weight)
    values = merge_into_carriers(inputs.kept_values(), inputs.evicted_values(), carrier, source_weight, self_weight)
    return keys, values


@dataclass
class LocalMergePress(BaseMergerPress):
    """Base of the local merging baselines: keep the base press's tokens, fold each evicted token into carriers.

    Subclasses implement ``assign_carriers`` and ``merge`` (and ``token_attention`` if they weight by
    attention); ``BaseMergerPress.compress`` does the rest. With a uniform budget (every ``ScorerPress``,
    ``PyramidKVPress``) the cache is physically compacted to exactly the kept tokens. With per-head budgets
    (``AdaKVPress``, ``CriticalAdaKVPress``) kvpress masks evicted entries instead of removing them, so memory
    is *not* saved; the rule is then applied to one (batch, head) at a time and the kept rows are rewritten in
    place.

    Parameters
    ----------
    press : BasePress
        The eviction press: any of ``grkv_core.presses.selection.SUPPORTED_BASE_PRESSES`` (by name:
        ``grkv_core.catalog.EVICTION_PRESSES``). Its ``compression_ratio`` sets the budget.
    """

    def token_attention(
        self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, kwargs: dict
    ) -> torch.Tensor | None:
        """(B, H_kv, n) attention each cached token receives, for rules that need it; None by default."""
        return None

    def assign_carriers(self, inputs: MergeInputs) -> torch.Tensor:
        """(B, H_kv, e) long: the index into ``inputs.kept`` of each evicted token's carrier, -1 if dropped.

        Rules that spread one token over several carriers (CaM) return the nearest one here.
        """
        raise NotImplementedError

    def merge(self, inputs: MergeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H_kv, c, d) float32 merged kept keys and values."""
        raise NotImplementedError

    def layer_context(
        self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, kwargs: dict
    ) -> torch.Tensor | None:
        return self.token_attention(module, hidden_states, keys, kwargs)

    def head_context(self, context: torch.Tensor | None, batch_index: int, head_index: int) -> torch.Tensor | None:
        return None if context is None else context[batch_index : batch_index + 1, head_index : head_index + 1]

    def merge_selected(
        self, keys: torch.Tensor, values: torch.Tensor, selection: TokenSelection, context: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.merge(MergeInputs.from_kept_mask(keys, values, selection.mask(), context))
