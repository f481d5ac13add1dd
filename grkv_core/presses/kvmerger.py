"""KVMergerPress: KVMerger-style merging (Wang et al., arXiv 2407.08454) on the decision of any kvpress eviction press.

Reference: Z. Wang, B. Jin, Z. Yu, M. Zhang, "Model Tells You Where to Merge: Adaptive KV Cache Merging for
LLMs on Long-Context Tasks", arXiv 2407.08454. KVMerger groups *consecutive* tokens whose keys are
cosine-similar into merging sets and replaces each set by one pseudo-token: the Gaussian-kernel weighted
average around the set's pivot (its most attended token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grkv_core.options import KVMergerOptions
from grkv_core.presses.local_merging import (
    LocalMergePress,
    MergeInputs,
    adjacent_carriers,
    carrier_rows,
    rowwise_cosine,
    weighted_mean_merge,
)


@dataclass
class KVMergerPress(KVMergerOptions, LocalMergePress):
    """Grow a merging set from each kept token over adjacent similar evicted tokens; replace it by a pseudo-token.

    Rule (per batch element and KV head). Adjacent positions t-1, t are *linked* when
    cos(k_{t-1}, k_t) ≥ ``threshold``. An evicted token j in the gap between kept tokens L < j < R joins
    L's set when every link from L to j holds, and R's set when every link from j to R holds (so sets are
    runs of consecutive tokens, as in KVMerger); when both hold it joins the nearer one (L on ties), when
    neither it is dropped. The kept token is the set's pivot p, and the set becomes

        x_p ← (x_p + Σ_{j∈S_p} g_j x_j) / (1 + Σ_{j∈S_p} g_j),   g_j = exp(-‖k_j − k_p‖² / (2σ_p²)),

    for keys and values alike (the pivot's own kernel weight is exp(0) = 1).

    Choices where the paper's setting differs: the pivot is the kept token (the base press already decided
    which tokens matter; KVMerger's pivot is the set's most attended token), and σ_p, when not fixed by
    ``sigma``, is the root-mean-square key distance of the set's members to the pivot, so that the weights
    do not depend on the keys' scale (a member at the typical distance gets weight exp(-1/2)). The default
    ``threshold`` 0.75 is our choice; the paper tunes it per model.

    Parameters
    ----------
    press : BasePress
        The eviction press; see ``LocalMergePress``.
    threshold : float
        Cosine similarity in [-1, 1] that links two adjacent keys.
    sigma : float, optional
        A fixed Gaussian-kernel width (> 0) in key units; None adapts it per merging set (see above).
    """

    def assign_carriers(self, inputs: MergeInputs) -> torch.Tensor:
        keys = inputs.keys.float()
        linked = rowwise_cosine(keys[:, :, 1:], keys[:, :, :-1]) >= self.threshold
        # breaks[t] = number of broken links among (0,1), ..., (t-1,t): a run L..j is linked iff breaks agree.
        breaks = torch.nn.functional.pad((~linked).long().cumsum(dim=-1), (1, 0))
        previous, following = adjacent_carriers(inputs.kept, inputs.evicted)
        previous_position = inputs.kept.gather(-1, previous.clamp_min(0))
        following_position = inputs.kept.gather(-1, following.clamp_min(0))
        evicted_breaks = breaks.gather(-1, inputs.evicted)
        joins_previous = (previous >= 0) & (breaks.gather(-1, previous_position) == evicted_breaks)
        joins_following = (following >= 0) & (breaks.gather(-1, following_position) == evicted_breaks)
        nearer_following = (following_position - inputs.evicted) < (inputs.evicted - previous_position)
        take_following = joins_following & (~joins_previous | nearer_following)
        carrier = torch.where(take_following, following, previous)
        return carrier.masked_fill(~(joins_previous | joins_following), -1)

    def merge(self, inputs: MergeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        carrier = self.assign_carriers(inputs)
        evicted_keys = inputs.evicted_keys()
        distance2 = (evicted_keys - carrier_rows(inputs.kept_keys(), carrier)).square().sum(dim=-1)
        if self.sigma is not None:
            sigma2 = torch.full_like(distance2, float(self.sigma) ** 2)
        else:
            members = (carrier >= 0).float()
            index = carrier.clamp_min(0)
            total = torch.zeros(inputs.kept.shape, device=distance2.device).scatter_add_(-1, index, distance2 * members)
            count = torch.zeros(inputs.kept.shape, device=distance2.device).scatter_add_(-1, index, members)
            sigma2 = (total / count.clamp_min(1)).gather(-1, index)
        # NOTE: a set whose members all equal the pivot has σ² = 0 and distance 0: weight exp(0) = 1.
        weight = torch.exp(-distance2 / (2 * sigma2).clamp_min(torch.finfo(torch.float32).tiny))
        return weighted_mean_merge(inputs, carrier, weight, 1.0)
