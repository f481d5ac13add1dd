"""The key step: a linearised dual ridge update of the free keys, solved by Jacobi-preconditioned conjugate
gradients with analytic, matrix-free Jacobian products."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from grkv_core.solver.problem import MergeProblem, reads_are_free, scale_rows

# On the CPU, how often the conjugate gradients check whether every head has stopped (``_conjugate_gradients``).
EXIT_CHECK_EVERY = 8


def key_step(
    problem: MergeProblem,
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
    Returns the new keys, ‖E‖² per head (P,), the window loss before the step, and (P,) bool flags of the heads whose
    CG made no progress (their linearised system has no usable curvature: they keep ``problem.keys0``' rows plus
    nothing, i.e. the value step's keys when it is the first round).
    """
    jacobian = _AttentionJacobian.at(problem, attention, values)
    rhs = problem.weighted(problem.target - jacobian.output)
    error = _head_dot(rhs, rhs).flatten()
    # NOTE: the first round linearises at K⁰ itself, where the J·vec(K − K⁰) term is exactly zero.
    if keys is not problem.keys0:
        rhs += jacobian.jvp(keys - problem.keys0)
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
    return problem.keys0 + jacobian.vjp(dual), error, stalled


@dataclass
class _AttentionJacobian:
    """Analytic products with J = ∂f/∂K of f(K) = softmax(s Q Kᵀ) V at one point, on the free rows only.

    With A the attention weights and F = A V: J[ΔK] = W V − rowsum(W) ⊙ F for W = A ⊙ (s Q ΔKᵀ), and
    Jᵀ[U] = s Wᵀ Q for W = A ⊙ (U Vᵀ − rowsum(U ⊙ F)).

    NOTE: only the free rows enter: ``attention_free`` holds A with the fixed rows' columns zeroed, so every product
    gives them zero weight; both row sums ride along in the matrix products through a column of minus ones appended
    to V (``values_centring`` = [V | −1]).

    With row weights (``MergeProblem.row_scale``, √w per query row, or None) J is the weighted Jacobian
    diag(√w) J: its output rows are scaled on the way out (``jvp``) and its cotangent rows on the way in (``vjp``).

    Shapes (P = B·H, as in ``MergeProblem``): ``queries_scaled`` (P, M, d), ``attention_free``
    (P, M, c), ``values_centring`` (P, c, d + 1), ``output`` (P, M, d) over all kept rows, ``query_gram``
    (P, M, M) or None (see ``normal``), ``query_norms`` (P, M, 1) the squared norms ‖s·q_i‖², ``row_scale``
    (P, M, 1) or None.
    """

    queries_scaled: torch.Tensor
    attention_free: torch.Tensor
    values_centring: torch.Tensor
    output: torch.Tensor
    query_gram: torch.Tensor | None
    query_norms: torch.Tensor
    row_scale: torch.Tensor | None

    @classmethod
    def at(cls, problem: MergeProblem, attention: torch.Tensor, values: torch.Tensor) -> _AttentionJacobian:
        """Linearise at the attention weights ``attention`` (P, M, c) with ``values`` (P, c, d)."""
        queries_scaled = problem.queries_scaled
        rows, head_dim = queries_scaled.shape[-2:]
        query_gram = None
        if rows < 2 * head_dim:
            query_gram = torch.bmm(queries_scaled, queries_scaled.transpose(-1, -2))
            query_norms = query_gram.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
        else:
            query_norms = queries_scaled.square().sum(dim=-1, keepdim=True)
        return cls(
            queries_scaled=queries_scaled,
            attention_free=problem.free_columns(attention),
            values_centring=torch.cat([values, values.new_full(values.shape[:-1] + (1,), -1.0)], dim=-1),
            output=torch.bmm(attention, values),
            query_gram=query_gram,
            query_norms=query_norms,
            row_scale=problem.row_scale,
        )

    def jvp(self, delta_keys: torch.Tensor) -> torch.Tensor:
        """(P, c, d) perturbation of the keys (the fixed rows' ignored) -> (P, M, d) output perturbation."""
        logit_change = torch.bmm(self.queries_scaled, delta_keys.transpose(-1, -2))
        return self._scaled(self._output_change(logit_change.mul_(self.attention_free)))

    def vjp(self, cotangent: torch.Tensor) -> torch.Tensor:
        """(P, M, d) output cotangent -> (P, c, d) cotangent of the keys (zero on the fixed rows)."""
        return torch.bmm(self._vjp_weights(cotangent).transpose(-1, -2), self.queries_scaled)

    def normal(self, cotangent: torch.Tensor, ridge: float | torch.Tensor = 0.0) -> torch.Tensor:
        """(J Jᵀ + ridge·I) applied to a (P, M, d) cotangent; ``ridge`` a number or (P, 1, 1) per head.

        Jᵀ then J forms s·Q ΔKᵀ with ΔK = s·Wᵀ Q, i.e. (sQ)(sQ)ᵀ W. NOTE: with fewer than 2d query rows (the paper's
        m = 32 on SmolLM2: M = 96 < 128) the M×M query Gram matrix replaces those two M×F×d products by one cheaper
        M×M×F product; with more (stratified m = 128: M = 384) the two products are the cheaper route. Both apply
        the same operator, up to float rounding.
        """
        if self.query_gram is None:
            output_change = self.jvp(self.vjp(cotangent))
        else:
            logit_change = torch.bmm(self.query_gram, self._vjp_weights(cotangent))
            output_change = self._scaled(self._output_change(logit_change.mul_(self.attention_free)))
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
        spread = (
            torch.bmm(squared, self.values_centring[..., :-1].square())
            - 2 * self.output * moments[..., :-1]
            - self.output.square() * moments[..., -1:]
        )
        diagonal = self.query_norms * spread.clamp_min(0.0)
        return diagonal if self.row_scale is None else diagonal * self.row_scale.square()

    def _vjp_weights(self, cotangent: torch.Tensor) -> torch.Tensor:
        """A ⊙ (U Vᵀ − rowsum(U ⊙ F)) on the free columns, as one product of [U | rowsum] with [V | −1]ᵀ
        (U the cotangent scaled by the row weights' roots)."""
        cotangent = self._scaled(cotangent)
        row_dots = torch.linalg.vecdot(cotangent, self.output).unsqueeze(-1)
        centred = torch.bmm(torch.cat([cotangent, row_dots], dim=-1), self.values_centring.transpose(-1, -2))
        return centred.mul_(self.attention_free)

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        return scale_rows(rows, self.row_scale)

    def _output_change(self, change: torch.Tensor) -> torch.Tensor:
        """W V − rowsum(W) ⊙ F for (P, M, c) logit-weighted attention changes W (zero on the fixed rows)."""
        moments = torch.bmm(change, self.values_centring)  # [W V | −rowsum(W)]
        return torch.addcmul(moments[..., :-1], moments[..., -1:], self.output)


def _conjugate_gradients(
    apply_operator,
    rhs: torch.Tensor,
    max_iter: int,
    rtol: float,
    inverse_diagonal: torch.Tensor,
    operator_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched Jacobi-preconditioned CG from zero for SPD operators, one independent solve per leading index.

    ``rhs`` and ``inverse_diagonal`` are (P, M, d), P = B·H; inner products run over the last two axes. A head
    stops (its step size is zeroed) once its preconditioned residual norm rᵀD⁻¹r falls below ``rtol``² times
    its initial value, or once its search direction loses curvature, which guards the singular systems that
    ridge 0 produces. NOTE: on a GPU, and under ``torch.compile``, every head runs all ``max_iter`` iterations,
    stopped heads with a zero step: a loop that ended once every head stopped would read a flag on the host (a GPU
    synchronisation). On the CPU, where that read costs nothing, the loop ends once every head has stopped, checked
    every ``EXIT_CHECK_EVERY`` iterations: the same result (a stopped head's steps are zero) without running the paper's
    200 iterations to the end. Curvature is judged against ``operator_scale`` (P, 1, 1), the operator's largest diagonal
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
    checks_exit = reads_are_free(rhs)
    for iteration in range(max_iter):
        if checks_exit and iteration % EXIT_CHECK_EVERY == 0 and iteration and not bool(running.any()):
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
