"""The safeguard: shorten a key step per head until the true window loss does not rise (a deviation from the
paper, on by default; see ``grkv_merge``)."""

from __future__ import annotations

import torch

from grkv_core.solver.problem import MergeProblem

# NOTE: the safeguard tries the key step at lengths 1, 1/2, ..., 2^-MAX_HALVINGS before keeping the value
# step's keys; with CG 16, 4 of 720 real SmolLM2 (layer, head) units passed no length (docs/results/safeguard.md).
MAX_HALVINGS = 4


def safeguarded(
    problem: MergeProblem,
    keys: torch.Tensor,
    logits: torch.Tensor,
    step_keys: torch.Tensor,
    bar: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """Shorten the key step ``keys`` -> ``step_keys`` per head until the true window loss does not rise.

    ``logits`` are ``problem.logits(keys)``, ``values`` the round's new values and ``bar`` (P,) the window loss
    at (``keys``, ``values``), i.e. after the value step. Of the lengths 1, 1/2, ... 2^-MAX_HALVINGS a head takes the
    longest that passes; a head that passes none keeps ``keys``.

    NOTE: logits are linear in the keys, so the logits at keys + t·step are ``logits`` + t·Q stepᵀ: one product
    serves every length tried, and each try costs a softmax and one product with the values.

    NOTE: a head that passes at length 1 gets ``step_keys`` itself (not keys + 1·step, which may round
    differently), so where the paper's step lowers the loss the result is unchanged bit for bit.
    """
    step = step_keys - keys
    step_logits = torch.bmm(problem.queries_scaled, step.mT)

    def loss_at(length: float) -> torch.Tensor:
        return problem.window_error(problem.softmax(torch.add(logits, step_logits, alpha=length)), values)

    # NOTE: every length is tried on every head, shortest first, so that each head ends with the longest that passes:
    # stopping once every head had passed would read a flag on the host (a GPU synchronisation) after each try.
    length = torch.zeros_like(bar)
    for halvings in range(MAX_HALVINGS, 0, -1):
        trial = 2.0**-halvings
        length = torch.where(loss_at(trial) <= bar, trial, length)
    shortened = torch.addcmul(keys, length[:, None, None], step)
    return torch.where((loss_at(1.0) <= bar)[:, None, None], step_keys, shortened)
