"""AsymKVPress: AsymKV's local merging (Cui & Xu, arXiv 2506.05410) on the decision of any kvpress eviction press.

Reference: W. Cui, M. Xu, "Homogeneous Keys, Heterogeneous Values: Exploiting Local KV Cache Asymmetry for
Long-Context LLMs", arXiv 2506.05410 (NeurIPS 2025), code github.com/the-scale-lab/Asymkv; this is the
AsymKV the GRKV paper compares with (``cui2025homogeneous``). It is not the 1-bit quantisation paper of the
same name (arXiv 2410.13212).

What AsymKV does: adjacent keys are homogeneous, so an adjacent pair is merged into one key (their mean,
or a Fisher-diagonal-weighted mean); values are heterogeneous, so they are *not* averaged lossily but
stored losslessly as the sum Σv together with the cardinality l, which its Locally Merged Attention reads
as softmax weight l·exp(q·k) and value Σv / l. Repeated pairwise merges let one kept slot absorb a run of
neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grkv_core.presses.local_merging import (
    LocalMergePress,
    MergeInputs,
    adjacent_carriers,
    carrier_rows,
    rowwise_cosine,
    weighted_mean_merge,
)


@dataclass
class AsymKVPress(LocalMergePress):
    """Merge each evicted token into the more key-homogeneous of the two kept tokens bounding its gap.

    Rule (per batch element and KV head). An evicted token j lies in a gap of evicted positions between
    the kept tokens L (before) and R (after). Its carrier π(j) is whichever of L, R has the higher key
    cosine similarity with k_j (L on ties; the only one when the gap touches an end of the sequence).
    Every evicted token is merged (AsymKV evicts by merging, it never drops). A carrier i with cardinality
    l_i = 1 + |{j: π(j)=i}| becomes

        k_i ← (k_i + Σ_{j→i} k_j) / l_i                      homogeneous keys: their mean
        v_i ← (v_i + Σ_{j→i} v_j) / l_i                      AsymKV's lossless value Σv with its count l

    Choices and the one deviation:

    * Keys use the plain mean (AsymKV's default key merge); its Fisher-diagonal weighting needs gradients
      through the model and is not reproduced.
    * Values: AsymKV stores (Σv, l) and its attention gives the merged slot weight l·exp(q·k) and value
      Σv / l, which is exact when the merged keys are equal. kvpress's attention (sdpa, flash, eager) has
      no per-key cardinality term and none can be folded into a RoPE key, so the count l is dropped and the
      slot keeps Σv / l: the value is the same vector AsymKV reads, with the softmax mass of one token
      instead of l. Storing Σv instead would multiply the slot's output by l whenever it dominates the
      softmax, so the normalised value is the safe half of AsymKV's representation.
    * AsymKV picks which adjacent pairs to merge by its own importance score; here the base press picks
      what stays and every evicted token is merged into a bounding kept neighbour.

    Parameters
    ----------
    press : BasePress
        The eviction press; see ``LocalMergePress``.
    """

    def assign_carriers(self, inputs: MergeInputs) -> torch.Tensor:
        previous, following = adjacent_carriers(inputs.kept, inputs.evicted)
        kept_keys, evicted_keys = inputs.kept_keys(), inputs.evicted_keys()
        previous_similarity = rowwise_cosine(evicted_keys, carrier_rows(kept_keys, previous))
        following_similarity = rowwise_cosine(evicted_keys, carrier_rows(kept_keys, following))
        take_following = (previous < 0) | ((following >= 0) & (following_similarity > previous_similarity))
        return torch.where(take_following, following, previous)

    def merge(self, inputs: MergeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        carrier = self.assign_carriers(inputs)
        return weighted_mean_merge(inputs, carrier, torch.ones(carrier.shape, device=carrier.device), 1.0)
