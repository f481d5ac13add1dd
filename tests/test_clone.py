"""A clone stays light: the tracked files weigh at most 10 MB, the committed per-sample results compressed
(docs/results/README.md, "Where the outputs are")."""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 10_000_000


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="not a git checkout")
def test_the_tracked_files_weigh_at_most_10_mb():
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    # NOTE: a tracked file deleted in the working tree but not yet in git is listed and weighs nothing here.
    paths = [REPO / name for name in listed.stdout.split("\0") if name]
    sizes = {path: path.stat().st_size for path in paths if path.is_file()}
    assert len(sizes) > 100
    heaviest = sorted(sizes, key=sizes.get)[-3:]
    assert sum(sizes.values()) <= LIMIT_BYTES, f"tracked files over 10 MB; the heaviest: {heaviest}"
