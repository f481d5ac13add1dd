"""Bounded-cache evaluations end to end: grkv compare / grkv eval under stream_nll and stream_answer."""

import json
from dataclasses import replace

import pytest
import torch
from conftest import REPO, tiny_model

from grkv_core.cli import main
from grkv_core.config import FULL_CACHE, PressConfig, StreamConfig
from grkv_core.datasets import load_dataset_samples
from grkv_core.evaluation.answer_metrics import answer_log_probs, reference_ids
from grkv_core.evaluation.generation import prefill, tokenize_sample
from grkv_core.evaluation.stream_eval import StreamStore, bounded_press, evaluate_stream_item, load_stream_items
from grkv_core.stream_options import STREAM_ANSWER

ANSWER_ARGS = ["--model", "tiny-llama", "--protocol", STREAM_ANSWER, "--tasks", "niah_single_1", "--samples", "2"]
ANSWER_ARGS += ["--context-length", "512", "--compression-interval", "48", "--no-progress"]


def test_compare_stream_answer_prints_full_eviction_and_grkv_per_size_and_resumes(tmp_path, capsys):
    arguments = ["compare", *ANSWER_ARGS, "--press", "streamingllm", "--target-sizes", "128", "160"]
    arguments += ["--output-dir", str(tmp_path)]
    assert main(arguments) == 0
    printed = capsys.readouterr().out
    for label in ("| full | 2 |", "| streamingllm 128 | 2 |", "| streamingllm 128 + grkv | 2 |", "streamingllm 160"):
        assert label in printed
    folder = tmp_path / STREAM_ANSWER
    files = sorted(path.name for path in folder.glob("*.jsonl"))
    assert files == sorted(
        ["full.jsonl", *(f"streamingllm-{size}{merge}.jsonl" for size in (128, 160) for merge in ("", "+grkv"))]
    )
    before = {path.name: path.read_text() for path in folder.glob("*.jsonl")}
    assert main(arguments) == 0  # every text done: nothing evaluated again
    assert {path.name: path.read_text() for path in folder.glob("*.jsonl")} == before
    rows = [json.loads(line) for line in (folder / "streamingllm-128+grkv.jsonl").read_text().splitlines()[1:]]
    assert len(rows) == 2 and all(row["rows"] <= 128 + 48 for row in rows)
    assert (folder / "table.md").read_text().strip() in printed


def test_eval_stream_answer_writes_one_configuration(tmp_path, capsys):
    output = tmp_path / "one.jsonl"
    arguments = ["eval", *ANSWER_ARGS, "--press", "snapkv", "--merge", "cam", "--target-size", "128"]
    assert main([*arguments, "--output", str(output)]) == 0
    assert "snapkv 128 + cam" in capsys.readouterr().out
    header = json.loads(output.read_text().splitlines()[0])["config"]
    assert header["press"]["merge"] == "cam" and header["target_size"] == 128


def test_a_full_cache_streamed_context_gives_the_answer_log_probs_of_one_prefill():
    loaded = tiny_model("tiny-llama")
    config = StreamConfig(
        protocol=STREAM_ANSWER, press=PressConfig(FULL_CACHE, 0.0), model="tiny-llama", source="ruler", samples=1,
        max_tokens=512, min_tokens=1, tasks=("niah_single_1",), target_size=128, compression_interval=48,
    )  # fmt: skip
    item = load_stream_items(config, loaded.tokenizer)[0]
    result, reference = evaluate_stream_item(loaded, item, config, None, None)
    sample = load_dataset_samples(
        "ruler", tasks=["niah_single_1"], context_length=512, samples_per_task=1, tokenizer=loaded.tokenizer
    )[0]
    context_ids, questions = tokenize_sample(loaded.tokenizer, sample)
    answer = reference_ids(loaded.tokenizer, sample, 0)
    expected = answer_log_probs(
        loaded.model, prefill(loaded.model, context_ids), questions[0], answer, context_ids.shape[1]
    )
    torch.testing.assert_close(reference, expected[0], atol=1e-5, rtol=0)
    assert result["answer_kl"] == pytest.approx(0.0, abs=1e-6) and result["answer_top1"] == 1.0
    assert bounded_press(config) is None


def test_a_results_file_of_another_configuration_is_refused_in_one_line(tmp_path):
    path = tmp_path / "r.jsonl"
    StreamStore(path, StreamConfig(target_size=256))
    with pytest.raises(ValueError, match="holds another configuration's results") as raised:
        StreamStore(path, StreamConfig(target_size=512))
    assert "\n" not in str(raised.value)
    StreamStore(path, StreamConfig(target_size=256, samples=9))  # more texts of the same configuration resume it


def test_the_committed_bounded_cache_results_resume_under_todays_configuration(tmp_path):
    """A configuration field added since the committed tables were begun must not stop them resuming."""
    committed = sorted((REPO / "benchmarks/results/bounded-cache").rglob("*.jsonl"))
    assert committed
    for index, path in enumerate(committed):
        text = path.read_text()
        header, *texts = text.splitlines()
        copy = tmp_path / f"{index}.jsonl"
        copy.write_text(text)
        config = StreamConfig.from_dict(json.loads(header)["config"])
        assert len(StreamStore(copy, config).results) == len(texts), path


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(protocol="stream"), "protocol must be one of ('stream_nll', 'stream_answer')"),
        (dict(target_size=0), "target_size must be an integer >= 1, got 0"),
        (dict(compression_interval=-3), "compression_interval must be an integer >= 1, got -3"),
        (dict(min_tokens=100, max_tokens=50), "max_tokens >= min_tokens"),
    ],
)
def test_bad_stream_configurations_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=None) as raised:
        StreamConfig(**fields)
    assert message in str(raised.value)


def test_compare_stream_nll_scores_every_streamed_token_of_eval_texts(tmp_path, capsys):
    arguments = ["compare", "--model", "tiny-llama", "--protocol", "stream_nll", "--texts", "code", "--samples", "2"]
    arguments += ["--max-tokens", "600", "--press", "snapkv", "--target-sizes", "128", "--compression-interval", "48"]
    assert main([*arguments, "--output-dir", str(tmp_path), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "| snapkv 128 + grkv | 2 |" in printed and "Δ vs snapkv 128" in printed
    for name in ("full", "snapkv-128", "snapkv-128+grkv"):
        lines = (tmp_path / "stream_nll" / f"{name}.jsonl").read_text().splitlines()
        assert json.loads(lines[0])["config"]["split"] == "eval"
        rows = [json.loads(line) for line in lines[1:]]
        # 600-token texts (min = max), the first 128 prefilled: 472 streamed tokens scored each
        assert [row["tokens"] for row in rows] == [472, 472]
        assert all(row["item_id"].startswith("code/") for row in rows)


def test_compare_under_adakv_streams_a_per_head_cache_and_leaves_out_the_merge_it_cannot_run(tmp_path, capsys):
    arguments = ["compare", "--model", "tiny-llama", "--protocol", "stream_nll", "--texts", "code", "--samples", "1"]
    arguments += ["--max-tokens", "400", "--press", "adakv", "--target-sizes", "128", "--compression-interval", "48"]
    assert main([*arguments, "--output-dir", str(tmp_path), "--no-progress"]) == 0
    printed = capsys.readouterr()
    assert "| adakv 128 | 1 |" in printed.out and "+ grkv" not in printed.out
    assert "no + grkv row: MergingDecodingPress with AdaKVPress's per-head budgets" in printed.err
    assert sorted(path.name for path in (tmp_path / "stream_nll").glob("*.jsonl")) == ["adakv-128.jsonl", "full.jsonl"]
    # A merge asked for by name is refused with its reason, before the model loads.
    assert main([*arguments, "--merge-variant", "g=grkv", "--output-dir", str(tmp_path / "v"), "--no-progress"]) == 2
    assert "eviction only (GRKVPress merges into a uniform cache)" in capsys.readouterr().err


def test_eval_of_an_exported_bounded_press_streams_at_its_own_sizes_under_its_protocol(tmp_path, capsys):
    press_file = tmp_path / "press.yaml"
    press_file.write_text(
        "press: snapkv\ncompression_ratio: 0.0\nmerge: grkv\nmerge_options: {}\n"
        "decoding: {target_size: 96, compression_interval: 48}\nprotocol: stream_nll\n"
    )
    output = tmp_path / "one.jsonl"
    arguments = ["eval", "--model", "tiny-llama", "--press-config", str(press_file), "--texts", "code"]
    arguments += ["--samples", "1", "--max-tokens", "300", "--output", str(output), "--no-progress"]
    assert main(arguments) == 0
    assert "snapkv 96 + grkv" in capsys.readouterr().out
    header = json.loads(output.read_text().splitlines()[0])["config"]
    assert (header["protocol"], header["target_size"], header["compression_interval"]) == ("stream_nll", 96, 48)
    # The file's sizes mean nothing to a prefill protocol: refused in one line, nothing evaluated.
    assert main([*arguments[:-3], "--protocol", "question_agnostic"]) == 2
    error = capsys.readouterr().err.strip()
    assert "is a bounded cache" in error and "--protocol stream_nll or stream_answer" in error and "\n" not in error


def test_a_bounded_press_config_is_one_configuration_and_builds_the_decoding_press():
    from grkv_core.presses.decoding import MergingDecodingPress
    from grkv_core.presses.from_config import BuiltPress, build
    from grkv_core.presses.grkv import GRKVPress

    sizes = {"target_size": 256, "compression_interval": 64}
    bounded = PressConfig("streamingllm", 0.0, "grkv", {"lambda_k": 1}, decoding=dict(reversed(sizes.items())))
    # One canonical form however the sizes are ordered or the floats typed; a prefill press's form has no sizes.
    assert (
        bounded.canonical() == PressConfig("streamingllm", 0.0, "grkv", {"lambda_k": 1.0}, decoding=sizes).canonical()
    )
    assert bounded.canonical()["decoding"] == sizes and "decoding" not in PressConfig("snapkv", 0.5).canonical()
    assert bounded.label == "streamingllm 256 + grkv" and PressConfig("snapkv", 0.9).label == "snapkv 10%"
    press = build(bounded)
    assert isinstance(press, MergingDecodingPress) and isinstance(press.base_press, GRKVPress)
    assert (press.target_size, press.compression_interval, press.base_press.lambda_k) == (256, 64, 1.0)
    settings = BuiltPress.of(bounded).settings
    assert (
        settings["target_size"] == 256
        and settings["lambda_k"] == 1.0
        and settings["press.class"] == "StreamingLLMPress"
    )
    # The evaluation a sweep's trial runs takes the sizes from the press; the full cache stays as it is.
    config = StreamConfig(target_size=512, compression_interval=128).with_press(bounded)
    assert (config.target_size, config.compression_interval, config.press.decoding) == (256, 64, {})
    assert config.bounded_press == replace(bounded, merge_options={"lambda_k": 1})
    full = StreamConfig().with_press(PressConfig(FULL_CACHE, 0.0))
    assert full.bounded_press == PressConfig(FULL_CACHE, 0.0) and bounded_press(full) is None
    assert StreamConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: PressConfig("snapkv", 0.0, decoding={"target_size": 0}),
            "decoding.target_size must be an integer >= 1",
        ),
        (lambda: PressConfig("snapkv", 0.0, decoding={"window": 3}), "decoding must be a mapping of some of"),
        (lambda: PressConfig(FULL_CACHE, 0.0, decoding={"target_size": 8}), "press 'full' keeps the whole cache"),
        (
            lambda: StreamConfig(press=PressConfig("snapkv", 0.0, decoding={"target_size": 8})),
            "a StreamConfig's press takes no decoding",
        ),
        (
            lambda: StreamConfig().with_press(PressConfig("snapkv", 0.0, decoding={"target_compression_ratio": 0.5})),
            "sets target_size and compression_interval only",
        ),
    ],
)
def test_a_bounded_configuration_that_cannot_be_built_is_refused_in_one_line(make, message):
    with pytest.raises(ValueError, match=message) as error:
        make()
    assert "\n" not in str(error.value)
