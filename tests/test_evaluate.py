"""Single-process evaluation: the kvpress protocol, costs and losses per sample, resume after interruption."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import VENV_BIN, tiny_model
from kvpress.utils import compute_n_kept

from grkv_core.config import EvalConfig, PressConfig
from grkv_core.datasets import load_dataset_samples
from grkv_core.evaluation.evaluator import Evaluator
from grkv_core.evaluation.generation import render_sample, tokenize_sample
from grkv_core.evaluation.run import EvaluationSetup, run_evaluation, run_evaluations
from grkv_core.metrics import SAMPLE_MEAN_METRICS, SCREENING_METRICS
from grkv_core.models.embedded import COMPLETION_TEMPLATE
from grkv_core.options import GRKV_DEFAULTS, WINDOW32_GRKV_OPTIONS

REPO = Path(__file__).resolve().parents[1]
GRKV = str(VENV_BIN / "grkv")


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("tiny-llama")


@pytest.fixture(scope="module")
def samples(tiny):
    return load_dataset_samples(
        "ruler", tasks=["niah_single_1", "vt"], context_length=768, samples_per_task=2, tokenizer=tiny.tokenizer
    )


def test_question_ids_carry_template_tail_and_answer_prefix(tiny, samples):
    sample = samples[0]
    context_ids, question_ids = tokenize_sample(tiny.tokenizer, sample)
    assert len(question_ids) == len(sample.questions)
    question_text = tiny.tokenizer.decode(question_ids[0][0])
    assert question_text.startswith(sample.questions[0]) and question_text.endswith(sample.answer_prefix)
    assert sample.context in tiny.tokenizer.decode(context_ids[0])
    # The context part must not contain the question: it is compressed alone.
    assert sample.questions[0] not in tiny.tokenizer.decode(context_ids[0])


@pytest.mark.parametrize("protocol", ["question_agnostic", "query_aware"])
def test_a_base_models_completion_template_renders_rulers_base_prompt_under_both_protocols(
    tiny, samples, protocol, monkeypatch
):
    """A base model's prompt (gemma3-270m's template) is RULER's for base models: BOS, context, question, answer
    prefix, nothing between them; the protocol only moves the question to the prefill's side."""
    monkeypatch.setattr(tiny.tokenizer, "chat_template", COMPLETION_TEMPLATE)
    sample = samples[0]
    context, questions = render_sample(tiny.tokenizer, sample, protocol)
    bos = tiny.tokenizer.bos_token
    assert context + questions[0] == bos + sample.context + sample.questions[0] + sample.answer_prefix
    assert questions == (
        [sample.questions[0] + sample.answer_prefix] if protocol == "question_agnostic" else [sample.answer_prefix]
    )
    context_ids, _ = tokenize_sample(tiny.tokenizer, sample, protocol)
    assert context_ids[0, 0] == tiny.tokenizer.bos_token_id, "the BOS is the special token, not its spelling"


def test_costs_and_losses_per_sample(tiny, samples):
    evaluator = Evaluator(tiny, heldout_tokens=4)
    sample = samples[0]
    full = evaluator.evaluate_sample(sample, PressConfig("full", 0.0))
    plain = evaluator.evaluate_sample(sample, PressConfig("snapkv", 0.75))
    merged = evaluator.evaluate_sample(sample, PressConfig("snapkv", 0.75, "grkv"))
    assert full.window_loss == 0.0 and full.kv_bytes == full.full_kv_bytes
    n_layers = tiny.model.config.num_hidden_layers
    per_token = 2 * tiny.model.config.num_key_value_heads * tiny.model.config.head_dim * 4 * n_layers
    assert plain.kv_bytes == compute_n_kept(plain.context_tokens, 0.75) * per_token
    assert merged.kv_bytes == plain.kv_bytes
    for result in (plain, merged):
        assert 0 < result.window_loss < 10 and result.heldout_loss is not None and result.heldout_loss > 0
        assert result.ttft_s >= result.prefill_s > 0 and result.decode_ms_per_token > 0
        assert 0.0 <= result.score <= 1.0 and len(result.predictions) == len(sample.questions)
    assert merged.window_loss != plain.window_loss


def test_several_configurations_share_each_sample_and_resume_each_from_its_own_file(tiny, samples, tmp_path):
    presses = [PressConfig("snapkv", 0.5), PressConfig("snapkv", 0.5, "grkv"), PressConfig("streamingllm", 0.5)]
    configs = [
        EvalConfig(model="tiny-llama", tasks=("niah_single_1", "vt"), context_length=768, samples=2, press=press)
        for press in presses
    ]
    outputs = [tmp_path / f"{index}.json" for index in range(len(configs))]
    evaluator = Evaluator(tiny)
    # The second configuration already has two samples, as an interrupted run leaves it.
    run_evaluation(configs[1], outputs[1], setup=EvaluationSetup(tiny, samples[:2], evaluator), progress=False)
    earlier = json.loads(outputs[1].read_text())["samples"]
    summaries = run_evaluations(configs, outputs, setup=EvaluationSetup(tiny, samples, evaluator), progress=False)
    assert [summary["label"] for summary in summaries] == [press.label for press in presses]
    for press, output, summary in zip(presses, outputs, summaries):
        rows = json.loads(output.read_text())["samples"]
        assert sorted(row["sample_id"] for row in rows) == sorted(sample.sample_id for sample in samples)
        assert summary["samples"] == len(samples)
        for row in rows:
            sample = next(sample for sample in samples if sample.sample_id == row["sample_id"])
            alone = evaluator.evaluate_sample(sample, press)
            assert (row["predictions"], row["kv_bytes"], row["window_loss"]) == (
                alone.predictions,
                alone.kv_bytes,
                alone.window_loss,
            )
    assert json.loads(outputs[1].read_text())["samples"][:2] == earlier, "finished samples are not recomputed"
    new_rows = json.loads(outputs[0].read_text())["samples"]
    assert {row["batch_trials"] for row in new_rows} == {2, 3}  # shared with those still missing the sample


def test_without_decoding_the_answer_metrics_and_losses_equal_a_decoding_runs_and_nothing_is_scored(
    tiny, samples, tmp_path
):
    presses = [PressConfig("full", 0.0), PressConfig("snapkv", 0.5), PressConfig("snapkv", 0.5, "grkv")]
    setup = EvaluationSetup(tiny, samples[:2], Evaluator(tiny))
    runs = {}
    for decode in (True, False):
        configs = [
            EvalConfig(
                model="tiny-llama",
                tasks=("niah_single_1", "vt"),
                context_length=768,
                samples=1,
                press=press,
                decode=decode,
            )
            for press in presses
        ]
        outputs = [tmp_path / f"{decode}-{index}.json" for index in range(len(configs))]
        run_evaluations(configs, outputs, setup=setup, progress=False)
        runs[decode] = [json.loads(output.read_text())["samples"] for output in outputs]
    same = (*SCREENING_METRICS, "answer_top1", "kv_bytes")
    for decoded, answer_only in zip(runs[True], runs[False]):
        for row, row_only in zip(decoded, answer_only, strict=True):
            assert row["score"] is not None and row_only["score"] is None and row_only["predictions"] == []
            assert {name: row[name] for name in same} == {name: row_only[name] for name in same}
            assert None not in [row_only[name] for name in SCREENING_METRICS]  # what a screening stage ranks by
            assert row_only["answer_nll"] > 0
    # A decoding run's summary averages every per-sample metric the table says it does, each measured.
    costs = json.loads((tmp_path / "True-2.json").read_text())["summary"]["costs"]
    assert list(costs) == list(SAMPLE_MEAN_METRICS) and None not in costs.values()
    answer_only_file = tmp_path / "False-1.json"
    with pytest.raises(ValueError, match="different configuration"):
        run_evaluation(
            EvalConfig(
                model="tiny-llama", tasks=("niah_single_1", "vt"), context_length=768, samples=1, press=presses[1]
            ),
            answer_only_file,
            setup=setup,
            progress=False,
        )
    written = json.loads(answer_only_file.read_text())
    del written["config"]["decode"]  # as written before the field existed: its rows say it did not decode
    answer_only_file.write_text(json.dumps(written))
    config = EvalConfig(
        model="tiny-llama", tasks=("niah_single_1", "vt"), context_length=768, samples=1, press=presses[1], decode=False
    )
    assert run_evaluation(config, answer_only_file, setup=setup, progress=False)["samples"] == 2
    with pytest.raises(ValueError, match="drop --no-decode"):
        run_evaluation(config, None, setup=setup, progress=False, kvpress_dir=tmp_path / "kvpress")


def test_h2o_needs_eager_attention_and_says_so(tiny, samples):
    with pytest.raises(ValueError, match="eager"):
        Evaluator(tiny).evaluate_sample(samples[0], PressConfig("h2o", 0.5))


def test_run_evaluation_writes_summary_versions_and_resumes(tiny, samples, tmp_path):
    output = tmp_path / "results.json"
    config = EvalConfig(
        model="tiny-llama",
        tasks=("niah_single_1", "vt"),
        context_length=768,
        samples=2,
        press=PressConfig("snapkv", 0.5, "grkv", {"lambda_k": 0.1}),
    )
    setup = EvaluationSetup(tiny, samples, Evaluator(tiny))
    summary = run_evaluation(config, output, setup=EvaluationSetup(tiny, samples[:3], setup.evaluator), progress=False)
    stored = json.loads(output.read_text())
    assert len(stored["samples"]) == 3 and stored["versions"]["kvpress"] == "0.5.5"
    assert stored["config"]["press"]["merge_options"] == {"lambda_k": 0.1}
    assert stored["resolved_press"]["lambda_k"] == 0.1 and stored["resolved_press"]["safeguard"] is True
    assert set(summary["tasks"]) == {"niah_single_1", "vt"}
    first_run = {row["sample_id"]: row for row in stored["samples"]}
    run_evaluation(config, output, setup=setup, progress=False)
    stored = json.loads(output.read_text())
    assert len(stored["samples"]) == 4
    for row in stored["samples"]:
        if row["sample_id"] in first_run:
            assert row == first_run[row["sample_id"]], "finished samples must not be recomputed"
    other = EvalConfig(
        model="tiny-llama",
        tasks=("niah_single_1", "vt"),
        context_length=768,
        samples=2,
        press=PressConfig("snapkv", 0.9),
    )
    with pytest.raises(ValueError, match="different configuration"):
        run_evaluation(other, output, setup=setup, progress=False)
    written = json.loads(output.read_text())
    default = GRKV_DEFAULTS["cg_max_iter"]
    written["resolved_press"]["cg_max_iter"] = default + 2  # as written under another version's default
    output.write_text(json.dumps(written))
    with pytest.raises(ValueError, match=rf"other press settings \(cg_max_iter: {default + 2} -> {default}\)"):
        run_evaluation(config, output, setup=setup, progress=False)
    # A file written before an option existed resumes while the option is at its default (the old behaviour).
    written["resolved_press"]["cg_max_iter"] = default
    del written["resolved_press"]["head_weighting"]
    output.write_text(json.dumps(written))
    assert run_evaluation(config, output, setup=setup, progress=False)["samples"] == 4
    config_weighted = EvalConfig(
        **{
            **config.__dict__,
            "press": PressConfig("snapkv", 0.5, "grkv", {"lambda_k": 0.1, "head_weighting": "o_proj"}),
        }
    )
    with pytest.raises(ValueError, match="different configuration"):
        run_evaluation(config_weighted, output, setup=setup, progress=False)
    assert stored["model_dtype"] == "float32"
    stored["model_dtype"] = "bfloat16"  # as written by an earlier run whose dtype="auto" meant bfloat16
    output.write_text(json.dumps(stored))
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        run_evaluation(config, output, setup=setup, progress=False)


def test_interrupted_cli_run_loses_nothing_and_resumes(tmp_path):
    output = tmp_path / "run.json"
    command = [
        GRKV,
        "eval",
        "--model",
        "tiny-llama",
        "--tasks",
        "niah_single_1",
        "vt",
        "--context-length",
        "768",
        "--samples",
        "3",
        "--press",
        "snapkv",
        "--compression-ratio",
        "0.5",
        "--merge",
        "grkv",
        "--output",
        str(output),
        "--no-progress",
    ]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if output.exists() and len(json.loads(output.read_text())["samples"]) >= 2:
            break
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    written = json.loads(output.read_text())  # never half-written: the file is replaced atomically
    done_before = {row["sample_id"]: row for row in written["samples"]}
    assert 2 <= len(done_before) < 6
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    final = json.loads(output.read_text())
    assert len(final["samples"]) == 6
    assert all(row == done_before[row["sample_id"]] for row in final["samples"] if row["sample_id"] in done_before)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--press", "snapkvv"], "grkv eval: error: argument --press: invalid choice: 'snapkvv'"),
        (["--merge", "grkv", "--beta", "2"], "grkv eval: error: beta must be a finite number in [0, 1], got 2.0"),
    ],
)
def test_cli_bad_arguments_end_in_one_line(arguments, message):
    result = subprocess.run(
        [
            GRKV,
            "eval",
            "--model",
            "tiny-llama",
            "--samples",
            "1",
            "--tasks",
            "niah_single_1",
            "--context-length",
            "768",
            *arguments,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith(message) and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("merge", ["cam", "d2o", "asymkv", "kvmerger", "kvpress_merging"])
def test_every_merger_reports_its_reconstruction_losses(tiny, samples, merge):
    result = Evaluator(tiny, heldout_tokens=2).evaluate_sample(samples[0], PressConfig("snapkv", 0.75, merge))
    assert result.window_loss is not None and result.window_loss > 0 and result.heldout_loss is not None


@pytest.mark.parametrize("flags", [[], ["--only-variants"], ["--preset", "window32"]])
def test_compare_writes_one_result_file_per_row_and_the_table(tmp_path, flags):
    result = subprocess.run(
        [
            GRKV,
            "compare",
            "--model",
            "tiny-llama",
            "--samples",
            "1",
            "--tasks",
            "niah_single_1",
            "--context-length",
            "1024",
            "--compression-ratios",
            "0.75",
            "--output-dir",
            str(tmp_path),
            "--merge-variant",
            "grv=grkv:components=v",
            "--no-progress",
            *flags,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    names = {path.stem for path in tmp_path.glob("*.json")}
    only_variants = "--only-variants" in flags
    assert names == {"full", "snapkv-25pct", "snapkv-25pct+grv"} | (set() if only_variants else {"snapkv-25pct+grkv"})
    if "--preset" in flags:
        ran = json.loads((tmp_path / "snapkv-25pct+grkv.json").read_text())["resolved_press"]
        assert {name: ran[name] for name in WINDOW32_GRKV_OPTIONS} == WINDOW32_GRKV_OPTIONS
    losses = {
        name: json.loads((tmp_path / f"{name}.json").read_text())["summary"]["costs"]["window_loss"] for name in names
    }
    assert losses["full"] == 0 and losses["snapkv-25pct+grv"] < losses["snapkv-25pct"]
    assert (tmp_path / "table.md").read_text().splitlines()[2].startswith("full")
