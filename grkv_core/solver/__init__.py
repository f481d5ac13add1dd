"""The GRKV update on plain tensors (paper Sec. 3, Alg. 1, App. D).

Given surrogate queries, the full cache and the positions an eviction method keeps, GRKV refits the kept
keys and values so that the kept cache reproduces the full cache's attention outputs on the queries,
with ridge penalties pulling both back towards the plain evicted cache:

    min_{K, V}  || softmax(s Q K_fullᵀ) V_full - softmax(s Q Kᵀ) V ||_F²
                + λ_k ||K - K⁰||_F² + λ_v ||V - V⁰||_F²

It alternates an exact value step (ridge regression in dual/Woodbury form, an M×M system per head, or in primal
form, F×F, when the M query rows outnumber the F free rows) and a linearised key step (dual ridge problem solved by
conjugate gradients with analytic, matrix-free Jacobian products). Everything is batched over batch and KV heads,
and each head is solved on its own, so the regressions of several layers of one shape (``KeptRegression``) stack
into one call (``solve_regression``), which keeps more cores busy and dispatches fewer operations than one call per
layer (``GRKVPress.layers_per_solve``).

Deviations from the paper, all options (``safeguard=False, ridge_scale="absolute"`` with the key step solved to
convergence, ``cg_max_iter=200, cg_rtol=1e-7``, is the paper's Alg. 1 exactly):

- ``safeguard`` (on by default): the linearised key step predicts a decrease of the window loss on every
  head, but where it moves logits far (sharp heads) the true loss can rise instead; the step direction is
  a descent direction, only its length is wrong. The safeguard evaluates the true window loss per head and
  halves the step until it is no worse than after the value step, else keeps the value step's keys
  (docs/results/safeguard.md has the measurement behind it).
- ``ridge_scale="relative"``: λ multiplies a per-head scale of each system (the mean diagonal of X_G X_Gᵀ for
  the value step, of J Jᵀ for the key step), so one λ means the same across heads and models whose caches
  differ in scale.
- ``cg_max_iter=4``: the key step's CG stops after 4 iterations; behind the safeguard that keeps about half of
  16 iterations' gain over the value step alone, and, unlike 2, a held-out gain over it end to end
  (docs/results/safeguard.md).

Modules
-------
- ``merge``: ``grkv_merge``, the public entry point, and ``solve_regression``, the same on a reduced cache (the
  alternating loop, non-finite heads).
- ``regression``: ``KeptRegression``, a cache reduced to what the solver reads (kept rows, queries, target),
  with the input checks, and how regressions of one shape stack.
- ``problem``: the tensors one call shares between its steps, in the solver's row order (free rows first).
- ``value_step``: the exact ridge refit of the values.
- ``key_step``: the linearised key step, by conjugate gradients with matrix-free Jacobian products.
- ``safeguard``: the shortening of a key step that would raise the true window loss.
- ``attention``: the full cache's attention outputs and a masked softmax (also used by the diagnostics and the
  CaM baseline).
- ``losses``: how far a compressed cache's attention outputs drift from the full cache's (the reconstruction
  discrepancy the evaluation records and GRKV's acceptance rule compares), and which full-cache positions
  an evicted cache kept.
- ``reference``: a slow, explicit-Jacobian float64 implementation, the tests' yardstick.

NOTE: this package imports torch and the light ``grkv_core.config`` only: no transformers, no kvpress.
"""

from grkv_core.solver.attention import full_cache_outputs, masked_softmax
from grkv_core.solver.merge import grkv_merge, solve_regression
from grkv_core.solver.regression import KeptRegression

__all__ = ["KeptRegression", "full_cache_outputs", "grkv_merge", "masked_softmax", "solve_regression"]
