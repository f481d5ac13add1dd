"""What GRKV's merge reads of a layer besides its cache: the surrogate window (``WindowRegression``).

With the window policy GRKV's surrogate queries are the last m prompt tokens' queries, and its regression target
is their attention over the full cache. The forward computes both anyway; ``WindowCapture`` keeps a copy of their
last m rows per layer (forward hooks that only observe), so the merge computes neither a second time;
``stack_by_kv_head`` lines the kept outputs up with the queries, and ``output_projection_weights`` weighs their rows
(``head_weighting="o_proj"``).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from grkv_core.queries import SurrogateQueries

# NOTE: in these attention classes the input of ``o_proj`` is the concatenation, over query heads, of
# softmax(scale·q Kᵀ) V over the prompt (no output gate), i.e. GRKV's regression target. Sliding-window layers, which
# attend within their window instead, are never merged (``sliding_layers``) and so never captured. Gemma 3's
# attention logits are not soft-capped (``attn_logit_softcapping`` is None), else its outputs would not be this
# softmax. Other classes get the target recomputed by the solver.
OUTPUTS_BEFORE_O_PROJ = (LlamaAttention, MistralAttention, Qwen2Attention, Qwen3Attention, Gemma3Attention)


class WindowCapture:
    """The last ``window_size`` rows of each layer's ``q_proj`` outputs and ``o_proj`` inputs in a prefill.

    NOTE: kept on this object (one per press), never on the shared attention modules, so that several presses can
    share one prefill without reading each other's windows.

    Parameters
    ----------
    window_size : int
        m, how many last prompt rows are kept.
    keep_outputs : bool
        Whether to keep the attention outputs (the ``o_proj`` inputs) besides the queries.
    """

    def __init__(self, window_size: int, keep_outputs: bool) -> None:
        self.window_size = window_size
        self.keep_outputs = keep_outputs
        self._projections: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._awaiting_projections: set[int] = set()

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

    def take(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's kept (B, m, H_q·d) ``q_proj`` outputs and (B, m, H_q·d) attention outputs, each None when
        not captured; handed over once (the next prefill captures its own)."""
        return self._projections.pop(layer_idx, None), self._outputs.pop(layer_idx, None)

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
            with torch.no_grad():
                self._projections[attention.layer_idx] = projections[:, -self.window_size :].clone()

    def _keep_outputs(self, attention: nn.Module, o_proj: nn.Module, args: tuple) -> None:
        outputs = args[0]  # (B, n, H_q·d)
        if outputs.shape[1] > 1:  # a prefill chunk: decoding steps are never compressed
            # NOTE: a copy of the m rows made without autograd, so that neither the layer's (B, n, H_q·d) output nor,
            # in grad mode, its autograd graph is kept alive.
            with torch.no_grad():
                self._outputs[attention.layer_idx] = outputs[:, -self.window_size :].clone()


@dataclass(frozen=True)
class WindowRegression:
    """What GRKV's merge reads besides the cache, for one layer (or one (batch, head) of it).

    Attributes
    ----------
    surrogate : SurrogateQueries
        The window queries, (B, H_kv, M, d) stacked by KV head.
    full_outputs : torch.Tensor or None
        (B, H_kv, M, d) their attention outputs over the full cache, kept from the prefill forward; None: the
        solver computes them.
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


def output_projection_weights(module: nn.Module, surrogate: SurrogateQueries) -> torch.Tensor:
    """(B, H_kv, groups·m) row weights: query head h's rows weigh ‖W_o[:, h·d:(h+1)·d]‖²_F over the layer's
    mean.

    NOTE: ``o_proj`` reads the heads' outputs concatenated head-major (column h·d + j is head h's j-th channel),
    and the surrogate rows stack the query heads of a KV head group-major, so a view and a repeat line them up.
    """
    batch, kv_heads, rows, head_dim = surrogate.queries.shape
    window = surrogate.token_positions.numel()
    weight = module.o_proj.weight.detach().float()
    per_head = weight.view(weight.shape[0], -1, head_dim).square().sum(dim=(0, 2))  # (H_q,)
    per_head = per_head / per_head.mean()
    row_weights = per_head.view(kv_heads, rows // window).repeat_interleave(window, dim=-1)
    return row_weights.to(surrogate.queries.device).expand(batch, kv_heads, rows)
