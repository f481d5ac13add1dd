"""What GRKV's merge reads of a layer besides its cache: the surrogate queries' rows kept from the forward
(``SurrogateCapture``), their regression target and row weights (``WindowRegression``).

A surrogate-query policy reads the pre-RoPE queries of some prompt rows (the window's last m, strata midpoints, ...),
and with the window policy its regression target is the window's attention over the full cache. The forward computes
both anyway; ``SurrogateCapture`` keeps a copy of those rows per layer (forward hooks that only observe), so the merge
projects none of them a second time; ``stack_by_kv_head`` lines the kept outputs up with the queries, and
``OutputProjectionWeights`` weighs their rows (``head_weighting="o_proj"``), computed once per model.
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from grkv_core.presses.query_policies import QueryPolicy, SurrogateQueries

# NOTE: in these attention classes the input of ``o_proj`` is the concatenation, over query heads, of
# softmax(scale·q Kᵀ) V over the prompt (no output gate), i.e. GRKV's regression target. Sliding-window layers, which
# attend within their window instead, are never merged (``sliding_layers``) and so never captured. Gemma 3's
# attention logits are not soft-capped (``attn_logit_softcapping`` is None), else its outputs would not be this
# softmax. Other classes get the target recomputed by the solver.
OUTPUTS_BEFORE_O_PROJ = (LlamaAttention, MistralAttention, Qwen2Attention, Qwen3Attention, Gemma3Attention)


class SurrogateCapture:
    """The rows of each layer's ``q_proj`` outputs that a query policy reads (``QueryPolicy.prompt_rows``) in a
    prefill, and, with ``keep_outputs`` (a policy whose target they are, ``QueryPolicy.target_in_forward``), the
    ``o_proj`` inputs of the same rows.

    NOTE: kept on this object (one per press context), never on the shared attention modules, so that several presses
    can share one prefill without reading each other's rows.

    Parameters
    ----------
    policy : QueryPolicy
        The query policy (``GRKVOptions.query_policy``'s).
    n_queries : int
        Its m (``window_size``).
    keep_outputs : bool
        Whether to keep the attention outputs (the ``o_proj`` inputs) of the rows besides their queries.
    """

    def __init__(self, policy: QueryPolicy, n_queries: int, keep_outputs: bool) -> None:
        self.policy = policy
        self.n_queries = n_queries
        self.keep_outputs = keep_outputs
        self._projections: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._awaiting_projections: set[int] = set()
        self._rows: dict[tuple[int, torch.device], torch.Tensor] = {}

    @contextmanager
    def hooked(self, attentions: list[nn.Module]):
        """Observe those of the ``attentions`` modules whose class passes its target to ``o_proj``; forget everything
        after."""
        handles = []
        try:
            for attention in attentions:
                if not isinstance(attention, OUTPUTS_BEFORE_O_PROJ):
                    continue
                handles.append(
                    attention.register_forward_pre_hook(functools.partial(self._await_projections, attention))
                )
                handles.append(
                    attention.q_proj.register_forward_hook(functools.partial(self._keep_projections, attention))
                )
                if self.keep_outputs:
                    handles.append(
                        attention.o_proj.register_forward_pre_hook(functools.partial(self._keep_outputs, attention))
                    )
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self._projections.clear()
            self._outputs.clear()
            self._awaiting_projections.clear()
            self._rows.clear()

    def take(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's kept (B, r, H_q·d) ``q_proj`` outputs and (B, r, H_q·d) attention outputs, each None when
        not captured; handed over once (the next prefill captures its own)."""
        return self._projections.pop(layer_idx, None), self._outputs.pop(layer_idx, None)

    def _kept_rows(self, prompt: torch.Tensor) -> torch.Tensor:
        """The policy's rows of (B, n, X) ``prompt``, copied (an index, not a slice's view), so that neither the layer's
        whole tensor nor, in grad mode, its autograd graph is kept alive.

        NOTE: the rows' index depends on the prompt's length alone, so it is built once per length (per prefill), not
        once per layer; a slice becomes an index tensor, whose one ``index`` operation copies."""
        key = (prompt.shape[1], prompt.device)
        if key not in self._rows:
            length = prompt.shape[1]
            m = self.policy.row_count(self.n_queries, length)
            rows = self.policy.prompt_rows(m, length, prompt.device)[0]
            self._rows[key] = torch.arange(length, device=prompt.device)[rows] if isinstance(rows, slice) else rows
        with torch.no_grad():
            return prompt[:, self._rows[key]]

    def _await_projections(self, attention: nn.Module, module: nn.Module, args: tuple) -> None:
        # NOTE: only the forward's own q_proj call, the first after this pre-hook, is kept: a base press that
        # projects other hidden states while scoring (SnapKV's observation window) calls q_proj again later.
        self._projections.pop(attention.layer_idx, None)
        self._awaiting_projections.add(attention.layer_idx)

    def _keep_projections(
        self, attention: nn.Module, q_proj: nn.Module, args: tuple, projections: torch.Tensor
    ) -> None:
        if attention.layer_idx not in self._awaiting_projections:
            return
        self._awaiting_projections.discard(attention.layer_idx)
        if projections.shape[1] > 1:  # a prefill chunk: decoding steps are never compressed
            self._projections[attention.layer_idx] = self._kept_rows(projections)

    def _keep_outputs(self, attention: nn.Module, o_proj: nn.Module, args: tuple) -> None:
        outputs = args[0]  # (B, n, H_q·d)
        if outputs.shape[1] > 1:  # a prefill chunk: decoding steps are never compressed
            self._outputs[attention.layer_idx] = self._kept_rows(outputs)


@dataclass(frozen=True)
class WindowRegression:
    """What GRKV's merge reads besides the cache, for one layer (or one (batch, head) of it).

    Attributes
    ----------
    surrogate : SurrogateQueries
        The surrogate queries, (B, H_kv, M, d) stacked by KV head.
    full_outputs : torch.Tensor or None
        (B, H_kv, M, d) their attention outputs over the full cache, kept from the prefill forward; None: the
        merge computes them.
    scale : float
        The layer's softmax scale.
    deferrable : bool
        Whether the layer's merge may wait for the rest of its group of ``layers_per_solve`` layers.
    row_weights : torch.Tensor or None
        (B, H_kv, M) weights of the query rows in the loss (``head_weighting``); None: all 1.
    """

    surrogate: SurrogateQueries
    full_outputs: torch.Tensor | None
    scale: float
    deferrable: bool
    row_weights: torch.Tensor | None = None


def stack_by_kv_head(outputs: torch.Tensor | None, surrogate: SurrogateQueries) -> torch.Tensor | None:
    """(B, m, H_q·d) attention outputs of the window tokens -> (B, H_kv, groups·m, d), stacked like the queries."""
    if outputs is None:
        return None
    batch, kv_heads, rows, head_dim = surrogate.queries.shape
    window = surrogate.token_positions.numel()
    query_heads = kv_heads * (rows // window)
    if outputs.shape != (batch, window, query_heads * head_dim):
        return None  # not this forward's window: the solver computes the target itself
    per_query_head = outputs.view(batch, window, query_heads, head_dim).transpose(1, 2)  # (B, H_q, m, d)
    return per_query_head.reshape(batch, kv_heads, rows, head_dim)


def output_projection_head_weights(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(H_q,) float32: query head h's ‖W_o[:, h·d:(h+1)·d]‖²_F over the mean of the layer's heads, for an ``o_proj``
    weight (hidden, H_q·d)."""
    weight = weight.detach().float()
    per_head = weight.view(weight.shape[0], -1, head_dim).square().sum(dim=(0, 2))
    return per_head / per_head.mean()


class OutputProjectionWeights:
    """The loss rows' weights of ``head_weighting="o_proj"``, per layer: each query head's rows weigh its output
    projection's squared norm over the layer's mean (``output_projection_head_weights``).

    NOTE: a weight is read once per model, not once per layer and prefill: the per-head weights are kept per ``o_proj``
    weight (weakly: a model that goes away leaves only a dead entry, dropped at the next miss) and recomputed only
    when that weight changes (its version counter moves with every in-place update, ``load_state_dict`` included, and
    its storage with a move or a cast); the rows' layout, which depends on the prompt's window, is kept per (window,
    batch, device).
    """

    def __init__(self) -> None:
        # NOTE: by the weight's id, with a weak reference that tells a live weight from a dead one whose id was reused
        # (a tensor cannot key a WeakKeyDictionary: its ``==`` is elementwise).
        self._per_head: dict[int, tuple] = {}

    def rows(self, module: nn.Module, surrogate: SurrogateQueries) -> torch.Tensor:
        """(B, H_kv, groups·m) row weights of ``module``'s surrogate rows.

        NOTE: ``o_proj`` reads the heads' outputs concatenated head-major (column h·d + j is head h's j-th channel),
        and the surrogate rows stack the query heads of a KV head group-major, so a view and a repeat line them up.
        """
        weight = module.o_proj.weight
        batch, kv_heads, rows, head_dim = surrogate.queries.shape
        window = surrogate.token_positions.numel()
        version = (weight._version, weight.data_ptr(), weight.dtype, weight.device)
        entry = self._per_head.get(id(weight))
        if entry is None or entry[0]() is not weight or entry[1] != version:
            self._per_head = {key: kept for key, kept in self._per_head.items() if kept[0]() is not None}
            entry = (weakref.ref(weight), version, output_projection_head_weights(weight, head_dim), {})
            self._per_head[id(weight)] = entry
        layouts = entry[3]
        layout = (window, batch, surrogate.queries.device)
        if layout not in layouts:
            per_head = entry[2].to(surrogate.queries.device)
            row_weights = per_head.view(kv_heads, rows // window).repeat_interleave(window, dim=-1)
            layouts[layout] = row_weights.expand(batch, kv_heads, rows)
        return layouts[layout]
