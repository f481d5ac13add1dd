"""LayerGroups on its own: when a group is solved, that each layer's rows get what a solve alone gives them, and that
a group's fixed rows are chosen in one pass over its layers."""

import torch

from grkv_core.options import SolverOptions
from grkv_core.presses.layer_groups import LayerGroups, LayerMerge
from grkv_core.solver.attention import full_cache_outputs
from grkv_core.solver.merge import SolveIssues, solve_regression
from grkv_core.solver.problem import gather_rows

OPTIONS = SolverOptions(steps=2, lambda_k=1e-3)
LENGTH = 48
QUERY_POSITIONS = torch.arange(36, LENGTH)  # NOTE: one tensor for every layer, as GRKVPress hands them out


def layer_merge(seed: int, budget: int = 12) -> LayerMerge:
    """A random layer's merge, as GRKVPress builds one: batch 2, 2 KV heads, 12 window rows, 48 positions."""
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randn(2, 2, 12, 8, generator=generator)
    keys, values = torch.randn(2, 2, LENGTH, 8, generator=generator), torch.randn(2, 2, LENGTH, 8, generator=generator)
    kept = torch.stack(
        [torch.stack([torch.randperm(LENGTH, generator=generator)[:budget] for _ in range(2)]) for _ in range(2)]
    )
    kept_keys, kept_values = gather_rows(kept, keys, values)
    return LayerMerge(
        queries=queries,
        target=full_cache_outputs(queries, keys, values, query_positions=QUERY_POSITIONS),
        kept_keys=kept_keys,
        kept_values=kept_values,
        kept=kept,
        kept_scores=torch.rand(2, 2, budget, generator=generator),
        length=LENGTH,
        query_positions=QUERY_POSITIONS,
        scale=8**-0.5,
        row_weights=None,
    )


def top_quarter(calls: list):
    """A fixed-row rule (the rows scored in a head's top quarter) that records the batch of each call."""

    def fixed_rows(kept, kept_scores, length):
        assert length == LENGTH
        calls.append(kept.shape[0])
        return kept_scores >= kept_scores.quantile(0.75, dim=-1, keepdim=True)

    return fixed_rows


def test_a_group_is_solved_when_full_or_at_the_last_hooked_layer_each_layer_as_if_alone():
    calls = []
    groups = LayerGroups(size=2, last_layer=2, fixed_rows=top_quarter(calls), issues=SolveIssues())
    merges = [layer_merge(seed) for seed in range(3)]
    alone = [solve_regression(LayerMerge.regression([merge], top_quarter([])), OPTIONS) for merge in merges]
    starts = [(merge.kept_keys.clone(), merge.kept_values.clone()) for merge in merges]
    for layer, merge in enumerate(merges):
        groups.defer(merge, OPTIONS)
        groups.compressed(layer)
        if layer == 0:  # the group of two waits for its second layer: nothing written yet
            assert calls == [] and torch.equal(merge.kept_keys, starts[0][0])
    assert calls == [4, 2], "layers 0-1 solved (their fixed rows chosen at once) when full, layer 2 as the last"
    for merge, (keys, values), (start_keys, _) in zip(merges, alone, starts):
        assert not torch.equal(merge.kept_keys, start_keys), "the cache rows were merged in place"
        torch.testing.assert_close(merge.kept_keys, keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merge.kept_values, values, rtol=1e-5, atol=1e-5)


def test_a_layer_of_another_shape_or_other_options_closes_the_group_first():
    calls = []
    groups = LayerGroups(size=6, last_layer=5, fixed_rows=top_quarter(calls), issues=SolveIssues())
    groups.defer(layer_merge(0), OPTIONS)
    groups.defer(layer_merge(1, budget=10), OPTIONS)  # per-layer budgets: another shape
    assert calls == [2]
    groups.defer(layer_merge(2, budget=10), SolverOptions(steps=1))
    assert calls == [2, 2]
    groups.solve()
    assert calls == [2, 2, 2]


def test_the_rows_the_rule_holds_fixed_are_written_back_as_they_were():
    groups = LayerGroups(
        size=1, last_layer=0, fixed_rows=lambda kept, scores, length: kept % 2 == 0, issues=SolveIssues()
    )
    merge = layer_merge(3)
    start_keys, start_values = merge.kept_keys.clone(), merge.kept_values.clone()
    groups.defer(merge, OPTIONS)
    groups.compressed(0)
    fixed = merge.kept % 2 == 0
    assert torch.equal(merge.kept_keys[fixed], start_keys[fixed])
    assert torch.equal(merge.kept_values[fixed], start_values[fixed])
    assert not torch.equal(merge.kept_values[~fixed], start_values[~fixed])
