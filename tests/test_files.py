"""Whole-or-nothing writes: result files, checkpoints, the sweep's state and kvpress folders go through them. JSON read
plain or gzip-compressed: every reader of a result file, the committed ones among them, goes through ``read_json``."""

from __future__ import annotations

import errno
import gzip
import json
import os
from pathlib import Path

import pytest

from grkv_core.config import EvalConfig, PressConfig
from grkv_core.evaluation.results import ResultStore, SampleResult
from grkv_core.files import json_files, json_source, read_json, write_atomically

REPO = Path(__file__).resolve().parents[1]


def test_a_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "results.json"
    write_atomically(path, "old")
    write_atomically(path, "new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


@pytest.mark.parametrize("failing", ["write_text", "replace"])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_partial_one(tmp_path, monkeypatch, failing):
    path = tmp_path / "results.json"
    write_atomically(path, "old")

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if failing == "replace":
        monkeypatch.setattr(os, "replace", disk_full)
    else:
        monkeypatch.setattr(type(path), "write_text", lambda self, text: (self.touch(), disk_full()))
    with pytest.raises(OSError, match="No space left"):
        write_atomically(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def compress(path: Path) -> Path:
    """``gzip -9n path``: the compressed copy, the plain file removed."""
    compressed = path.with_name(path.name + ".gz")
    compressed.write_bytes(gzip.compress(path.read_bytes(), compresslevel=9, mtime=0))
    path.unlink()
    return compressed


def test_json_is_read_from_the_file_else_from_its_compressed_copy_and_the_plain_file_wins(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"samples": [1]}))
    compressed = compress(path)
    assert json_source(path) == compressed and read_json(path) == {"samples": [1]}
    path.write_text(json.dumps({"samples": [1, 2]}))
    assert json_source(path) == path and read_json(path) == {"samples": [1, 2]}
    assert json_source(tmp_path / "b.json") is None
    with pytest.raises(FileNotFoundError, match="b.json.gz"):
        read_json(tmp_path / "b.json")


def test_json_files_names_plain_and_compressed_files_once_each_by_their_plain_name(tmp_path):
    for name in ("x+a.json", "x+b.json", "x.json", "y+c.json", "notes.md"):
        (tmp_path / name).write_text("{}")
    compress(tmp_path / "x+b.json")
    compress(tmp_path / "y+c.json")
    (tmp_path / "x+a.json.gz").write_bytes(gzip.compress(b"{}"))
    assert [path.name for path in json_files(tmp_path, "x+*.json")] == ["x+a.json", "x+b.json"]
    assert [path.name for path in json_files(tmp_path)] == ["x+a.json", "x+b.json", "x.json", "y+c.json"]


def result(sample_id: str) -> SampleResult:
    return SampleResult(
        sample_id, "niah_single_1", ["42"], [1.0], 1.0, 100, 0.1, 0.1, 5.0, 4, 10, 50, 0, 0.01, 0.02, 0.2
    )


def test_a_run_resumes_from_a_compressed_result_file_and_writes_the_plain_one(tmp_path):
    path = tmp_path / "snapkv-20pct.json"
    config = EvalConfig(model="tiny-llama", tasks=("niah_single_1",), samples=2, press=PressConfig("snapkv", 0.8))
    store = ResultStore(path, config, "float32")
    store.add(result("s0"))
    compress(path)
    resumed = ResultStore(path, config, "float32")
    assert resumed.results == [result("s0")]
    resumed.add(result("s1"))
    assert [row["sample_id"] for row in json.loads(path.read_text())["samples"]] == ["s0", "s1"]
    assert ResultStore(path, config, "float32").results == [result("s0"), result("s1")]


def test_the_committed_result_files_are_compressed_reproducibly_and_read_whole():
    """gzip -9n: no name and no time in the header, so compressing the same file again gives the same bytes."""
    compressed = sorted((REPO / "benchmarks" / "results").rglob("*.json.gz"))
    assert compressed
    for path in compressed:
        header = path.read_bytes()[:10]
        assert header[3] == 0 and header[4:8] == bytes(4), f"{path}: a name or a time in its gzip header"
    assert all(isinstance(read_json(path.with_suffix(""))["samples"], list) for path in compressed)
