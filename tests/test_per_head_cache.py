"""The per-head cache (``grkv_core.cache``, ``PerHeadCachePress``): each head's kept rows only, the masked layout's
answers, real bytes, and one-line refusals."""

import math

import pytest
import torch
from conftest import TINY_ARCHITECTURES, tiny_model
from kvpress import AdaKVPress, CriticalAdaKVPress, DecodingPress, KnormPress, SnapKVPress
from transformers import DynamicCache, StaticCache

from grkv_core.cache.per_head import PerHeadLayer, PerHeadRows, kept_rows, stacked_rows
from grkv_core.cache.per_head_attention import per_head_attention, varlen_attention
from grkv_core.config import PressConfig
from grkv_core.evaluation.batched_decoding import answer_batch
from grkv_core.evaluation.generation import answer_question, crop_cache, prefill
from grkv_core.evaluation.shared_prefill import prefill_shared
from grkv_core.presses import GRKVPress
from grkv_core.presses.from_config import build, resolved
from grkv_core.presses.per_head_cache import PerHeadCachePress

RATIO = 0.9
STEPS = 32


def token_ids(vocab_size: int, length: int = 200, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def reference_attention(query, keys, values, kept, steps, scale):
    """float64 attention of ``query`` (B, H_q, q, D) over ``keys``/``values`` (B, H, L, D) where ``kept`` (B, H, L)
    marks the visible rows, the last ``steps`` rows being the queries' own (causal among them)."""
    batch, query_heads, _, dim = query.shape
    groups = query_heads // keys.shape[1]
    keys, values = keys.double().repeat_interleave(groups, 1), values.double().repeat_interleave(groups, 1)
    scores = query.double() @ keys.transpose(-1, -2) * scale
    length = keys.shape[2]
    causal = torch.arange(length) <= torch.arange(length - steps, length)[:, None]
    visible = kept.repeat_interleave(groups, 1)[:, :, None, :] & causal
    return (scores.masked_fill(~visible, -math.inf).softmax(-1) @ values).transpose(1, 2)


@pytest.mark.parametrize("steps", [1, 5])
@pytest.mark.parametrize("groups", [1, 3])
def test_attention_over_each_heads_rows_matches_a_float64_reference(steps, groups):
    generator = torch.Generator().manual_seed(steps * 10 + groups)
    batch, heads, length, dim = 2, 2, 40, 8
    keys, values = (torch.randn(batch, heads, length, dim, generator=generator) for _ in range(2))
    kept = torch.rand(batch, heads, length, generator=generator) < 0.4
    kept[..., length - steps :] = True  # the new tokens' rows, appended after the compression
    prefix = length - steps
    compressed = kept[..., :prefix]
    lengths = tuple(compressed.sum(-1).flatten().tolist())

    key_rows = PerHeadRows(keys[..., :prefix, :][compressed], lengths, keys[..., prefix:, :], length)
    value_rows = PerHeadRows(values[..., :prefix, :][compressed], lengths, values[..., prefix:, :], length)
    query = torch.randn(batch, heads * groups, steps, dim, generator=generator)
    output, _ = per_head_attention(torch.nn.Module(), query, key_rows, value_rows, None, scaling=dim**-0.5)
    expected = reference_attention(query, keys, values, kept, steps, dim**-0.5)
    torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-6)


def flash_varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """flash-attn's ``flash_attn_varlen_func`` as documented (GQA heads, causal mask aligned to each sequence's end),
    in float64 on the CPU."""
    assert causal and q.shape[1] % k.shape[1] == 0
    output = torch.empty(q.shape, dtype=torch.float64)
    for start_q, stop_q, start_k, stop_k in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        queries, keys, values = q[start_q:stop_q].double(), k[start_k:stop_k].double(), v[start_k:stop_k].double()
        assert stop_q - start_q <= max_q and stop_k - start_k <= max_k
        repeat = q.shape[1] // k.shape[1]
        keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * softmax_scale
        steps, length = scores.shape[1:]
        visible = torch.arange(length) <= torch.arange(steps)[:, None] + length - steps
        weights = scores.masked_fill(~visible, -math.inf).softmax(-1)
        output[start_q:stop_q] = torch.einsum("hqk,khd->qhd", weights, values)
    return output


@pytest.mark.parametrize("steps", [1, 4])
def test_the_variable_length_kernels_packing_gives_the_reference_paths_attention(steps):
    """What flash-attn receives (sequences per batch row and KV head, GQA heads, offsets), checked through a float64
    implementation of its documented semantics (flash-attn itself runs on CUDA only)."""
    generator = torch.Generator().manual_seed(steps)
    batch, heads, groups, length, dim = 2, 3, 2, 30, 8
    keys, values = (torch.randn(batch, heads, length, dim, generator=generator) for _ in range(2))
    masked = torch.nonzero(torch.rand(batch, heads, length, generator=generator) < 0.6, as_tuple=True)
    layer = PerHeadLayer.from_masked(keys, values, masked)
    layer.update(*(torch.randn(batch, heads, steps, dim, generator=generator) for _ in range(2)))
    query = torch.randn(batch, heads * groups, steps, dim, generator=generator)
    packed = varlen_attention(query, layer.keys, layer.values, dim**-0.5, flash_varlen_reference)
    reference, _ = per_head_attention(torch.nn.Module(), query, layer.keys, layer.values, None, scaling=dim**-0.5)
    torch.testing.assert_close(packed, reference.double(), rtol=1e-5, atol=1e-6)


def test_rows_report_the_length_they_came_from_and_crop_only_what_was_appended():
    keys = torch.randn(1, 2, 10, 4)
    masked = (torch.tensor([0, 0, 0]), torch.tensor([0, 0, 1]), torch.tensor([1, 2, 7]))
    layer = PerHeadLayer.from_masked(keys, keys, masked)
    assert layer.keys.lengths == (8, 9) and layer.get_seq_length() == 10
    assert layer.keys.nbytes == 17 * 4 * 4
    layer.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    assert layer.get_seq_length() == 13 and layer.keys.shape == (1, 2, 13, 4)
    cropped = layer.keys[:, :, :11]
    assert cropped.tail.shape[-2] == 1 and cropped.length == 11 and cropped.lengths == (8, 9)
    assert layer.keys[..., :11, :].tail.shape == cropped.tail.shape
    with pytest.raises(ValueError, match="can drop only the 3 rows appended since"):
        layer.keys[:, :, :9]
    with pytest.raises(ValueError, match="sliced only along its length"):
        layer.keys[0]
    with pytest.raises(ValueError, match="beam search"):
        layer.reorder_cache(torch.tensor([0]))
    kept = kept_rows(keys, masked)
    dense = PerHeadLayer.from_masked(keys, keys, masked).keys.dense(kept)
    assert torch.equal(dense[kept], keys[kept]) and not dense[~kept].any()


def test_stacked_rows_keep_each_batch_rows_heads_in_order():
    first = PerHeadLayer.from_masked(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), None).keys
    second = PerHeadLayer.from_masked(
        torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), (torch.tensor([0]), torch.tensor([1]), torch.tensor([2]))
    ).keys
    stacked = stacked_rows([first, second])
    assert stacked.lengths == (6, 6, 6, 5) and stacked.tail.shape[0] == 2
    assert all(torch.equal(a, b) for a, b in zip(stacked.heads(), first.heads() + second.heads()))


HEAD_ADAPTIVE = {
    "adakv": lambda: AdaKVPress(SnapKVPress(compression_ratio=RATIO)),
    "criticaladakv": lambda: CriticalAdaKVPress(SnapKVPress(compression_ratio=RATIO)),
    "adakv+grkv": lambda: GRKVPress(press=AdaKVPress(SnapKVPress(compression_ratio=RATIO)), window_size=16),
    "snapkv": lambda: SnapKVPress(compression_ratio=RATIO),
    "knorm+grkv": lambda: GRKVPress(press=KnormPress(compression_ratio=RATIO), window_size=16),
}


def decode(model, press, ids, steps=STEPS):
    """The cache ``press`` leaves, then ``steps`` greedy tokens over it: (logits per step, token ids, cache)."""
    cache = prefill(model, ids, press)
    logits, tokens = [], []
    next_token = ids[:, -1:]
    with torch.inference_mode():
        for step in range(steps):
            position = torch.tensor([[ids.shape[1] + step]])
            out = model(input_ids=next_token, past_key_values=cache, position_ids=position).logits[:, -1]
            logits.append(out[0])
            next_token = out.argmax(-1, keepdim=True)
            tokens.append(int(next_token))
    return torch.stack(logits), tokens, cache


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
@pytest.mark.parametrize("press_name", HEAD_ADAPTIVE)
def test_the_per_head_layout_decodes_as_the_masked_one(architecture, press_name):
    """32 decoded tokens: logits within 1e-5 at every step, the same ids, with each head's kept rows only."""
    model = tiny_model(architecture).model
    ids = token_ids(model.config.vocab_size)
    masked_logits, masked_tokens, _ = decode(model, HEAD_ADAPTIVE[press_name](), ids)
    logits, tokens, cache = decode(model, PerHeadCachePress(HEAD_ADAPTIVE[press_name]()), ids)
    torch.testing.assert_close(logits, masked_logits, rtol=1e-5, atol=1e-5)
    assert tokens == masked_tokens
    per_head = [layer for layer in cache.layers if isinstance(layer, PerHeadLayer)]
    assert per_head, "no layer was converted"
    heads, dim = model.config.num_key_value_heads, per_head[0].keys.prefix.shape[-1]
    held = sum(layer.keys.prefix.nbytes + layer.values.prefix.nbytes for layer in per_head)
    assert held <= 0.12 * len(per_head) * 2 * heads * ids.shape[1] * dim * 4


def test_in_float64_the_layouts_agree_to_float64_precision():
    """A float64 model (``--dtype float64``, the numerical reference) attends over a per-head cache in float64."""
    model = tiny_model(dtype="float64").model
    ids = token_ids(model.config.vocab_size)
    masked_logits, masked_tokens, _ = decode(model, HEAD_ADAPTIVE["adakv+grkv"](), ids, steps=8)
    logits, tokens, cache = decode(model, PerHeadCachePress(HEAD_ADAPTIVE["adakv+grkv"]()), ids, steps=8)
    assert logits.dtype == torch.float64 and tokens == masked_tokens
    torch.testing.assert_close(logits, masked_logits, rtol=1e-12, atol=1e-12)


def test_model_generate_with_the_press_gives_the_masked_layouts_tokens():
    model = tiny_model().model
    ids = token_ids(model.config.vocab_size)

    def generate(press):
        with press(model):
            out = model.generate(
                ids, max_new_tokens=STEPS, do_sample=False, output_scores=True, return_dict_in_generate=True
            )
        return out.sequences[0, ids.shape[1] :].tolist(), torch.stack(out.scores)

    masked_tokens, masked_scores = generate(HEAD_ADAPTIVE["adakv+grkv"]())
    tokens, scores = generate(PerHeadCachePress(HEAD_ADAPTIVE["adakv+grkv"]()))
    assert tokens == masked_tokens
    torch.testing.assert_close(scores, masked_scores, rtol=1e-5, atol=1e-5)


def test_answers_leave_the_cache_as_it_was_and_batch_as_alone():
    """The evaluator's path: a question answered and cropped away (twice the same answer), and two per-head caches
    decoded as one batch give each one's own answer."""
    model = tiny_model().model
    ids = token_ids(model.config.vocab_size)
    question = token_ids(model.config.vocab_size, 6, seed=1)
    presses = [PerHeadCachePress(HEAD_ADAPTIVE["adakv"]()), PerHeadCachePress(HEAD_ADAPTIVE["adakv+grkv"]())]
    shared = prefill_shared(model, ids, presses)
    assert shared.forwards == 1 and all(cache.per_head for cache in shared.pressed)
    alone = [answer_question(model, cache.cache, question, ids.shape[1], 8, set()) for cache in shared.pressed]
    again = [answer_question(model, cache.cache, question, ids.shape[1], 8, set()) for cache in shared.pressed]
    batched = answer_batch(model, shared.pressed, question, ids.shape[1], 8, set())
    assert [a.token_ids for a in alone] == [a.token_ids for a in again] == [a.token_ids for a in batched]
    hooked = prefill(model, ids, PerHeadCachePress(HEAD_ADAPTIVE["adakv"]()))
    for layer, shared_layer in zip(hooked.layers, shared.pressed[0].cache.layers):
        assert layer.keys.lengths == shared_layer.keys.lengths
        torch.testing.assert_close(layer.keys.prefix, shared_layer.keys.prefix)
    lengths = [layer.keys.shape[2] for layer in hooked.layers]
    crop_cache(hooked, lengths)  # what the evaluator does after an answer: nothing appended, nothing dropped
    assert [layer.keys.shape[2] for layer in hooked.layers] == lengths


def test_configuration_builds_and_names_the_per_head_layout():
    config = PressConfig("adakv", RATIO, "grkv", per_head_cache=True)
    press = build(config)
    assert isinstance(press, PerHeadCachePress) and isinstance(press.press, GRKVPress)
    assert config.label == "adakv 10% + grkv (per-head)"
    assert config.canonical()["per_head_cache"] is True
    assert "per_head_cache" not in PressConfig("adakv", RATIO).canonical()
    settings = resolved(config)
    assert settings["per_head_cache"] is True and settings["press.class"] == "AdaKVPress"
    for bad, message in [
        (dict(press="full", compression_ratio=0.0), "takes no merger"),
        (dict(press="h2o"), "needs eager attention"),
        (dict(press="snapkv", decoding={"target_size": 64}), "holds each head's own rows under press 'adakv'"),
        (dict(press="snapkv", per_head_cache="yes"), "per_head_cache"),
    ]:
        with pytest.raises(ValueError, match=message):
            PressConfig(**{**dict(per_head_cache=True), **bad})


def test_refusals_are_one_line_before_any_layer_runs():
    model = tiny_model().model
    ids = token_ids(model.config.vocab_size)
    with pytest.raises(ValueError, match="kvpress's DecodingPress keeps one count of rows in every head"):
        PerHeadCachePress(DecodingPress(SnapKVPress(compression_ratio=RATIO)))
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        prefill(tiny_model(attn_implementation="eager").model, ids, PerHeadCachePress(SnapKVPress(RATIO)))
    padded = torch.cat([ids, ids])
    mask = torch.ones_like(padded)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="per-head cache does not support padded batches"):
        with PerHeadCachePress(AdaKVPress(SnapKVPress(compression_ratio=RATIO)))(model), torch.inference_mode():
            model.model(input_ids=padded, attention_mask=mask, past_key_values=DynamicCache())
    with pytest.raises(ValueError, match="this cache's layer 0 is a"):
        with PerHeadCachePress(SnapKVPress(compression_ratio=RATIO))(model), torch.inference_mode():
            cache = StaticCache(config=model.config, max_cache_len=256)
            model.model(input_ids=ids, past_key_values=cache)
