"""Bounded-cache evaluations end to end: texts (or contexts and questions) loaded once, each press's results per text,
resumable, in one JSON lines file per configuration.

``stream_nll``: a long text (``grkv_core.datasets.long_texts``) is teacher-forced through the bounded cache
(``grkv_core.evaluation.streaming.stream_text``); a text's result is its streamed tokens' mean NLL. ``stream_answer``:
a benchmark sample's context is streamed into the bounded cache, then its question and reference answer are
teacher-forced on it (the answer NLL, KL and top-1 against the full cache, ``grkv_core.evaluation.answer_metrics``).
The full cache is the reference of both, computed once per text and shared by every press.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from grkv_core.config import StreamConfig
from grkv_core.evaluation.answer_metrics import answer_log_probs, compare_to_reference, reference_ids
from grkv_core.evaluation.generation import tokenize_sample
from grkv_core.evaluation.streaming import stream_context, stream_text
from grkv_core.models import LoadedModel, load_model
from grkv_core.presses.decoding import MergingDecodingPress
from grkv_core.presses.from_config import build
from grkv_core.stream_options import STREAM_NLL


@dataclass(frozen=True)
class StreamItem:
    """One text of a bounded-cache evaluation: (1, n) token ids streamed; for ``stream_answer`` also the (1, q)
    question and (1, a) reference answer that follow it. ``task``: the long texts' domain, or the benchmark's task."""

    item_id: str
    token_ids: torch.Tensor
    question_ids: torch.Tensor | None = None
    answer_ids: torch.Tensor | None = None
    task: str = ""

    @property
    def sample_id(self) -> str:
        return self.item_id


def load_stream_items(config: StreamConfig, tokenizer) -> list[StreamItem]:
    """``config.samples`` texts of ``config.source`` (per task for a benchmark), in a fixed order."""
    if config.protocol == STREAM_NLL:
        from grkv_core.datasets.long_texts import load_long_texts

        texts = load_long_texts(
            config.source,
            config.split,
            tokenizer=tokenizer,
            min_tokens=config.min_tokens,
            max_tokens=config.max_tokens,
            data_dir=config.data_dir,
            limit=config.samples,
        )
        return [
            StreamItem(text.text_id, _ids(tokenizer, text.text)[:, : config.max_tokens], task=config.source)
            for text in texts
        ]
    from grkv_core.datasets import load_dataset_samples

    samples = load_dataset_samples(
        config.source,
        tasks=config.tasks,
        context_length=config.max_tokens,
        samples_per_task=config.samples,
        seed=config.seed,
        data_dir=config.data_dir,
        tokenizer=tokenizer,
    )
    items = []
    for sample in samples:
        context_ids, question_ids = tokenize_sample(tokenizer, sample)
        answer_ids = reference_ids(tokenizer, sample, 0)
        items.append(StreamItem(sample.sample_id, context_ids, question_ids[0], answer_ids, sample.task))
    return items


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)])


def bounded_press(config: StreamConfig) -> MergingDecodingPress | None:
    """The press ``config`` describes, kept bounded by ``MergingDecodingPress``; None for the full cache."""
    return build(config.bounded_press)


class StreamStore:
    """One configuration's results, one JSON line per text, appended as each text finishes (a stopped run resumes at
    its next text); its first line is the configuration, which a resumed run must match."""

    def __init__(self, path: Path, config: StreamConfig) -> None:
        self.path, self.results = path, {}
        # NOTE: as JSON gives it back (tuples as lists), to compare with a stored header.
        header = json.loads(json.dumps({"config": _resume_key(config)}))
        if path.exists():
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if not lines or lines[0] != header:
                raise ValueError(f"{path} holds another configuration's results: remove it or choose another file")
            self.results = {line["item_id"]: line for line in lines[1:]}
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(header) + "\n")

    def add(self, result: dict) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(result) + "\n")
        self.results[result["item_id"]] = result


def _resume_key(config: StreamConfig) -> dict:
    key = config.to_dict()
    key.pop("samples")
    # NOTE: absent from the files written before they existed, and the same in every stream configuration: decoding
    # (always empty: the sizes are the config's own) and per_head_cache (a bounded cache refuses it).
    key["press"].pop("decoding")
    key["press"].pop("per_head_cache")
    return key


def run_stream_evaluations(
    configs: list[StreamConfig],
    outputs: list[str | Path],
    *,
    loaded: LoadedModel | None = None,
    progress: bool = True,
) -> list[dict]:
    """Evaluate configurations that differ at most in their press and sizes, text by text, each text's full-cache
    reference computed once; each resumes from and appends to its own file. Returns one summary per configuration
    (``summarize_stream``)."""
    base = configs[0]
    if any(
        replace(c, press=base.press, target_size=base.target_size, compression_interval=base.compression_interval)
        != base
        for c in configs
    ):
        raise ValueError("configurations evaluated together may differ only in press, target_size and interval")
    presses = [bounded_press(config) for config in configs]  # NOTE: first, so a refused press costs no model load
    loaded = loaded or load_model(base.model, dtype=base.dtype, device=base.device)
    items = load_stream_items(base, loaded.tokenizer)
    stores = [StreamStore(Path(output), config) for config, output in zip(configs, outputs, strict=True)]
    pending = [
        (item, [index for index, store in enumerate(stores) if item.item_id not in store.results]) for item in items
    ]
    # NOTE: one step per text and configuration (a text through every configuration can take many minutes).
    bar = tqdm(total=sum(len(todo) for _, todo in pending), desc=base.protocol, unit="run", disable=not progress)
    with bar:
        for item, todo in pending:
            reference = None
            for index in todo:
                bar.set_postfix_str(f"{item.item_id} · {configs[index].label}", refresh=True)
                result, reference = evaluate_stream_item(loaded, item, configs[index], presses[index], reference)
                stores[index].add(result)
                bar.update()
    return [
        summarize_stream(config, [store.results[item.item_id] for item in items])
        for config, store in zip(configs, stores)
    ]


def evaluate_stream_item(loaded: LoadedModel, item: StreamItem, config: StreamConfig, press, reference):
    """One text under one press: its result dict and the full cache's reference (answer log-probabilities; computed
    here when ``reference`` is None, for the next press of the same text)."""
    model = loaded.model
    prefill = config.prefill_tokens if config.prefill_tokens is not None else config.target_size
    prefill = min(prefill, item.token_ids.shape[1] - 1)
    start = time.perf_counter()
    if config.protocol == STREAM_NLL:
        streamed = stream_text(model, item.token_ids, press, prefill_tokens=prefill)
        metrics = {"nll": float(streamed.token_nll.double().mean()), "tokens": int(streamed.token_nll.numel())}
    else:
        streamed = stream_context(model, item.token_ids, press, prefill_tokens=prefill)
        context_length = item.token_ids.shape[1]
        log_probs = answer_log_probs(model, streamed.cache, item.question_ids, item.answer_ids, context_length)
        if reference is None:
            reference = (
                log_probs[0]
                if press is None
                else answer_log_probs(
                    model,
                    stream_context(model, item.token_ids, None, prefill_tokens=prefill).cache,
                    item.question_ids,
                    item.answer_ids,
                    context_length,
                )[0]
            )
        found = compare_to_reference(reference, log_probs, item.answer_ids)[0]
        metrics = {"answer_nll": found.nll, "answer_kl": found.kl, "answer_top1": found.top1}
    seconds = time.perf_counter() - start
    cache = streamed.cache
    kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    rows = max(layer.keys.shape[2] for layer in cache.layers)
    return {"item_id": item.item_id, **metrics, "kv_bytes": kv_bytes, "rows": rows, "seconds": seconds}, reference


def summarize_stream(config: StreamConfig, results: list[dict]) -> dict:
    """The configuration, its label, and each metric's mean over texts (``per_item`` keeps every text's)."""
    metric_names = [name for name in results[0] if name not in ("item_id",)] if results else []
    means = {name: sum(row[name] for row in results) / len(results) for name in metric_names}
    return {"config": config.to_dict(), "label": config.label, "n": len(results), **means, "per_item": results}


def format_stream_table(summaries: list[dict], metric: str, baseline: int | None = None) -> str:
    """A Markdown table: each configuration's mean ``metric`` and, against ``summaries[baseline]`` (paired per
    text), the mean difference with its 95% interval (t) and how many texts it lowers the metric of."""
    against = summaries[baseline]["label"] if baseline is not None else "-"
    lines = [f"| configuration | n | {metric} | Δ vs {against} | lower in | rows |"]
    lines.append("|---|---:|---:|---:|---:|---:|")
    for summary in summaries:
        delta, lower = "", ""
        if baseline is not None and summary is not summaries[baseline]:
            reference = {row["item_id"]: row[metric] for row in summaries[baseline]["per_item"]}
            differences = [row[metric] - reference[row["item_id"]] for row in summary["per_item"]]
            delta = _mean_interval(differences)
            lower = f"{sum(d < 0 for d in differences)}/{len(differences)}"
        mean = f"{summary[metric]:.4f}"
        lines.append(f"| {summary['label']} | {summary['n']} | {mean} | {delta} | {lower} | {summary['rows']:.0f} |")
    return "\n".join(lines)


def _mean_interval(differences: list[float]) -> str:
    """ "mean [low, high]" with a 95% t interval (the mean alone for one text)."""
    count = len(differences)
    mean = sum(differences) / count
    if count < 2:
        return f"{mean:+.4f}"
    from scipy import stats

    spread = math.sqrt(sum((d - mean) ** 2 for d in differences) / (count - 1) / count)
    half = float(stats.t.ppf(0.975, count - 1)) * spread
    return f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]"
