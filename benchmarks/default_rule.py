"""The selection rule of GRKV's default (docs/results/default-rule.md), applied to `grkv compare` cells.

    .venv/bin/python -m benchmarks.default_rule benchmarks/results/default-rule
    .venv/bin/python -m benchmarks.default_rule benchmarks/results/default-confirmation --samples smollm2-135m=40

The folder holds one `grkv compare` output folder per model and protocol (``MODEL/PROTOCOL/``); in each, a base press's
result file (``snapkv-20pct.json``) and one file per candidate behind it (``snapkv-20pct+CANDIDATE.json``), each plain
or compressed (``.json.gz``, as committed), make a cell. For every cell and candidate: the paired difference of the
answer NLL and of the answer KL against the base press alone, per sample (mean, 95% bootstrap CI, two-sided sign-flip
p). Holm's correction runs over each candidate's tests (every cell, both metrics). A candidate is *worse* in a cell
where either metric's difference is positive at a Holm-adjusted p below ``ALPHA``, *better* where the answer NLL's is
negative at it. It passes with no cell worse and at least half better; the winner is the passing candidate with the
largest mean gain in answer NLL over the cells, and among those within ``TIE_NATS`` of it, the cheapest prefill (median
of its prefill time over the base press's, per sample). Without a passing candidate the default is the best that is
worse nowhere (the no-harm fallback), else the one worse in the fewest cells. The verdict waits for every cell to have
its samples. ``--samples`` names other cells' models and sizes: the confirmation's, the chosen default alone on fresh
samples (``bash benchmarks/default_rule.sh confirm``), gets its standing and no verdict.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.paired_losses import by_sample
from grkv_core.files import json_files, json_source
from tracking.reports.stats import paired_bootstrap_ci, sign_flip_test

ALPHA = 0.01
TIE_NATS = 0.002
METRICS = ("answer_nll", "answer_kl")
SIGN_FLIP_RESAMPLES = 100_000
# The rule's cells (docs/results/default-rule.md): base presses, and samples per cell by model.
BASE_PRESSES = ("snapkv-10pct", "snapkv-20pct", "snapkv-50pct", "pyramidkv-20pct")
SAMPLES_PER_CELL = {"smollm2-135m": 80, "gemma3-270m": 40}
PROTOCOLS = ("query_aware", "question_agnostic")


@dataclass(frozen=True)
class PairedTest:
    """One candidate's paired comparison with the base press in one cell, on one metric."""

    cell: str
    metric: str
    n: int
    difference: float
    low: float
    high: float
    p: float
    holm_p: float = 1.0


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given."""
    order = sorted(range(len(p_values)), key=p_values.__getitem__)
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def cell_tests(cell: str, base: dict[str, dict], candidate: dict[str, dict]) -> list[PairedTest]:
    tests = []
    for metric in METRICS:
        differences = [
            candidate[s][metric] - base[s][metric]
            for s in base
            if s in candidate and candidate[s].get(metric) is not None and base[s].get(metric) is not None
        ]
        if differences:
            ci = paired_bootstrap_ci(differences)
            p = sign_flip_test(differences, n_resamples=SIGN_FLIP_RESAMPLES)
            tests.append(PairedTest(cell, metric, len(differences), ci.estimate, ci.low, ci.high, p))
    return tests


def prefill_ratio(base: dict[str, dict], candidate: dict[str, dict]) -> float:
    return statistics.median(candidate[s]["prefill_s"] / base[s]["prefill_s"] for s in base if s in candidate)


@dataclass(frozen=True)
class Standing:
    """A candidate over every cell: its Holm-adjusted tests and what the rule reads from them."""

    name: str
    tests: list[PairedTest]
    cost: float  # median prefill ratio to the base press over all cells' samples

    def worse_cells(self) -> set[str]:
        return {t.cell for t in self.tests if t.difference > 0 and t.holm_p < ALPHA}

    def better_cells(self) -> set[str]:
        return {t.cell for t in self.tests if t.metric == "answer_nll" and t.difference < 0 and t.holm_p < ALPHA}

    def mean_gain(self) -> float:
        """Minus the mean over the cells of the answer NLL's difference (positive: lower NLL than the base)."""
        nll = [t.difference for t in self.tests if t.metric == "answer_nll"]
        return -sum(nll) / len(nll)


def standing(name: str, tests: list[PairedTest], cost: float) -> Standing:
    adjusted = holm([t.p for t in tests])
    return Standing(
        name, [PairedTest(**{**t.__dict__, "holm_p": p}) for t, p in zip(tests, adjusted, strict=True)], cost
    )


def choose(standings: list[Standing], cells: int) -> tuple[Standing, str]:
    """The rule's pick and why: the passing candidate of largest mean gain (ties within ``TIE_NATS`` to the cheapest
    prefill); else the no-harm fallback; else the candidate worse in the fewest cells."""
    passing = [s for s in standings if not s.worse_cells() and 2 * len(s.better_cells()) >= cells]
    if passing:
        best = max(s.mean_gain() for s in passing)
        tied = [s for s in passing if s.mean_gain() >= best - TIE_NATS]
        return min(tied, key=lambda s: s.cost), "passes: worse in no cell, better in at least half"
    harmless = [s for s in standings if not s.worse_cells()]
    if harmless:
        return max(harmless, key=Standing.mean_gain), "no candidate passes; the no-harm fallback"
    pick = min(standings, key=lambda s: (len(s.worse_cells()), -s.mean_gain()))
    return pick, "no candidate is harmless; the one worse in the fewest cells"


def read_cells(
    root: Path, samples_per_cell: dict[str, int]
) -> tuple[dict[str, dict[str, list[PairedTest]]], dict[str, list[float]], dict[str, int]]:
    """{candidate: {cell: tests}}, {candidate: per-cell prefill ratios}, {cell: samples missing}."""
    tests: dict[str, dict[str, list[PairedTest]]] = {}
    costs: dict[str, list[float]] = {}
    missing: dict[str, int] = {}
    for model, wanted in samples_per_cell.items():
        for protocol in PROTOCOLS:
            folder = root / model / protocol
            for press in BASE_PRESSES:
                cell = f"{model} {protocol} {press}"
                base_path = folder / f"{press}.json"
                base = by_sample(base_path) if json_source(base_path) is not None else {}
                missing[cell] = max(0, wanted - len(base))
                for path in json_files(folder, f"{press}+*.json"):
                    candidate = by_sample(path)
                    name = path.stem.split("+", 1)[1]
                    missing[cell] = max(missing[cell], wanted - len(candidate.keys() & base.keys()))
                    tests.setdefault(name, {})[cell] = cell_tests(cell, base, candidate)
                    costs.setdefault(name, []).append(prefill_ratio(base, candidate))
    return tests, costs, missing


def report(root: Path, samples_per_cell: dict[str, int] = SAMPLES_PER_CELL) -> str:
    """The tables of every cell and the rule's standing of every candidate; the verdict once every cell has its
    samples and there is a choice (a confirmation's one candidate gets its standing alone)."""
    tests, costs, missing = read_cells(root, samples_per_cell)
    standings = [
        standing(name, [t for c in per_cell.values() for t in c], statistics.median(costs[name]))
        for name, per_cell in sorted(tests.items())
    ]
    lines = []
    for cell in missing:
        lines += [
            f"### {cell}",
            "",
            "| candidate | n | Δ answer NLL [95% CI] | p (Holm) | Δ answer KL [95% CI] | p (Holm) |",
        ]
        lines.append("|---|---|---|---|---|---|")
        for found in standings:
            row = {t.metric: t for t in found.tests if t.cell == cell}
            if set(row) == set(METRICS):
                lines.append(
                    f"| {found.name} | {row['answer_nll'].n} | "
                    + " | ".join(
                        f"{t.difference:+.4f} [{t.low:+.4f}, {t.high:+.4f}] | {t.p:.2g} ({t.holm_p:.2g})"
                        for t in (row[m] for m in METRICS)
                    )
                    + " |"
                )
        lines.append("")
    lines += ["## The rule", "", "| candidate | mean gain (nats) | better cells | worse cells | prefill / base |"]
    lines.append("|---|---|---|---|---|")
    for s in sorted(standings, key=lambda s: -s.mean_gain()):
        lines.append(
            f"| {s.name} | {s.mean_gain():+.4f} | {len(s.better_cells())} | {len(s.worse_cells())} | {s.cost:.3f} |"
        )
    incomplete = {cell: n for cell, n in missing.items() if n}
    if incomplete:
        lines += ["", f"No verdict: {len(incomplete)} of {len(missing)} cells lack samples ({incomplete})."]
    elif len(standings) > 1:
        pick, why = choose(standings, len(missing))
        lines += ["", f"Verdict: **{pick.name}** ({why})."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument(
        "--samples",
        nargs="+",
        metavar="MODEL=N",
        help="the cells' models and samples per cell (default: the rule's, "
        + " ".join(f"{model}={n}" for model, n in SAMPLES_PER_CELL.items())
        + "; the confirmation: smollm2-135m=40)",
    )
    args = parser.parse_args()
    cells = SAMPLES_PER_CELL
    if args.samples:
        cells = {model: int(n) for model, _, n in (item.partition("=") for item in args.samples)}
    print(report(args.folder, cells))


if __name__ == "__main__":
    main()
