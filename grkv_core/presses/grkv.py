"""GRKVPress: GRKV merging behind any kvpress eviction press."""

from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from grkv_core.config import GRKVOptions
from grkv_core.diagnostics.losses import discrepancy_per_head
from grkv_core.presses.merging import MergingPress
from grkv_core.presses.selection import TokenSelection, forced_score_positions
from grkv_core.queries import SurrogateQueries, surrogate_queries
from grkv_core.solver.attention import full_cache_outputs
from grkv_core.solver.merge import solve_regression
from grkv_core.solver.regression import KeptRegression

# NOTE: in these attention classes the input of ``o_proj`` is the concatenation, over query heads, of
# softmax(scale·q Kᵀ) V over the prompt (no output gate), i.e. GRKV's regression target. One exception: a
# sliding-window layer (Gemma 3's local layers, a Mistral with a window) shorter than the prompt attends within the
# window, and that windowed output, what the full cache gives, becomes the target; the solver's recomputed target
# (``target_from_forward=False``) attends over the whole prompt. Gemma 3's attention logits are not soft-capped
# (``attn_logit_softcapping`` is None), else its outputs would not be this softmax. Other classes get the target
# recomputed by the solver.
_OUTPUTS_BEFORE_O_PROJ = (LlamaAttention, MistralAttention, Qwen2Attention, Qwen3Attention, Gemma3Attention)


@dataclass
class GRKVPress(GRKVOptions, MergingPress):
    """Keep the base press's tokens and merge the evicted ones into them by global ridge regression.

    The base press decides which tokens stay; GRKV then refits the kept keys and values so that attention
    of the surrogate queries over the compressed cache reproduces attention over the full cache (paper
    Alg. 1). With a uniform budget (every ``ScorerPress``, ``PyramidKVPress``) the cache is physically
    compacted to the kept tokens. With per-head budgets (``AdaKVPress``, ``CriticalAdaKVPress``) kvpress
    masks evicted entries instead of removing them, so memory is *not* saved; GRKV still merges per head.

    Parameters
    ----------
    press : BasePress
        The eviction press (SnapKV, PyramidKV, StreamingLLM, ObservedAttention, ExpectedAttention, Knorm,
        CriticalKV, AdaKV, CriticalAdaKV), or ``PerLayerCompressionPress`` or ``ChunkPress`` around one of the
        first seven. Its ``compression_ratio`` sets the budget.
    lambda_k, lambda_v : float
        Ridge coefficients (>= 0). Paper defaults: 1e-2 for Llama, 1e-1 for Mistral and Qwen.
    beta : float
        Fraction of the kept tokens (besides sinks and the window) with the highest base-press scores
        that are held fixed.
    window_size : int
        m, the number of surrogate query tokens (the last m prompt tokens by default).
    steps : int
        S, the maximum number of alternating value/key steps.
    n_sink : int
        The first ``n_sink`` positions are held fixed when kept.
    components : {"kv", "k", "v"}
        GRKV, GRK (keys only) or GRV (values only).
    query_policy : {"window", "stratified"}
        See ``grkv_core.queries.surrogate_queries``; "stratified" mirrors the authors' released code.
    max_rel_update_k, max_rel_update_v : float, optional
        Trust-region caps (authors' code: 0.025 and 0.1): per head, ‖ΔK‖ ≤ cap·‖K⁰‖ and likewise for V.
    accept : {"always", "objective", "validation"}
        "objective" keeps, per head, whichever of {evicted cache, values-only merge, full merge} has the
        lowest window discrepancy (authors' code). "validation" tests the merge on queries it was not fitted on:
        a merge fitted on the window's even-numbered tokens must lower the loss of its odd-numbered tokens below
        the evicted cache's, else the head keeps its evicted rows; the heads that pass get the merge fitted on
        the whole window.
    cg_max_iter, cg_rtol : int, float
        Conjugate-gradient controls of the key step.
    safeguard : bool
        Halve the key step per head until the true window loss is no worse than after the value step (a
        measured deviation from the paper, on by default; see ``grkv_merge``). The paper's Alg. 1 exactly is
        ``safeguard=False`` with the key step solved to convergence (``cg_max_iter=200, cg_rtol=1e-7``).
    ridge_scale : {"absolute", "relative"}
        "relative" multiplies λ_k and λ_v by a per-head scale of their systems (see ``grkv_merge``).
    layers_per_solve : int
        Within this press's own context manager, the merges of this many consecutive layers (of one shape) are
        solved together, in one batched call when the last of them is compressed; the earlier layers' caches are
        merged in place then. Results equal merging each layer alone up to float rounding; on SmolLM2 on 2 CPU
        cores 6 layers cut the merge's prefill overhead by about 30% (benchmarks/RESULTS.md §6). 1 merges every
        layer at once.
    target_from_forward : bool
        With the window policy, take the regression target (the full cache's attention outputs for the
        window queries) from the model's own prefill forward, the input of ``o_proj``, instead of computing
        it again (in float32) over the whole cache. It saves one attention pass per layer; the target then
        carries the model's dtype (bf16 rounding, ~0.4% per entry, on half-precision models).
    head_weighting : {"uniform", "o_proj"}
        "uniform" (the paper): every query head's error counts alike. "o_proj": each query head's rows of the loss
        are weighted by ‖W_o^h‖²_F, the squared norm of its block of the output projection, over the layer's mean
        (so λ keeps its scale): the error that reaches the residual stream, with the heads' cross terms left out.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        # NOTE: the window's attention outputs and q_proj outputs, per layer, kept on the press itself (never on the
        # shared attention modules), so that several GRKV presses can share one prefill without reading each other's.
        self._window_outputs: dict[int, torch.Tensor] = {}
        self._window_projections: dict[int, torch.Tensor] = {}
        self._awaiting_projections: set[int] = set()
        # NOTE: the merges waiting for the rest of their group, as (regression, solver options); None outside this
        # press's own context manager, where every layer is merged at once (see ``__call__``).
        self._pending: list[tuple[KeptRegression, dict]] | None = None
        self._last_hooked_layer: int | None = None

    @contextmanager
    def __call__(self, model):
        """kvpress's context manager, plus hooks that keep the window's queries and attention outputs.

        With the window policy the surrogate queries are built from the ``q_proj`` outputs of the forward itself
        (the same rows the forward projected), and with ``target_from_forward`` the target is the input of
        ``o_proj``; neither is computed a second time.
        """
        language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
        attentions = [attention for attention in (layer.self_attn for layer in language_model.layers)
                      if isinstance(attention, _OUTPUTS_BEFORE_O_PROJ)]
        handles = []
        try:
            if self.query_policy == "window":
                for attention in attentions:
                    handles.append(attention.register_forward_pre_hook(
                        functools.partial(self._await_window_projections, attention)))
                    handles.append(attention.q_proj.register_forward_hook(
                        functools.partial(self._keep_window_projections, attention)))
                    if self.target_from_forward:
                        handles.append(attention.o_proj.register_forward_pre_hook(
                            functools.partial(self._keep_window_outputs, attention)))
            with super().__call__(model):
                self._start_groups(language_model)
                yield
        finally:
            self._pending = self._last_hooked_layer = None
            for handle in handles:
                handle.remove()
            self._window_outputs.clear()
            self._window_projections.clear()
            self._awaiting_projections.clear()

    def _start_groups(self, language_model: nn.Module) -> None:
        """Let the layers' merges wait for their group (``layers_per_solve``) within each prefill forward.

        NOTE: a deferred layer's cache holds its kept rows unmerged until the last layer of its group is compressed,
        at the latest the last layer kvpress hooked (found among the hooks it registered), all within the prefill's
        forward: nothing reads a layer's cache between its own attention and the end of that forward, so what
        follows sees only merged caches. Deferral needs this press's own context manager, where nothing runs after
        its hook on a layer; inside ``ComposedPress`` or ``PrefillDecodingPress`` every layer is merged at once.
        """
        hooked = [layer.self_attn.layer_idx for layer in language_model.layers
                  if self.forward_hook in layer.self_attn._forward_hooks.values()]
        if self.layers_per_solve > 1 and hooked:
            self._pending, self._last_hooked_layer = [], max(hooked)

    def _await_window_projections(self, attention: nn.Module, module: nn.Module, args: tuple) -> None:
        # NOTE: only the forward's own q_proj call, the first after this pre-hook, is kept: a base press that
        # projects other hidden states while scoring (SnapKV's observation window) calls q_proj again later.
        self._window_projections.pop(attention.layer_idx, None)
        self._awaiting_projections.add(attention.layer_idx)

    def _keep_window_projections(self, attention: nn.Module, q_proj: nn.Module, args: tuple,
                                 projections: torch.Tensor) -> None:
        if attention.layer_idx not in self._awaiting_projections:
            return
        self._awaiting_projections.discard(attention.layer_idx)
        if projections.shape[1] > 1:  # a prefill chunk: decoding steps are never compressed
            self._window_projections[attention.layer_idx] = projections[:, -self.window_size:].detach().clone()

    def _keep_window_outputs(self, attention: nn.Module, o_proj: nn.Module, args: tuple) -> None:
        outputs = args[0]  # (B, n, H_q·d)
        if outputs.shape[1] > 1:  # a prefill chunk: decoding steps are never compressed
            # NOTE: a detached copy of the m rows, so that neither the layer's (B, n, H_q·d) output nor, in grad
            # mode, its autograd graph is kept alive.
            self._window_outputs[attention.layer_idx] = outputs[:, -self.window_size:].detach().clone()

    def layer_context(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                      kwargs: dict) -> _WindowRegression:
        surrogate = surrogate_queries(
            module, hidden_states, kwargs["position_embeddings"], policy=self.query_policy, n_queries=self.window_size,
            window_projections=self._window_projections.pop(module.layer_idx, None),
        )
        full_outputs = _stack_by_kv_head(self._window_outputs.pop(module.layer_idx, None), surrogate)
        deferrable = (self._pending is not None and self.accept == "always"
                      and _keeps_returned_rows(kwargs["past_key_values"], module.layer_idx))
        row_weights = _output_projection_weights(module, surrogate) if self.head_weighting == "o_proj" else None
        return _WindowRegression(surrogate, full_outputs, module.scaling, deferrable, row_weights)

    def head_context(self, context: _WindowRegression, batch_index: int, head_index: int) -> _WindowRegression:
        head = (slice(batch_index, batch_index + 1), slice(head_index, head_index + 1))
        surrogate = context.surrogate
        head_queries = SurrogateQueries(
            surrogate.queries[head], surrogate.positions, surrogate.token_positions, surrogate.loss_weight
        )
        full_outputs = context.full_outputs[head] if context.full_outputs is not None else None
        row_weights = context.row_weights[head] if context.row_weights is not None else None
        return _WindowRegression(head_queries, full_outputs, context.scale, deferrable=False, row_weights=row_weights)

    def _fixed(self, selection: TokenSelection, kept: torch.Tensor) -> torch.Tensor:
        """(B, H, c) bool: sinks, the recent window, and the top-beta of the other kept tokens by score.

        NOTE: the top-beta ranking runs on the base press's genuine scores only: positions it scores
        artificially (its own observation window or sinks, ``forced_score_positions``) are not candidates, else a
        base window wider than GRKV's would take every top-beta slot.
        """
        length = selection.scores.shape[-1]
        protected = (kept < self.n_sink) | (kept >= length - self.window_size)
        candidates = ~protected & ~forced_score_positions(self.press, length, kept.device)[kept]
        kept_scores = selection.scores.gather(-1, kept).masked_fill(~candidates, float("-inf"))
        order = kept_scores.argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(kept.shape[-1], device=kept.device).expand_as(order))
        n_top = (candidates.sum(dim=-1, keepdim=True) * self.beta).floor().long()
        return protected | (candidates & (rank < n_top))

    def merge_selected(
        self, keys: torch.Tensor, values: torch.Tensor, selection: TokenSelection, context: _WindowRegression
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Refit the kept rows by GRKV's regression; then the trust-region caps and the acceptance rule, if set.

        A layer that ``context.deferrable`` marks gets its kept rows back as they are, and they are merged in place
        together with the other layers of its group (``layers_per_solve``), when the last of them is compressed.
        """
        surrogate, full_outputs, scale = context.surrogate, context.full_outputs, context.scale
        kept = selection.kept_positions()
        fixed = self._fixed(selection, kept)
        if bool(fixed.all()):
            # NOTE: one message per setting (not per layer or head), so Python's warning filter shows it once.
            warnings.warn(f"GRKV refits nothing: every kept token is held fixed (the first n_sink={self.n_sink}, the "
                          f"last window_size={self.window_size} positions and the top beta={self.beta} of the rest); "
                          "raise the budget or lower window_size or beta", UserWarning, stacklevel=2)
        if self.accept != "always" and full_outputs is None:
            # NOTE: one full-cache pass serves every merge and every candidate's loss below.
            full_outputs = full_cache_outputs(surrogate.queries, keys, values, query_positions=surrogate.positions,
                                              scale=scale)
        regression = KeptRegression.of(surrogate.queries, keys, values, kept, fixed,
                                       query_positions=surrogate.positions, scale=scale, full_outputs=full_outputs,
                                       row_weights=context.row_weights)
        options = self._solver_options(surrogate.loss_weight)
        if context.deferrable:
            self._defer(regression, options)
            return regression.kept_keys, regression.kept_values
        merged_keys, merged_values = self._capped(regression, *solve_regression(regression, **options))
        if self.accept == "always":
            return merged_keys, merged_values
        if self.accept == "validation":
            passes = self._passes_validation(regression, options, keys, values, full_outputs,
                                             surrogate.token_positions.numel())[..., None, None]
            return (torch.where(passes, merged_keys, regression.kept_keys),
                    torch.where(passes, merged_values, regression.kept_values))

        _, values_only = self._capped(regression, *solve_regression(regression, **{**options, "components": "v"}))
        evicted_keys, evicted_values = regression.kept_keys, regression.kept_values
        candidates = [(evicted_keys, evicted_values), (evicted_keys, values_only), (merged_keys, merged_values)]
        errors = torch.stack([
            discrepancy_per_head(surrogate.queries, keys, values, k, v, query_positions=surrogate.positions,
                                 compressed_positions=kept, scale=scale, full_outputs=full_outputs)[0]
            for k, v in candidates
        ])
        best = errors.argmin(dim=0)[..., None, None]
        choose = lambda options: torch.where(best == 0, options[0], torch.where(best == 1, options[1], options[2]))  # noqa: E731
        return choose([k for k, _ in candidates]), choose([v for _, v in candidates])

    def _passes_validation(self, regression: KeptRegression, options: dict, keys: torch.Tensor, values: torch.Tensor,
                           full_outputs: torch.Tensor, window: int) -> torch.Tensor:
        """(B, H_kv) bool: the heads where a merge fitted on the ``window`` surrogate tokens of even index has a lower
        loss than the evicted cache on those of odd index (every query head's rows of them: the rows of a KV head
        repeat the window once per query head)."""
        token = torch.arange(regression.queries.shape[2], device=keys.device) % window
        fit, held_out = token % 2 == 0, token % 2 == 1

        def rows(tensor: torch.Tensor | None, chosen: torch.Tensor) -> torch.Tensor | None:
            return None if tensor is None else tensor[..., chosen, :] if tensor.ndim == 4 else tensor[..., chosen]

        positions = regression.query_positions
        fitted = KeptRegression.of(rows(regression.queries, fit), keys, values, regression.kept, regression.fixed,
                                   query_positions=None if positions is None else positions[fit],
                                   scale=regression.scale, full_outputs=rows(full_outputs, fit),
                                   row_weights=rows(regression.row_weights, fit))
        candidates = [(regression.kept_keys, regression.kept_values),
                      self._capped(fitted, *solve_regression(fitted, **options))]
        evicted, merged = (
            discrepancy_per_head(rows(regression.queries, held_out), keys, values, k, v,
                                 query_positions=None if positions is None else positions[held_out],
                                 compressed_positions=regression.kept, scale=regression.scale,
                                 full_outputs=rows(full_outputs, held_out))[0]
            for k, v in candidates)
        return merged < evicted

    def compress(self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 attentions: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``MergingPress.compress``, then the group's solve once it is full or this is the last hooked layer."""
        compressed = super().compress(module, hidden_states, keys, values, attentions, kwargs)
        if self._pending and (len(self._pending) >= self.layers_per_solve
                              or module.layer_idx == self._last_hooked_layer):
            self._solve_pending()
        return compressed

    def _solver_options(self, loss_weight: float) -> dict:
        return dict(lambda_k=self.lambda_k / loss_weight, lambda_v=self.lambda_v / loss_weight, steps=self.steps,
                    components=self.components, cg_max_iter=self.cg_max_iter, cg_rtol=self.cg_rtol,
                    safeguard=self.safeguard, ridge_scale=self.ridge_scale)

    def _capped(self, regression: KeptRegression, merged_keys: torch.Tensor,
                merged_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The trust-region caps (``max_rel_update_k``/``_v``) applied to a merge of ``regression``."""
        return (_cap_update(regression.kept_keys, merged_keys, self.max_rel_update_k),
                _cap_update(regression.kept_values, merged_values, self.max_rel_update_v))

    def _defer(self, regression: KeptRegression, options: dict) -> None:
        if self._pending and not (self._pending[0][1] == options and self._pending[0][0].stacks_with(regression)):
            self._solve_pending()  # NOTE: a group holds one shape (per-layer budgets change c): solve it first
        self._pending.append((regression, options))

    def _solve_pending(self) -> None:
        """Solve the pending layers in one call and write each result into the cache rows it handed out."""
        pending, self._pending = self._pending, []
        regressions = [regression for regression, _ in pending]
        merged_keys, merged_values = solve_regression(KeptRegression.stack(regressions), **pending[0][1])
        sizes = [regression.batch for regression in regressions]
        for regression, keys, values in zip(regressions, merged_keys.split(sizes), merged_values.split(sizes)):
            keys, values = self._capped(regression, keys, values)
            regression.kept_keys.copy_(keys)
            regression.kept_values.copy_(values)


@dataclass(frozen=True)
class _WindowRegression:
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


def _stack_by_kv_head(outputs: torch.Tensor | None, surrogate: SurrogateQueries) -> torch.Tensor | None:
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


def _output_projection_weights(module: nn.Module, surrogate: SurrogateQueries) -> torch.Tensor:
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


def _keeps_returned_rows(cache, layer_idx: int) -> bool:
    """Whether kvpress's hook stores the very tensors ``compress`` returns as the layer's cache, so that a merge
    finished later, in place, reaches the cache: a plain ``DynamicCache`` layer does; a quantized cache re-encodes
    them and an offloading one moves them."""
    return (isinstance(cache, DynamicCache) and not cache.offloading
            and type(cache.layers[layer_idx]) is DynamicLayer)


def _cap_update(start: torch.Tensor, merged: torch.Tensor, max_relative: float | None) -> torch.Tensor:
    """Shrink each head's update so that ‖merged − start‖_F ≤ max_relative·‖start‖_F (no-op when None)."""
    if max_relative is None:
        return merged
    update = merged.float() - start.float()
    update_norm = update.flatten(2).norm(dim=-1)
    limit = max_relative * start.float().flatten(2).norm(dim=-1)
    factor = (limit / update_norm.clamp_min(1e-30)).clamp(max=1.0)[..., None, None]
    return (start.float() + factor * update).to(merged.dtype)
