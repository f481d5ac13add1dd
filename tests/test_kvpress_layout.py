"""Results in kvpress's evaluation layout: written by grkv eval and the sweep's test stage, read back beside kvpress's.

The layout is checked against kvpress's own code by ``benchmarks/kvpress_layout_check.py`` (it needs a kvpress
checkout: ``evaluation/`` is not in the wheel); here every file is read back the way kvpress's code reads it
(pandas, PyYAML, json) and its numbers are recomputed from its own rows.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from grkv_core.cli import main
from grkv_core.config import QUERY_AWARE, EvalConfig, PressConfig
from grkv_core.datasets import EvalSample
from grkv_core.datasets.scoring import string_match_all
from grkv_core.evaluation import kvpress_layout
from grkv_core.evaluation.kvpress_layout import KvpressRun, kvpress_runs, method_name, write_run
from grkv_core.evaluation.leaderboard import leaderboard_table, read_runs
from grkv_core.evaluation.results import SampleResult

# kvpress 0.5.5's EvaluationConfig fields in its order, as save_config writes them for a press with a compression
# ratio (evaluation/evaluate.py; benchmarks/kvpress_layout_check.py checks against the source itself).
KVPRESS_CONFIG_FIELDS = (
    "dataset",
    "data_dir",
    "model",
    "device",
    "press_name",
    "compression_ratio",
    "key_channel_compression_ratio",
    "fraction",
    "max_new_tokens",
    "max_context_length",
    "query_aware",
    "needle_depth",
    "compression_interval",
    "target_size",
    "hidden_states_buffer_size",
    "output_dir",
    "log_level",
    "model_kwargs",
    "press_init_command",
    "seed",
    "fp8",
)
KVPRESS_COLUMNS = [
    "task",
    "question",
    "answer_prefix",
    "answer",
    "max_new_tokens",
    "predicted_answer",
    "compression_ratio",
]
GRKV = PressConfig("snapkv", 0.8, "grkv", {"lambda_k": 0.1})


def ruler_sample(index: int, task: str, references: tuple[str, ...]) -> EvalSample:
    return EvalSample(
        f"ruler/{task}/2048/0/{index}",
        task,
        "context " * 10,
        (f"question {index}?",),
        " Answer:",
        (references,),
        32,
        "string_match_all",
    )


def result_of(sample: EvalSample, prediction: str, **metrics) -> SampleResult:
    score = string_match_all(prediction, sample.references[0])
    return SampleResult(
        sample.sample_id,
        sample.task,
        [prediction],
        [score],
        score,
        100,
        0.1,
        0.1,
        5.0,
        4,
        10,
        50,
        0,
        0.01,
        0.02,
        0.2,
        **metrics,
    )


SAMPLES = [
    ruler_sample(0, "niah_single_1", ("1234",)),
    ruler_sample(1, "niah_single_1", ("999",)),
    ruler_sample(2, "niah_multivalue", ("11", "22", "33")),
]
PREDICTIONS = ["It is 1234.", "no idea", "11 and 33, maybe 4"]
RESULTS = [
    result_of(sample, prediction, answer_nll=0.5 + index, answer_kl=0.1 * index, answer_top1=1.0)
    for index, (sample, prediction) in enumerate(zip(SAMPLES, PREDICTIONS))
]


def config_of(press: PressConfig = GRKV, **fields) -> EvalConfig:
    return EvalConfig(model="org/Some-Model", tasks=("niah_single_1", "niah_multivalue"), press=press, **fields)


def only_run(config: EvalConfig) -> KvpressRun:
    (run,) = kvpress_runs(config, SAMPLES, RESULTS, "GRKVPress(...)")
    return run


def test_a_ruler_run_is_one_folder_named_and_filled_as_kvpress_does(tmp_path):
    folder = write_run(tmp_path, only_run(config_of()))
    assert folder == tmp_path / "ruler__2048__org--Some-Model__grkv_snapkv__0.80"
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert tuple(config) == KVPRESS_CONFIG_FIELDS  # kvpress's EvaluationConfig fields, in its order
    assert config["press_name"] == "grkv_snapkv" and config["compression_ratio"] == 0.8
    assert config["data_dir"] == "2048" and config["query_aware"] is False and config["output_dir"] == str(tmp_path)
    frame = pd.read_csv(folder / "predictions.csv", keep_default_na=False)
    assert list(frame.columns[: len(KVPRESS_COLUMNS)]) == KVPRESS_COLUMNS
    assert "context" not in frame.columns
    assert [ast.literal_eval(cell) for cell in frame["answer"]] == [list(s.references[0]) for s in SAMPLES]
    assert list(frame["predicted_answer"]) == PREDICTIONS and list(frame["sample_id"]) == [s.sample_id for s in SAMPLES]
    assert list(frame["answer_nll"]) == [0.5, 1.5, 2.5]
    # metrics.json: kvpress's RULER scorer, per task the mean string_match of the rows, in percent.
    expected = {}
    for task, rows in frame.groupby("task"):
        matched = [string_match_all(p, ast.literal_eval(a)) for p, a in zip(rows["predicted_answer"], rows["answer"])]
        expected[task] = {"string_match": round(100 * sum(matched) / len(matched), 2)}
    assert (
        json.loads((folder / "metrics.json").read_text())
        == expected
        == {"niah_multivalue": {"string_match": 66.67}, "niah_single_1": {"string_match": 50.0}}
    )
    extras = json.loads((folder / "grkv.json").read_text())
    assert extras["label"] == "snapkv 20% + grkv" and EvalConfig.from_dict(extras["config"]) == config_of()


def test_query_aware_and_full_cache_runs_are_named_as_kvpress_names_them(tmp_path):
    run = only_run(config_of(protocol=QUERY_AWARE))
    assert run.name.endswith("__grkv_snapkv__0.80__query_aware") and run.config["query_aware"] is True
    assert {row["question"] for row in run.rows} == {""}  # kvpress's query_aware moves the question to the context
    full = only_run(config_of(PressConfig("full", 0.0)))
    assert full.name == "ruler__2048__org--Some-Model__no_press__0.00"
    assert method_name("snapkv", "none") == "snapkv" and method_name("knorm", "kvpress_merging") == "merging_knorm"


def test_longbench_runs_are_one_folder_per_subset_with_one_number(tmp_path):
    samples = [
        EvalSample(
            f"longbench/{task}/{i}",
            task,
            "text " * 5,
            ("q?",),
            "A:",
            (("gold answer",),),
            16,
            "qa_f1_score",
            {"all_classes": None},
        )
        for task in ("hotpotqa", "qasper")
        for i in range(2)
    ]
    scores = [1.0, 0.5, 0.0, 0.25]
    results = [
        SampleResult(**{**result_of(sample, "x").__dict__, "scores": [score], "score": score})
        for sample, score in zip(samples, scores)
    ]
    config = EvalConfig(model="m", dataset="longbench", context_length=None, tasks=("hotpotqa", "qasper"), press=GRKV)
    runs = {run.config["data_dir"]: run for run in kvpress_runs(config, samples, results, "p")}
    assert set(runs) == {"hotpotqa", "qasper"} and runs["hotpotqa"].name == "longbench__hotpotqa__m__grkv_snapkv__0.80"
    assert runs["hotpotqa"].metrics == 75.0 and runs["qasper"].metrics == 12.5
    folder = write_run(tmp_path, runs["qasper"])
    frame = pd.read_csv(folder / "predictions.csv", keep_default_na=False)
    assert "answers" in frame.columns and "all_classes" in frame.columns  # kvpress's LongBench columns


def test_screening_results_have_nothing_to_write():
    unscored = [SampleResult(**{**r.__dict__, "predictions": [], "scores": [], "score": None}) for r in RESULTS]
    with pytest.raises(ValueError, match="decoded predictions"):
        kvpress_runs(config_of(), SAMPLES, unscored, "p")


def write_kvpress_folder(
    root: Path, press_name: str, ratio_field: str = "compression_ratio", ratio: float = 0.5, config_yaml: bool = True
) -> Path:
    """A folder as kvpress's evaluate.py writes it: numpy-printed answers, no grkv.json."""
    folder = root / f"ruler__4096__Qwen--Qwen3-8B__{press_name}__{ratio:.2f}"
    folder.mkdir(parents=True)
    (folder / "predictions.csv").write_text(
        "max_new_tokens,answer,question,task,predicted_answer,answer_prefix,compression_ratio\n"
        "128,['1' '2'],q?,niah_multivalue,1 2,A:,0.5\n128,['7'],q?,niah_single_1,8,A:,0.5\n"
    )
    (folder / "metrics.json").write_text(
        json.dumps({"niah_multivalue": {"string_match": 100.0}, "niah_single_1": {"string_match": 0.0}})
    )
    if config_yaml:
        config = {
            "dataset": "ruler",
            "data_dir": "4096",
            "model": "Qwen/Qwen3-8B",
            "press_name": press_name,
            ratio_field: ratio,
            "query_aware": False,
        }
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder


def test_a_write_cut_short_before_config_yaml_is_rewritten_in_place(tmp_path, monkeypatch):
    """kvpress marks a finished run by its config.yaml, written last; a folder of ours cut short before it is still
    known as this configuration's, so writing the run again rewrites it instead of starting ``<name>/1``."""
    run = only_run(config_of())
    written = kvpress_layout.write_atomically

    def cut_at_config(path, text):
        if Path(path).name == "config.yaml":
            raise KeyboardInterrupt
        written(path, text)

    with monkeypatch.context() as patched:
        patched.setattr(kvpress_layout, "write_atomically", cut_at_config)
        with pytest.raises(KeyboardInterrupt):
            write_run(tmp_path, run)
    with pytest.warns(UserWarning, match="unfinished"):
        assert read_runs(tmp_path) == []  # not a finished run yet
    folder = write_run(tmp_path, run)
    assert folder == tmp_path / run.name
    (row,) = read_runs(tmp_path)
    assert row.rows == len(run.rows)


def test_kvpress_never_has_its_folders_overwritten_and_ours_are_rewritten(tmp_path):
    run = only_run(config_of())
    first = write_run(tmp_path, run)
    assert write_run(tmp_path, run) == first  # the same configuration: rewritten in place
    other = only_run(config_of(PressConfig("snapkv", 0.8, "grkv", {"lambda_k": 1.0})))
    assert other.name == run.name and write_run(tmp_path, other) == first / "1"
    assert write_run(tmp_path, other) == first / "1"
    theirs = write_kvpress_folder(tmp_path / "kv", "grkv_snapkv", ratio=0.8)
    ours = KvpressRun(theirs.name, run.config, run.rows, run.metrics, run.extras)
    assert write_run(tmp_path / "kv", ours) == theirs / "1"
    assert json.loads((theirs / "metrics.json").read_text())["niah_multivalue"] == {"string_match": 100.0}


def test_the_leaderboard_reads_kvpress_runs_beside_ours(tmp_path):
    write_run(tmp_path / "ours", only_run(config_of()))
    write_kvpress_folder(tmp_path / "theirs", "snapkv")
    write_kvpress_folder(tmp_path / "theirs", "kvzap_mlp", ratio_field="threshold", ratio=-4)
    write_kvpress_folder(tmp_path / "theirs" / "unfinished", "knorm", config_yaml=False)
    with pytest.warns(UserWarning, match="without config.yaml"):
        rows = read_runs(tmp_path / "ours", tmp_path / "theirs")
    by_method = {row.method: row for row in rows}
    assert set(by_method) == {"grkv_snapkv", "snapkv", "kvzap_mlp"}
    ours, theirs = by_method["grkv_snapkv"], by_method["snapkv"]
    assert ours.score == pytest.approx((66.67 + 50.0) / 2) and ours.rows == 3 and ours.label == "snapkv 20% + grkv"
    assert ours.answer_nll == pytest.approx(1.5) and ours.answer_kl == pytest.approx(0.1)
    assert theirs.score == 50.0 and theirs.model == "Qwen/Qwen3-8B" and theirs.answer_nll is None and theirs.rows == 2
    assert by_method["kvzap_mlp"].ratio_field == "threshold" and by_method["kvzap_mlp"].compression_ratio == -4
    table = leaderboard_table(rows)
    assert table.count("\n") == 2 + len(rows) - 1 and "(threshold)" in table


def test_the_leaderboard_refuses_folders_without_results_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        read_runs(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no kvpress results"):
        read_runs(tmp_path / "empty")
    folder = write_kvpress_folder(tmp_path / "bad", "snapkv")
    (folder / "config.yaml").write_text(yaml.safe_dump({"dataset": "ruler", "model": "m", "press_name": "snapkv"}))
    with pytest.raises(ValueError, match="lacks compression_ratio"):
        read_runs(folder)


def test_grkv_eval_writes_the_layout_and_grkv_leaderboard_reads_it_back(tmp_path, capsys):
    arguments = [
        "--model",
        "tiny-llama",
        "--tasks",
        "niah_single_1",
        "--context-length",
        "512",
        "--samples",
        "2",
        "--device",
        "cpu",
        "--no-progress",
        "--kvpress-dir",
        str(tmp_path / "kv"),
    ]
    assert main(["eval", *arguments, "--output", str(tmp_path / "eval.json")]) == 0
    folder = tmp_path / "kv" / "ruler__512__tiny-llama__snapkv__0.90"
    assert f"kvpress layout: {folder}" in capsys.readouterr().out
    summary = json.loads((tmp_path / "eval.json").read_text())["summary"]
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics == {task: {"string_match": round(score, 2)} for task, score in summary["tasks"].items()}
    frame = pd.read_csv(folder / "predictions.csv", keep_default_na=False)
    assert len(frame) == 2 and frame["answer_nll"].mean() == pytest.approx(summary["costs"]["answer_nll"])
    assert main(["leaderboard", str(tmp_path / "kv"), "--output-dir", str(tmp_path / "board")]) == 0
    out = capsys.readouterr().out
    assert "| ruler | 512 | tiny-llama | snapkv | 0.9 | no |" in out
    assert (tmp_path / "board" / "leaderboard.png").stat().st_size > 0
    assert (tmp_path / "board" / "leaderboard.md").read_text().strip() == out.split("table and figure")[0].strip()
    assert main(["leaderboard", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip() == f"grkv leaderboard: error: {tmp_path / 'nothing'}: no such folder"
