"""Is a merge worth its memory where a cache stays bounded? The pre-registered runs of docs/results/bounded-cache.md.

    python -m benchmarks.bounded_cache tune  benchmarks/results/bounded-cache      # choose GRKV's options (tune texts)
    python -m benchmarks.bounded_cache table benchmarks/results/bounded-cache --model smollm2-135m --texts 40
    # or one process per domain, side by side: ... --texts 40 --domains essays & ... --texts 40 --domains code
    python -m benchmarks.bounded_cache report benchmarks/results/bounded-cache     # the tables, from what is done

``tune`` streams the tune texts (never the table's) under each candidate of ``TUNING_CANDIDATES`` behind StreamingLLM
at target 512 and writes the one with the lowest mean NLL to ``<dir>/tuned.json``. ``table`` streams the eval texts
under the full cache and every cell (3 target sizes × 3 base presses × eviction alone, + GRKV with the tuned options,
+ CaM, + D2O), text by text: every cell has the same texts at every moment, and a stopped run resumes at its next
text (``--texts`` says how many to reach; run it in chunks). ``report`` writes ``<dir>/report.md``: per model and cell
the mean NLL, each merger's paired difference to eviction alone at its size (mean, 95% bootstrap CI, sign-flip p),
and the exchange rate: the eviction target size whose NLL equals the merger's, interpolated in log2(size) between the
measured sizes; each merger's verdict under the rule; and what the texts cost (the rows' ``seconds``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from benchmarks.default_rule import holm
from grkv_core.config import FULL_CACHE, PressConfig, StreamConfig
from grkv_core.options import GRKV_PRESETS

TARGET_SIZES = (256, 512, 1024)
INTERVAL = 128
BASE_PRESSES = ("streamingllm", "snapkv", "knorm")
MERGERS = ("none", "grkv", "cam", "d2o")
MODELS = ("smollm2-135m", "gemma3-270m")
DOMAINS = ("essays", "code")
MAX_TOKENS = 4096
TEXTS_PER_CELL = 40  # the rule's n: a cell with fewer is marked partial in the report
# What the tuning chooses among (``tune``): the library's default, the paper's Alg. 1, the default before 2026-11-28,
# and the paper's surrogate rows (the most recent tokens) at the default's m and ridges.
TUNING_CANDIDATES = {
    "default": {},
    "paper": GRKV_PRESETS["paper"],
    "window32": GRKV_PRESETS["window32"],
    "recent64": {"query_policy": "window"},
}
TUNING_TEXTS_PER_DOMAIN = 2


def stream_config(model: str, domain: str, split: str, samples: int, press: PressConfig, size: int) -> StreamConfig:
    return StreamConfig(
        protocol="stream_nll",
        press=press,
        target_size=size,
        compression_interval=INTERVAL,
        model=model,
        source=domain,
        split=split,
        samples=samples,
        max_tokens=MAX_TOKENS,
    )


def cells(tuned: dict) -> list[tuple[str, PressConfig, int]]:
    """(file name, press, target size) of the full cache and every cell of the table."""
    rows = [("full", PressConfig(FULL_CACHE, 0.0), TARGET_SIZES[0])]
    for size in TARGET_SIZES:
        for press in BASE_PRESSES:
            for merge in MERGERS:
                options = tuned if merge == "grkv" else {}
                rows.append((f"{press}-{size}-{merge}", PressConfig(press, 0.0, merge, options), size))
    return rows


def run(configs: list[StreamConfig], outputs: list[Path]) -> list[dict]:
    from grkv_core.evaluation.stream_eval import run_stream_evaluations

    return run_stream_evaluations(configs, outputs)


def tune(folder: Path) -> dict:
    scores = {}
    for domain in DOMAINS:
        configs, outputs = [], []
        for name, options in TUNING_CANDIDATES.items():
            press = PressConfig("streamingllm", 0.0, "grkv", dict(options))
            configs.append(stream_config(MODELS[0], domain, "tune", TUNING_TEXTS_PER_DOMAIN, press, 512))
            outputs.append(folder / "tune" / domain / f"{name}.jsonl")
        for name, summary in zip(TUNING_CANDIDATES, run(configs, outputs)):
            scores.setdefault(name, []).extend(row["nll"] for row in summary["per_item"])
    means = {name: sum(values) / len(values) for name, values in scores.items()}
    chosen = min(means, key=means.get)
    result = {"chosen": chosen, "options": TUNING_CANDIDATES[chosen], "mean_nll": means}
    (folder / "tuned.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def table(folder: Path, model: str, texts: int, domains: tuple[str, ...] = DOMAINS) -> None:
    tuned = json.loads((folder / "tuned.json").read_text())["options"]
    per_domain = math.ceil(texts / len(DOMAINS))
    for domain in domains:
        rows = cells(tuned)
        configs = [stream_config(model, domain, "eval", per_domain, press, size) for _, press, size in rows]
        run(configs, [folder / model / domain / f"{name}.jsonl" for name, _, _ in rows])


def read_cell(folder: Path, model: str, name: str, field: str = "nll") -> dict[str, float]:
    """{text id: its ``field`` (the mean NLL, or the run's ``seconds``)} of one cell over both domains (what is done so
    far)."""
    found = {}
    for domain in DOMAINS:
        path = folder / model / domain / f"{name}.jsonl"
        if path.exists():
            for line in path.read_text().splitlines()[1:]:
                row = json.loads(line)
                found[f"{domain}/{row['item_id']}"] = row[field]
    return found


def exchange_rate(nll: float, eviction: dict[int, float]) -> str:
    """The eviction target size at which eviction's NLL equals ``nll`` (linear in log2(size) between measured sizes);
    "< smallest" or "> largest" outside them."""
    sizes = sorted(eviction)
    if nll >= eviction[sizes[0]]:
        return f"≤ {sizes[0]}"
    for low, high in zip(sizes, sizes[1:]):
        if eviction[high] <= nll <= eviction[low]:
            drop = eviction[low] - eviction[high]
            fraction = (eviction[low] - nll) / drop if drop else 0.0
            return f"{2 ** (math.log2(low) + fraction * (math.log2(high) - math.log2(low))):.0f}"
    return f"> {sizes[-1]}"


def cost(folder: Path, model: str) -> str:
    """One line: the minutes a text took through every row of ``model`` and a GRKV row's time over its eviction row's
    (the ``seconds`` each row records; on shared cores, so a median and a range)."""
    seconds = {name: read_cell(folder, model, name, "seconds") for name, _, _ in cells({})}
    through_all = [
        sum(row[text] for row in seconds.values()) / 60 for text in set.intersection(*map(set, seconds.values()))
    ]
    ratios = [
        merged[text] / seconds[name.removesuffix("grkv") + "none"][text]
        for name, merged in seconds.items()
        if name.endswith("-grkv")
        for text in merged.keys() & seconds[name.removesuffix("grkv") + "none"].keys()
    ]
    if not through_all or not ratios:
        return "Cost: no text has been through every row yet."
    return (
        f"Cost (the rows' `seconds`): a text through all {len(seconds)} rows took a median "
        f"{statistics.median(through_all):.0f} minutes ({min(through_all):.0f} to {max(through_all):.0f}, "
        f"{len(through_all)} texts); a GRKV row a median {statistics.median(ratios):.2f}× its eviction row's time "
        f"({len(ratios)} pairs)."
    )


def report(folder: Path) -> str:
    """The measured cells per model, each merger's verdict under the rule, and the exchange rates."""
    from tracking.reports.stats import paired_bootstrap_ci, sign_flip_test

    lines = ["# Bounded caches: the measured cells", ""]
    for model in MODELS:
        full = read_cell(folder, model, "full")
        if not full:
            continue
        full_mean = sum(full.values()) / len(full)
        lines += [f"## {model}", "", f"Full cache: mean NLL {full_mean:.4f} over {len(full)} texts.", ""]
        lines += ["| press | size | merger | n | mean NLL | Δ vs eviction [95% CI] | p (Holm) | exchange rate |"]
        lines += ["|---|---:|---|---:|---:|---:|---:|---:|"]
        rows, verdicts = [], []
        for merge in MERGERS:
            found = []
            for press in BASE_PRESSES:
                means = {size: read_cell(folder, model, f"{press}-{size}-none") for size in TARGET_SIZES}
                eviction = {size: sum(cell.values()) / len(cell) for size, cell in means.items() if cell}
                for size in TARGET_SIZES:
                    cell, evicted = read_cell(folder, model, f"{press}-{size}-{merge}"), means[size]
                    texts = sorted(set(cell) & set(evicted))
                    if texts:
                        found.append((press, size, texts, cell, evicted, eviction))
            p_values = []
            for press, size, texts, cell, evicted, eviction in found:
                differences = [cell[text] - evicted[text] for text in texts]
                p_values.append(sign_flip_test(differences, n_resamples=100_000) if merge != "none" else 1.0)
            adjusted = holm(p_values) if merge != "none" else p_values
            better = worse = 0
            ratios, deltas = [], []
            for (press, size, texts, cell, evicted, eviction), p in zip(found, adjusted):
                mean = sum(cell[text] for text in texts) / len(texts)
                delta = shown_p = rate = ""
                if merge != "none":
                    ci = paired_bootstrap_ci([cell[text] - evicted[text] for text in texts], n_resamples=10_000)
                    delta, shown_p = f"{ci.estimate:+.4f} [{ci.low:+.4f}, {ci.high:+.4f}]", f"{p:.3g}"
                    deltas.append(ci.estimate)
                    better += ci.estimate < 0 and p < 0.01
                    worse += ci.estimate > 0 and p < 0.01
                    if len(eviction) == len(TARGET_SIZES):
                        rate = exchange_rate(mean, eviction)
                        if rate[0].isdigit():
                            ratios.append(float(rate) / size)
                n = f"{len(texts)}" + (" (partial)" if len(texts) < TEXTS_PER_CELL else "")
                cells_text = f"{n} | {mean:.4f} | {delta} | {shown_p} | {rate}"
                rows.append(f"| {press} | {size} | {merge} | {cells_text} |")
            if merge != "none" and found:
                verdict = "earns its memory" if better >= 5 and not worse else "does no harm" if not worse else "harms"
                median = f"{statistics.median(ratios):.2f}" if ratios else "n/a"
                verdicts.append(
                    f"- {merge}: {verdict} (better in {better}, worse in {worse} of {len(found)} cells at Holm p < "
                    f"0.01; mean Δ {statistics.fmean(deltas):+.4f} nats over the cells; median exchange ratio "
                    f"{median} over {len(ratios)} cells inside the measured sizes)"
                )
        lines += rows + [""] + verdicts + ["", cost(folder, model), ""]
    text = "\n".join(lines)
    (folder / "report.md").write_text(text + "\n")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("tune", "table", "report"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--model", default=MODELS[0], choices=MODELS)
    parser.add_argument("--texts", type=int, default=40, help="table: texts per cell to reach (half per domain)")
    parser.add_argument(
        "--domains",
        nargs="+",
        choices=DOMAINS,
        default=list(DOMAINS),
        help="table: only these domains' texts (each domain's cells are files apart: one process per domain can run "
        "them side by side)",
    )
    args = parser.parse_args()
    if args.step == "tune":
        print(json.dumps(tune(args.folder), indent=1))
    elif args.step == "table":
        table(args.folder, args.model, args.texts, tuple(args.domains))
    else:
        print(report(args.folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
