"""``benchmarks/gpu_check.py`` on the CPU with tiny shapes: the GPU machine's command runs the same code, so it cannot
rot between the rare sessions that have a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from grkv_core.evaluation.results import SampleResult

REPO = Path(__file__).resolve().parents[1]


def on_tiny_shapes(module: str, output_dir: Path, *arguments: str) -> str:
    """``python -m benchmarks.<module> --device cpu --tiny`` with ``arguments``: what it printed, once it has exited
    0."""
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--device", "cpu", "--tiny", *arguments]
        + ["--output-dir", str(output_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def tiny_check(output_dir: Path, *arguments: str) -> tuple[dict, str]:
    """``gpu_check.py`` on tiny shapes with ``arguments``: its JSON report and what it printed."""
    printed = on_tiny_shapes("gpu_check", output_dir, *arguments)
    return json.loads((output_dir / "gpu_check.json").read_text()), printed


NOT_ON_CPU = "n/a (CPU)"


def test_the_gpu_check_runs_every_section_on_tiny_shapes(tmp_path):
    report, printed_output = tiny_check(tmp_path)
    sections = report["sections"]
    assert report["problems"] == [] and set(sections) == {
        "parity",
        "prefill",
        "first request",
        "memory",
        "trial engine",
        "out of memory",
        "bars",
    }
    assert [row["cache dtype"] for row in sections["parity"]] == ["float32", "bfloat16"]
    assert all(row["passed"] and row["key error"] < row["tolerance"] for row in sections["parity"])
    presses = {row["press"] for row in sections["prefill"]}
    assert presses == {
        "snapkv",
        "snapkv+grkv",
        "snapkv+grkv layers_per_solve=1",
        "snapkv+grkv side stream layers_per_solve=0",
        "snapkv+grkv side stream layers_per_solve=4",
        "snapkv+grkv stratified m=128",
    }
    rows = {(256, 1), (256, 2)}
    assert report["rows"] == [[256, 1], [256, 2]]
    assert {(row["context"], row["batch"]) for row in sections["prefill"]} == rows
    # The time to the second token is the prefill's and one decode step's, from the same start.
    assert all(
        row["second token ms"] > row["TTFT ms"] > 0 and row["synced prefill ms"] > 0 and row["decode ms/token"] > 0
        for row in sections["prefill"]
    )
    ratios = ("TTFT ratio", "second token ratio", "synced TTFT ratio")
    assert all(row[ratio] == 1 for row in sections["prefill"] if row["press"] == "snapkv" for ratio in ratios)
    assert all(
        row[column] == NOT_ON_CPU
        for row in sections["prefill"]
        for column in ("peak allocated GiB", "peak reserved GiB")
    )
    # GRKV dispatches operations of its own on every layer, fewer per layer the more layers share a solve (the
    # default: all of them), and reads the device on the host once per prefill (its warnings' counts). On the CPU a
    # side stream is no stream: its solves run in line.
    added = {(row["context"], row["batch"], row["press"]): row["added ops/layer"] for row in sections["prefill"]}
    for context, batch in rows:
        alone = added[context, batch, "snapkv+grkv layers_per_solve=1"]
        grouped = added[context, batch, "snapkv+grkv side stream layers_per_solve=4"]
        assert added[context, batch, "snapkv"] == 0 and alone > grouped > 0
    assert all(
        row["added host reads/layer"] == 1 / 4
        and row["merge µs/added op"] != ""
        and isinstance(row["merge ms/layer"], float)
        and row["added kernels/layer"] == NOT_ON_CPU
        for row in sections["prefill"]
        if row["press"] != "snapkv"
    )
    # The first request at each shape on its own line (no graph captured on the CPU), then the row's memory.
    assert {(row["context"], row["batch"]) for row in sections["first request"]} == rows
    assert all(
        row["press"] == "snapkv+grkv" and row["first prefill ms"] > 0 and row["graphs captured"] == 0
        for row in sections["first request"]
    )
    assert {(row["context"], row["batch"]) for row in sections["memory"]} == rows
    assert all(
        row[column] == NOT_ON_CPU
        for row in sections["memory"]
        for column in ("reserved GiB", "graph pools GiB", "CapturedSolves pool GiB")
    )
    # Issue #50's bars are at 4K and 32K: none measured on tiny shapes.
    assert sections["bars"] and all(row["holds"] == "n/a (not measured)" for row in sections["bars"])
    assert [row["mode"] for row in sections["trial engine"]] == ["full", "answer"]
    assert all(row["agree"] and row["tolerance"] == "exact" for row in sections["trial engine"])
    (oom,) = sections["out of memory"]
    assert oom["failed trials"] == 2 and oom["next batch ok"] == 2 and oom["as expected"]
    # Every row is printed as it is measured, and the markdown holds every section.
    printed = [line for line in printed_output.splitlines() if line.startswith("[")]
    assert len(printed) == sum(len(rows) for rows in sections.values())
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert all(f"## {section}" in markdown for section in sections) and "problems: none" in markdown


def test_the_bars_say_whether_each_holds_where_their_row_was_measured():
    from benchmarks.gpu_measure import Report
    from benchmarks.gpu_prefill import BARS, check_bars

    report = Report("test", {})
    row = {"context": 32768, "batch": 1, "attention": "sdpa"}
    base = {"TTFT ratio": 1.0, "second token ratio": 1.0, "peak reserved GiB": 20.0}
    report.sections["prefill"] = [
        {**row, "press": "snapkv", **base},
        {**row, "press": "snapkv+grkv", "TTFT ratio": 1.01, "second token ratio": 1.03, "peak reserved GiB": 20.5},
    ]
    report.sections["memory"] = [{**row, "graph pools GiB": 2.5}]
    check_bars(report)
    bars = {(bar["bar"], bar["press"], bar["context"], bar["batch"]): bar for bar in report.sections["bars"]}
    assert len(bars) == len(BARS)
    assert bars["TTFT ratio <= 1.02", "snapkv+grkv", 32768, 1]["holds"] is True
    assert bars["second token ratio <= 1.02", "snapkv+grkv", 32768, 1]["holds"] is False
    assert bars["graph pools GiB <= 2", "", 32768, 1]["holds"] is False
    reserved = bars["peak reserved GiB above SnapKV <= 1", "snapkv+grkv", 32768, 1]
    assert reserved["holds"] is True and reserved["measured"] == 0.5
    assert bars["TTFT ratio <= 1.05", "snapkv+grkv", 4096, 1]["holds"] == "n/a (not measured)"
    assert bars["TTFT ratio <= 1.01", "snapkv+grkv preset=window32", 32768, 1]["measured"] == ""


def _result(**changes) -> SampleResult:
    base = SampleResult(
        sample_id="s",
        task="t",
        predictions=["42"],
        scores=[1.0],
        score=1.0,
        context_tokens=10,
        ttft_s=0.1,
        prefill_s=0.1,
        decode_ms_per_token=1.0,
        generated_tokens=3,
        kv_bytes=100,
        full_kv_bytes=1000,
        peak_memory_bytes=0,
        window_loss=0.5,
        heldout_loss=0.25,
        wall_s=1.0,
        answer_nll=12.7,
        answer_kl=1.0,
        answer_top1=0.5,
    )
    return replace(base, **changes)


def test_the_engine_check_is_exact_in_float32_and_to_the_format_in_bfloat16():
    from benchmarks.sweep_throughput import BATCHED_RTOL, mismatches

    rtol = BATCHED_RTOL[torch.bfloat16]
    # The differences the H200 run showed between the engine's batched forwards and single-trial ones
    # (docs/results/gpu.md)
    rounded = _result(
        answer_nll=12.7278, heldout_loss=0.19661, predictions=[""], scores=[0.0], score=0.0, answer_top1=0.25
    )
    reference = _result(answer_nll=12.7047, heldout_loss=0.19652)
    found, largest = mismatches([rounded], [reference])
    assert {problem.split()[1] for problem in found} == {
        "answer_nll",
        "heldout_loss",
        "predictions",
        "scores",
        "score",
        "answer_top1",
    }
    assert mismatches([rounded], [reference], rtol) == ([], abs(12.7278 - 12.7047))
    # The held-out loss comes from each cache's own decoding, which bfloat16 measures to a few percent on either path.
    assert mismatches([_result(answer_nll=12.7047, heldout_loss=0.2)], [reference], rtol) == ([], 0.0)
    # Beyond the format's precision, or in what the merge computes once per trial, it is still a difference.
    far = _result(answer_nll=12.7047 * (1 + 2 * rtol), heldout_loss=0.19652)
    assert [problem.split()[1] for problem in mismatches([far], [reference], rtol)[0]] == ["answer_nll"]
    merged_differently = _result(window_loss=0.5001, kv_bytes=101, heldout_loss=0.19652)
    assert {problem.split()[1] for problem in mismatches([merged_differently], [reference], rtol)[0]} == {
        "window_loss",
        "kv_bytes",
    }
    assert mismatches([reference], [reference]) == ([], 0.0)


def test_the_prefill_only_check_times_the_query_policies_and_presets_asked_for(tmp_path):
    report, _ = tiny_check(
        tmp_path,
        "--prefill-only",
        "--rows",
        "256x1",
        "128x2",
        "--query-policies",
        "mixture",
        "expected",
        "--presets",
        "window32",
    )
    assert report["problems"] == [] and set(report["sections"]) == {
        "parity",
        "prefill",
        "first request",
        "memory",
        "bars",
    }
    assert {(row["context"], row["batch"]) for row in report["sections"]["prefill"]} == {(256, 1), (128, 2)}
    presses = {row["press"] for row in report["sections"]["prefill"]}
    assert {"snapkv+grkv mixture m=128", "snapkv+grkv expected m=128", "snapkv+grkv preset=window32"} <= presses
    assert not any("stratified" in press for press in presses)
    assert all(row["added host reads/layer"] * 4 <= 1 for row in report["sections"]["prefill"])


def test_the_per_head_gpu_measurement_runs_on_tiny_shapes(tmp_path):
    """``benchmarks/gpu_per_head.py`` (issue #60's GPU note) on the CPU: both layouts decode the same greedy tokens,
    the per-head cache holds about a tenth of the masked one's bytes, and the reference path serves it."""
    on_tiny_shapes("gpu_per_head", tmp_path, "--context", "256", "--decode-tokens", "4", "--rounds", "1")
    report = json.loads((tmp_path / "per_head.json").read_text())
    masked, per_head = report["layouts"]
    assert (masked["attention"], per_head["attention"]) == ("sdpa", "reference")
    ratios = report["per-head / masked"][0]
    assert 0.09 <= ratios["kv_MiB"] <= 0.12 and ratios["same_greedy_tokens"] == "4/4"
    assert (tmp_path / "per_head.md").read_text().count("| per-head |") == 1
