"""``benchmarks/gpu_check.py`` on the CPU with tiny shapes: the GPU machine's command runs the same code, so it cannot
rot between the rare sessions that have a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_every_section_on_tiny_shapes(tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--tiny", "--output-dir",
                             str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert report["problems"] == [] and set(sections) == {"parity", "prefill", "trial engine", "out of memory"}
    assert [row["cache dtype"] for row in sections["parity"]] == ["float32", "bfloat16"]
    assert all(row["passed"] and row["key error"] < row["tolerance"] for row in sections["parity"])
    presses = {row["press"] for row in sections["prefill"]}
    assert presses == {"snapkv", "snapkv+grkv layers_per_solve=1", "snapkv+grkv layers_per_solve=4"}
    assert {(row["context"], row["batch"]) for row in sections["prefill"]} == {(256, 1), (256, 2)}
    assert all(row["prefill ms"] > 0 and row["decode ms/token"] > 0 for row in sections["prefill"])
    assert all(row["TTFT ratio"] == 1 for row in sections["prefill"] if row["press"] == "snapkv")
    assert [row["mode"] for row in sections["trial engine"]] == ["full", "answer"]
    assert all(row["identical"] for row in sections["trial engine"])
    (oom,) = sections["out of memory"]
    assert oom["failed trials"] == 2 and oom["next batch ok"] == 2 and oom["as expected"]
    # Every row is printed as it is measured, and the markdown holds every section.
    printed = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert len(printed) == sum(len(rows) for rows in sections.values())
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert all(f"## {section}" in markdown for section in sections) and "problems: none" in markdown
