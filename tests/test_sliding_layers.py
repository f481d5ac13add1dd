"""Sliding-window layers stay whole under every press (``grkv_core.presses.sliding_layers``), on tiny-gemma3's layout
(a sliding-window layer, then a global one) and on the same layers in the other order."""

import copy

import pytest
import torch
from conftest import tiny_model
from kvpress.utils import compute_n_kept
from test_kvpress_compat import OUR_MERGERS
from transformers import DynamicCache

from grkv_core.catalog import merger_names
from grkv_core.evaluation.generation import cache_lengths, prefill
from grkv_core.evaluation.shared_prefill import prefill_shared
from grkv_core.presses.from_config import build_press
from grkv_core.presses.sliding_layers import compressing, sliding_layer_indices

RATIO = 0.75
CONTEXT = 160  # longer than tiny-gemma3's window of 64


def prompt(model, seed=0):
    return torch.randint(0, model.config.vocab_size, (1, CONTEXT), generator=torch.Generator().manual_seed(seed))


def global_last_model():
    """tiny-gemma3 with its layer types swapped: the global layer first, the sliding-window one last."""
    model = copy.deepcopy(tiny_model("tiny-gemma3").model)
    model.config.layer_types = ["full_attention", "sliding_attention"]
    for layer, is_sliding in zip(model.model.layers, (False, True)):
        layer.self_attn.is_sliding = is_sliding
        layer.self_attn.sliding_window = model.config.sliding_window if is_sliding else None
        layer.attention_type = model.config.layer_types[layer.self_attn.layer_idx]
    return model


def test_the_model_configuration_names_the_sliding_layers():
    assert sliding_layer_indices(tiny_model("tiny-gemma3").model) == {0}
    assert sliding_layer_indices(global_last_model()) == {1}
    assert sliding_layer_indices(tiny_model("tiny-llama").model) == frozenset()


@pytest.mark.parametrize("merge", merger_names())
def test_a_sliding_layer_keeps_its_full_cache_and_the_global_layer_the_budget(merge):
    model = tiny_model("tiny-gemma3").model
    ids = prompt(model)
    full, pressed = prefill(model, ids), prefill(model, ids, build_press("snapkv", RATIO, merge=merge))
    assert cache_lengths(pressed) == [CONTEXT, compute_n_kept(CONTEXT, RATIO)]
    assert torch.equal(pressed.layers[0].keys, full.layers[0].keys)
    assert torch.equal(pressed.layers[0].values, full.layers[0].values)


@pytest.mark.parametrize("merge", OUR_MERGERS)
def test_a_merger_entered_as_kvpress_enters_presses_leaves_sliding_layers_whole_itself(merge):
    """``with press(model)``, kvpress's spelling, of a merger of this package; kvpress's own press compresses the
    sliding layer of a Gemma3ForCausalLM (it skips them only for Gemma3ForConditionalGeneration)."""
    model = tiny_model("tiny-gemma3").model
    ids = prompt(model, seed=1)
    caches = {}
    for name, press in (
        ("merger", build_press("snapkv", RATIO, merge=merge)),
        ("kvpress", build_press("snapkv", RATIO)),
    ):
        caches[name] = cache = DynamicCache()
        with torch.inference_mode(), press(model):
            model.model(input_ids=ids, past_key_values=cache)
    assert cache_lengths(caches["merger"]) == [CONTEXT, compute_n_kept(CONTEXT, RATIO)]
    assert cache_lengths(caches["kvpress"]) == [compute_n_kept(CONTEXT, RATIO)] * 2


def test_grkv_merges_the_global_layer_whichever_comes_last():
    """With the sliding layer last, the group of layers that GRKV solves together (``layers_per_solve``) still ends at
    the last layer it compresses: the global layer's rows are merged, not left as SnapKV evicted them."""
    model = global_last_model()
    ids = prompt(model, seed=2)
    full = prefill(model, ids)
    evicted = prefill(model, ids, build_press("snapkv", RATIO))
    merged = prefill(model, ids, build_press("snapkv", RATIO, merge="grkv", layers_per_solve=4))
    alone = prefill(model, ids, build_press("snapkv", RATIO, merge="grkv", layers_per_solve=1))
    assert cache_lengths(merged) == [compute_n_kept(CONTEXT, RATIO), CONTEXT]
    assert torch.equal(merged.layers[1].keys, full.layers[1].keys)
    assert not torch.allclose(merged.layers[0].values.sort(dim=2).values, evicted.layers[0].values.sort(dim=2).values)
    torch.testing.assert_close(merged.layers[0].keys, alone.layers[0].keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged.layers[0].values, alone.layers[0].values, rtol=1e-5, atol=1e-5)


def test_the_trial_engine_leaves_the_same_layers_whole_as_one_prefill_per_press():
    model = tiny_model("tiny-gemma3").model
    ids = prompt(model, seed=3)
    presses = [None, build_press("snapkv", RATIO), build_press("snapkv", RATIO, merge="grkv")]
    shared = prefill_shared(model, ids, presses)
    for press, pressed in zip(presses[1:], shared.pressed[1:]):
        alone = prefill(model, ids, press)
        assert cache_lengths(pressed.cache) == cache_lengths(alone) == [CONTEXT, compute_n_kept(CONTEXT, RATIO)]
        for layer_shared, layer_alone in zip(pressed.cache.layers, alone.layers):
            torch.testing.assert_close(layer_shared.keys, layer_alone.keys, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(layer_shared.values, layer_alone.values, rtol=1e-6, atol=1e-6)


def test_a_model_of_sliding_layers_only_is_refused_in_one_line():
    model = copy.deepcopy(tiny_model("tiny-gemma3").model)
    model.config.layer_types = ["sliding_attention"] * 2
    with pytest.raises(ValueError, match="^every layer of Gemma3ForCausalLM is sliding-window attention[^\n]*$"):
        with compressing(build_press("snapkv", RATIO), model):
            pass


def test_eager_attention_on_a_model_with_sliding_layers_is_refused_in_one_line():
    loaded = tiny_model("tiny-gemma3", attn_implementation="eager")
    with pytest.raises(
        ValueError, match="^Gemma3ForCausalLM mixes sliding-window and global layers[^\n]*load it with sdpa[^\n]*$"
    ):
        prefill(loaded.model, prompt(loaded.model), build_press("h2o", RATIO, merge="grkv"))
