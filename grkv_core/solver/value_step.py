"""The value step: the exact ridge refit of the free values at fixed keys (dual form, an M×M system per head)."""

from __future__ import annotations

import torch

from grkv_core.solver.problem import MergeProblem


def value_step(problem: MergeProblem, attention: torch.Tensor, lambda_v: float, ridge_scale: str) -> torch.Tensor:
    """Exact ridge refit of the free values given the (P, M, c) attention at the current keys.

    With A the (P, M, c) attention with the fixed rows' columns zeroed and R the residual, the update is
    Aᵀ(A Aᵀ + λI)⁻¹ R (dual, an M×M system) = (AᵀA + λI)⁻¹ Aᵀ R (primal, c×c; likewise for the pseudo-inverses at
    λ = 0). NOTE: the smaller system is solved: the dual while M ≤ c (the paper's m = 32 on SmolLM2), the primal for
    more query rows than kept rows (stratified m = 128); both give the same refit up to float rounding. A fixed row's
    column of A is zero, so its update is zero on either route (in the primal system its row and column hold the
    ridge alone). The relative ridge scale is the dual system's mean diagonal, ‖A‖²_F / M, on either route.
    """
    residual = problem.weighted(torch.baddbmm(problem.target, attention, problem.values0, alpha=-1.0))
    attention_free = problem.weighted(problem.free_columns(attention))
    rows, kept = attention_free.shape[-2:]
    dual = rows <= kept
    gram = torch.bmm(attention_free, attention_free.mT) if dual else torch.bmm(attention_free.mT, attention_free)
    ridge = lambda_v
    if ridge_scale == "relative" and lambda_v > 0:
        diagonal = gram.diagonal(dim1=-2, dim2=-1)
        ridge = lambda_v * (diagonal.mean(dim=-1) if dual else diagonal.sum(dim=-1) / rows)[..., None, None]
    if dual:
        update = torch.bmm(attention_free.mT, _ridge_solve(gram, residual, ridge))
    else:
        update = _ridge_solve(gram, torch.bmm(attention_free.mT, residual), ridge)
    return problem.values0 + update


def _ridge_solve(gram: torch.Tensor, rhs: torch.Tensor, ridge: float | torch.Tensor) -> torch.Tensor:
    """Solve (gram + ridge·I) z = rhs for symmetric PSD ``gram`` (P, M, M).

    ``ridge`` is a number or a (P, 1, 1) tensor (one per system, ``ridge_scale="relative"``). A ridge of 0 (a number)
    gives every system the pseudo-inverse by eigen-decomposition, i.e. the minimum-norm least-squares solution, so it
    never yields NaN. A positive ridge makes a system positive definite: Cholesky.

    NOTE: the route is chosen from the ridge alone, never from the data (a flag read on the host is a GPU
    synchronisation). A per-system ridge is zero only where the system's diagonal is, i.e. ``gram`` = 0, whose
    minimum-norm solution is z = 0 (its factorisation runs with a ridge of 1 and is discarded). A system that
    Cholesky finds numerically singular despite its ridge (a ridge below float32's resolution of the matrix) gets
    z = 0, i.e. no update, instead of a pseudo-inverse.
    """
    if not isinstance(ridge, torch.Tensor) and ridge == 0:
        return _pseudo_inverse_solve(gram, rhs, torch.zeros(gram.shape[0], 1, device=gram.device))
    shifted_gram = gram.clone()
    shift = ridge[..., 0] if isinstance(ridge, torch.Tensor) else ridge
    unsolved = None
    if isinstance(ridge, torch.Tensor):
        unsolved = shift == 0
        shift = shift.masked_fill(unsolved, 1.0)
    shifted_gram.diagonal(dim1=-2, dim2=-1).add_(shift)
    factor, info = torch.linalg.cholesky_ex(shifted_gram)
    unsolved = info != 0 if unsolved is None else unsolved[:, 0] | (info != 0)
    return torch.cholesky_solve(rhs, factor).masked_fill_(unsolved[:, None, None], 0.0)


def _pseudo_inverse_solve(gram: torch.Tensor, rhs: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """(gram + shift·I)⁺ rhs by eigen-decomposition, for (P, M, M) ``gram`` and (P, 1) ``shift``."""
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    shifted = eigenvalues + shift
    cutoff = shifted.amax(dim=-1, keepdim=True) * gram.shape[-1] * torch.finfo(gram.dtype).eps
    inverse = torch.where(shifted > cutoff, 1.0 / shifted.clamp_min(torch.finfo(gram.dtype).tiny), 0.0)
    projected = eigenvectors.transpose(-1, -2) @ rhs
    return eigenvectors @ (inverse.unsqueeze(-1) * projected)
