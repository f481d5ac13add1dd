"""The value step: the exact ridge refit of the free values at fixed keys (dual form, an M×M system per head)."""

from __future__ import annotations

import torch

from grkv_core.solver.problem import MergeProblem


def value_step(problem: MergeProblem, attention: torch.Tensor, lambda_v: float, ridge_scale: str) -> torch.Tensor:
    """Exact ridge refit of the free values given the (P, M, c) attention at the current keys.

    With A the (P, M, F) attention on the free rows and R the residual, the update is Aᵀ(A Aᵀ + λI)⁻¹ R (dual, an
    M×M system) = (AᵀA + λI)⁻¹ Aᵀ R (primal, F×F; likewise for the pseudo-inverses at λ = 0). NOTE: the smaller
    system is solved: the dual while M ≤ F (the paper's m = 32 on SmolLM2), the primal for more query rows than free
    rows (stratified m = 128); both give the same refit up to float rounding. The relative ridge scale is the dual
    system's mean diagonal, ‖A‖²_F / M, on either route.
    """
    residual = problem.weighted(torch.baddbmm(problem.target, attention, problem.values0, alpha=-1.0))
    attention_free = problem.weighted(problem.free_columns(attention))
    rows, free = attention_free.shape[-2:]
    dual = rows <= free
    gram = torch.bmm(attention_free, attention_free.mT) if dual else torch.bmm(attention_free.mT, attention_free)
    ridge = lambda_v
    if ridge_scale == "relative":
        diagonal = gram.diagonal(dim1=-2, dim2=-1)
        ridge = lambda_v * (diagonal.mean(dim=-1) if dual else diagonal.sum(dim=-1) / rows)[..., None, None]
    if dual:
        update = torch.bmm(attention_free.mT, _ridge_solve(gram, residual, ridge))
    else:
        update = _ridge_solve(gram, torch.bmm(attention_free.mT, residual), ridge)
    return problem.add_to_free_rows(problem.values0, update)


def _ridge_solve(gram: torch.Tensor, rhs: torch.Tensor, ridge: float | torch.Tensor) -> torch.Tensor:
    """Solve (gram + ridge·I) z = rhs for symmetric PSD ``gram`` (P, M, M), robust to ridge = 0.

    ``ridge`` is a number or a (P, 1, 1) tensor (one per system). A positive ridge makes a system positive
    definite: Cholesky. Without one (or for the systems where Cholesky meets a numerically singular matrix) an
    eigen-decomposition gives the pseudo-inverse, i.e. the minimum-norm least-squares solution, so ridge = 0
    never yields NaN. Each system takes its own route, whatever the others do.
    """
    shift = ridge[..., 0] if isinstance(ridge, torch.Tensor) else torch.full((gram.shape[0], 1), float(ridge),
                                                                             device=gram.device)
    positive = shift[:, 0] > 0
    if not bool(positive.any()):
        return _pseudo_inverse_solve(gram, rhs, shift)
    shifted_gram = gram.clone()
    shifted_gram.diagonal(dim1=-2, dim2=-1).add_(shift)
    factor, info = torch.linalg.cholesky_ex(shifted_gram)
    solution = torch.cholesky_solve(rhs, factor)
    singular = (info != 0) | ~positive
    if bool(singular.any()):
        solution[singular] = _pseudo_inverse_solve(gram[singular], rhs[singular], shift[singular])
    return solution


def _pseudo_inverse_solve(gram: torch.Tensor, rhs: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """(gram + shift·I)⁺ rhs by eigen-decomposition, for (P, M, M) ``gram`` and (P, 1) ``shift``."""
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    shifted = eigenvalues + shift
    cutoff = shifted.amax(dim=-1, keepdim=True) * gram.shape[-1] * torch.finfo(gram.dtype).eps
    inverse = torch.where(shifted > cutoff, 1.0 / shifted.clamp_min(torch.finfo(gram.dtype).tiny), 0.0)
    projected = eigenvectors.transpose(-1, -2) @ rhs
    return eigenvectors @ (inverse.unsqueeze(-1) * projected)
