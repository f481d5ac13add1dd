"""Every merger at home in kvpress: its pipeline, ``model.generate``, its wrappers, its cache order, and the press
properties kvpress checks for its own presses, over every merger (the catalog, kvpress's own MergingPress included) ×
several base presses, and every kvpress wrapper around our mergers."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import functools
import re
import statistics

import pytest
import torch
from conftest import assert_batch_elements_compressed_independently, model_and_press, needs_package, tiny_model
from kvpress import (
    AdaKVPress,
    BlockPress,
    ChunkKVPress,
    ChunkPress,
    ComposedPress,
    CriticalAdaKVPress,
    CriticalKVPress,
    DecodingPress,
    DMSPress,
    KeyRerotationPress,
    KnormPress,
    PerLayerCompressionPress,
    PrefillDecodingPress,
    SnapKVPress,
    ThinKPress,
)
from kvpress import MergingPress as KVPressMergingPress
from kvpress.utils import compute_n_kept
from test_baselines import MERGE_ALL
from test_press import SHORT_PROMPT_GRKV
from transformers import DynamicCache, pipeline

from grkv_core import presses
from grkv_core.catalog import EVICTION_PRESSES
from grkv_core.catalog import MERGERS as MERGER_ENTRIES
from grkv_core.datasets import load_dataset_samples
from grkv_core.evaluation.generation import (
    answer_question,
    append_question,
    cache_lengths,
    crop_cache,
    prefill,
    tokenize_sample,
)
from grkv_core.evaluation.shared_prefill import attention_modules
from grkv_core.models.gemma3 import GEMMA3
from grkv_core.presses import BaseMergerPress
from grkv_core.presses.from_config import build_press, refuses_eager, required_attention
from grkv_core.presses.query_policies import surrogate_queries
from grkv_core.presses.sliding_layers import sliding_layer_indices
from grkv_core.solver.losses import discrepancy_per_head, recover_kept_positions

MERGERS = {name: entry.load() for name, entry in MERGER_ENTRIES.items()}
NOT_EAGER = {name for name in EVICTION_PRESSES if refuses_eager(name)}
MERGER_NAMES = list(MERGERS)
# Ours: the mergers built on grkv_core's BaseMergerPress template (all but kvpress's own, "kvpress_merging").
OUR_MERGERS = [name for name in MERGER_NAMES if issubclass(MERGERS[name], BaseMergerPress)]
# Every registered eviction press, so a press added to the catalog joins the matrix; but those that need eager
# attention (H2O's observed attention), which these sdpa models cannot serve: tests/test_evaluate.py runs H2O.
BASE_PRESSES = [name for name in EVICTION_PRESSES if required_attention(name) is None]


def bases_of(name, bases=BASE_PRESSES):
    """The base presses a merger takes among ``bases``: kvpress's MergingPress takes a ScorerPress only (no AdaKV)."""
    return [base for base in bases if name in OUR_MERGERS or base not in NOT_EAGER]


def model_merger_base(models, bases=BASE_PRESSES):
    """pytest params (model, merger, base) over ``models``; what kvpress fails on itself is a strict xfail."""
    return [
        pytest.param(model, name, base, marks=pair.marks)
        for pair in model_and_press(models, bases)
        for model, base in [pair.values]
        for name in MERGER_NAMES
        if base in bases_of(name, [base])
    ]


# The press property matrix runs on a GQA Llama and on Gemma 3's layout (a sliding-window layer, one KV head).
PROPERTY_MODELS = ["tiny-llama", "tiny-gemma3"]
CONTEXT, QUESTION, RATIO = 160, 32, 0.75


SHORT_PROMPT_OPTIONS = {**MERGE_ALL, "grkv": SHORT_PROMPT_GRKV}


def merger(name, base="snapkv", ratio=RATIO, **options):
    """A merger by name over a base press by name; D2O and KVMerger merge every evicted token, GRKV fits 16
    surrogate queries (``SHORT_PROMPT_OPTIONS``)."""
    return build_press(base, ratio, merge=name, **SHORT_PROMPT_OPTIONS.get(name, {}), **options)


def merger_over(name, base_press, **options):
    """A merger by name over a kvpress press object (the catalog builds bases by name only)."""
    return MERGERS[name](press=base_press, **SHORT_PROMPT_OPTIONS.get(name, {}), **options)


def exact_merger_over(name, base_press):
    """``merger_over``, with GRKV's regression target recomputed: a merger inside a kvpress wrapper runs without its
    own context manager, so GRKV cannot take the target from the forward there (``target_from_forward``)."""
    return merger_over(name, base_press, **({"target_from_forward": False} if name == "grkv" else {}))


def token_ids(vocab_size, length=CONTEXT, batch=1, seed=0):
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def prefill_and_module_state(model, ids, press, name):
    """The cache ``press`` leaves, and what it left on each attention module under ``name``."""
    cache = prefill(model, ids, press)
    state = [getattr(module, name, None) for module in attention_modules(model)]
    for module in attention_modules(model):
        setattr(module, name, None)  # NOTE: the shared tiny model must not carry a press's state to the next test
    return cache, state


def kept_positions_by_eviction(model, ids, base_press):
    """Per layer, the positions kvpress's own eviction keeps, increasing (rows recovered from the full cache)."""
    full, evicted = prefill(model, ids), prefill(model, ids, base_press)
    return [recover_kept_positions(e.keys, f.keys).sort(dim=-1).values for e, f in zip(evicted.layers, full.layers)]


def question_logits(model, cache, question_ids):
    """(1, vocab) logits after ``question_ids`` over ``cache``, which is left as it was."""
    lengths = cache_lengths(cache)
    try:
        return append_question(model, cache, question_ids, CONTEXT)
    finally:
        crop_cache(cache, lengths)


def assert_same_caches(actual, expected):
    for layer_actual, layer_expected in zip(actual.layers, expected.layers):
        torch.testing.assert_close(layer_actual.keys, layer_expected.keys, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(layer_actual.values, layer_expected.values, rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------------------------ pipeline and generate


@pytest.mark.parametrize("name", MERGER_NAMES)
def test_the_kvpress_pipeline_answers_as_the_library_decodes(name):
    loaded = tiny_model("tiny-llama")
    pipe = pipeline("kv-press-text-generation", model=loaded.model, tokenizer=loaded.tokenizer)
    context, question = "The quick brown fox jumps over the lazy dog. " * 4, "What does the fox jump over?"
    press = merger(name)
    answer = pipe(context, question=question, press=press, max_new_tokens=8)["answer"]

    inputs = pipe.preprocess(context, questions=[question], answer_prefix="", max_context_length=10**6)
    context_ids, question_ids = inputs["context_ids"], inputs["questions_ids"][0]
    cache = prefill(loaded.model, context_ids, press)
    assert cache_lengths(cache) == [compute_n_kept(context_ids.shape[1], RATIO)] * loaded.num_layers
    tokens = answer_question(
        loaded.model,
        cache,
        question_ids,
        context_ids.shape[1],
        max_new_tokens=8,
        stop_token_ids={loaded.tokenizer.eos_token_id},
    ).token_ids
    assert answer == loaded.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("name", MERGER_NAMES)
def test_model_generate_decodes_over_the_merged_prompt_cache(name):
    model = tiny_model("tiny-llama").model
    ids = token_ids(model.config.vocab_size)
    press = merger(name)
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        generated = model.generate(ids, past_key_values=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape == (1, CONTEXT + 4)
    budget = compute_n_kept(CONTEXT, RATIO)
    assert cache_lengths(cache) == [budget + 3] * len(cache.layers), "the prompt compressed, 3 decoded tokens appended"
    merged = prefill(model, ids, press)
    for layer_generated, layer_merged in zip(cache.layers, merged.layers):
        torch.testing.assert_close(layer_generated.keys[:, :, :budget], layer_merged.keys)
        torch.testing.assert_close(layer_generated.values[:, :, :budget], layer_merged.values)


# ------------------------------------------------------------------------------------------------ wrappers


@pytest.mark.parametrize("name", OUR_MERGERS)
def test_per_layer_ratios_are_honoured_by_the_merger(name):
    model = tiny_model("tiny-llama").model
    ids = token_ids(model.config.vocab_size, seed=1)
    ratios = [0.5, 0.75]
    press = merger_over(name, PerLayerCompressionPress(press=build_press("snapkv", 0.0), compression_ratios=ratios))
    cache, kept = prefill_and_module_state(model, ids, press, "kept_positions")
    assert cache_lengths(cache) == [compute_n_kept(CONTEXT, ratio) for ratio in ratios]
    evicted = kept_positions_by_eviction(
        model, ids, PerLayerCompressionPress(press=build_press("snapkv", 0.0), compression_ratios=ratios)
    )
    for layer_kept, layer_evicted in zip(kept, evicted):
        assert torch.equal(layer_kept, layer_evicted), "the merger keeps the tokens kvpress's wrapper keeps"


def test_a_layer_whose_ratio_is_zero_keeps_its_full_cache():
    model = tiny_model("tiny-llama").model
    ids = token_ids(model.config.vocab_size, seed=1)
    per_layer = PerLayerCompressionPress(press=build_press("snapkv", 0.0), compression_ratios=[0.0, 0.75])
    press = merger_over("grkv", per_layer)
    full, merged = prefill(model, ids), prefill(model, ids, press)
    assert torch.equal(merged.layers[0].keys, full.layers[0].keys)
    assert torch.equal(merged.layers[0].values, full.layers[0].values)
    assert cache_lengths(merged)[1] == compute_n_kept(CONTEXT, 0.75)


@pytest.mark.parametrize("name", OUR_MERGERS)
def test_chunk_press_keeps_the_tokens_kvpress_keeps(name):
    model = tiny_model("tiny-llama").model
    ids = token_ids(model.config.vocab_size, seed=2)
    chunked = lambda: ChunkPress(press=KnormPress(compression_ratio=0.5), chunk_length=48)  # noqa: E731
    cache, kept = prefill_and_module_state(model, ids, merger_over(name, chunked()), "kept_positions")
    # 160 = 3 chunks of 48 keeping 24 each + one of 16 keeping 8
    assert cache_lengths(cache) == [3 * 24 + 8] * len(cache.layers)
    for layer_kept, layer_evicted in zip(kept, kept_positions_by_eviction(model, ids, chunked())):
        assert torch.equal(layer_kept, layer_evicted)


@pytest.mark.parametrize("name", MERGER_NAMES)
def test_a_merger_first_in_kvpress_compositions_merges_as_alone(name):
    model = tiny_model("tiny-llama").model
    ids = token_ids(model.config.vocab_size, seed=3)
    alone = prefill(model, ids, exact_merger_over(name, build_press("snapkv", RATIO)))
    composed = prefill(model, ids, ComposedPress(presses=[exact_merger_over(name, build_press("snapkv", RATIO))]))
    assert_same_caches(composed, alone)
    prefill_decoding = PrefillDecodingPress(
        prefilling_press=exact_merger_over(name, build_press("snapkv", RATIO)),
        decoding_press=DecodingPress(base_press=KnormPress(), compression_interval=2, target_size=24),
    )
    assert_same_caches(prefill(model, ids, prefill_decoding), alone)
    then_knorm = ComposedPress(presses=[exact_merger_over(name, build_press("snapkv", RATIO)), KnormPress(0.5)])
    assert cache_lengths(prefill(model, ids, then_knorm)) == [compute_n_kept(compute_n_kept(CONTEXT, RATIO), 0.5)] * 2


@pytest.mark.parametrize("name", OUR_MERGERS)
@pytest.mark.parametrize(
    "base,reason",
    [
        (lambda: DecodingPress(base_press=KnormPress()), "compresses while decoding"),
        (lambda: PrefillDecodingPress(prefilling_press=KnormPress(0.5)), "compose the other way round"),
        (lambda: KeyRerotationPress(press=KnormPress(0.5)), "moves the kept keys to new positions"),
        (lambda: ComposedPress(presses=[KnormPress(0.5)]), r"put the merger first inside it"),
        (lambda: ChunkKVPress(press=KnormPress(0.5)), "ChunkPress is supported"),
        (lambda: ThinKPress(key_channel_compression_ratio=0.5), "token selection as data"),
        (lambda: build_press("snapkv", RATIO, merge="cam"), "a merger selects none"),
    ],
    ids=["decoding", "prefill_decoding", "key_rerotation", "composed", "chunkkv", "think", "merger"],
)
def test_unsupported_base_presses_are_refused_with_the_reason(name, base, reason):
    with pytest.raises(ValueError, match=f"press must be .*{reason}"):
        MERGERS[name](press=base())


@pytest.mark.parametrize("ratios", [[0.5, 0.5], [0.5, 0.75], [0.0, 0.9]])
@pytest.mark.parametrize("name", OUR_MERGERS)
def test_per_layer_compression_press_around_a_merger_merges_to_each_layers_budget(name, ratios):
    """This package's PerLayerCompressionPress (kvpress's, around a merger too) sets the merger's ratio (its base
    press's) layer by layer and runs the merger's own hook: the cache of the other spelling, kvpress's wrapper inside
    the merger, up to float rounding."""
    model = tiny_model("tiny-llama").model
    ids = token_ids(model.config.vocab_size, seed=1)
    around = presses.PerLayerCompressionPress(
        exact_merger_over(name, SnapKVPress(compression_ratio=0.5)), compression_ratios=ratios
    )
    cache = prefill(model, ids, around)
    assert cache_lengths(cache) == [compute_n_kept(CONTEXT, ratio) for ratio in ratios]
    assert around.press.compression_ratio == 0.5, "the wrapper puts the merger's own ratio back"
    inside = exact_merger_over(name, PerLayerCompressionPress(press=SnapKVPress(), compression_ratios=ratios))
    assert_same_caches(cache, prefill(model, ids, inside))
    evicted = prefill(model, ids, PerLayerCompressionPress(press=SnapKVPress(), compression_ratios=ratios))
    assert not torch.equal(cache.layers[1].values.sort(dim=2).values, evicted.layers[1].values.sort(dim=2).values)


@pytest.mark.parametrize("name", OUR_MERGERS)
def test_a_layer_given_ratio_one_keeps_no_token_as_kvpress_does(name):
    """kvpress keeps no token of a layer whose ratio is 1 (``compute_n_kept``); a merger has nothing to merge into
    there and leaves the layer empty too, under either spelling. A question is still answered over such a cache."""
    model = tiny_model("tiny-llama").model
    ids = token_ids(model.config.vocab_size, seed=1)
    ratios = [1.0, 0.75]
    evicted = prefill(model, ids, PerLayerCompressionPress(press=SnapKVPress(), compression_ratios=ratios))
    around = presses.PerLayerCompressionPress(
        merger_over(name, SnapKVPress(compression_ratio=0.5)), compression_ratios=ratios
    )
    inside = merger_over(name, PerLayerCompressionPress(press=SnapKVPress(), compression_ratios=ratios))
    for press in (around, inside):
        cache = prefill(model, ids, press)
        assert cache_lengths(cache) == cache_lengths(evicted) == [0, compute_n_kept(CONTEXT, 0.75)]
        assert torch.isfinite(question_logits(model, cache, ids[:, :QUESTION])).all()


@pytest.mark.parametrize("value", [1.5, -0.5, "0.5"])
@pytest.mark.parametrize("name", OUR_MERGERS)
def test_a_base_ratio_outside_zero_one_is_refused_in_one_line(name, value):
    model = tiny_model("tiny-llama").model
    ids = token_ids(model.config.vocab_size, seed=1)
    press = merger(name)
    with pytest.raises(
        ValueError, match=r"^[A-Za-z0-9]+Press\.compression_ratio must be a number in \[0, 1\]"
    ) as error:
        press.compression_ratio = value
    assert "\n" not in str(error.value)
    press.press.compression_ratio = value  # set on the base press itself: refused when the merger compresses
    with pytest.raises(ValueError, match=r"^SnapKVPress\.compression_ratio must be a number in \[0, 1\]"):
        prefill(model, ids, press)


def test_a_merger_takes_its_budget_as_a_keyword_and_shares_it_with_its_base_press():
    base = SnapKVPress()
    press = MERGERS["grkv"](base, compression_ratio=0.6)
    assert press.compression_ratio == base.compression_ratio == 0.6
    press.compression_ratio = 0.25
    assert base.compression_ratio == 0.25
    assert "compression_ratio" not in repr(press).replace(repr(base), "")


# kvpress's wrappers that select tokens from the inner press's ``score`` (or call its ``compress`` while decoding),
# and the spelling the refusal names: the wrapper inside the merger where that works, else why it does not. Each
# asserts a ScorerPress when built (tests/test_kvpress_wrappers.py); built around one and handed a merger instead, as
# under ``python -O`` (no asserts), it meets the merger's own refusal.
SELECTING_WRAPPERS = [
    (lambda press: ChunkPress(press=press, chunk_length=48), "use {merger}(ChunkPress(...))"),
    (lambda press: AdaKVPress(press=press), "use {merger}(AdaKVPress(...))"),
    (lambda press: CriticalKVPress(press=press), "use {merger}(CriticalKVPress(...))"),
    (lambda press: CriticalAdaKVPress(press=press), "use {merger}(CriticalAdaKVPress(...))"),
    (lambda press: DMSPress(press=press, threshold=0.0, sliding_window_size=32), "{merger} cannot wrap it either"),
    (lambda press: BlockPress(press=press, block_size=32), "{merger} cannot wrap it either"),
    (lambda press: KeyRerotationPress(press=press), "moves the kept keys to new positions"),
    (lambda press: ChunkKVPress(press=press), "ChunkPress is supported"),
    (lambda press: KVPressMergingPress(press=press), "a merger cannot wrap another merger"),
]


@pytest.mark.parametrize(
    "wrapper,advice",
    SELECTING_WRAPPERS,
    ids=[
        "chunk",
        "adakv",
        "criticalkv",
        "criticaladakv",
        "dms",
        "block",
        "key_rerotation",
        "chunkkv",
        "kvpress_merging",
    ],
)
@pytest.mark.parametrize("name", OUR_MERGERS)
def test_kvpress_wrappers_past_their_assert_are_refused_in_one_line_on_entering_the_model(name, wrapper, advice):
    model = tiny_model("tiny-llama").model
    press = wrapper(SnapKVPress(compression_ratio=0.5))
    press.press = merger(name, ratio=0.5)
    merger_class, wrapper_class = type(press.press).__name__, type(press).__name__
    with pytest.raises(ValueError) as error:
        prefill(model, token_ids(model.config.vocab_size), press)
    message = str(error.value)
    assert message.startswith(f"{wrapper_class}({merger_class}(...)) would select tokens itself, without merging them;")
    assert advice.format(merger=merger_class) in message and "\n" not in message


@pytest.mark.parametrize("name", OUR_MERGERS)
def test_decoding_press_past_its_assert_is_refused_naming_merging_decoding_press(name):
    model = tiny_model("tiny-llama").model
    press = DecodingPress(base_press=KnormPress(), compression_interval=2, target_size=24)
    press.base_press = merger(name)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"DecodingPress({type(press.base_press).__name__}(...)) would compress the cache while decoding"
        )
        + ".*to merge while decoding use grkv_core.presses.MergingDecodingPress",
    ):
        with torch.inference_mode(), press(model):
            model.generate(
                token_ids(model.config.vocab_size),
                past_key_values=DynamicCache(),
                max_new_tokens=4,
                min_new_tokens=4,
                do_sample=False,
            )


# ------------------------------------------------------------------------------------------------- order


@pytest.mark.parametrize("name", OUR_MERGERS)
def test_merged_rows_come_in_position_order_and_attention_ignores_the_order(name):
    loaded = tiny_model("tiny-llama")
    model = loaded.model
    ids = token_ids(model.config.vocab_size, seed=4)
    full, evicted = prefill(model, ids), prefill(model, ids, build_press("snapkv", RATIO))
    merged, kept = prefill_and_module_state(model, ids, merger(name), "kept_positions")
    reordered = DynamicCache()
    for layer, (full_layer, evicted_layer, merged_layer, layer_kept) in enumerate(
        zip(full.layers, evicted.layers, merged.layers, kept)
    ):
        kvpress_order = recover_kept_positions(evicted_layer.keys, full_layer.keys)  # kvpress's top-k order
        assert torch.equal(layer_kept, kvpress_order.sort(dim=-1).values)
        assert not torch.equal(layer_kept, kvpress_order), "the orders differ, else this test shows nothing"
        rows = torch.searchsorted(layer_kept, kvpress_order)[..., None].expand_as(merged_layer.keys)
        reordered.update(merged_layer.keys.gather(2, rows), merged_layer.values.gather(2, rows), layer)
    question = ids[:, :QUESTION]
    torch.testing.assert_close(
        question_logits(model, reordered, question), question_logits(model, merged, question), rtol=1e-5, atol=1e-5
    )

    def answer(cache):
        return answer_question(model, cache, question, CONTEXT, max_new_tokens=8, stop_token_ids=set()).token_ids

    assert answer(reordered) == answer(merged)


def test_cam_keeps_kvpress_keys_once_rows_are_aligned_by_position():
    """The kvpress-style index-aligned check, after aligning rows by position: CaM leaves the kept keys as they are."""
    model = tiny_model("tiny-llama").model
    ids = token_ids(model.config.vocab_size, seed=4)
    full, evicted, merged = (
        prefill(model, ids, press)
        for press in (None, build_press("snapkv", RATIO), build_press("snapkv", RATIO, merge="cam"))
    )
    for full_layer, evicted_layer, merged_layer in zip(full.layers, evicted.layers, merged.layers):
        order = recover_kept_positions(evicted_layer.keys, full_layer.keys).argsort(dim=-1)
        aligned = lambda rows: rows.gather(2, order[..., None].expand_as(rows))  # noqa: E731
        assert torch.equal(merged_layer.keys, aligned(evicted_layer.keys))
        assert not torch.equal(merged_layer.values, aligned(evicted_layer.values))


# ---------------------------------------------------------------------- press properties, merger × base press


def assert_merging_keeps_the_base_budget_and_changes_the_cache(model, ids, name, base):
    """The merged cache has the eviction's lengths (or, per-head budgets, its masks), finite entries, and differs from
    what eviction alone leaves on every global layer; sliding-window layers are left whole by both."""
    full = prefill(model, ids)
    evicted, evicted_masks = prefill_and_module_state(model, ids, build_press(base, RATIO), "masked_key_indices")
    merged, merged_masks = prefill_and_module_state(model, ids, merger(name, base), "masked_key_indices")
    assert cache_lengths(merged) == cache_lengths(evicted)
    sliding = sliding_layer_indices(model)
    for index, (full_layer, evicted_layer, merged_layer, evicted_mask, merged_mask) in enumerate(
        zip(full.layers, evicted.layers, merged.layers, evicted_masks, merged_masks)
    ):
        if index in sliding:  # left whole by both (grkv_core.presses.sliding_layers)
            assert torch.equal(merged_layer.keys, full_layer.keys) and torch.equal(evicted_layer.keys, full_layer.keys)
            continue
        assert torch.isfinite(merged_layer.keys).all() and torch.isfinite(merged_layer.values).all()
        if base in NOT_EAGER:  # per-head budgets: the same entries masked, the kept ones merged in place
            assert all(torch.equal(e, m) for e, m in zip(evicted_mask, merged_mask))
            kept = torch.ones(merged_layer.keys.shape[:3], dtype=torch.bool)
            kept[merged_mask] = False
            assert torch.equal(merged_layer.values[~kept], full_layer.values[~kept])
            assert not torch.equal(merged_layer.values[kept], full_layer.values[kept])
            continue
        order = recover_kept_positions(evicted_layer.keys, full_layer.keys).argsort(dim=-1)[..., None]
        changed = [
            not torch.equal(merged_rows, evicted_rows.gather(2, order.expand_as(evicted_rows)))
            for merged_rows, evicted_rows in (
                (merged_layer.keys, evicted_layer.keys),
                (merged_layer.values, evicted_layer.values),
            )
        ]
        assert any(changed), "merging must change the cache eviction alone leaves"


@pytest.mark.parametrize("model_name,name,base", model_merger_base(PROPERTY_MODELS))
def test_merging_keeps_the_base_budget_and_changes_the_cache(model_name, name, base):
    model = tiny_model(model_name).model
    assert_merging_keeps_the_base_budget_and_changes_the_cache(
        model, token_ids(model.config.vocab_size, seed=5), name, base
    )


def heldout_question_set(model, ids, context_length):
    """Per layer: the queries of the tokens after the context, teacher-forced under the full cache, and the context's
    full keys and values. They are queries no merge saw: what a compressed context must serve next."""
    captured = {}

    def keep_queries(module, args, kwargs, output):
        captured[module.layer_idx] = surrogate_queries(
            module, kwargs["hidden_states"], kwargs["position_embeddings"], n_queries=ids.shape[1] - context_length
        ).queries

    handles = [
        attention.register_forward_hook(keep_queries, with_kwargs=True) for attention in attention_modules(model)
    ]
    try:
        cache = prefill(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    return [
        (captured[index], layer.keys[:, :, :context_length], layer.values[:, :, :context_length])
        for index, layer in enumerate(cache.layers)
    ]


def heldout_discrepancy(model, context_ids, press, heldout):
    """Σ‖Y_full − Y_comp‖² / Σ‖Y_full‖² of the held-out queries, over all layers and heads (masked rows unseen)."""
    cache, masks = prefill_and_module_state(model, context_ids, press, "masked_key_indices")
    error = reference = 0.0
    for module, (queries, keys, values), layer, masked in zip(attention_modules(model), heldout, cache.layers, masks):
        visible = None
        if masked is not None:
            visible = torch.ones(layer.keys.shape[:3], dtype=torch.bool)
            visible[masked] = False
        layer_error, layer_reference = discrepancy_per_head(
            queries, keys, values, layer.keys, layer.values, compressed_mask=visible, scale=module.scaling
        )
        error, reference = error + float(layer_error.sum()), reference + float(layer_reference.sum())
    return error / reference


# NOTE: measured on the tiny models (held-out error of a merger / of eviction, 7 base presses × 3 contexts × 3
# architectures): GRKV 0.03-0.72 and D2O (every token merged) 0.08-0.30, below eviction every time; AsymKV and
# KVMerger 0.08-1.14, below on most base presses but not all (averaging a gap into a neighbour can move a kept
# token away from what the queries need); CaM 2.9-14: it adds attention-scaled evicted values onto the kept ones
# without renormalising, which inflates the outputs where attention is spread out, as on random models. kvpress's
# BaseMergerPress (6 ScorerPress bases, tiny-llama): 0.27-0.33, below eviction every time.
BELOW_EVICTION = {
    "grkv": max,
    "d2o": max,
    "asymkv": statistics.median,
    "kvmerger": statistics.median,
    "cam": max,
    "kvpress_merging": max,
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=pytest.mark.xfail(
                strict=True,
                reason="CaM's additive value merge inflates attention "
                "outputs on spread-out attention (measured 2.9-14x eviction's error)",
            ),
        )
        if name == "cam"
        else name
        for name in MERGER_NAMES
    ],
)
def test_merging_preserves_more_than_eviction_on_held_out_queries(name):
    """The attention of the queries that follow the context, over the merged cache, is closer to the full cache's
    than over the evicted one: for every base press (GRKV, D2O) or most (AsymKV, KVMerger, ``BELOW_EVICTION``)."""
    model = tiny_model("tiny-llama").model
    ids = token_ids(model.config.vocab_size, length=CONTEXT + QUESTION, seed=6)
    heldout = heldout_question_set(model, ids, CONTEXT)
    context_ids = ids[:, :CONTEXT]
    bases = bases_of(name)
    ratios = [
        heldout_discrepancy(model, context_ids, merger(name, base), heldout)
        / heldout_discrepancy(model, context_ids, build_press(base, RATIO), heldout)
        for base in bases
    ]
    assert BELOW_EVICTION[name](ratios) < 1, dict(zip(bases, ratios))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", MERGER_NAMES)
@pytest.mark.parametrize("model_name", PROPERTY_MODELS)
def test_half_precision_merges_stay_finite(model_name, name, dtype):
    model = tiny_model(model_name, "sdpa", dtype).model
    ids = token_ids(model.config.vocab_size, seed=7)
    for base in bases_of(name, ["snapkv", "adakv"]):
        cache = prefill(model, ids, merger(name, base))
        try:
            for layer in cache.layers:
                assert layer.keys.dtype == layer.values.dtype == getattr(torch, dtype)
                assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
            # NOTE: one question token: kvpress's masking (AdaKV) can fail to mask several tokens on random weights
            assert torch.isfinite(question_logits(model, cache, ids[:, :1])).all()
        finally:
            for module in attention_modules(model):
                module.masked_key_indices = None


# kvpress 0.5.5's CriticalAdaKVPress masks other positions of a sequence in a batch of two than alone (its
# ``masked_key_indices`` differ; AdaKVPress's do not), and a merger behind it merges what it keeps.
BATCH_DEPENDENT_BASES = {
    "criticaladakv": "kvpress 0.5.5's CriticalAdaKVPress selects per sequence differently in a batch than alone"
}


def batch_independence_cases(models, bases):
    """``model_merger_base``'s cases, those over a batch-dependent base press a strict xfail."""
    cases = model_merger_base(models, bases)
    return [
        pytest.param(*case.values, marks=[*case.marks, pytest.mark.xfail(strict=True, reason=reason)])
        if (reason := BATCH_DEPENDENT_BASES.get(case.values[2]))
        else case
        for case in cases
    ]


# SnapKV: test_press, test_baselines
@pytest.mark.parametrize(
    "model_name,name,base", batch_independence_cases(PROPERTY_MODELS, sorted(set(BASE_PRESSES) - {"snapkv"}))
)
def test_batch_elements_are_merged_independently_over_every_base(model_name, name, base):
    model = tiny_model(model_name).model
    ids = token_ids(model.config.vocab_size, batch=2, seed=8)
    assert_batch_elements_compressed_independently(model, ids, merger(name, base))


# ------------------------------------------------------------------------- the press matrix on Gemma 3 270M


@functools.lru_cache(maxsize=None)
def real_prompt_ids(model_name, length=256):
    """(2, length) token ids of real text for ``model_name``: two stretches of one RULER prompt, rendered with the
    model's prompt template (BOS first)."""
    tokenizer = tiny_model(model_name).tokenizer
    sample = load_dataset_samples(
        "ruler", tasks=["niah_single_1"], context_length=3 * length, samples_per_task=1, tokenizer=tokenizer
    )[0]
    context_ids, _ = tokenize_sample(tokenizer, sample)
    return torch.cat([context_ids[:, :length], context_ids[:, length : 2 * length]])


@pytest.mark.slow
@needs_package(GEMMA3)
@pytest.mark.parametrize("model_name,name,base", batch_independence_cases([GEMMA3.name], BASE_PRESSES))
def test_on_gemma3_270m_merging_keeps_the_budget_changes_the_cache_and_merges_batch_elements_alone(
    model_name, name, base
):
    """The real model: 18 layers, 15 of them sliding-window (512 tokens), one KV head of dimension 256. Its sliding
    layers are left whole (kvpress 0.5.5 would compress them in a Gemma3ForCausalLM; grkv_core.presses.sliding_layers),
    and a merger compresses the 3 global layers its base press does."""
    model = tiny_model(model_name).model
    ids = real_prompt_ids(model_name)
    assert_merging_keeps_the_base_budget_and_changes_the_cache(model, ids, name, base)
    # NOTE: an 18-layer real model's batched and single forwards differ by float32 rounding (GRKV over SnapKV: one
    # key entry in 16384 off by 6e-4, of magnitude 1.4); a batch element leaking into the other would be O(1).
    assert_batch_elements_compressed_independently(model, ids, merger(name, base), tolerance=1e-3)


def test_kvpress_says_a_model_is_untested_once_per_process_not_at_every_press(caplog):
    model = tiny_model("tiny-gemma3").model
    ids = token_ids(model.config.vocab_size)
    with caplog.at_level("WARNING", logger="kvpress.presses.base_press"):
        for _ in range(3):
            prefill(model, ids, build_press("snapkv", RATIO))
    untested = [record for record in caplog.records if "not tested" in record.getMessage()]
    assert len(untested) <= 1, "the first entry may log it (unless an earlier test did), never the later ones"
