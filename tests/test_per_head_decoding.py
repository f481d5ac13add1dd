"""A per-head cache bounded while decoding (``grkv_core.presses.per_head_decoding``): each head scored as if alone,
kept as the press keeps (AdaKV's budgets moving between heads), the uniform case decoding as the uniform cache."""

import copy

import pytest
import torch
from conftest import tiny_model
from kvpress import (
    AdaKVPress,
    CriticalAdaKVPress,
    KnormPress,
    PrefillDecodingPress,
    SnapKVPress,
    StreamingLLMPress,
)

from grkv_core.cache.per_head import PerHeadLayer, PerHeadRows, kept_rows
from grkv_core.config import PressConfig, StreamConfig
from grkv_core.evaluation.stream_eval import run_stream_evaluations
from grkv_core.evaluation.streaming import stream_text
from grkv_core.presses import GRKVPress, MergingDecodingPress
from grkv_core.presses.per_head_cache import PerHeadCachePress
from grkv_core.presses.per_head_decoding import compress_per_head_layer, kept_per_head, per_head_scores

TARGET, INTERVAL, BUFFER = 48, 16, 32


def ragged_rows(lengths, tail_rows=20, dim=16, kv_heads=2, seed=0, dtype=torch.float32) -> PerHeadRows:
    generator = torch.Generator().manual_seed(seed)
    batch = len(lengths) // kv_heads
    return PerHeadRows(
        prefix=torch.randn(sum(lengths), dim, generator=generator, dtype=dtype),
        lengths=tuple(lengths),
        tail=torch.randn(batch, kv_heads, tail_rows, dim, generator=generator, dtype=dtype),
        length=max(lengths) + tail_rows,
    )


def bounded(base, target=TARGET) -> MergingDecodingPress:
    return MergingDecodingPress(
        base, target_size=target, compression_interval=INTERVAL, hidden_states_buffer_size=BUFFER
    )


def test_right_aligned_rows_end_every_head_together_and_give_the_same_rows_back():
    rows = ragged_rows([30, 7, 12, 30])
    dense, real = rows.right_aligned()
    assert dense.shape == (2, 2, 50, 16)
    tails = rows.tail.reshape(4, 20, 16)
    for head, (own, tail) in enumerate(zip(rows.heads(), tails)):
        batch, kv_head = divmod(head, 2)
        count = own.shape[0] + 20
        assert real[batch, kv_head].sum() == count and real[batch, kv_head, -count:].all()
        torch.testing.assert_close(dense[batch, kv_head, -count:], torch.cat([own, tail]), rtol=0, atol=0)
        assert not dense[batch, kv_head, :-count].any()
    again = PerHeadLayer.from_kept(dense, dense, real, tuple(n + 20 for n in rows.lengths)).keys
    torch.testing.assert_close(again.prefix, torch.cat([t for o, e in zip(rows.heads(), tails) for t in (o, e)]))


def attention_module():
    """Layer 0's attention of a tiny model in float64, and hidden states for a window of recent tokens."""
    model = tiny_model().model
    module = model.model.layers[0].self_attn
    hidden = torch.randn(1, BUFFER, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(100, 100 + BUFFER)[None]
    embeddings = model.model.rotary_emb(hidden, positions)
    return module, hidden, embeddings


def test_snapkv_scores_each_heads_own_rows_as_kvpress_scores_them_alone():
    """Against kvpress's own SnapKV in float64 on a cache where every KV head holds head h's rows only."""
    module, hidden, embeddings = attention_module()
    module64 = copy.deepcopy(module).double()
    embeddings64 = {"position_embeddings": tuple(table.double() for table in embeddings)}
    press = SnapKVPress(window_size=8)
    rows = ragged_rows([40, 9], tail_rows=INTERVAL, kv_heads=2, dtype=torch.float32)
    keys, real = rows.right_aligned()
    kwargs = {"position_embeddings": embeddings}
    scores = per_head_scores(press, module, hidden, keys, keys, real, kwargs)
    assert torch.isinf(scores[~real]).all() and (scores[~real] < 0).all()
    tails = rows.tail.reshape(2, INTERVAL, 16)
    for head, (own, tail) in enumerate(zip(rows.heads(), tails)):
        alone = torch.cat([own, tail])[None, None].expand(1, 2, -1, -1).double()
        with torch.no_grad():
            reference = press.score(module64, hidden.double(), alone, alone, None, embeddings64)[0, head]
        count = alone.shape[2]
        mine = scores[0, head, -count:]
        torch.testing.assert_close(mine[:-8].double(), reference[:-8], rtol=1e-5, atol=1e-7)
        assert (mine[-8:] > mine[:-8].max()).all()  # the window is kept, as kvpress keeps it


def test_streamingllm_keeps_each_heads_own_first_rows_and_its_most_recent():
    rows = ragged_rows([40, 9, 25, 60])
    layer = PerHeadLayer(rows, rows)
    target = 30
    module, hidden, embeddings = attention_module()
    kept = compress_per_head_layer(
        StreamingLLMPress(n_sink=4), module, layer, hidden, {"position_embeddings": embeddings}, target
    )
    assert kept.keys.lengths == (30, 29, 30, 30) and kept.keys.length == 30
    tails = rows.tail.reshape(4, 20, 16)
    for own, tail, mine in zip(rows.heads(), tails, kept.keys.heads()):
        every = torch.cat([own, tail])
        expected = every if len(every) <= target else torch.cat([every[:4], every[-(target - 4) :]])
        torch.testing.assert_close(mine, expected, rtol=0, atol=0)


def reference_kept(press, scores: torch.Tensor, target: int) -> torch.Tensor:
    """The kept rows by the rule, in plain Python over float64 scores (−inf: padding)."""
    kept = torch.zeros(scores.shape, dtype=torch.bool)
    batch, heads, length = scores.shape
    for b in range(batch):
        rows = [(float(scores[b, h, j]), h, j) for h in range(heads) for j in range(length)]
        rows = [row for row in rows if row[0] > float("-inf")]
        if not isinstance(press, AdaKVPress):
            for h in range(heads):
                for _, _, j in sorted((r for r in rows if r[1] == h), reverse=True)[:target]:
                    kept[b, h, j] = True
            continue
        safe = max(1, int(target * press.alpha_safeguard))
        chosen = {
            (h, j) for h in range(heads) for _, _, j in sorted((r for r in rows if r[1] == h), reverse=True)[:safe]
        }
        for _, h, j in sorted((r for r in rows if (r[1], r[2]) not in chosen), reverse=True):
            if len(chosen) >= heads * target:
                break
            chosen.add((h, j))
        for h, j in chosen:
            kept[b, h, j] = True
    return kept


@pytest.mark.parametrize("press", [KnormPress(), AdaKVPress(KnormPress()), AdaKVPress(KnormPress(), 0.5)])
def test_the_kept_rows_follow_the_rule_on_ragged_heads(press):
    scores = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    real = torch.arange(50) >= torch.tensor([[0, 35, 20], [44, 0, 10]])[..., None]
    scores = scores.masked_fill(~real, float("-inf"))
    for target in (5, 12, 30):
        torch.testing.assert_close(kept_per_head(press, scores.float(), target), reference_kept(press, scores, target))


def test_adakv_keeps_what_kvpress_adakv_masks_when_every_head_holds_every_row():
    module, hidden, embeddings = attention_module()
    keys = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(4))
    target = 20
    press = AdaKVPress(KnormPress(compression_ratio=1 - (target + 0.5) / 64))
    press.compress(module, hidden, keys, keys, None, {})
    expected = kept_rows(keys, module.masked_key_indices)
    module.masked_key_indices = None
    real = torch.ones(1, 2, 64, dtype=torch.bool)
    scores = per_head_scores(press.press, module, hidden, keys, keys, real, {})
    assert torch.equal(kept_per_head(press, scores, target), expected)
    assert expected.sum(-1).tolist() != [[target, target]]  # the budget moved between heads


def per_head_sizes(cache) -> list[tuple[int, ...]]:
    return [
        tuple(n + layer.keys.tail.shape[2] for n in layer.keys.lengths)
        for layer in cache.layers
        if isinstance(layer, PerHeadLayer)
    ]


def generate_bounded(model, press, ids, new_tokens=64):
    """Greedy tokens and per-step logits, and each forward's per-head sizes (a hook on the decoder)."""
    sizes = []

    def record(module, args, kwargs, output):
        sizes.append(per_head_sizes(output.past_key_values))

    handle = model.model.register_forward_hook(record, with_kwargs=True)
    try:
        with press(model):
            out = model.generate(
                ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
    finally:
        handle.remove()
    return out.sequences[0, ids.shape[1] :].tolist(), torch.stack(out.scores), sizes


def prompt(model, length=200):
    return torch.randint(10, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "eviction",
    [lambda: SnapKVPress(window_size=8), lambda: KnormPress(), lambda: StreamingLLMPress(n_sink=4)],
    ids=["snapkv", "knorm", "streamingllm"],
)
def test_the_uniform_case_decodes_as_the_uniform_cache(eviction):
    model = tiny_model().model
    ids = prompt(model)
    uniform_tokens, uniform_logits, _ = generate_bounded(model, bounded(eviction()), ids)
    tokens, logits, sizes = generate_bounded(model, PerHeadCachePress(bounded(eviction())), ids)
    assert tokens == uniform_tokens
    torch.testing.assert_close(logits, uniform_logits, rtol=1e-5, atol=1e-5)
    assert max(max(max(layer) for layer in step) for step in sizes[1:]) <= TARGET + INTERVAL


def test_adaptive_prefill_then_adaptive_decoding_stays_bounded_with_budgets_moving_between_heads():
    model = tiny_model().model
    ids = prompt(model)
    heads = model.config.num_key_value_heads

    def press():
        return PerHeadCachePress(
            PrefillDecodingPress(
                prefilling_press=AdaKVPress(SnapKVPress(compression_ratio=0.8, window_size=8)),
                decoding_press=bounded(AdaKVPress(SnapKVPress(window_size=8))),
            )
        )

    tokens, logits, sizes = generate_bounded(model, press(), ids)
    for step in sizes:
        assert all(sum(layer) <= heads * (TARGET + INTERVAL) for layer in step)
    assert any(len(set(layer)) > 1 for layer in sizes[-1]), "every head holds the same count"
    full_tokens, full_logits, _ = generate_bounded(model, PerHeadCachePress(AdaKVPress(SnapKVPress(0.8, 8))), ids)
    assert not torch.allclose(logits, full_logits), "the decoding press changed nothing"
    again_tokens, again_logits, _ = generate_bounded(model, (used := press()), ids)
    assert again_tokens == tokens and torch.equal(again_logits, logits)
    assert (generate_bounded(model, used, ids)[0]) == tokens  # the same press object twice


def test_adakv_as_the_decoding_press_makes_the_cache_per_head_itself():
    model = tiny_model().model
    ids = prompt(model)
    _, _, sizes = generate_bounded(model, bounded(AdaKVPress(KnormPress())), ids, new_tokens=40)
    heads = model.config.num_key_value_heads
    assert len(sizes[0]) == model.config.num_hidden_layers  # the prompt was compressed at its end, per head
    assert all(sum(layer) <= heads * (TARGET + INTERVAL) for step in sizes for layer in step)


def test_refusals_are_one_line_before_any_layer_runs():
    for press, message in [
        (lambda: PerHeadCachePress(bounded(GRKVPress(SnapKVPress(window_size=8), window_size=16))), "eviction only"),
        (lambda: bounded(GRKVPress(AdaKVPress(SnapKVPress(window_size=8)), window_size=16)), "eviction only"),
        (lambda: bounded(CriticalAdaKVPress(SnapKVPress(window_size=8))), "got CriticalAdaKVPress"),
    ]:
        with pytest.raises(ValueError, match=message) as raised:
            press()
        assert "\n" not in str(raised.value)
    eager = tiny_model(attn_implementation="eager").model
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        generate_bounded(eager, bounded(AdaKVPress(KnormPress())), prompt(eager), new_tokens=2)


def test_a_stream_bounded_by_adakv_holds_each_heads_rows_and_reports_their_real_bytes():
    model = tiny_model().model
    ids = prompt(model, 300)
    heads = model.config.num_key_value_heads
    streamed = stream_text(model, ids, bounded(AdaKVPress(SnapKVPress(window_size=8))))
    uniform = stream_text(model, ids, bounded(SnapKVPress(window_size=8)))
    assert torch.isfinite(streamed.token_nll).all() and streamed.token_nll.shape == uniform.token_nll.shape
    assert streamed.kept_positions == {} and uniform.kept_positions
    layers = streamed.cache.layers
    assert all(isinstance(layer, PerHeadLayer) for layer in layers)
    assert len({n for layer in layers for n in layer.keys.lengths}) > 1
    rows = sum(sum(layer.keys.lengths) + heads * layer.keys.tail.shape[2] for layer in layers)
    assert rows <= len(layers) * heads * (TARGET + INTERVAL)
    dim = layers[0].keys.prefix.shape[-1]
    assert sum(layer.keys.nbytes + layer.values.nbytes for layer in layers) == rows * 2 * dim * 4


def test_a_stream_refuses_a_merger_behind_adakv_before_loading_the_model(tmp_path):
    config = StreamConfig(
        protocol="stream_nll",
        press=PressConfig("adakv", 0.0, "grkv"),
        target_size=256,
        compression_interval=128,
        model="no-such-model",
    )
    with pytest.raises(ValueError, match=r"eviction only \(GRKVPress merges into a uniform cache\)"):
        run_stream_evaluations([config], [tmp_path / "adakv.jsonl"], progress=False)
