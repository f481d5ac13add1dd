"""D2OPress: D2O's token-level merging (Wan et al., arXiv 2406.13035) on the decision of any kvpress eviction press.

Reference: Z. Wan et al., "D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of
Large Language Models", arXiv 2406.13035 (ICLR 2025). Only D2O's token-level compensation (merge evicted
tokens into their most similar kept token) is reproduced; its layer-level budget allocation is left to
the base press.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grkv_core.options import D2OOptions
from grkv_core.presses.local_merging import (
    LocalMergePress,
    MergeInputs,
    cosine_similarity,
    weighted_mean_merge,
)


@dataclass
class D2OPress(D2OOptions, LocalMergePress):
    """Merge each evicted token into its most key-similar kept token when the similarity clears a threshold.

    Rule (per batch element and KV head). For evicted token j let u_j = max_i cos(k_j, k_i) over the kept
    tokens i (within ``candidate_range`` positions when set) and π(j) the argmax. Token j is merged when
    u_j ≥ ``threshold``, otherwise dropped. Carrier i then becomes the similarity-softmax mean of itself
    (self-similarity 1) and the tokens merged into it, for keys and values alike:

        x_i ← (e·x_i + Σ_{j: π(j)=i} exp(u_j) x_j) / (e + Σ_{j: π(j)=i} exp(u_j)),      e = exp(1).

    Choices where the paper is a decoding-time algorithm: D2O keeps an exponential moving average of the
    merge threshold across compression steps; a prefill compression is a single step with no history, so
    the EMA collapses to one number, exposed as ``threshold``. Its default 0.5 is our choice (the paper
    gives no prefill value); ``threshold=-1`` merges every evicted token, which is the key-cosine matching
    rule the GRKV paper uses for its merge maps and carrier statistics (App. B).

    Parameters
    ----------
    press : BasePress
        The eviction press; see ``LocalMergePress``.
    threshold : float
        Minimum cosine similarity in [-1, 1] for an evicted token to be merged.
    candidate_range : int, optional
        Only kept tokens at most this many positions away are candidates (the paper's "local candidate
        range"); None (D2O) makes every kept token a candidate. A token with no candidate is dropped.
    """

    def most_similar_carrier(self, inputs: MergeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Each evicted token's most key-similar candidate carrier, before thresholding.

        Returns
        -------
        carrier, similarity : torch.Tensor
            (B, H, e) long index into ``inputs.kept`` (-1 when no candidate is in range) and the float32
            cosine similarity to it (-inf when none).
        """
        similarity = cosine_similarity(inputs.evicted_keys(), inputs.kept_keys())
        if self.candidate_range is not None:
            distance = (inputs.evicted.unsqueeze(-1) - inputs.kept.unsqueeze(-2)).abs()
            similarity = similarity.masked_fill(distance > self.candidate_range, float("-inf"))
        best, carrier = similarity.max(dim=-1)
        return carrier.masked_fill(best == float("-inf"), -1), best

    def assign_carriers(self, inputs: MergeInputs) -> torch.Tensor:
        return self._matched(inputs)[0]

    def merge(self, inputs: MergeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        carrier, similarity = self._matched(inputs)
        return weighted_mean_merge(inputs, carrier, similarity.exp(), carrier_weight=math.e)

    def _matched(self, inputs: MergeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        carrier, similarity = self.most_similar_carrier(inputs)
        return carrier.masked_fill(similarity < self.threshold, -1), similarity
