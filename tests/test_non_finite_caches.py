"""A NaN or inf row in a layer's cache: after GRKV the non-finite rows are exactly those the base press alone leaves,
under every option that touches the update (the presets, the trust-region caps, the acceptance rules, the row weights).
"""

import warnings

import pytest
import torch
from conftest import tiny_model
from test_press import RATIO, SHORT_PROMPT_GRKV, context_ids

from grkv_core.evaluation.generation import prefill
from grkv_core.options import GRKV_PRESETS
from grkv_core.presses.from_config import build_press

CONFIGURATIONS = {
    "defaults": SHORT_PROMPT_GRKV,
    "paper": {**GRKV_PRESETS["paper"], **SHORT_PROMPT_GRKV},
    "window32": {**GRKV_PRESETS["window32"], **SHORT_PROMPT_GRKV},
    "no-cap": {**SHORT_PROMPT_GRKV, "max_rel_update_k": None},
    "value-cap": {**SHORT_PROMPT_GRKV, "max_rel_update_v": 0.1},
    "both-caps-uniform": {
        **SHORT_PROMPT_GRKV,
        "max_rel_update_k": 0.025,
        "max_rel_update_v": 0.1,
        "head_weighting": "uniform",
    },
    "objective": {**SHORT_PROMPT_GRKV, "accept": "objective", "max_rel_update_v": 0.1},
    "validation": {**SHORT_PROMPT_GRKV, "accept": "validation", "max_rel_update_v": 0.1},
}
# (layer, KV head, position, keys or values): rows of the cache made non-finite before the press compresses it, inside
# SnapKV's observation window (which it keeps) and before GRKV's fixed window of m = 16 (which it refits).
BAD_ROWS = [(1, 0, 120, "keys"), (1, 1, 130, "values")]


def poisoned_prefill(model, ids, press, bad: float):
    """``press``'s prefill of ``ids`` with ``BAD_ROWS`` set to ``bad`` in the cache after each layer's attention and
    before the press's hook reads it (a hook registered before the press's runs first)."""

    def poison(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        for index, head, position, part in BAD_ROWS:
            if index == module.layer_idx:
                getattr(layer, part)[0, head, position] = bad

    handles = [layer.self_attn.register_forward_hook(poison, with_kwargs=True) for layer in model.model.layers]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return prefill(model, ids, press)
    finally:
        for handle in handles:
            handle.remove()


def non_finite_rows(cache) -> list[list[list[tuple]]]:
    """Per layer and KV head, the non-finite rows (keys and values side by side), as sorted value tuples: the same
    rows in any order compare equal (a merger orders its rows by position, kvpress's eviction by score)."""
    rows = []
    for layer in cache.layers:
        both = torch.cat([layer.keys, layer.values], dim=-1)[0]  # (H_kv, c, 2d)
        bad = ~torch.isfinite(both).all(dim=-1)
        rows.append([sorted(map(tuple, both[head][bad[head]].tolist())) for head in range(both.shape[0])])
    return rows


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_the_non_finite_rows_after_grkv_are_those_eviction_leaves(configuration, bad):
    model = tiny_model("tiny-llama").model
    ids = context_ids(model.config.vocab_size, seed=12)
    evicted = poisoned_prefill(model, ids, build_press("snapkv", RATIO), bad)
    merged = poisoned_prefill(
        model, ids, build_press("snapkv", RATIO, merge="grkv", **CONFIGURATIONS[configuration]), bad
    )
    expected = non_finite_rows(evicted)
    assert sum(len(head) for layer in expected for head in layer) == len(BAD_ROWS), "both bad rows are kept"
    got = non_finite_rows(merged)
    # NOTE: NaN != NaN, so the rows compare by their text.
    assert repr(got) == repr(expected)
    clean_heads = [(layer, head) for layer in range(len(expected)) for head in range(len(expected[layer]))]
    assert all(not got[layer][head] for layer, head in clean_heads if not expected[layer][head])
