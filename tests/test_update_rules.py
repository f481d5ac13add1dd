"""GRKV's rules after a solve, on their own: the trust-region caps and the two acceptance rules, each checked
against an independent float64 computation."""

import pytest
import torch

from grkv_core.options import SolverOptions
from grkv_core.presses.update_rules import lowest_window_loss, passes_validation
from grkv_core.solver import grkv_merge
from grkv_core.solver.attention import full_cache_outputs
from grkv_core.solver.losses import discrepancy_per_head
from grkv_core.solver.merge import solve_regression
from grkv_core.solver.regression import KeptRegression
from grkv_core.solver.trust_region import cap_update


def random_cache(seed: int, batch=2, heads=4, rows=8, length=64, budget=32, dim=8):
    generator = torch.Generator().manual_seed(seed)
    queries = 2 * torch.randn(batch, heads, rows, dim, generator=generator)
    keys, values = (torch.randn(batch, heads, length, dim, generator=generator) for _ in range(2))
    kept = torch.stack(
        [
            torch.stack([torch.randperm(length, generator=generator)[:budget] for _ in range(heads)])
            for _ in range(batch)
        ]
    )
    return queries, keys, values, kept, torch.zeros(batch, heads, budget, dtype=torch.bool)


def test_the_cap_shrinks_each_heads_update_to_its_share_of_the_start_and_no_further():
    generator = torch.Generator().manual_seed(1)
    start = torch.randn(2, 3, 16, 8, generator=generator)
    merged = start + torch.randn(2, 3, 16, 8, generator=generator) * torch.tensor([0.01, 0.1, 1.0])[:, None, None]
    capped = cap_update(start, merged, 0.05)
    update, limit = (merged - start).double(), 0.05 * start.double().flatten(2).norm(dim=-1)
    norm = update.flatten(2).norm(dim=-1)
    expected = start.double() + update * torch.minimum(torch.ones_like(norm), limit / norm)[..., None, None]
    torch.testing.assert_close(capped.double(), expected, rtol=1e-6, atol=1e-6)
    small = norm <= limit
    assert small.any() and (~small).any(), "both kinds of head are present"
    assert torch.equal(capped[small], merged[small]), "an update within the cap is left as it is"
    assert cap_update(start, merged, None) is merged


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_cap_leaves_a_head_with_a_non_finite_row_as_it_is_and_every_other_head_capped(bad):
    generator = torch.Generator().manual_seed(2)
    start = torch.randn(1, 2, 8, 4, generator=generator)
    start[0, 0, 2] = bad
    # NOTE: the solver hands a head with a non-finite row back unmerged: merged equals start there.
    merged = start + torch.randn(1, 2, 8, 4, generator=generator) * torch.tensor([0.0, 1.0])[:, None, None]
    capped = cap_update(start, merged, 0.1)
    torch.testing.assert_close(capped[0, 0], merged[0, 0], equal_nan=True, rtol=0, atol=0)
    assert (~torch.isfinite(capped)).any(dim=-1).sum() == 1, "only the bad row stays non-finite"
    limit = 0.1 * start[0, 1].double().norm()
    assert (capped[0, 1].double() - start[0, 1].double()).norm() <= limit * (1 + 1e-5)


def test_the_validation_rule_passes_exactly_the_heads_whose_held_out_loss_falls():
    # Unrelated random queries, no ridge and more free rows than fitted ones: the half-fit overfits on some heads.
    queries, keys, values, kept, fixed = random_cache(0)
    options = SolverOptions(lambda_k=0.0, lambda_v=0.0)
    regression = KeptRegression.of(queries, keys, values, kept, fixed)
    passes = passes_validation(
        regression, options, solve_regression, keys, values, full_cache_outputs(queries, keys, values), window=8
    )
    even, odd = torch.arange(8) % 2 == 0, torch.arange(8) % 2 == 1
    half = grkv_merge(queries[:, :, even], keys, values, kept, fixed, lambda_k=0.0, lambda_v=0.0)
    evicted = (regression.kept_keys, regression.kept_values)
    half_loss, evicted_loss = (
        discrepancy_per_head(
            queries[:, :, odd].double(),
            keys.double(),
            values.double(),
            *(part.double() for part in cache),
            compressed_positions=kept,
        )[0]
        for cache in (half, evicted)
    )
    assert torch.equal(passes, half_loss < evicted_loss)
    assert passes.any() and not passes.all()


def test_the_objective_rule_takes_each_heads_candidate_of_lowest_window_loss():
    queries, keys, values, kept, fixed = random_cache(2)
    rows = kept[..., None].expand(-1, -1, -1, 8)
    evicted = (keys.gather(2, rows), values.gather(2, rows))
    values_only = grkv_merge(queries, keys, values, kept, fixed, components="v", lambda_v=1e-3)
    merged = grkv_merge(queries, keys, values, kept, fixed, lambda_k=0.0, lambda_v=0.0, steps=2, safeguard=False)
    spoiled = torch.zeros(2, 4, 1, 1).index_fill_(1, torch.tensor([0, 1]), 3.0)  # half the heads' merge made worse
    noise = torch.randn(merged[1].shape, generator=torch.Generator().manual_seed(3))
    merged = (merged[0], merged[1] + spoiled * noise)
    candidates = [evicted, (evicted[0], values_only[1]), merged]
    chosen = lowest_window_loss(
        candidates, queries, keys, values, kept, None, 8**-0.5, full_cache_outputs(queries, keys, values)
    )
    losses = torch.stack(
        [
            discrepancy_per_head(
                queries.double(), keys.double(), values.double(), k.double(), v.double(), compressed_positions=kept
            )[0]
            for k, v in candidates
        ]
    )
    best = losses.argmin(dim=0)
    for index, (k, v) in enumerate(candidates):
        heads = best == index
        assert torch.equal(chosen[0][heads], k[heads]) and torch.equal(chosen[1][heads], v[heads])
    assert len(set(best.flatten().tolist())) > 1, "the rule chose differently across heads"
