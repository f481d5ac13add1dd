"""GRKVPress: GRKV merging behind any kvpress eviction press."""

from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from grkv_core.option_specs import options_docstring
from grkv_core.options import PAPER_GRKV_OPTIONS, SOLVER_OPTION_NAMES, GRKVOptions, SolverOptions
from grkv_core.presses.layer_groups import LayerGroups, LayerMerge, keeps_returned_rows
from grkv_core.presses.merging import BaseMergerPress
from grkv_core.presses.query_policies import (
    PolicyRowsMemo,
    QueryPolicy,
    SurrogateQueries,
    query_policy,
    surrogate_queries,
)
from grkv_core.presses.selection import TokenSelection, forced_score_ranges
from grkv_core.presses.sliding_layers import language_model, sliding_layer_indices
from grkv_core.presses.surrogate_capture import (
    OutputProjectionWeights,
    SurrogateCapture,
    WindowRegression,
    stack_by_kv_head,
)
from grkv_core.presses.update_rules import lowest_window_loss, passes_validation
from grkv_core.solver.attention import full_cache_outputs
from grkv_core.solver.merge import SolveIssues, solve_regression
from grkv_core.solver.problem import gather_rows
from grkv_core.solver.regression import KeptRegression


@dataclass
class GRKVPress(GRKVOptions, BaseMergerPress):
    """Keep the base press's tokens and merge the evicted ones into them by global ridge regression.

    The base press decides which tokens stay; GRKV then refits the kept keys and values so that attention
    of the surrogate queries over the compressed cache reproduces attention over the full cache (paper
    Alg. 1). With a uniform budget (every ``ScorerPress``, ``PyramidKVPress``) the cache is physically
    compacted to the kept tokens. With per-head budgets (``AdaKVPress``, ``CriticalAdaKVPress``) kvpress
    masks evicted entries instead of removing them, so memory is *not* saved; GRKV still merges per head.

    With no option it builds the library's default (``GRKVOptions``' defaults: stratified queries, m = 64, small
    ridges, a key cap and output-projection row weights, chosen by a rule fixed before its runs,
    docs/results/default-rule.md). ``GRKVPress.paper(press)`` builds the paper's Alg. 1;
    ``GRKVPress(press, **GRKV_PRESETS["window32"])`` the default before 2026-11-28.

    Parameters
    ----------
    press : BasePress
        The eviction press, one of ``grkv_core.presses.selection.SUPPORTED_BASE_PRESSES``. Its
        ``compression_ratio`` sets the budget.
    """

    # NOTE: the regression reads the full cache only through its target, the window's attention outputs over it, which
    # a NaN or +inf anywhere in the cache makes non-finite; the solver then hands the head back unmerged, counted on
    # the device, where a check of the whole cache here would read it on the host at every layer.
    unmerges_non_finite_caches: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        # NOTE: these exist only within this press's own context manager (see ``__call__``).
        self._capture: SurrogateCapture | None = None
        self._groups: LayerGroups | None = None
        self._issues: SolveIssues | None = None
        self._policy: QueryPolicy | None = None
        self._policy_rows: PolicyRowsMemo | None = None
        # NOTE: kept across contexts: the output projections' weights are read once per model (and again if changed).
        self._row_weights = OutputProjectionWeights()
        # NOTE: set by ``post_init_from_model``, which kvpress (and its wrappers) call before any layer is hooked.
        self._merged_layers: frozenset[int] | None = None

    @classmethod
    def paper(cls, press, **options) -> GRKVPress:
        """GRKV exactly as the paper's Alg. 1 (``PAPER_GRKV_OPTIONS``) behind ``press``; ``options`` override it."""
        return cls(press=press, **{**PAPER_GRKV_OPTIONS, **options})

    def post_init_from_model(self, model) -> None:
        super().post_init_from_model(model)
        self._merged_layers = merged_layer_indices(model, self.merged_layers)

    @contextmanager
    def __call__(self, model):
        """kvpress's context manager; the surrogate queries' rows (and, with ``target_from_forward`` and a policy
        whose target the forward holds, ``QueryPolicy.target_in_forward``, their attention outputs) are kept from the
        forward itself (``SurrogateCapture``), and with ``layers_per_solve`` other than 1 the layers' merges wait for
        their group (``LayerGroups``)."""
        decoder = language_model(model)
        merged = merged_layer_indices(model, self.merged_layers)
        merged_attentions = [layer.self_attn for index, layer in enumerate(decoder.layers) if index in merged]
        policy = query_policy(self.query_policy)
        capture = SurrogateCapture(
            policy, self.window_size, keep_outputs=self.target_from_forward and policy.target_in_forward
        )
        join = None
        try:
            with capture.hooked(merged_attentions), self.merging_state(policy), super().__call__(model):
                self._capture = capture
                self._groups = LayerGroups.for_press(
                    self, decoder, self.layers_per_solve, self._fixed, self._issues, self.merge_stream == "side"
                )
                if self._groups is not None and self._groups.stream is not None:
                    # NOTE: the prefill's forward ends once its merges are joined: whatever reads the cache next is
                    # queued after them.
                    join = decoder.register_forward_hook(lambda *args: self._groups.join())
                yield
        finally:
            if join is not None:
                join.remove()
            self._capture = self._groups = None

    @contextmanager
    def merging_state(self, policy: QueryPolicy | None = None):
        """The query policy, the rows its layers share and the solves' issues for one stretch of compressions (this
        press's own context, or ``MergingDecodingPress``'s); the issues are warned about once, at its end."""
        self._policy = policy if policy is not None else query_policy(self.query_policy)
        self._policy_rows = PolicyRowsMemo()
        self._issues = SolveIssues()
        try:
            yield
            self._warn_issues()
        finally:
            self._issues = self._policy = self._policy_rows = None

    def _warn_issues(self) -> None:
        """Warn once about what this context's solves found (``SolveIssues``: its one read of the device)."""
        heads, nothing_free = self._issues.warn(stacklevel=4)
        if heads and nothing_free == heads:
            warnings.warn(
                f"GRKV refits nothing: every kept token is held fixed (the first n_sink={self.n_sink}, the "
                f"last window_size={self.window_size} positions and the top beta={self.beta} of the rest); "
                "raise the budget or lower window_size or beta",
                UserWarning,
                stacklevel=4,
            )

    def layer_context(
        self, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, kwargs: dict
    ) -> WindowRegression | None:
        """The layer's regression inputs; None for a layer that ``merged_layers`` leaves unmerged."""
        if self._merged_layers is None and self.merged_layers != "all":
            raise ValueError(
                f"GRKVPress(merged_layers={self.merged_layers!r}) was not set up for a model: enter it "
                "with `with press(model):` or inside a kvpress press that calls its post_init_from_model"
            )
        if self._merged_layers is not None and module.layer_idx not in self._merged_layers:
            return None
        projections, outputs = self._capture.take(module.layer_idx) if self._capture else (None, None)
        # NOTE: a wrapper (``ComposedPress``...) calls the hooks without this press's context: no policy kept.
        policy = self._policy if self._policy is not None else query_policy(self.query_policy)
        surrogate = surrogate_queries(
            module,
            hidden_states,
            kwargs["position_embeddings"],
            policy=policy,
            n_queries=self.window_size,
            prompt_projections=projections,
            memo=self._policy_rows,
            cache_rows=keys.shape[2],
        )
        full_outputs = stack_by_kv_head(outputs, surrogate)
        deferrable = (
            self._groups is not None
            and self.accept == "always"
            and keeps_returned_rows(kwargs["past_key_values"], module.layer_idx)
        )
        row_weights = self._row_weights.rows(module, surrogate) if self.head_weighting == "o_proj" else None
        return WindowRegression(surrogate, full_outputs, module.scaling, deferrable, row_weights)

    def head_context(
        self, context: WindowRegression | None, batch_index: int, head_index: int
    ) -> WindowRegression | None:
        if context is None:
            return None
        head = (slice(batch_index, batch_index + 1), slice(head_index, head_index + 1))
        surrogate = context.surrogate
        head_queries = SurrogateQueries(
            surrogate.queries[head], surrogate.positions, surrogate.token_positions, surrogate.loss_weight
        )
        full_outputs = context.full_outputs[head] if context.full_outputs is not None else None
        row_weights = context.row_weights[head] if context.row_weights is not None else None
        return WindowRegression(head_queries, full_outputs, context.scale, deferrable=False, row_weights=row_weights)

    def _fixed(self, kept: torch.Tensor, kept_scores: torch.Tensor, length: int) -> torch.Tensor:
        """(B, H, c) bool: sinks, the recent window, and the top-beta of the other kept tokens by score, of kept
        positions (B, H, c) with the base press's ``kept_scores`` (B, H, c) in a ``length``-token prompt
        (``FixedRows``).

        NOTE: the top-beta ranking runs on the base press's genuine scores only: positions it scores
        artificially (its own observation window or sinks, ``forced_score_ranges``) are not candidates, else a
        base window wider than GRKV's would take every top-beta slot.

        NOTE: the ranges are host integers and the count of top-beta rows stays on the device: nothing here reads a
        tensor on the host. Every row is decided from its own head's rows alone, so the layers of a group are decided
        in one pass over their stacked batch.
        """
        protected_ranges = [range(0, self.n_sink)]
        if self.fix_window:
            protected_ranges.append(range(length - self.window_size, length))
        protected = in_ranges(kept, protected_ranges, length)
        if self.beta == 0:
            return protected
        not_candidate = in_ranges(kept, protected_ranges + forced_score_ranges(self.press, length), length)
        kept_scores = kept_scores.masked_fill(not_candidate, float("-inf"))
        rank = kept_scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        n_top = ((kept.shape[-1] - not_candidate.sum(dim=-1, keepdim=True)) * self.beta).floor_()
        # NOTE: the protected rows are among the non-candidates, so a candidate is fixed by its rank alone.
        return torch.where(not_candidate, protected, rank < n_top)

    def merge_selected(
        self, keys: torch.Tensor, values: torch.Tensor, selection: TokenSelection, context: WindowRegression
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Refit the kept rows by GRKV's regression; then the trust-region caps and the acceptance rule, if set.

        A layer that ``context.deferrable`` marks gets its kept rows back as they are, and they are merged in place
        together with the other layers of its group (``layers_per_solve``), when the last of them is compressed. A
        layer without a context (``merged_layers``) gets its kept rows unmerged.
        """
        kept = selection.kept_positions()
        if context is None:
            return gather_rows(kept, keys, values)
        surrogate, full_outputs, scale = context.surrogate, context.full_outputs, context.scale
        if full_outputs is None:
            # NOTE: one full-cache pass serves every merge and every candidate's loss below.
            full_outputs = full_cache_outputs(
                surrogate.queries, keys, values, query_positions=surrogate.positions, scale=scale, in_cache_dtype=True
            )
        kept_keys, kept_values = gather_rows(kept, keys, values)
        # NOTE: kept comes from the base press's own selection and the query positions from an arange: their values
        # need no check, which would cost operations (and GPU synchronisations) at every layer.
        merge = LayerMerge(
            queries=surrogate.queries,
            target=full_outputs,
            kept_keys=kept_keys,
            kept_values=kept_values,
            kept=kept,
            kept_scores=selection.scores.gather(-1, kept),
            length=keys.shape[2],
            query_positions=surrogate.positions,
            scale=scale,
            row_weights=context.row_weights,
        )
        options = self._solver_options(surrogate.loss_weight)
        if context.deferrable:
            self._groups.defer(merge, options)
            return kept_keys, kept_values
        regression = LayerMerge.regression([merge], self._fixed)
        merged = self._solve(regression, options)
        if self.accept == "always":
            return merged
        if self.accept == "validation":
            passes = passes_validation(
                regression, options, self._solve, keys, values, full_outputs, surrogate.token_positions.numel()
            )[..., None, None]
            return (
                torch.where(passes, merged[0], regression.kept_keys),
                torch.where(passes, merged[1], regression.kept_values),
            )
        _, values_only = self._solve(regression, replace(options, components="v"))
        evicted = (regression.kept_keys, regression.kept_values)
        return lowest_window_loss(
            [evicted, (evicted[0], values_only), merged],
            surrogate.queries,
            keys,
            values,
            kept,
            surrogate.positions,
            scale,
            full_outputs,
        )

    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``BaseMergerPress.compress``, then the group's solve once it is full or this is the last hooked layer."""
        compressed = super().compress(module, hidden_states, keys, values, attentions, kwargs)
        if self._groups is not None:
            self._groups.compressed(module.layer_idx)
        return compressed

    def _solver_options(self, loss_weight: float) -> SolverOptions:
        """This press's solver options, the ridges divided by the surrogate rows' loss weight w (the policy's
        ``QueryPolicy.row_weight``): minimising w·loss + λ·ridge is minimising loss + (λ/w)·ridge."""
        options = {name: getattr(self, name) for name in SOLVER_OPTION_NAMES}
        return SolverOptions(
            **{**options, "lambda_k": self.lambda_k / loss_weight, "lambda_v": self.lambda_v / loss_weight}
        )

    def _solve(self, regression: KeptRegression, options: SolverOptions) -> tuple[torch.Tensor, torch.Tensor]:
        return solve_regression(regression, options, self._issues)


# NOTE: the options' documentation is their ``OptionSpec``s' (``grkv_core.options``), the one source of their help.
GRKVPress.__doc__ = GRKVPress.__doc__.rstrip() + "\n" + options_docstring(GRKVOptions)


def merged_layer_indices(model: nn.Module, merged_layers: str) -> frozenset[int]:
    """The indices of the layers GRKV merges on ``model``: of its compressed (not sliding-window) layers, all, the
    first half (``"early"``, rounded down) or the rest (``"late"``)."""
    compressed = [
        index for index in range(len(language_model(model).layers)) if index not in sliding_layer_indices(model)
    ]
    half = len(compressed) // 2
    return frozenset({"all": compressed, "early": compressed[:half], "late": compressed[half:]}[merged_layers])


def in_ranges(positions: torch.Tensor, ranges: list[range], length: int) -> torch.Tensor:
    """(...) bool: which of the integer ``positions`` (each in [0, ``length``)) lie in any of ``ranges``.

    NOTE: the ranges are merged on the host first, and a range that reaches either end of [0, ``length``) costs one
    comparison: a handful of operations per layer, whatever the ranges.
    """
    merged: list[list[int]] = []
    for span in sorted((max(span.start, 0), min(span.stop, length)) for span in ranges):
        if span[0] >= span[1]:
            continue
        if merged and span[0] <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], span[1])
        else:
            merged.append(list(span))
    if merged == [[0, length]]:
        return torch.ones_like(positions, dtype=torch.bool)
    tests = [
        positions >= start
        if stop == length
        else positions < stop
        if start == 0
        else (positions >= start) & (positions < stop)
        for start, stop in merged
    ]
    return functools.reduce(torch.logical_or, tests) if tests else torch.zeros_like(positions, dtype=torch.bool)
