"""The GRKV update on plain tensors (paper Sec. 3, Alg. 1, App. D).

Given surrogate queries, the full cache and the positions an eviction method keeps, GRKV refits the kept
keys and values so that the kept cache reproduces the full cache's attention outputs on the queries,
with ridge penalties pulling both back towards the plain evicted cache:

    min_{K, V}  || softmax(s Q K_fullᵀ) V_full - softmax(s Q Kᵀ) V ||_F²
                + λ_k ||K - K⁰||_F² + λ_v ||V - V⁰||_F²

It alternates an exact value step (ridge regression in dual/Woodbury form, an M×M system per head) and a
linearised key step (dual ridge problem solved by conjugate gradients with analytic, matrix-free
Jacobian products). Everything is batched over batch and KV heads.

Deviations from the paper, all options (``safeguard=False, ridge_scale="absolute"`` with the key step solved to
convergence, ``cg_max_iter=200, cg_rtol=1e-7``, is the paper's Alg. 1 exactly):

- ``safeguard`` (on by default): the linearised key step predicts a decrease of the window loss on every
  head, but where it moves logits far (sharp heads) the true loss can rise instead; the step direction is
  a descent direction, only its length is wrong. The safeguard evaluates the true window loss per head and
  halves the step until it is no worse than after the value step, else keeps the value step's keys
  (benchmarks/RESULTS.md §6 has the measurement behind it).
- ``ridge_scale="relative"``: λ multiplies a per-head scale of each system (the mean diagonal of X_G X_Gᵀ for
  the value step, of J Jᵀ for the key step), so one λ means the same across heads and models whose caches
  differ in scale.
- ``cg_max_iter=4``: the key step's CG stops after 4 iterations; behind the safeguard that keeps about half of
  16 iterations' gain over the value step alone at about half the merge's cost (RESULTS §6).

This module imports torch and the light ``grkv_core.config`` only: no transformers, no kvpress.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grkv_core.config import COMPONENTS, RIDGE_SCALES

# NOTE: Alg. 1 stops alternating once no entry of K or V moves by more than this.
EARLY_STOP_TOL = 1e-9
# NOTE: the safeguard tries the key step at lengths 1, 1/2, ..., 2^-MAX_HALVINGS before keeping the value
# step's keys; on 720 real SmolLM2 heads 1 of them passed no length (benchmarks/RESULTS.md §6).
MAX_HALVINGS = 4


@dataclass(frozen=True)
class _FreeRows:
    """The free (refitted) rows of each head as the leading part of a permutation of its c kept rows.

    ``index`` (B, H, F) long: per head, the free rows first, then fixed ones, cut at F = the largest free
    count of any head; ``valid`` (B, H, 1, F) float 0/1 marks the entries that are free rows. NOTE: ``index``
    never repeats a row within a head (a permutation prefix), so scattering back cannot collide.
    """

    index: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, fixed: torch.Tensor) -> _FreeRows:
        free_count = (~fixed).sum(dim=-1, keepdim=True)
        width = int(free_count.max())
        index = torch.argsort(fixed.to(torch.uint8), dim=-1, stable=True)[..., :width]
        valid = torch.arange(width, device=fixed.device) < free_count
        return cls(index=index, valid=valid.unsqueeze(-2).to(torch.float32))

    def columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B, H, X, c) -> (B, H, X, F): the free columns, zero on padding."""
        index = self.index.unsqueeze(-2).expand(-1, -1, tensor.shape[-2], -1)
        return tensor.gather(-1, index) * self.valid

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B, H, c, X) -> (B, H, F, X): the free rows (padding holds some fixed row)."""
        return _rows(tensor, self.index)

    def scatter_rows(self, rows: torch.Tensor, length: int) -> torch.Tensor:
        """(B, H, F, X) -> (B, H, c, X) with zeros on every row outside the free set."""
        scattered = rows.new_zeros(*rows.shape[:2], length, rows.shape[-1])
        scattered[(*_batch_head_index(rows), self.index)] = rows * self.valid.transpose(-1, -2)
        return scattered


@dataclass(frozen=True)
class _Problem:
    """Float32 tensors shared by the value and key steps of one call.

    Shapes: ``queries_scaled`` (B, H, M, d) already multiplied by the softmax scale; ``target`` (B, H, M, d);
    ``keys0``/``values0`` (B, H, c, d); ``free`` (B, H, c, 1) float 0/1 and ``free_rows`` the same rows as
    indices; ``hidden`` (B, H, M, c) bool, True where a query may not see a kept key (None without causal
    positions); ``sees_nothing`` (B, H, M, 1) bool, rows that see no kept key at all (None when there is none).
    """

    queries_scaled: torch.Tensor
    target: torch.Tensor
    keys0: torch.Tensor
    values0: torch.Tensor
    free: torch.Tensor
    free_rows: _FreeRows
    hidden: torch.Tensor | None
    sees_nothing: torch.Tensor | None

    def attention(self, keys: torch.Tensor) -> torch.Tensor:
        """(B, H, M, c) attention weights of the queries over ``keys`` (B, H, c, d)."""
        return _fused_masked_softmax(self.queries_scaled @ keys.transpose(-1, -2), self.hidden, self.sees_nothing)

    def window_error(self, attention: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(B, H) Σ‖Y − A V‖² over the window for attention weights ``attention`` and ``values``."""
        return (self.target - attention @ values).square_().sum(dim=(-2, -1))


@torch.no_grad()
def grkv_merge(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    fixed: torch.Tensor,
    *,
    lambda_k: float = 1e-2,
    lambda_v: float = 1e-2,
    steps: int = 1,
    components: str = "kv",
    query_positions: torch.Tensor | None = None,
    scale: float | None = None,
    cg_max_iter: int = 4,
    cg_rtol: float = 1e-6,
    full_outputs: torch.Tensor | None = None,
    safeguard: bool = True,
    ridge_scale: str = "absolute",
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

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        (B, H_kv, c, d) merged keys and values in the input dtype. Heads whose results, queries, kept rows
        or full-cache attention outputs (a NaN or +inf anywhere in the cache reaches those) are not finite
        get the plain evicted cache back, with a warning.
    """
    _validate(queries, keys, values, kept, fixed, lambda_k, lambda_v, steps, components, query_positions,
              scale, cg_max_iter, cg_rtol, full_outputs, safeguard, ridge_scale)
    out_dtype = keys.dtype
    head_dim = keys.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    evicted_keys, evicted_values = _rows(keys, kept), _rows(values, kept)

    kept_hidden = sees_nothing = None
    if query_positions is not None:
        query_positions = query_positions.to(device=keys.device, dtype=torch.long)
        kept_hidden = kept.long()[:, :, None, :] > query_positions[None, None, :, None]
        sees_nothing = kept_hidden.all(dim=-1, keepdim=True)
        if not bool(sees_nothing.any()):
            sees_nothing = None

    queries_scaled = queries.float() * scale
    if full_outputs is not None:
        target = full_outputs.float()
    else:
        target = full_cache_outputs(queries, keys, values, query_positions=query_positions, scale=scale)
    # NOTE: the regression sees the full cache only through `target`. A head whose queries, target or kept
    # rows hold a NaN/inf (a NaN or +inf anywhere in the full cache reaches `target`) is solved on zeros, so
    # batched linear algebra never meets a non-finite matrix, and is then handed back unmerged.
    regression_inputs = [queries_scaled, target, evicted_keys.float(), evicted_values.float()]
    finite_inputs = functools.reduce(torch.logical_and, map(_finite_per_head, regression_inputs))
    if not bool(finite_inputs.all()):
        head_ok = finite_inputs[..., None, None]
        regression_inputs = [torch.where(head_ok, t, 0.0) for t in regression_inputs]
    queries_scaled, target, keys0, values0 = regression_inputs
    problem = _Problem(
        queries_scaled=queries_scaled,
        target=target,
        keys0=keys0,
        values0=values0,
        free=(~fixed).unsqueeze(-1).to(torch.float32),
        free_rows=_FreeRows.of(fixed),
        hidden=kept_hidden,
        sees_nothing=sees_nothing,
    )

    new_keys, new_values = problem.keys0, problem.values0
    for round_index in range(steps):
        # Both steps of one round see the attention at the current keys (the key step linearises there).
        attention = problem.attention(new_keys)
        if components in ("kv", "v"):
            step_values = _value_step(problem, attention, lambda_v, ridge_scale)
        else:
            step_values = new_values
        if components in ("kv", "k"):
            step_keys, value_step_error = _key_step(problem, new_keys, attention, step_values, lambda_k, ridge_scale,
                                                    cg_max_iter, cg_rtol)
            if safeguard:
                step_keys = _safeguarded(problem, new_keys, step_keys, value_step_error, step_values)
        else:
            step_keys = new_keys
        # NOTE: the last round skips the movement check; it could only end a loop that ends anyway.
        done = round_index + 1 == steps or max(
            _largest_change(step_keys, new_keys), _largest_change(step_values, new_values)) <= EARLY_STOP_TOL
        new_keys, new_values = step_keys, step_values
        if done:
            break

    keep_fixed = fixed.unsqueeze(-1)
    merged_keys = torch.where(keep_fixed, evicted_keys, new_keys.to(out_dtype))
    merged_values = torch.where(keep_fixed, evicted_values, new_values.to(out_dtype))

    head_ok = finite_inputs & _finite_per_head(merged_keys) & _finite_per_head(merged_values)
    if not bool(head_ok.all()):
        bad = int((~head_ok).sum())
        warnings.warn(
            f"grkv_merge: {bad} of {head_ok.numel()} (batch, head) pairs had non-finite inputs or results; "
            "they keep the plain evicted cache.",
            RuntimeWarning,
            stacklevel=2,
        )
        merged_keys = torch.where(head_ok[..., None, None], merged_keys, evicted_keys)
        merged_values = torch.where(head_ok[..., None, None], merged_values, evicted_values)
    return merged_keys, merged_values


def _safeguarded(problem: _Problem, keys: torch.Tensor, step_keys: torch.Tensor, bar: torch.Tensor,
                 values: torch.Tensor) -> torch.Tensor:
    """Shorten the key step ``keys`` -> ``step_keys`` per head until the true window loss does not rise.

    ``values`` are the round's new values and ``bar`` (B, H) the window loss at (``keys``, ``values``), i.e.
    after the value step. Lengths 1, 1/2, ... 2^-MAX_HALVINGS are tried in turn; a head that passes none keeps
    ``keys``.

    NOTE: a head that passes at length 1 gets ``step_keys`` itself (not keys + 1·step, which may round
    differently), so where the paper's step lowers the loss the result is unchanged bit for bit.
    """
    passed_full = problem.window_error(problem.attention(step_keys), values) <= bar
    if bool(passed_full.all()):
        return step_keys
    step = step_keys - keys
    accepted = passed_full.clone()
    length = torch.zeros_like(bar)
    trial = 1.0
    for _ in range(MAX_HALVINGS):
        trial /= 2
        candidate = torch.add(keys, step, alpha=trial)
        passes = ~accepted & (problem.window_error(problem.attention(candidate), values) <= bar)
        length = torch.where(passes, trial, length)
        accepted |= passes
        if bool(accepted.all()):
            break
    shortened = torch.addcmul(keys, length[..., None, None], step)
    return torch.where(passed_full[..., None, None], step_keys, shortened)


@torch.no_grad()
def full_cache_outputs(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    query_positions: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """(B, H_kv, M, d) float32 attention outputs softmax(scale·Q Kᵀ) V of ``queries`` over a whole cache.

    ``keys``/``values`` (B, H_kv, n, d) with key i at position i; with ``query_positions`` (M,) attention is
    causal. One fused attention kernel: the (M, n) weights are never materialised.
    """
    scale = 1.0 / math.sqrt(keys.shape[-1]) if scale is None else float(scale)
    mask = None
    if query_positions is not None:
        mask = _causal_additive_mask(query_positions.to(device=keys.device, dtype=torch.long), keys.shape[2])
    return F.scaled_dot_product_attention(queries.float(), keys.float(), values.float(), attn_mask=mask, scale=scale)


def _rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, H, n, d) rows picked per head by (B, H, c) ``index`` -> (B, H, c, d).

    Advanced indexing rather than ``gather`` with an expanded index, which is 2-3x slower on the CPU.
    """
    return tensor[(*_batch_head_index(tensor), index.long())]


def _batch_head_index(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 1, 1) and (1, H, 1) aranges that, with a (B, H, c) row index, address rows of a (B, H, n, ...) tensor."""
    batch = torch.arange(tensor.shape[0], device=tensor.device)[:, None, None]
    head = torch.arange(tensor.shape[1], device=tensor.device)[None, :, None]
    return batch, head


def _causal_additive_mask(query_positions: torch.Tensor, length: int) -> torch.Tensor:
    """(M, length) float mask, 0 where key position p <= query_positions[i] and -inf elsewhere.

    NOTE: every key up to the earliest query position is visible to all queries, so only the columns after
    it are compared; and no row is all -inf (key 0 is visible to every query position >= 0), so the fused
    attention kernel never meets an empty row. A float mask also spares SDPA its own bool-to-float pass.
    """
    mask = torch.zeros(query_positions.shape[0], length, device=query_positions.device)
    first_hidden = min(int(query_positions.min()) + 1, length)
    tail = torch.arange(first_hidden, length, device=query_positions.device)
    mask[:, first_hidden:] = torch.where(tail[None, :] <= query_positions[:, None], 0.0, float("-inf"))
    return mask


def masked_softmax(logits: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis restricted to ``visible`` entries; rows that see nothing are all zero.

    Parameters
    ----------
    logits : torch.Tensor
        (..., M, n) attention logits.
    visible : torch.Tensor or None
        Boolean mask broadcastable to ``logits``; None means every entry is visible.
    """
    if visible is None:
        return torch.softmax(logits, dim=-1)
    logits = logits.masked_fill(~visible, float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)
    weights = torch.exp(logits - row_max)
    return weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)


def _fused_masked_softmax(logits: torch.Tensor, hidden: torch.Tensor | None,
                          sees_nothing: torch.Tensor | None) -> torch.Tensor:
    """The solver's fast ``masked_softmax``: one fused softmax kernel, masking ``logits`` in place.

    NOTE: ``logits`` must be a fresh temporary (it is overwritten). ``hidden`` is the complement of
    ``masked_softmax``'s ``visible``; rows flagged in ``sees_nothing`` (whose fused softmax is NaN) become zero.
    """
    if hidden is None:
        return torch.softmax(logits, dim=-1)
    weights = torch.softmax(logits.masked_fill_(hidden, float("-inf")), dim=-1)
    if sees_nothing is not None:
        weights = weights.masked_fill_(sees_nothing, 0.0)
    return weights


def _value_step(problem: _Problem, attention: torch.Tensor, lambda_v: float, ridge_scale: str) -> torch.Tensor:
    """Exact ridge refit of the free values given the (B, H, M, c) attention at the current keys (dual, M×M)."""
    residual = problem.target - attention @ problem.values0
    attention_free = attention * problem.free.transpose(-1, -2)
    gram = attention_free @ attention_free.transpose(-1, -2)
    ridge = lambda_v
    if ridge_scale == "relative":
        ridge = lambda_v * gram.diagonal(dim1=-2, dim2=-1).mean(dim=-1)[..., None, None]
    dual = _ridge_solve(gram, residual, ridge)
    return problem.values0 + attention_free.transpose(-1, -2) @ dual


def _ridge_solve(gram: torch.Tensor, rhs: torch.Tensor, ridge: float | torch.Tensor) -> torch.Tensor:
    """Solve (gram + ridge·I) z = rhs for symmetric PSD ``gram`` (..., M, M), robust to ridge = 0.

    ``ridge`` is a number or a (..., 1, 1) tensor (one per system). A positive ridge makes the system positive
    definite: Cholesky. Without one (or if Cholesky meets a numerically singular matrix) an
    eigen-decomposition gives the pseudo-inverse, i.e. the minimum-norm least-squares solution, so ridge = 0
    never yields NaN.
    """
    per_system = isinstance(ridge, torch.Tensor)
    diagonal_shift = ridge[..., 0] if per_system else ridge  # (..., 1) or a number
    if bool((ridge > 0).all()) if per_system else ridge > 0:
        shifted_gram = gram.clone()
        shifted_gram.diagonal(dim1=-2, dim2=-1).add_(diagonal_shift)
        factor, info = torch.linalg.cholesky_ex(shifted_gram)
        if not bool(info.any()):
            return torch.cholesky_solve(rhs, factor)
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    shifted = eigenvalues + diagonal_shift
    cutoff = shifted.amax(dim=-1, keepdim=True) * gram.shape[-1] * torch.finfo(gram.dtype).eps
    inverse = torch.where(shifted > cutoff, 1.0 / shifted.clamp_min(torch.finfo(gram.dtype).tiny), 0.0)
    projected = eigenvectors.transpose(-1, -2) @ rhs
    return eigenvectors @ (inverse.unsqueeze(-1) * projected)


def _key_step(
    problem: _Problem,
    keys: torch.Tensor,
    attention: torch.Tensor,
    values: torch.Tensor,
    lambda_k: float,
    ridge_scale: str,
    cg_max_iter: int,
    cg_rtol: float,
) -> torch.Tensor:
    """Linearised dual ridge update of the free keys around ``keys`` with ``values`` held fixed.

    Solves (J Jᵀ + λ_k I) α = vec(E) + J vec(K - K⁰) per head by conjugate gradients, where J is the
    Jacobian of f(K) = softmax(s Q Kᵀ) V restricted to the free rows, applied without ever forming it.
    Returns the new keys and ‖E‖² per head (B, H), the window loss before the step.
    """
    free_rows = problem.free_rows
    if free_rows.index.shape[-1] == 0:
        return problem.keys0, problem.window_error(attention, values)
    jacobian = _AttentionJacobian.at(problem, attention, values)
    rhs = problem.target.flatten(0, 1) - jacobian.output
    error = _head_dot(rhs, rhs).view(keys.shape[:2])
    # NOTE: the first round linearises at K⁰ itself, where the J·vec(K − K⁰) term is exactly zero.
    if keys is not problem.keys0:
        rhs += jacobian.jvp(free_rows.rows(keys - problem.keys0).flatten(0, 1))
    normal_diagonal = jacobian.normal_diagonal()
    ridge = lambda_k
    if ridge_scale == "relative":
        ridge = lambda_k * normal_diagonal.mean(dim=(-2, -1), keepdim=True)
    diagonal = normal_diagonal + ridge
    # NOTE: scale-invariant guards. An entry whose diagonal is negligible against its head's largest (a query
    # row whose attention over the free rows underflowed: its row of J is zero) gets no preconditioning
    # weight instead of 1/tiny ≈ 1e38, which would swamp the search direction; CG then works on the rest.
    head_scale = diagonal.amax(dim=(-2, -1), keepdim=True)
    significant = diagonal > head_scale * torch.finfo(diagonal.dtype).eps
    inverse_diagonal = torch.where(significant, 1.0 / diagonal.clamp_min(torch.finfo(diagonal.dtype).tiny), 0.0)
    operator = functools.partial(jacobian.normal, ridge=ridge)
    dual, stalled = _conjugate_gradients(operator, rhs, cg_max_iter, cg_rtol, inverse_diagonal, head_scale)
    if bool(stalled.any()):
        warnings.warn(
            f"grkv_merge: the key step made no progress on {int(stalled.sum())} of {stalled.numel()} (batch, head) "
            "pairs (their linearised system has no usable curvature); those heads keep the value step's keys.",
            RuntimeWarning,
            stacklevel=3,
        )
    key_change = jacobian.vjp(dual).unflatten(0, keys.shape[:2])
    return problem.keys0 + free_rows.scatter_rows(key_change, keys.shape[-2]), error


@dataclass
class _AttentionJacobian:
    """Analytic products with J = ∂f/∂K of f(K) = softmax(s Q Kᵀ) V at one point, on the free rows only.

    With A the attention weights and F = A V: J[ΔK] = W V − rowsum(W) ⊙ F for W = A ⊙ (s Q ΔKᵀ), and
    Jᵀ[U] = s Wᵀ Q for W = A ⊙ (U Vᵀ − rowsum(U ⊙ F)).

    NOTE: only the F free rows enter (``attention_free`` holds A's free columns, zero on padding), so every
    product runs over F ≤ c columns; both row sums ride along in the matrix products through a column of
    minus ones appended to V (``values_centring`` = [V | −1] on the free rows).

    NOTE: batch and heads are flattened into one leading axis P = B·H, so every product is one ``bmm`` on
    contiguous 3-D tensors; 4-D ``matmul`` re-plans (expands and reshapes) its operands on every call, which
    costs as much as the arithmetic at these sizes. Shapes: ``queries_scaled`` (P, M, d), ``attention_free``
    (P, M, F), ``values_centring`` (P, F, d + 1), ``output`` (P, M, d) over all kept rows, ``query_gram``
    (P, M, M).
    """

    queries_scaled: torch.Tensor
    attention_free: torch.Tensor
    values_centring: torch.Tensor
    output: torch.Tensor
    query_gram: torch.Tensor

    @classmethod
    def at(cls, problem: _Problem, attention: torch.Tensor, values: torch.Tensor) -> _AttentionJacobian:
        """Linearise at the attention weights ``attention`` (B, H, M, c) with ``values`` (B, H, c, d)."""
        free_values = problem.free_rows.rows(values).flatten(0, 1)
        queries_scaled = problem.queries_scaled.flatten(0, 1)
        return cls(
            queries_scaled=queries_scaled,
            attention_free=problem.free_rows.columns(attention).flatten(0, 1),
            values_centring=torch.cat([free_values, free_values.new_full(free_values.shape[:-1] + (1,), -1.0)],
                                      dim=-1),
            output=torch.bmm(attention.flatten(0, 1), values.flatten(0, 1)),
            query_gram=torch.bmm(queries_scaled, queries_scaled.transpose(-1, -2)),
        )

    def jvp(self, delta_keys: torch.Tensor) -> torch.Tensor:
        """(P, F, d) perturbation of the free keys -> (P, M, d) output perturbation."""
        logit_change = torch.bmm(self.queries_scaled, delta_keys.transpose(-1, -2))
        return self._output_change(logit_change.mul_(self.attention_free))

    def vjp(self, cotangent: torch.Tensor) -> torch.Tensor:
        """(P, M, d) output cotangent -> (P, F, d) cotangent of the free keys (zero on padding)."""
        return torch.bmm(self._vjp_weights(cotangent).transpose(-1, -2), self.queries_scaled)

    def normal(self, cotangent: torch.Tensor, ridge: float | torch.Tensor = 0.0) -> torch.Tensor:
        """(J Jᵀ + ridge·I) applied to a (P, M, d) cotangent; ``ridge`` a number or (P, 1, 1) per head.

        Jᵀ then J would form s·Q ΔKᵀ with ΔK = s·Wᵀ Q, i.e. (sQ)(sQ)ᵀ W: the M×M query Gram matrix replaces
        two M×F×d products by one M×M×F product.
        """
        logit_change = torch.bmm(self.query_gram, self._vjp_weights(cotangent))
        output_change = self._output_change(logit_change.mul_(self.attention_free))
        if isinstance(ridge, torch.Tensor):
            return output_change.addcmul_(cotangent, ridge)
        return output_change.add_(cotangent, alpha=ridge) if ridge else output_change

    def normal_diagonal(self) -> torch.Tensor:
        """(P, M, d) the diagonal of J Jᵀ, for Jacobi preconditioning.

        Entry (i, a) is ‖s·q_i‖² Σ_k A_ik² (v_ka − f_ia)² over the free rows k, expanded so that it costs
        three M×F×d products.
        """
        squared = self.attention_free.square()
        moments = torch.bmm(squared, self.values_centring)  # [Σ A² v | −Σ A²]
        spread = (torch.bmm(squared, self.values_centring[..., :-1].square()) - 2 * self.output * moments[..., :-1]
                  - self.output.square() * moments[..., -1:])
        return self.query_gram.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * spread.clamp_min(0.0)

    def _vjp_weights(self, cotangent: torch.Tensor) -> torch.Tensor:
        """A ⊙ (U Vᵀ − rowsum(U ⊙ F)) on the free columns, as one product of [U | rowsum] with [V | −1]ᵀ."""
        row_dots = torch.linalg.vecdot(cotangent, self.output).unsqueeze(-1)
        centred = torch.bmm(torch.cat([cotangent, row_dots], dim=-1), self.values_centring.transpose(-1, -2))
        return centred.mul_(self.attention_free)

    def _output_change(self, change: torch.Tensor) -> torch.Tensor:
        """W V − rowsum(W) ⊙ F for (P, M, F) logit-weighted attention changes W on the free rows."""
        moments = torch.bmm(change, self.values_centring)  # [W V | −rowsum(W)]
        return torch.addcmul(moments[..., :-1], moments[..., -1:], self.output)


def _conjugate_gradients(apply_operator, rhs: torch.Tensor, max_iter: int, rtol: float,
                         inverse_diagonal: torch.Tensor, operator_scale: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched Jacobi-preconditioned CG from zero for SPD operators, one independent solve per leading index.

    ``rhs`` and ``inverse_diagonal`` are (P, M, d), P = B·H; inner products run over the last two axes. A head
    stops (its step size is zeroed) once its preconditioned residual norm rᵀD⁻¹r falls below ``rtol``² times
    its initial value, or once its search direction loses curvature, which guards the singular systems that
    ridge 0 produces. Curvature is judged against ``operator_scale`` (P, 1, 1), the operator's largest diagonal
    entry per head (1 when omitted), so the guard does not depend on the units of the problem.

    Returns the (P, M, d) solution and a (P,) bool flag of the heads that had something to solve (a residual
    the preconditioner reaches) but never took a step.

    NOTE: the loop updates its tensors in place: each iteration is a few dozen small ops, whose dispatch and
    allocations cost as much as the operator's products at these sizes; the last iteration skips the residual
    and direction updates that only a next iteration would read.
    """
    tiny = torch.finfo(rhs.dtype).tiny
    eps = torch.finfo(rhs.dtype).eps
    solution = torch.zeros_like(rhs)
    residual = rhs.clone()
    preconditioned = inverse_diagonal * residual
    direction = preconditioned.clone()
    residual_dot = _head_dot(residual, preconditioned)
    threshold = residual_dot * rtol**2
    running = residual_dot > threshold
    solvable = running.clone()
    stepped = torch.zeros_like(running)
    for iteration in range(max_iter):
        if not bool(running.any()):
            break
        operator_direction = apply_operator(direction)
        curvature = _head_dot(direction, operator_direction)
        negligible = _head_dot(direction, direction).mul_(eps)
        running &= curvature > (negligible if operator_scale is None else negligible.mul_(operator_scale))
        stepped |= running
        # NOTE: `where`, not a multiplication by the flags: a head that lost curvature may divide by ~0 (inf).
        step = torch.where(running, residual_dot / curvature.clamp_min_(tiny), 0.0)
        solution.addcmul_(step, direction)
        if iteration + 1 == max_iter:
            break
        residual.addcmul_(step, operator_direction, value=-1.0)
        torch.mul(inverse_diagonal, residual, out=preconditioned)
        new_residual_dot = _head_dot(residual, preconditioned)
        direction.mul_(new_residual_dot / residual_dot.clamp_min_(tiny)).add_(preconditioned)
        residual_dot = new_residual_dot
        running &= residual_dot > threshold
    return solution, (solvable & ~stepped).flatten()


def _head_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Inner product over the last two axes of (..., X, Y) tensors, shaped (..., 1, 1) for broadcasting.

    NOTE: multiply-and-sum, not a (1 × XY)·(XY × 1) ``bmm``: at CG's sizes the bmm costs 5x more on the CPU.
    """
    return (a * b).sum(dim=(-2, -1), keepdim=True)


def _largest_change(new: torch.Tensor, old: torch.Tensor) -> float:
    return float((new - old).abs().amax()) if new is not old else 0.0


def _finite_per_head(tensor: torch.Tensor) -> torch.Tensor:
    """(B, H, ...) -> (B, H) bool: every entry of that head is finite.

    NOTE: one float32 sum per head instead of an elementwise test: NaN and inf propagate into the sum, and
    a sum that overflows to inf can only come from entries near float32's limit, which are rejected too.
    """
    return torch.isfinite(tensor.sum(dim=tuple(range(2, tensor.ndim)), dtype=torch.float32))


def _validate(queries, keys, values, kept, fixed, lambda_k, lambda_v, steps, components, query_positions,
              scale, cg_max_iter, cg_rtol, full_outputs, safeguard, ridge_scale) -> None:
    """Raise a ValueError naming the argument for any malformed input (never a torch error deep inside)."""
    for name, tensor in (("queries", queries), ("keys", keys), ("values", values)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.ndim != 4:
            raise ValueError(f"{name} must have shape (B, H_kv, length, d), got {tuple(tensor.shape)}")
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    if values.shape != keys.shape:
        raise ValueError(f"values shape {tuple(values.shape)} must equal keys shape {tuple(keys.shape)}")
    batch, heads, length, head_dim = keys.shape
    if queries.shape[:2] != (batch, heads) or queries.shape[3] != head_dim:
        raise ValueError(
            f"queries shape {tuple(queries.shape)} must be (B={batch}, H_kv={heads}, M, d={head_dim}) to match keys"
        )
    if queries.shape[2] == 0:
        raise ValueError("queries must hold at least one query row (M >= 1)")
    for name, tensor in (("kept", kept), ("fixed", fixed)):
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != 3 or tensor.shape[:2] != (batch, heads):
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must have shape (B={batch}, H_kv={heads}, c), got {shape}")
    if kept.dtype.is_floating_point or kept.dtype == torch.bool or kept.is_complex():
        raise ValueError(f"kept must be an integer (long) tensor, got {kept.dtype}")
    if fixed.dtype != torch.bool:
        raise ValueError(f"fixed must be a bool tensor, got {fixed.dtype}")
    if fixed.shape != kept.shape:
        raise ValueError(f"fixed shape {tuple(fixed.shape)} must equal kept shape {tuple(kept.shape)}")
    budget = kept.shape[2]
    if not 1 <= budget <= length:
        raise ValueError(f"kept must select between 1 and n={length} positions per head, got c={budget}")
    if bool((kept < 0).any()) or bool((kept >= length).any()):
        raise ValueError(f"kept positions must lie in [0, {length}), got range [{int(kept.min())}, {int(kept.max())}]")
    if budget > 1 and bool((kept.sort(dim=-1).values.diff(dim=-1) == 0).any()):
        raise ValueError("kept must not repeat a position within a (batch, head)")
    for name, lam in (("lambda_k", lambda_k), ("lambda_v", lambda_v)):
        if not isinstance(lam, (int, float)) or isinstance(lam, bool) or not math.isfinite(lam) or lam < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {lam!r}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if components not in COMPONENTS:
        raise ValueError(f"components must be one of {COMPONENTS}, got {components!r}")
    if query_positions is not None:
        if not isinstance(query_positions, torch.Tensor) or query_positions.shape != (queries.shape[2],):
            shape = tuple(query_positions.shape) if isinstance(query_positions, torch.Tensor) else query_positions
            raise ValueError(f"query_positions must have shape (M={queries.shape[2]},), got {shape}")
        if query_positions.is_floating_point() or query_positions.dtype == torch.bool:
            raise ValueError(f"query_positions must be an integer tensor, got {query_positions.dtype}")
        if bool((query_positions < 0).any()):
            raise ValueError("query_positions must be non-negative")
    if scale is not None and (not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if not isinstance(cg_max_iter, int) or isinstance(cg_max_iter, bool) or cg_max_iter < 1:
        raise ValueError(f"cg_max_iter must be an integer >= 1, got {cg_max_iter!r}")
    if not isinstance(cg_rtol, (int, float)) or isinstance(cg_rtol, bool) or not 0 < cg_rtol < 1:
        raise ValueError(f"cg_rtol must be in (0, 1), got {cg_rtol!r}")
    if not isinstance(safeguard, bool):
        raise ValueError(f"safeguard must be True or False, got {safeguard!r}")
    if ridge_scale not in RIDGE_SCALES:
        raise ValueError(f"ridge_scale must be one of {RIDGE_SCALES}, got {ridge_scale!r}")
    if full_outputs is not None:
        if not isinstance(full_outputs, torch.Tensor) or full_outputs.shape != queries.shape:
            shape = tuple(full_outputs.shape) if isinstance(full_outputs, torch.Tensor) else type(full_outputs).__name__
            raise ValueError(f"full_outputs must have the shape of queries {tuple(queries.shape)}, got {shape}")
        if not full_outputs.is_floating_point():
            raise ValueError(f"full_outputs must be a floating-point tensor, got {full_outputs.dtype}")
    tensors = [queries, keys, values, kept, fixed] + ([full_outputs] if full_outputs is not None else [])
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError("queries, keys, values, kept, fixed (and full_outputs) must be on one device, "
                         f"got {sorted(map(str, devices))}")
