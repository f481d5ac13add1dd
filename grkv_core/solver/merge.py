"""``grkv_merge``: the GRKV update on plain tensors (paper Sec. 3, Alg. 1, App. D); see the package docstring."""

from __future__ import annotations

import functools
import warnings

import torch

from grkv_core.options import SOLVER_OPTION_NAMES, SolverOptions
from grkv_core.solver.capture import CAPTURED_SOLVES
from grkv_core.solver.key_step import key_step
from grkv_core.solver.problem import MergeProblem, gather_rows, reads_are_free
from grkv_core.solver.regression import KeptRegression
from grkv_core.solver.safeguard import safeguarded
from grkv_core.solver.trust_region import cap_update
from grkv_core.solver.value_step import value_step

# NOTE: Alg. 1 stops alternating once no entry of K or V moves by more than this (per head here).
EARLY_STOP_TOL = 1e-9


@torch.no_grad()
def grkv_merge(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    fixed: torch.Tensor,
    *,
    query_positions: torch.Tensor | None = None,
    scale: float | None = None,
    full_outputs: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the evicted part of a KV cache into the kept entries by global ridge regression.

    Parameters
    ----------
    queries : torch.Tensor
        (B, H_kv, M, d) surrogate queries with RoPE applied. For GQA the queries of the heads sharing a
        KV head are stacked along M.
    keys, values : torch.Tensor
        (B, H_kv, n, d) the full cache.
    kept : torch.Tensor
        (B, H_kv, c) integer positions kept by the eviction method, distinct within each head.
    fixed : torch.Tensor
        (B, H_kv, c) bool; True rows are returned unchanged (bit-identical).
    **options
        ``SolverOptions`` fields (``grkv_core.options``), each at its default when left out:
    lambda_k, lambda_v : float
        Ridge coefficients (>= 0) for keys and values. 0 is allowed (minimum-norm solution).
    steps : int
        Maximum number S of alternating value/key steps; stops early when nothing moves by > 1e-9.
    components : {"kv", "k", "v"}
        Which part is refitted: GRKV (both), GRK (keys only) or GRV (values only).
    query_positions : torch.Tensor, optional
        (M,) integer positions of the query rows. When given, attention is causal: row i sees the key at
        position p iff p <= query_positions[i], for both the full and the kept cache.
    scale : float, optional
        Softmax scale, 1/sqrt(d) by default.
    cg_max_iter : int
        Conjugate-gradient iteration cap of the key step, per head.
    cg_rtol : float
        Relative residual tolerance of the key step's conjugate gradients.
    full_outputs : torch.Tensor, optional
        (B, H_kv, M, d) the regression target, softmax(scale·Q Kᵀ) V of ``queries`` over the full cache
        (causal when ``query_positions`` is given), stacked like ``queries``. Computed here when omitted;
        ``GRKVPress`` passes the model's own attention outputs, which its prefill forward already computed.
    safeguard : bool
        After each key step, evaluate the true window loss per head and halve the step (at most
        ``MAX_HALVINGS`` times) until it is no worse than after that round's value step; a head where no
        length passes keeps its keys. Heads where the full step already passes get exactly the paper's
        result. False, with CG run to convergence, is the paper's Alg. 1.
    ridge_scale : {"absolute", "relative"}
        "absolute" (the paper): λ_k and λ_v are used as given. "relative": each is multiplied, per head and
        round, by the mean diagonal of its system (X_G X_Gᵀ for values, J Jᵀ for keys).
    row_weights : torch.Tensor, optional
        (B, H_kv, M) non-negative weights w of the query rows: the loss becomes Σ_r w_r ‖y_r − a_r V‖² (the
        ridge terms unweighted), in both steps and in the safeguard's test. None (the paper): every row 1.
    max_rel_update_k, max_rel_update_v : float or None
        The authors' trust-region caps: each head's update of the keys (values) is shrunk to at most this fraction
        of its kept rows' Frobenius norm (``trust_region.cap_update``). None (the default here): no cap.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        (B, H_kv, c, d) merged keys and values in the input dtype. Heads whose results, queries, kept rows
        or full-cache attention outputs (a NaN or +inf anywhere in the cache reaches those) are not finite
        get the plain evicted cache back, with a warning.
    """
    unknown = sorted(set(options) - set(SOLVER_OPTION_NAMES))
    if unknown:
        raise ValueError(f"unknown solver option(s) {unknown}; valid: {list(SOLVER_OPTION_NAMES)}")
    solver_options = SolverOptions(**options)
    regression = KeptRegression.of(
        queries,
        keys,
        values,
        kept,
        fixed,
        query_positions=query_positions,
        scale=scale,
        full_outputs=full_outputs,
        row_weights=row_weights,
    )
    return solve_regression(regression, solver_options)


@torch.no_grad()
def solve_regression(
    regression: KeptRegression, options: SolverOptions = SolverOptions(), issues: SolveIssues | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``grkv_merge`` on a cache already reduced to its ``KeptRegression``, e.g. several layers stacked.

    ``options`` as in ``grkv_merge``. Every (batch, head) is solved on its own: its result does not depend on what
    else the batch holds, beyond float rounding. On a CUDA device the solve replays a CUDA graph captured once per
    shape (``grkv_core.solver.capture``); elsewhere it runs eagerly. What went wrong in some heads (non-finite inputs
    or results, a key step without progress) is added to ``issues``, to be warned about once
    (``SolveIssues.warn``), or warned about now when it is None.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        (B, H_kv, c, d) merged keys and values, in the order of ``regression.kept`` and the dtype of its rows.
    """
    merged_keys, merged_values, counts = CAPTURED_SOLVES(merge_heads, regression, options)
    own_issues = issues is None
    issues = SolveIssues() if own_issues else issues
    issues.add(counts, regression.kept.shape[0] * regression.kept.shape[1])
    if own_issues:
        issues.warn(stacklevel=3)
    return merged_keys, merged_values


def merge_heads(regression: KeptRegression, options: SolverOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole solve of ``solve_regression``: (B, H_kv, c, d) merged keys and values, and an (3,) int64 tensor of
    the heads that kept the plain evicted cache because their inputs or results were not finite, the heads whose key
    step made no progress, and the heads with no free row to refit.

    NOTE: a function of the tensors alone whose every shape comes from the inputs' shapes and ``options``: it reads
    no value on the host (no GPU synchronisation), so CUDA can capture it as one graph, and ``torch.compile`` compiles
    it with ``fullgraph=True``. Early exits are per-head masks over a fixed count of iterations.
    """
    out_dtype = regression.kept_keys.dtype
    batch, heads, budget, head_dim = regression.kept_keys.shape
    # NOTE: the solver works on (P = B·H)-flattened heads whose kept rows are reordered free rows first (a stable
    # sort), and put back in their order at the end: sums over the kept rows then run in the order they always have,
    # the fixed rows' zero terms last, which keeps results bit for bit where the free rows were once gathered.
    order = regression.fixed.flatten(0, 1).to(torch.uint8).argsort(dim=-1, stable=True)
    fixed = regression.fixed.flatten(0, 1).gather(-1, order)
    evicted_keys, evicted_values = gather_rows(
        order, regression.kept_keys.flatten(0, 1), regression.kept_values.flatten(0, 1)
    )

    logit_mask = sees_nothing = None
    if regression.query_positions is not None:
        kept = regression.kept.flatten(0, 1).gather(-1, order)
        hidden = kept[:, None, :] > regression.query_positions[None, :, None]
        logit_mask = torch.where(hidden, float("-inf"), 0.0)
        sees_nothing = hidden.all(dim=-1, keepdim=True)

    queries_scaled = regression.queries.float().flatten(0, 1) * regression.scale
    target = regression.target.flatten(0, 1)
    # NOTE: the regression sees the full cache only through `target`. A head whose queries, target or kept
    # rows hold a NaN/inf (a NaN or +inf anywhere in the full cache reaches `target`) is solved on zeros, so
    # batched linear algebra never meets a non-finite matrix, and is then handed back unmerged.
    row_scale = None if regression.row_weights is None else regression.row_weights.flatten(0, 1).sqrt().unsqueeze(-1)
    regression_inputs = [queries_scaled, target, evicted_keys.float(), evicted_values.float()]
    finite_inputs = functools.reduce(torch.logical_and, map(_finite_per_head, regression_inputs))
    head_ok = finite_inputs[:, None, None]
    queries_scaled, target, keys0, values0 = (torch.where(head_ok, t, 0.0) for t in regression_inputs)
    free = ~fixed
    problem = MergeProblem(
        queries_scaled=queries_scaled,
        target=target,
        keys0=keys0,
        values0=values0,
        free=free.unsqueeze(-2).float(),
        logit_mask=logit_mask,
        sees_nothing=sees_nothing,
        row_scale=row_scale,
    )

    new_keys, new_values = problem.keys0, problem.values0
    stalled = torch.zeros(fixed.shape[0], dtype=torch.bool, device=fixed.device)
    moving = None  # (P, 1, 1) bool: the heads still alternating (None: all of them)
    steps, components = options.steps, options.components
    for round_index in range(steps):
        if moving is not None and reads_are_free(fixed) and not bool(moving.any()):
            break  # NOTE: every head has stopped: the rounds left would keep every head as it is
        # Both steps of one round see the attention at the current keys (the key step linearises there).
        logits = problem.logits(new_keys)
        attention = problem.softmax(logits)
        if components in ("kv", "v"):
            step_values = value_step(problem, attention, options.lambda_v, options.ridge_scale)
        else:
            step_values = new_values
        if components in ("kv", "k"):
            step_keys, value_step_error, round_stalled = key_step(
                problem,
                new_keys,
                attention,
                step_values,
                options.lambda_k,
                options.ridge_scale,
                options.cg_max_iter,
                options.cg_rtol,
            )
            stalled |= round_stalled
            if options.safeguard:
                step_keys = safeguarded(problem, new_keys, logits, step_keys, value_step_error, step_values)
        else:
            step_keys = new_keys
        # NOTE: a head stops alternating on its own, keeping the round in which nothing of it moved, so its
        # result does not depend on the other heads of the batch (or on the other layers stacked with it). Every
        # round runs (a loop that ended once no head moved would read a flag on the host).
        if moving is not None:
            step_keys = torch.where(moving, step_keys, new_keys)
            step_values = torch.where(moving, step_values, new_values)
        if round_index + 1 < steps:  # NOTE: the last round skips the movement check, which only a next round reads
            moved = _moved(step_keys, new_keys) | _moved(step_values, new_values)
            moving = moved if moving is None else moving & moved
        new_keys, new_values = step_keys, step_values

    keep_fixed = fixed.unsqueeze(-1)
    merged_keys = torch.where(keep_fixed, evicted_keys, new_keys.to(out_dtype))
    merged_values = torch.where(keep_fixed, evicted_values, new_values.to(out_dtype))
    head_ok = finite_inputs & _finite_per_head(merged_keys) & _finite_per_head(merged_values)
    merged_keys = torch.where(head_ok[:, None, None], merged_keys, evicted_keys)
    merged_values = torch.where(head_ok[:, None, None], merged_values, evicted_values)
    counts = torch.stack([(~head_ok).sum(), stalled.sum(), fixed.all(dim=-1).sum()])
    merged_keys, merged_values = gather_rows(order.argsort(dim=-1), merged_keys, merged_values)
    # NOTE: the caps compare with the kept rows in their own order, so that a head's norms sum as they always have.
    start_keys, start_values = regression.kept_keys.flatten(0, 1), regression.kept_values.flatten(0, 1)
    merged_keys = cap_update(start_keys, merged_keys, options.max_rel_update_k)
    merged_values = cap_update(start_values, merged_values, options.max_rel_update_v)
    return merged_keys.view(batch, heads, budget, head_dim), merged_values.view(batch, heads, budget, head_dim), counts


class SolveIssues:
    """What solves found wrong in some heads, counted on the device and warned about once (``warn``).

    NOTE: a warning decided on the device would need a host read (a GPU synchronisation) per solve; the counts add
    up on the device instead, and ``GRKVPress`` reads them once, at the end of its context.
    """

    def __init__(self) -> None:
        self._counts: torch.Tensor | None = None
        self._heads = 0

    def add(self, counts: torch.Tensor, heads: int) -> None:
        """Add one solve's (3,) counts (``merge_heads``) over ``heads`` (batch, head) pairs."""
        self._counts = counts if self._counts is None else self._counts + counts
        self._heads += heads

    def warn(self, stacklevel: int = 2) -> tuple[int, int]:
        """Warn about the heads handed back unmerged and the key steps without progress (one host read), start
        counting anew, and return (heads solved, heads with no free row)."""
        if self._counts is None:
            return 0, 0
        (non_finite, stalled, nothing_free), heads = self._counts.tolist(), self._heads
        self._counts, self._heads = None, 0
        if non_finite:
            warnings.warn(
                f"grkv_merge: {non_finite} of {heads} (batch, head) pairs had non-finite inputs or results; "
                "they keep the plain evicted cache.",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
        if stalled:
            warnings.warn(
                f"grkv_merge: the key step made no progress on {stalled} of {heads} (batch, head) pairs "
                "(their linearised system has no usable curvature); those heads keep the value step's keys.",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
        return heads, nothing_free


def _moved(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """(P, 1, 1) bool: some entry of the head moved by more than ``EARLY_STOP_TOL`` from (P, c, d) ``old``."""
    if new is old:
        return torch.zeros(new.shape[0], 1, 1, dtype=torch.bool, device=new.device)
    return (new - old).abs().amax(dim=(-2, -1), keepdim=True) > EARLY_STOP_TOL


def _finite_per_head(tensor: torch.Tensor) -> torch.Tensor:
    """(P, ...) -> (P,) bool: every entry of that head is finite.

    NOTE: one float32 sum per head instead of an elementwise test: NaN and inf propagate into the sum, and
    a sum that overflows to inf can only come from entries near float32's limit, which are rejected too.
    """
    return torch.isfinite(tensor.sum(dim=tuple(range(1, tensor.ndim)), dtype=torch.float32))
