"""Per-sample paired comparison of `grkv compare` (or `grkv eval`) results against a reference method.

    .venv/bin/python -m benchmarks.paired_losses benchmarks/results/answer-regime/question_agnostic \
        --reference snapkv-20pct

For every result file in the folder (one method each), over the samples it shares with the reference, and for each
metric (answer NLL, KL and top-1, the score, the window and held-out losses by default): the method's mean, the mean
paired difference (method minus reference) with its 95% percentile bootstrap CI, the samples where the method is
better / worse with a two-sided exact sign test p-value (ties dropped). A markdown table, one row per method and
metric. A result file is read plain (``x.json``) or compressed (``x.json.gz``, as committed): ``grkv_core.files``.
"""

from __future__ import annotations

import argparse
from math import comb
from pathlib import Path

from grkv_core.files import json_files, read_json
from grkv_core.metrics import ANSWER_METRICS, HIGHER_IS_BETTER
from tracking.reports.stats import paired_bootstrap_ci

DEFAULT_METRICS = (*ANSWER_METRICS, "score", "window_loss", "heldout_loss")


def sign_test(better: int, worse: int) -> float:
    """Two-sided exact binomial sign-test p-value of ``better`` vs ``worse`` (ties already dropped)."""
    n = better + worse
    if n == 0:
        return 1.0
    tail = sum(comb(n, k) for k in range(min(better, worse) + 1)) / 2**n
    return min(1.0, 2 * tail)


def by_sample(path: Path) -> dict[str, dict]:
    """The rows of the result file ``path`` (or of its compressed copy, ``path.gz``) by sample id."""
    return {row["sample_id"]: row for row in read_json(path)["samples"]}


def paired_row(method: str, metric: str, rows: dict[str, dict], reference: dict[str, dict]) -> dict | None:
    """One table row: ``metric`` of ``rows`` against ``reference`` on the samples where both measured it."""
    pairs = [
        (rows[s][metric], reference[s][metric])
        for s in reference
        if s in rows and rows[s].get(metric) is not None and reference[s].get(metric) is not None
    ]
    if not pairs:
        return None
    differences = [a - b for a, b in pairs]
    sign = 1 if metric in HIGHER_IS_BETTER else -1
    better = sum(1 for d in differences if sign * d > 0)
    worse = sum(1 for d in differences if sign * d < 0)
    ci = paired_bootstrap_ci(differences)
    return {
        "method": method,
        "metric": metric,
        "n": len(pairs),
        "mean": sum(a for a, _ in pairs) / len(pairs),
        "difference": ci.estimate,
        "low": ci.low,
        "high": ci.high,
        "better": better,
        "worse": worse,
        "p": sign_test(better, worse),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--reference", required=True, help="file stem of the reference method")
    parser.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS))
    args = parser.parse_args()
    reference = by_sample(args.folder / f"{args.reference}.json")
    print("| method | metric | n | mean | Δ vs reference [95% CI] | better / worse | p |")
    print("|---|---|---|---|---|---|---|")
    for path in json_files(args.folder):
        if path.stem == args.reference:
            continue
        rows = by_sample(path)
        for metric in args.metrics:
            row = paired_row(path.stem, metric, rows, reference)
            if row is not None:
                print(
                    f"| {row['method']} | {metric} | {row['n']} | {row['mean']:.4g} | {row['difference']:+.4f} "
                    f"[{row['low']:+.4f}, {row['high']:+.4f}] | {row['better']} / {row['worse']} | {row['p']:.2g} |"
                )


if __name__ == "__main__":
    main()
