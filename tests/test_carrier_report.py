"""grkv analyze: carrier concentration over real prefill units, and its plots."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import subprocess
from pathlib import Path

import pytest
from conftest import VENV_BIN, tiny_model

from grkv_core.datasets import load_dataset_samples
from grkv_core.diagnostics.carrier_report import carrier_report

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("tiny-llama", attn_implementation="eager")


def test_carrier_report_covers_every_unit_and_plots(tiny, tmp_path):
    samples = load_dataset_samples(
        "ruler", tasks=["niah_single_1"], context_length=1024, samples_per_task=2, tokenizer=tiny.tokenizer
    )
    report = carrier_report(tiny, samples, "snapkv", 0.8, candidate_range=1024, plot_dir=tmp_path, progress=False)
    config = tiny.model.config
    # With a candidate range covering the whole context every evicted token is assigned: no unit is empty.
    assert report.units == len(samples) * config.num_hidden_layers * config.num_key_value_heads
    macro = report.macro
    assert 0 < macro.effective_fraction <= macro.active_fraction <= 1
    assert 0 <= macro.gini < 1 and macro.max_load_ratio >= 1
    assert 0 < macro.boundary_carrier_fraction <= 1 and 0 <= macro.boundary_assignment_ratio <= 1
    assert list(tmp_path.glob("merge_map_snapkv_layer*.png"))


def test_analyze_cli_compares_presses_and_writes_outputs(tmp_path):
    result = subprocess.run(
        [
            str(VENV_BIN / "grkv"),
            "analyze",
            "--model",
            "tiny-llama",
            "--tasks",
            "niah_single_1",
            "--context-length",
            "1024",
            "--samples",
            "1",
            "--press",
            "snapkv",
            "--compare",
            "h2o",
            "streamingllm",
            "--output-dir",
            str(tmp_path),
            "--no-progress",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "carrier_concentration.json").read_text())
    assert [row["press"] for row in rows] == ["snapkv", "h2o", "streamingllm"]
    # StreamingLLM keeps two spans (sinks and the recent window): all its assignments hit span boundaries
    # or the window, so its boundary carriers are few.
    assert rows[2]["boundary_carrier_fraction"] < 0.2
    assert (tmp_path / "cross_window_consistency.png").stat().st_size > 10_000
    assert "snapkv" in result.stdout and "h2o" in result.stdout
