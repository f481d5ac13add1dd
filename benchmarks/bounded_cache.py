"""Is a merge worth its memory where a cache must stay bounded? The pre-registered runs of docs/results/bounded-cache.md.

    python -m benchmarks.bounded_cache tune  benchmarks/results/bounded-cache      # choose GRKV's options (tune texts)
    python -m benchmarks.bounded_cache table benchmarks/results/bounded-cache --model smollm2-135m --texts 40
    python -m benchmarks.bounded_cache report benchmarks/results/bounded-cache     # the tables, from what is done

``tune`` streams the tune texts (never the table's) under each candidate of ``TUNING_CANDIDATES`` behind StreamingLLM
at target 512 and writes the one with the lowest mean NLL to ``<dir>/tuned.json``. ``table`` streams the eval texts
under the full cache and every cell (3 target sizes × 3 base presses × eviction alone, + GRKV with the tuned options,
+ CaM, + D2O), text by text: every cell has the same texts at every moment, and a stopped run resumes at its next
text (``--texts`` says how many to reach; run it in chunks). ``report`` writes ``<dir>/report.md``: per model and cell
the mean NLL, each merger's paired difference to eviction alone at its size (mean, 95% bootstrap CI, sign-flip p),
and the exchange rate: the eviction target size whose NLL equals the merger's, interpolated in log2(size) between the
measured sizes.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from grkv_core.config import FULL_CACHE, PressConfig
from grkv_core.options import GRKV_PRESETS
from grkv_core.stream_options import StreamConfig

TARGET_SIZES = (256, 512, 1024)
INTERVAL = 128
BASE_PRESSES = ("streamingllm", "snapkv", "knorm")
MERGERS = ("none", "grkv", "cam", "d2o")
MODELS = ("smollm2-135m", "gemma3-270m")
DOMAINS = ("essays", "code")
MAX_TOKENS = 8192
# What the tuning chooses among (``tune``): the library's default, the paper's Alg. 1, the default before 2026-11-28,
# and the paper's surrogate rows (the most recent tokens) at the default's m and ridges.
TUNING_CANDIDATES = {
    "default": {},
    "paper": GRKV_PRESETS["paper"],
    "window32": GRKV_PRESETS["window32"],
    "recent64": {"query_policy": "window"},
}
TUNING_TEXTS_PER_DOMAIN = 4


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


def table(folder: Path, model: str, texts: int) -> None:
    tuned = json.loads((folder / "tuned.json").read_text())["options"]
    per_domain = math.ceil(texts / len(DOMAINS))
    for domain in DOMAINS:
        rows = cells(tuned)
        configs = [stream_config(model, domain, "eval", per_domain, press, size) for _, press, size in rows]
        run(configs, [folder / model / domain / f"{name}.jsonl" for name, _, _ in rows])


def read_cell(folder: Path, model: str, name: str) -> dict[str, float]:
    """{text id: mean NLL} of one cell over both domains (what is done so far)."""
    found = {}
    for domain in DOMAINS:
        path = folder / model / domain / f"{name}.jsonl"
        if path.exists():
            for line in path.read_text().splitlines()[1:]:
                row = json.loads(line)
                found[f"{domain}/{row['item_id']}"] = row["nll"]
    return found


def exchange_rate(nll: float, eviction: dict[int, float]) -> str:
    """The eviction target size at which eviction's NLL equals ``nll`` (linear in log2(size) between measured sizes);
    "< smallest" or "> largest" outside them."""
    sizes = sorted(eviction)
    if nll >= eviction[sizes[0]]:
        return f"≤ {sizes[0]}"
    for low, high in zip(sizes, sizes[1:]):
        if eviction[high] <= nll <= eviction[low]:
            fraction = (eviction[low] - nll) / (eviction[low] - eviction[high]) if eviction[low] != eviction[high] else 0
            return f"{2 ** (math.log2(low) + fraction * (math.log2(high) - math.log2(low))):.0f}"
    return f"> {sizes[-1]}"


def report(folder: Path) -> str:
    from tracking.reports.stats import paired_bootstrap_ci, sign_flip_test

    lines = ["# Bounded caches: the measured cells", ""]
    for model in MODELS:
        full = read_cell(folder, model, "full")
        if not full:
            continue
        lines += [f"## {model}", "", f"Full cache: mean NLL {sum(full.values()) / len(full):.4f} over {len(full)} texts.", ""]
        lines += ["| press | size | merger | n | mean NLL | Δ vs eviction [95% CI] | p | exchange rate |"]
        lines += ["|---|---:|---|---:|---:|---:|---:|---:|"]
        for press in BASE_PRESSES:
            eviction_means = {}
            for size in TARGET_SIZES:
                cell = read_cell(folder, model, f"{press}-{size}-none")
                if cell:
                    eviction_means[size] = sum(cell.values()) / len(cell)
            for size in TARGET_SIZES:
                evicted = read_cell(folder, model, f"{press}-{size}-none")
                for merge in MERGERS:
                    cell = read_cell(folder, model, f"{press}-{size}-{merge}")
                    texts = sorted(set(cell) & set(evicted))
                    if not texts:
                        continue
                    mean = sum(cell[t] for t in texts) / len(texts)
                    delta = p = rate = ""
                    if merge != "none":
                        differences = [cell[t] - evicted[t] for t in texts]
                        ci = paired_bootstrap_ci(differences, n_resamples=10_000)
                        delta = f"{ci.estimate:+.4f} [{ci.low:+.4f}, {ci.high:+.4f}]"
                        p = f"{sign_flip_test(differences, n_resamples=100_000):.3g}"
                        rate = exchange_rate(mean, eviction_means) if len(eviction_means) == len(TARGET_SIZES) else ""
                    lines.append(f"| {press} | {size} | {merge} | {len(texts)} | {mean:.4f} | {delta} | {p} | {rate} |")
        lines.append("")
    text = "\n".join(lines)
    (folder / "report.md").write_text(text + "\n")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("tune", "table", "report"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--model", default=MODELS[0], choices=MODELS)
    parser.add_argument("--texts", type=int, default=40, help="table: texts per cell to reach (half per domain)")
    args = parser.parse_args()
    if args.step == "tune":
        print(json.dumps(tune(args.folder), indent=1))
    elif args.step == "table":
        table(args.folder, args.model, args.texts)
    else:
        print(report(args.folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
