"""The GRKV update on plain tensors (paper Sec. 3, Alg. 1, App. D).

Given surrogate queries, the full cache and the positions an eviction method keeps, GRKV refits the kept
keys and values so that the kept cache reproduces the full cache's attention outputs on the queries,
with ridge penalties pulling both back towards the plain evicted cache:

    min_{K, V}  || softmax(s Q K_fullᵀ) V_full - softmax(s Q Kᵀ) V ||_F²
                + λ_k ||K - K⁰||_F² + λ_v ||V - V⁰||_F²

It alternates an exact value step (ridge regression in dual/Woodbury form, an M×M system per head) and a
linearised key step (dual ridge problem solved by conjugate gradients with analytic, matrix-free
Jacobian products). Everything is batched over batch and KV heads.

This module imports torch only: no transformers, no kvpress.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch

COMPONENTS = ("kv", "k", "v")

# NOTE: Alg. 1 stops alternating once no entry of K or V moves by more than this.
EARLY_STOP_TOL = 1e-9


@dataclass(frozen=True)
class _Problem:
    """Float32 tensors shared by the value and key steps of one call.

    Shapes: ``queries_scaled`` (B, H, M, d) already multiplied by the softmax scale; ``target`` (B, H, M, d);
    ``keys0``/``values0`` (B, H, c, d); ``free`` (B, H, c, 1) float 0/1; ``visible`` (B, H, M, c) bool or None.
    """

    queries_scaled: torch.Tensor
    target: torch.Tensor
    keys0: torch.Tensor
    values0: torch.Tensor
    free: torch.Tensor
    visible: torch.Tensor | None


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
    cg_max_iter: int = 16,
    cg_rtol: float = 1e-6,
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

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        (B, H_kv, c, d) merged keys and values in the input dtype. Heads whose inputs or results are not
        finite get the plain evicted cache back, with a warning.
    """
    _validate(queries, keys, values, kept, fixed, lambda_k, lambda_v, steps, components, query_positions,
              scale, cg_max_iter, cg_rtol)
    out_dtype = keys.dtype
    head_dim = keys.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    gather_index = kept.long().unsqueeze(-1).expand(-1, -1, -1, head_dim)
    evicted_keys = keys.gather(2, gather_index)
    evicted_values = values.gather(2, gather_index)

    # NOTE: a head with a NaN/inf anywhere is solved on zeros (so batched linear algebra never sees a
    # non-finite matrix) and then handed back unmerged.
    finite_inputs = _finite_per_head(queries) & _finite_per_head(keys) & _finite_per_head(values)
    queries32, keys32, values32 = queries.float(), keys.float(), values.float()
    if not bool(finite_inputs.all()):
        head_ok = finite_inputs[..., None, None]
        queries32, keys32, values32 = (torch.where(head_ok, t, 0.0) for t in (queries32, keys32, values32))

    full_visible = kept_visible = None
    if query_positions is not None:
        query_positions = query_positions.to(device=keys.device, dtype=torch.long)
        key_positions = torch.arange(keys.shape[2], device=keys.device)
        full_visible = key_positions[None, None, None, :] <= query_positions[None, None, :, None]
        kept_visible = kept.long()[:, :, None, :] <= query_positions[None, None, :, None]

    queries_scaled = queries32 * scale
    target = masked_softmax(queries_scaled @ keys32.transpose(-1, -2), full_visible) @ values32
    problem = _Problem(
        queries_scaled=queries_scaled,
        target=target,
        keys0=keys32.gather(2, gather_index),
        values0=values32.gather(2, gather_index),
        free=(~fixed).unsqueeze(-1).to(torch.float32),
        visible=kept_visible,
    )

    new_keys, new_values = problem.keys0, problem.values0
    for _ in range(steps):
        # Both steps of one round see the attention at the current keys (the key step linearises there).
        attention = masked_softmax(problem.queries_scaled @ new_keys.transpose(-1, -2), problem.visible)
        if components in ("kv", "v"):
            step_values = _value_step(problem, attention, lambda_v)
        else:
            step_values = new_values
        if components in ("kv", "k"):
            step_keys = _key_step(problem, new_keys, attention, step_values, lambda_k, cg_max_iter, cg_rtol)
        else:
            step_keys = new_keys
        moved = torch.maximum((step_keys - new_keys).abs().amax(), (step_values - new_values).abs().amax())
        new_keys, new_values = step_keys, step_values
        if moved <= EARLY_STOP_TOL:
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


def _value_step(problem: _Problem, attention: torch.Tensor, lambda_v: float) -> torch.Tensor:
    """Exact ridge refit of the free values given the (B, H, M, c) attention at the current keys (dual, M×M)."""
    residual = problem.target - attention @ problem.values0
    attention_free = attention * problem.free.transpose(-1, -2)
    gram = attention_free @ attention_free.transpose(-1, -2)
    dual = _ridge_solve(gram, residual, lambda_v)
    return problem.values0 + attention_free.transpose(-1, -2) @ dual


def _ridge_solve(gram: torch.Tensor, rhs: torch.Tensor, ridge: float) -> torch.Tensor:
    """Solve (gram + ridge·I) z = rhs for symmetric PSD ``gram`` (..., M, M), robust to ridge = 0.

    A positive ridge makes the system positive definite: Cholesky. Without one (or if Cholesky meets a
    numerically singular matrix) an eigen-decomposition gives the pseudo-inverse, i.e. the minimum-norm
    least-squares solution, so ridge = 0 never yields NaN.
    """
    if ridge > 0:
        factor, info = torch.linalg.cholesky_ex(gram + ridge * torch.eye(gram.shape[-1], device=gram.device))
        if not bool(info.any()):
            return torch.cholesky_solve(rhs, factor)
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    shifted = eigenvalues + ridge
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
    cg_max_iter: int,
    cg_rtol: float,
) -> torch.Tensor:
    """Linearised dual ridge update of the free keys around ``keys`` with ``values`` held fixed.

    Solves (J Jᵀ + λ_k I) α = vec(E) + J vec(K - K⁰) per head by conjugate gradients, where J is the
    Jacobian of f(K) = softmax(s Q Kᵀ) V restricted to the free rows, applied without ever forming it.
    """
    output = attention @ values
    jacobian = _AttentionJacobian(problem.queries_scaled, attention, values, output, problem.free)
    rhs = (problem.target - output) + jacobian.jvp((keys - problem.keys0) * problem.free)
    inverse_diagonal = 1.0 / (jacobian.normal_diagonal() + lambda_k).clamp_min(torch.finfo(rhs.dtype).tiny)
    dual = _conjugate_gradients(lambda u: jacobian.normal(u) + lambda_k * u, rhs, cg_max_iter, cg_rtol,
                                inverse_diagonal)
    return problem.keys0 + jacobian.vjp(dual)


@dataclass
class _AttentionJacobian:
    """Analytic products with J = ∂f/∂K of f(K) = softmax(s Q Kᵀ) V at one point, free rows only.

    With A the attention weights and F = A V: J[ΔK] = W V − rowsum(W) ⊙ F for W = A ⊙ (s Q ΔKᵀ), and
    Jᵀ[U] = s Wᵀ Q for W = A ⊙ (U Vᵀ − rowsum(U ⊙ F)). Shapes: ``attention`` (B, H, M, c), the rest as in
    ``_Problem``.
    """

    queries_scaled: torch.Tensor
    attention: torch.Tensor
    values: torch.Tensor
    output: torch.Tensor
    free: torch.Tensor

    def jvp(self, delta_keys: torch.Tensor) -> torch.Tensor:
        """(B, H, c, d) key perturbation (zero on fixed rows) -> (B, H, M, d) output perturbation."""
        weights = self.attention * (self.queries_scaled @ delta_keys.transpose(-1, -2))
        return weights @ self.values - weights.sum(dim=-1, keepdim=True) * self.output

    def vjp(self, cotangent: torch.Tensor) -> torch.Tensor:
        """(B, H, M, d) output cotangent -> (B, H, c, d) key cotangent, zero on fixed rows."""
        return (self._vjp_weights(cotangent).transpose(-1, -2) @ self.queries_scaled) * self.free

    def normal(self, cotangent: torch.Tensor) -> torch.Tensor:
        """J Jᵀ applied to a (B, H, M, d) cotangent.

        Jᵀ then J would form s·Q ΔKᵀ with ΔK = s·Wᵀ Q, i.e. (sQ)(sQ)ᵀ W: the M×M query Gram matrix replaces
        two M×c×d products by one M×M×c product.
        """
        weights = self._vjp_weights(cotangent) * self.free.transpose(-1, -2)
        logits_change = self.query_gram @ weights
        change = self.attention * logits_change
        return change @ self.values - change.sum(dim=-1, keepdim=True) * self.output

    def normal_diagonal(self) -> torch.Tensor:
        """(B, H, M, d) the diagonal of J Jᵀ, for Jacobi preconditioning.

        Entry (i, a) is ‖s·q_i‖² Σ_k A_ik² (v_ka − f_ia)² over the free rows k, expanded so that it costs
        three M×c×d products.
        """
        squared = self.attention.square() * self.free.transpose(-1, -2)
        spread = (squared @ self.values.square() - 2 * self.output * (squared @ self.values)
                  + self.output.square() * squared.sum(dim=-1, keepdim=True))
        return self.query_gram.diagonal(dim1=-2, dim2=-1).unsqueeze(-1) * spread.clamp_min(0.0)

    def _vjp_weights(self, cotangent: torch.Tensor) -> torch.Tensor:
        centred = cotangent @ self.values.transpose(-1, -2) - (cotangent * self.output).sum(dim=-1, keepdim=True)
        return self.attention * centred

    @functools.cached_property
    def query_gram(self) -> torch.Tensor:
        return self.queries_scaled @ self.queries_scaled.transpose(-1, -2)


def _conjugate_gradients(apply_operator, rhs: torch.Tensor, max_iter: int, rtol: float,
                         inverse_diagonal: torch.Tensor) -> torch.Tensor:
    """Batched Jacobi-preconditioned CG from zero for SPD operators, one independent solve per (batch, head).

    ``rhs`` and ``inverse_diagonal`` are (B, H, M, d); inner products run over the last two axes. A head
    stops (its step size is zeroed) once its residual norm is below ``rtol``·‖rhs‖ or its search direction
    loses curvature, which guards the singular systems that ridge 0 produces.
    """
    tiny = torch.finfo(rhs.dtype).tiny
    solution = torch.zeros_like(rhs)
    residual = rhs.clone()
    preconditioned = inverse_diagonal * residual
    direction = preconditioned.clone()
    residual_dot = _head_dot(residual, preconditioned)
    threshold_sq = (rtol**2) * _head_dot(rhs, rhs)
    active = _head_dot(residual, residual) > threshold_sq
    for _ in range(max_iter):
        if not bool(active.any()):
            break
        operator_direction = apply_operator(direction)
        curvature = _head_dot(direction, operator_direction)
        active = active & (curvature > torch.finfo(rhs.dtype).eps * _head_dot(direction, direction))
        step = torch.where(active, residual_dot / curvature.clamp_min(tiny), 0.0)
        solution = solution + step * direction
        residual = residual - step * operator_direction
        preconditioned = inverse_diagonal * residual
        new_residual_dot = _head_dot(residual, preconditioned)
        direction = preconditioned + (new_residual_dot / residual_dot.clamp_min(tiny)) * direction
        residual_dot = new_residual_dot
        active = active & (_head_dot(residual, residual) > threshold_sq)
    return solution


def _head_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-(batch, head) inner product of (B, H, X, Y) tensors, shaped (B, H, 1, 1) for broadcasting."""
    return (a * b).sum(dim=(-2, -1), keepdim=True)


def _finite_per_head(tensor: torch.Tensor) -> torch.Tensor:
    """(B, H, ...) -> (B, H) bool: every entry of that head is finite.

    NOTE: one float32 sum per head instead of an elementwise test: NaN and inf propagate into the sum, and
    a sum that overflows to inf can only come from entries near float32's limit, which are rejected too.
    """
    return torch.isfinite(tensor.sum(dim=tuple(range(2, tensor.ndim)), dtype=torch.float32))


def _validate(queries, keys, values, kept, fixed, lambda_k, lambda_v, steps, components, query_positions,
              scale, cg_max_iter, cg_rtol) -> None:
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
        if not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
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
    if not isinstance(cg_max_iter, int) or cg_max_iter < 1:
        raise ValueError(f"cg_max_iter must be an integer >= 1, got {cg_max_iter!r}")
    if not isinstance(cg_rtol, (int, float)) or not 0 < cg_rtol < 1:
        raise ValueError(f"cg_rtol must be in (0, 1), got {cg_rtol!r}")
    devices = {t.device for t in (queries, keys, values, kept, fixed)}
    if len(devices) > 1:
        raise ValueError(f"queries, keys, values, kept and fixed must be on one device, got {sorted(map(str, devices))}")
