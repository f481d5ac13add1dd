"""CaMPress: CaM cache merging (Zhang et al., ICML 2024) on the decision of any kvpress eviction press.

Reference: Y. Zhang, Y. Du, G. Luo, Y. Zhong, Z. Zhang, S. Liu, R. Ji, "CaM: Cache Merging for
Memory-efficient LLMs Inference", ICML 2024 (https://openreview.net/forum?id=LCTmppB165). kvpress ships a
decoding-time ``CAMPress``; this is the prefill variant behind any eviction press.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from grkv_core.options import CaMOptions
from grkv_core.presses.local_merging import LocalMergePress, MergeInputs, merge_into_carriers
from grkv_core.presses.query_policies import surrogate_queries
from grkv_core.solver.attention import masked_softmax


@dataclass
class CaMPress(CaMOptions, LocalMergePress):
    """Merge each evicted token's value into the kept tokens that follow it, scaled by its attention share.

    Rule (per batch element and KV head). Let A_t be the attention token t receives from the surrogate
    window (the last ``window_size`` prompt queries, causal, averaged over rows and over the query heads of
    the GQA group), and W_j the first ``merge_budget`` kept tokens *after* evicted token j (CaM merges into
    the subsequent tokens; fewer when fewer follow). Then, for every i in W_j,

        v_i ← v_i + p_j · v_j / |W_j|,      p_j = min(1, A_j / mean_{t∈W_j} A_t),

    and keys are left unchanged. An evicted token with no kept token after it is dropped, as in kvpress's
    ``CAMPress``.

    Choices where the paper is a decoding-time algorithm:

    * CaM draws a Bernoulli(p_j) mask per merge; we add its expectation p_j instead, so results do not
      depend on a random seed (sweeps compare runs).
    * CaM's cumulative attention Ā is replaced by the surrogate window's attention, the quantity SnapKV
      and GRKV use in prefill.
    * ``merge_budget`` defaults to 32 like kvpress's ``CAMPress``; ``merge_budget=1`` is the one-carrier
      case of the paper's App. A.

    ``assign_carriers`` reports the first kept token after each evicted one (the nearest member of W_j).

    Parameters
    ----------
    press : BasePress
        The eviction press; see ``LocalMergePress``.
    merge_budget : int
        m, the number of subsequent kept tokens each evicted value is spread over.
    window_size : int
        The number of last prompt queries whose attention weights the merge.
    """

    def token_attention(
        self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, kwargs: dict
    ) -> torch.Tensor:
        surrogate = surrogate_queries(
            module, hidden_states, kwargs["position_embeddings"], n_queries=self.window_size, cache_rows=keys.shape[2]
        )
        return window_attention(surrogate.queries, keys, surrogate.positions, module.scaling)

    def merge_windows(self, inputs: MergeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Each evicted token's carriers W_j: the first ``merge_budget`` kept tokens after it.

        Returns
        -------
        window, valid : torch.Tensor
            (B, H, e, m) long indices into ``inputs.kept`` and the bool mask of those that exist.
        """
        first = torch.searchsorted(inputs.kept.contiguous(), inputs.evicted.contiguous())
        window = first.unsqueeze(-1) + torch.arange(self.merge_budget, device=first.device)
        valid = window < inputs.kept.shape[-1]
        return window.clamp(max=inputs.kept.shape[-1] - 1), valid

    def assign_carriers(self, inputs: MergeInputs) -> torch.Tensor:
        window, valid = self.merge_windows(inputs)
        return torch.where(valid[..., 0], window[..., 0], torch.full_like(window[..., 0], -1))

    def merge(self, inputs: MergeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs.token_attention is None:
            raise ValueError("CaM weights merges by attention: MergeInputs.token_attention is required")
        window, valid = self.merge_windows(inputs)
        batch, heads, n_evicted, budget = window.shape
        kept_attention = inputs.token_attention.float().gather(-1, inputs.kept)
        carrier_attention = kept_attention.gather(-1, window.flatten(2)).view_as(window) * valid
        size = valid.sum(dim=-1)
        window_mean = carrier_attention.sum(dim=-1) / size.clamp_min(1)
        evicted_attention = inputs.token_attention.float().gather(-1, inputs.evicted)
        # NOTE: 0/0 (no attention anywhere) merges nothing; a positive share over a zero window is capped at 1.
        probability = (evicted_attention / window_mean).nan_to_num(nan=0.0, posinf=1.0).clamp(0.0, 1.0)
        weight = (probability / size.clamp_min(1)).unsqueeze(-1).expand(-1, -1, -1, budget)
        carrier = torch.where(valid, window, torch.full_like(window, -1))
        sources = inputs.evicted_values().unsqueeze(3).expand(-1, -1, -1, budget, -1)
        values = merge_into_carriers(
            inputs.kept_values(),
            sources.reshape(batch, heads, n_evicted * budget, sources.shape[-1]),
            carrier.reshape(batch, heads, -1),
            weight.reshape(batch, heads, -1),
            None,
        )
        return inputs.kept_keys(), values


def window_attention(
    queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Mean attention each cached token receives from the surrogate query rows.

    Parameters
    ----------
    queries : torch.Tensor
        (B, H_kv, M, d) post-RoPE queries, GQA groups stacked along M.
    keys : torch.Tensor
        (B, H_kv, n, d) the full cache; key i sits at position i.
    query_positions : torch.Tensor or None
        (M,) positions of the query rows for causal attention; None for non-causal.
    scale : float
        Softmax scale.

    Returns
    -------
    torch.Tensor
        (B, H_kv, n) float32, averaged over the M rows.
    """
    visible = None
    if query_positions is not None:
        visible = torch.arange(keys.shape[2], device=keys.device) <= query_positions.to(keys.device)[:, None]
    logits = (queries.float() * scale) @ keys.float().transpose(-1, -2)
    return masked_softmax(logits, visible).mean(dim=-2)
