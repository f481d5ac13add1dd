"""Whole-or-nothing writes: result files, checkpoints, the sweep's state and kvpress folders go through them."""

from __future__ import annotations

import errno
import os

import pytest

from grkv_core.files import write_atomically


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
