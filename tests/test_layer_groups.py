"""LayerGroups on its own: when a group is solved, and that each layer's rows get what a solve alone gives them."""

import torch

from grkv_core.options import SolverOptions
from grkv_core.presses.layer_groups import LayerGroups
from grkv_core.solver.merge import SolveIssues, solve_regression
from grkv_core.solver.regression import KeptRegression

OPTIONS = SolverOptions(steps=2, lambda_k=1e-3)


def layer_regression(seed: int, budget: int = 12) -> KeptRegression:
    """A random layer's regression, as GRKVPress builds one: batch 2, 2 KV heads, 12 window rows, 48 positions."""
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randn(2, 2, 12, 8, generator=generator)
    keys, values = torch.randn(2, 2, 48, 8, generator=generator), torch.randn(2, 2, 48, 8, generator=generator)
    kept = torch.stack(
        [torch.stack([torch.randperm(48, generator=generator)[:budget] for _ in range(2)]) for _ in range(2)]
    )
    fixed = torch.rand(2, 2, budget, generator=generator) < 0.25
    return KeptRegression.of(queries, keys, values, kept, fixed, query_positions=torch.arange(36, 48))


def counted(finish_calls: list):
    def finish(regression, keys, values):
        finish_calls.append(regression.batch)
        return keys, values

    return finish


def test_a_group_is_solved_when_full_or_at_the_last_hooked_layer_each_layer_as_if_alone():
    calls = []
    groups = LayerGroups(size=2, last_layer=2, finish=counted(calls), issues=SolveIssues())
    regressions = [layer_regression(seed) for seed in range(3)]
    alone = [solve_regression(regression, OPTIONS) for regression in regressions]
    starts = [(regression.kept_keys.clone(), regression.kept_values.clone()) for regression in regressions]
    for layer, regression in enumerate(regressions):
        groups.defer(regression, OPTIONS)
        groups.compressed(layer)
        if layer == 0:  # the group of two waits for its second layer: nothing written yet
            assert calls == [] and torch.equal(regression.kept_keys, starts[0][0])
    assert calls == [2, 2, 2], "layers 0-1 solved when the group was full, layer 2 as the last hooked layer"
    for regression, (keys, values), (start_keys, _) in zip(regressions, alone, starts):
        assert not torch.equal(regression.kept_keys, start_keys), "the cache rows were merged in place"
        torch.testing.assert_close(regression.kept_keys, keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(regression.kept_values, values, rtol=1e-5, atol=1e-5)


def test_a_layer_of_another_shape_or_other_options_closes_the_group_first():
    calls = []
    groups = LayerGroups(size=6, last_layer=5, finish=counted(calls), issues=SolveIssues())
    groups.defer(layer_regression(0), OPTIONS)
    groups.defer(layer_regression(1, budget=10), OPTIONS)  # per-layer budgets: another shape
    assert calls == [2]
    groups.defer(layer_regression(2, budget=10), SolverOptions(steps=1))
    assert calls == [2, 2]
    groups.solve()
    assert calls == [2, 2, 2]


def test_finish_decides_what_is_written_into_the_cache():
    groups = LayerGroups(
        size=1, last_layer=0, finish=lambda regression, keys, values: (keys * 0, values * 0), issues=SolveIssues()
    )
    regression = layer_regression(3)
    groups.defer(regression, OPTIONS)
    groups.compressed(0)
    assert not regression.kept_keys.any() and not regression.kept_values.any()
