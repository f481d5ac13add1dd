"""Per-sample paired comparison of `grkv compare` results: how often each method beats a reference.

    PYTHONPATH=. .venv/bin/python benchmarks/paired_losses.py benchmarks/results/safeguard-ablation \
        --reference snapkv-10pct+grv

For every result file in the folder (one method each), over the samples it shares with the reference: the
mean score and losses, and for the window and held-out losses and the score, the number of samples where the
method is better / worse than the reference, with a two-sided exact sign test p-value (ties dropped).
"""

from __future__ import annotations

import argparse
import json
from math import comb
from pathlib import Path


def sign_test(better: int, worse: int) -> float:
    """Two-sided exact binomial sign-test p-value of ``better`` vs ``worse`` (ties already dropped)."""
    n = better + worse
    if n == 0:
        return 1.0
    tail = sum(comb(n, k) for k in range(min(better, worse) + 1)) / 2**n
    return min(1.0, 2 * tail)


def by_sample(path: Path) -> dict[str, dict]:
    return {row["sample_id"]: row for row in json.loads(path.read_text())["samples"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--reference", required=True, help="file stem of the reference method")
    args = parser.parse_args()
    reference = by_sample(args.folder / f"{args.reference}.json")
    print(f"{'method':30s} {'n':>3s} {'score':>6s} {'window':>8s} {'held-out':>8s}   "
          f"{'window +/-':>10s} {'p':>7s}   {'held-out +/-':>12s} {'p':>7s}   {'score +/-':>9s} {'p':>6s}")
    for path in sorted(args.folder.glob("*.json")):
        rows = by_sample(path)
        shared = [sample_id for sample_id in reference if sample_id in rows]
        cells = []
        for metric, lower_is_better in (("window_loss", True), ("heldout_loss", True), ("score", False)):
            pairs = [(rows[s][metric], reference[s][metric]) for s in shared
                     if rows[s][metric] is not None and reference[s][metric] is not None]
            better = sum((a < b) if lower_is_better else (a > b) for a, b in pairs)
            worse = sum((a > b) if lower_is_better else (a < b) for a, b in pairs)
            cells.append(f"{better:>4d}/{worse:<4d} {sign_test(better, worse):8.2g}")

        def mean(metric):
            values = [rows[s][metric] for s in shared if rows[s][metric] is not None]
            return sum(values) / len(values) if values else float("nan")

        print(f"{path.stem:30s} {len(shared):3d} {100 * mean('score'):6.1f} {mean('window_loss'):8.4f} "
              f"{mean('heldout_loss'):8.4f}   {cells[0]}   {cells[1]:>20s}   {cells[2]}")


if __name__ == "__main__":
    main()
