"""The trial engine: one prefill for many presses, batched greedy decoding, screening without decoding.

Every fast path is compared with the plain one-press-at-a-time path (``generation.prefill`` and
``generation.answer_question``, which is kvpress's protocol) for every eviction press and merger in the catalog.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace

import pytest
import torch
from conftest import mergers_over, tiny_model
from kvpress import SnapKVPress
from transformers import DynamicCache

from grkv_core.catalog import EVICTION_PRESSES
from grkv_core.config import PressConfig
from grkv_core.datasets import load_dataset_samples
from grkv_core.evaluation.batched_decoding import answer_batch
from grkv_core.evaluation.evaluator import Evaluator
from grkv_core.evaluation.generation import answer_question, append_question, prefill, stop_token_ids, tokenize_sample
from grkv_core.evaluation.results import summarize
from grkv_core.evaluation.shared_prefill import prefill_shared, shares_prefill
from grkv_core.presses.from_config import build, required_attention

RATIO = 0.75
MASKING = {"adakv", "criticaladakv"}


@pytest.fixture(scope="module")
def sample():
    tokenizer = tiny_model("tiny-llama").tokenizer
    return load_dataset_samples(
        "ruler", tasks=["niah_single_1"], context_length=768, samples_per_task=1, tokenizer=tokenizer
    )[0]


def configs_of(press: str) -> list[PressConfig]:
    """The full cache, the press alone, behind every merger, and behind GRKVs that differ in window, ridge, budget."""
    return [
        PressConfig("full", 0.0),
        *(PressConfig(press, RATIO, merge) for merge in mergers_over(press)),
        PressConfig(press, RATIO, "grkv", {"window_size": 16, "lambda_k": 1.0, "safeguard": False}),
        PressConfig(press, 0.5, "grkv", {"steps": 2}),
    ]


def model_for(press: str):
    return tiny_model("tiny-llama", attn_implementation=required_attention(press) or "sdpa")


@pytest.mark.parametrize("press", list(EVICTION_PRESSES))
def test_one_prefill_gives_every_press_the_cache_it_gives_alone(press, sample):
    loaded = model_for(press)
    context_ids, _ = tokenize_sample(loaded.tokenizer, sample)
    configs = configs_of(press)
    shared = prefill_shared(loaded.model, context_ids, [build(config) for config in configs])
    assert shared.forwards == 1
    for config, pressed in zip(configs, shared.pressed):
        alone_press = build(config)
        alone = prefill(loaded.model, context_ids, alone_press)
        for layer, (ours, theirs) in enumerate(zip(pressed.cache.layers, alone.layers)):
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values), (
                config.label,
                layer,
            )
            attention = loaded.model.model.layers[layer].self_attn
            for name, value in pressed.module_state[layer].items():
                expected = getattr(attention, name, None)
                if isinstance(value, tuple):
                    assert all(torch.equal(a, b) for a, b in zip(value, expected)), (config.label, name)
                else:
                    assert (value is None and expected is None) or torch.equal(value, expected), (config.label, name)
        for attention in (layer.self_attn for layer in loaded.model.model.layers):
            attention.masked_key_indices = attention.kept_positions = None
    full = shared.full
    for layer, (keys, values) in enumerate(full):
        assert keys.shape[2] == context_ids.shape[1]
        assert torch.equal(shared.pressed[0].cache.layers[layer].keys, keys)


@pytest.mark.parametrize("press", sorted(set(list(EVICTION_PRESSES)) - MASKING))
def test_batched_evaluation_predicts_and_measures_as_each_press_alone(press, sample):
    evaluator = Evaluator(model_for(press), heldout_tokens=4)
    configs = configs_of(press)
    together = evaluator.evaluate_trials(sample, configs)
    for config, ours in zip(configs, together):
        alone = evaluator.evaluate_sample(sample, config)
        assert ours.batch_trials == len(configs) and alone.batch_trials == 1
        assert (ours.predictions, ours.scores, ours.kv_bytes) == (alone.predictions, alone.scores, alone.kv_bytes)
        assert (ours.window_loss, ours.question_loss) == (alone.window_loss, alone.question_loss), config.label
        # NOTE: held-out queries come from the decoding's hidden states, which a batched matmul rounds
        # differently in the last float32 bit; every other field is exact.
        assert ours.heldout_loss == pytest.approx(alone.heldout_loss, rel=1e-5, abs=1e-9), config.label


@pytest.mark.parametrize("press", sorted(MASKING))
def test_masking_presses_decode_in_a_batch_with_their_own_masks(press, sample):
    # kvpress's fake key for masked entries must null every query of a row; on a random tiny model it exists for
    # a one-token question (the tiny model's multi-token questions have none, with or without batching).
    loaded = model_for(press)
    context_ids, _ = tokenize_sample(loaded.tokenizer, sample)
    question = torch.tensor([[loaded.tokenizer.encode(" the", add_special_tokens=False)[-1]]])
    configs = [
        PressConfig(press, RATIO),
        PressConfig(press, RATIO, "grkv"),
        PressConfig(press, 0.5, "cam"),
        PressConfig("full", 0.0),
    ]
    shared = prefill_shared(loaded.model, context_ids, [build(config) for config in configs])
    assert all(state["masked_key_indices"] is not None for state in shared.pressed[0].module_state)
    stops = stop_token_ids(loaded)
    answers = answer_batch(loaded.model, shared.pressed, question, context_ids.shape[1], 6, stops)
    for config, answer in zip(configs, answers):
        alone = prefill(loaded.model, context_ids, build(config))
        expected = answer_question(loaded.model, alone, question, context_ids.shape[1], 6, stops)
        assert answer.token_ids == expected.token_ids, config.label


def test_a_press_that_changes_the_layer_output_is_prefilled_alone(sample):
    @dataclass
    class ScaledOutputPress(SnapKVPress):
        """Compresses like SnapKV and also scales the attention output: later layers would see it."""

        def forward_hook(self, module, input, kwargs, output):
            super().forward_hook(module, input, kwargs, output)
            return (output[0] * 0.5, *output[1:])

    loaded = tiny_model("tiny-llama")
    context_ids, _ = tokenize_sample(loaded.tokenizer, sample)
    odd = ScaledOutputPress(compression_ratio=RATIO)
    assert not shares_prefill(odd) and shares_prefill(SnapKVPress(compression_ratio=RATIO)) and shares_prefill(None)
    shared = prefill_shared(loaded.model, context_ids, [SnapKVPress(compression_ratio=RATIO), odd, None])
    assert shared.forwards == 2
    alone = prefill(loaded.model, context_ids, ScaledOutputPress(compression_ratio=RATIO))
    plain = prefill(loaded.model, context_ids, SnapKVPress(compression_ratio=RATIO))
    last = len(alone.layers) - 1
    assert torch.equal(shared.pressed[1].cache.layers[last].keys, alone.layers[last].keys)
    assert torch.equal(shared.pressed[0].cache.layers[last].keys, plain.layers[last].keys)
    assert not torch.equal(alone.layers[last].keys, plain.layers[last].keys)  # the odd press did change the forward


def test_an_empty_context_is_refused_in_one_line(sample):
    loaded = tiny_model("tiny-llama")
    empty = torch.zeros(1, 0, dtype=torch.long)
    presses = [None, build(PressConfig("snapkv", RATIO, "grkv"))]
    with pytest.raises(ValueError, match=r"^context_ids must be \(1, n\) with n >= 1 \(an empty context"):
        prefill_shared(loaded.model, empty, presses)
    with pytest.raises(ValueError, match=r"^context_ids must be \(batch, n\) with n >= 1 \(an empty context"):
        prefill(loaded.model, empty, presses[1])
    for config in (PressConfig("full", 0.0), PressConfig("snapkv", RATIO, "grkv")):
        with pytest.raises(ValueError, match=r"^sample '.*' \(niah_single_1\) has an empty context: nothing to "):
            Evaluator(loaded).evaluate_trials(replace(sample, context=" \n"), [config])


def test_screening_measures_losses_without_generating(sample):
    evaluator = Evaluator(tiny_model("tiny-llama"), heldout_tokens=4)
    configs = [PressConfig("snapkv", RATIO), PressConfig("snapkv", RATIO, "grkv")]
    screened = evaluator.evaluate_trials(sample, configs, decode=False)
    scored = evaluator.evaluate_trials(sample, configs)
    for fast, full in zip(screened, scored):
        assert fast.predictions == [] and fast.score is None and fast.heldout_loss is None
        assert fast.generated_tokens == 0 and fast.kv_bytes == full.kv_bytes
        assert (fast.window_loss, fast.question_loss) == (full.window_loss, full.question_loss)
        assert full.question_loss > 0
    summary = summarize(screened)
    assert summary["mean_score"] is None and summary["tasks"] == {}
    assert summary["costs"]["question_loss"] == pytest.approx(sum(r.question_loss for r in screened) / 2)


@contextmanager
def capturing_queries(model):
    """Post-RoPE queries of every layer of the next forward, per layer (1, H, L, d), computed in float64."""
    captured, handles = {}, []
    for layer in model.model.layers:

        def hook(module, args, kwargs, output):
            hidden = kwargs["hidden_states"].double()
            cos, sin = (table.double() for table in kwargs["position_embeddings"])
            batch, length, _ = hidden.shape
            queries = (
                (hidden @ module.q_proj.weight.double().T).view(batch, length, -1, module.head_dim).transpose(1, 2)
            )
            half = module.head_dim // 2
            rotated = torch.cat([-queries[..., half:], queries[..., :half]], dim=-1)
            captured[module.layer_idx] = queries * cos[:, None] + rotated * sin[:, None]

        handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def test_question_loss_matches_a_float64_teacher_forced_reference(sample):
    loaded = tiny_model("tiny-llama")
    model, tokenizer = loaded.model, loaded.tokenizer
    evaluator = Evaluator(loaded)
    config = PressConfig("snapkv", RATIO, "grkv")
    result = evaluator.evaluate_trials(sample, [config], decode=False)[0]
    context_ids, questions = tokenize_sample(tokenizer, sample)
    answer = tokenizer.encode(" " + sample.references[0][0], add_special_tokens=False)
    # The reference: the whole sequence (context, question, reference answer) in one forward; the queries of
    # the question and answer positions, against the full context cache and against the compressed one.
    sequence = torch.cat([context_ids, questions[0], torch.tensor([answer])], dim=1)
    with capturing_queries(model) as queries, torch.inference_mode():
        model.model(input_ids=sequence, past_key_values=DynamicCache())
    compressed = prefill(model, context_ids, build(config))
    full = prefill(model, context_ids)
    n = context_ids.shape[1]
    error = reference = 0.0
    config_ = model.config
    groups = config_.num_attention_heads // config_.num_key_value_heads
    for layer in range(config_.num_hidden_layers):
        q = queries[layer][:, :, n:]
        scale = model.model.layers[layer].self_attn.scaling

        def attend(keys, values):
            keys = keys.double().repeat_interleave(groups, dim=1)
            values = values.double().repeat_interleave(groups, dim=1)
            return torch.softmax(scale * q @ keys.transpose(-1, -2), dim=-1) @ values

        y_full = attend(full.layers[layer].keys, full.layers[layer].values)
        y_comp = attend(compressed.layers[layer].keys, compressed.layers[layer].values)
        error += float((y_full - y_comp).square().sum())
        reference += float(y_full.square().sum())
    assert result.question_loss == pytest.approx(error / reference, rel=1e-4)
    assert math.isfinite(result.question_loss) and result.question_loss > 0


def test_a_question_reaches_caches_whose_layers_keep_different_lengths(sample):
    loaded = tiny_model("tiny-llama")
    model = loaded.model
    context_ids, questions = tokenize_sample(loaded.tokenizer, sample)
    n = context_ids.shape[1]

    def one_token_at_a_time(cache):
        with torch.inference_mode():
            for offset in range(questions[0].shape[1]):
                logits = model(
                    input_ids=questions[0][:, offset : offset + 1],
                    past_key_values=cache,
                    position_ids=torch.tensor([[n + offset]]),
                ).logits
        return logits[0, -1]

    pyramid = prefill(model, context_ids, build(PressConfig("pyramidkv", 0.5)))
    assert len({layer.keys.shape[2] for layer in pyramid.layers}) > 1  # PyramidKV's per-layer budgets
    with torch.inference_mode():
        ours = append_question(model, pyramid, questions[0], n)[0]
    reference = prefill(model, context_ids, build(PressConfig("pyramidkv", 0.5)))
    assert torch.equal(ours, one_token_at_a_time(reference))
    # With equal lengths the question goes in one forward, which the token-by-token path agrees with.
    uniform = prefill(model, context_ids, build(PressConfig("snapkv", 0.5)))
    with torch.inference_mode():
        at_once = append_question(model, uniform, questions[0], n)[0]
    torch.testing.assert_close(
        at_once,
        one_token_at_a_time(prefill(model, context_ids, build(PressConfig("snapkv", 0.5)))),
        rtol=1e-4,
        atol=1e-4,
    )
