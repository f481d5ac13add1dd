"""Single-process evaluation: model + press + benchmark -> predictions, scores and costs.

The protocol is kvpress's (see ``grkv_core.generation``). Besides the score, every sample records what a
compression method costs and how faithful its cache is: time to first token (prefill including the
compression, plus the first question), decode latency, peak memory, the persistent KV bytes left after
compression, and the normalised reconstruction discrepancy of the compressed cache on the surrogate window
and on held-out queries (those of the first generated tokens).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import resource
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from grkv_core.config import COST_METRICS, PAPER_WINDOW, EvalConfig, PressConfig
from grkv_core.datasets import EvalSample, load_dataset_samples, score_prediction
from grkv_core.diagnostics.losses import discrepancy_per_head, recover_kept_positions
from grkv_core.generation import answer_question, prefill, stop_token_ids, tokenize_sample
from grkv_core.models import LoadedModel, load_model
from grkv_core.queries import surrogate_queries
from grkv_core.registry import NOT_EAGER, required_attention

RESULT_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class SampleResult:
    """One evaluated sample. Times in seconds, memory in bytes, losses normalised (0 = exact)."""

    sample_id: str
    task: str
    predictions: list[str]
    scores: list[float]
    score: float | None
    context_tokens: int
    ttft_s: float
    prefill_s: float
    decode_ms_per_token: float
    generated_tokens: int
    kv_bytes: int
    full_kv_bytes: int
    peak_memory_bytes: int
    window_loss: float | None
    heldout_loss: float | None
    wall_s: float
    question_loss: float | None = None
    batch_trials: int = 1


class _ReconstructionProbe:
    """Forward hooks that keep what the reconstruction losses need, without touching the computation.

    At prefill a hook registered *before* the press's hooks keeps a reference to each layer's full keys
    and values (the press then swaps the cache's tensors, so the references stay full), and the inputs
    needed to rebuild the surrogate window queries after timing. During the first question's decoding it
    keeps the post-RoPE queries of the first ``heldout_tokens`` generated tokens.
    """

    def __init__(self, model, loss_window: int, heldout_tokens: int):
        self.model = model
        self.loss_window = loss_window
        self.heldout_tokens = heldout_tokens
        self.full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.window_inputs: dict[int, tuple] = {}
        self.heldout: dict[int, list[torch.Tensor]] = {}
        self.collect_heldout = False
        self.handles = []

    def __enter__(self):
        for layer in self.model.model.layers:
            attention = layer.self_attn
            for stale in ("kept_positions", "masked_key_indices"):
                if hasattr(attention, stale):
                    setattr(attention, stale, None)
            self.handles.append(attention.register_forward_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _hook(self, module, args, kwargs, output):
        hidden = kwargs["hidden_states"]
        layer = module.layer_idx
        cache_layer = kwargs["past_key_values"].layers[layer]
        if layer not in self.full:
            self.full[layer] = (cache_layer.keys, cache_layer.values)
            cos, sin = kwargs["position_embeddings"]
            self.window_inputs[layer] = (module, hidden[:, -self.loss_window:], cos[:, -self.loss_window:],
                                         sin[:, -self.loss_window:], hidden.shape[1])
        elif self.collect_heldout and hidden.shape[1] == 1:
            captured = self.heldout.setdefault(layer, [])
            if len(captured) < self.heldout_tokens:
                queries = surrogate_queries(module, hidden, kwargs["position_embeddings"], n_queries=1).queries
                captured.append(queries)

    def compressed_views(self, model, cache) -> list[dict]:
        """Per layer: the compressed keys/values with their positions (and mask for masking presses)."""
        views = []
        for layer_module, cache_layer in zip(model.model.layers, cache.layers):
            attention = layer_module.self_attn
            full_keys, _ = self.full[attention.layer_idx]
            keys, values = cache_layer.keys, cache_layer.values
            mask = None
            if getattr(attention, "kept_positions", None) is not None:
                positions = attention.kept_positions
            elif keys.shape[2] == full_keys.shape[2]:
                positions = torch.arange(keys.shape[2], device=keys.device).expand(keys.shape[:3])
                masked = getattr(attention, "masked_key_indices", None)
                if masked is not None:
                    mask = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
                    mask[tuple(index.to(keys.device) for index in masked)] = False
            else:
                positions = recover_kept_positions(keys, full_keys)
            views.append(dict(keys=keys, values=values, positions=positions, mask=mask))
        return views

    def window_loss(self, views: list[dict]) -> float:
        error = reference = 0.0
        for layer, view in enumerate(views):
            module, hidden, cos, sin, length = self.window_inputs[layer]
            window = surrogate_queries(module, hidden, (cos, sin), n_queries=self.loss_window)
            # surrogate_queries numbered the window from 0; shift to its true place at the prompt's end.
            positions = window.positions + (length - hidden.shape[1])
            full_keys, full_values = self.full[layer]
            err, ref = discrepancy_per_head(
                window.queries, full_keys, full_values, view["keys"], view["values"], query_positions=positions,
                compressed_positions=view["positions"], compressed_mask=view["mask"], scale=module.scaling,
            )
            error, reference = error + float(err.sum()), reference + float(ref.sum())
        return error / max(reference, 1e-30)

    def heldout_loss(self, views: list[dict]) -> float | None:
        if not self.heldout:
            return None
        error = reference = 0.0
        for layer, view in enumerate(views):
            queries = torch.cat(self.heldout[layer], dim=2)
            full_keys, full_values = self.full[layer]
            module = self.window_inputs[layer][0]
            err, ref = discrepancy_per_head(queries, full_keys, full_values, view["keys"], view["values"],
                                            compressed_mask=view["mask"], scale=module.scaling)
            error, reference = error + float(err.sum()), reference + float(ref.sum())
        return error / max(reference, 1e-30)


def _cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


class Evaluator:
    """A loaded model that evaluates samples under any press; load once, evaluate many (Ray workers do).

    Parameters
    ----------
    loaded : LoadedModel
        From ``grkv_core.models.load_model``.
    loss_window : int
        Number of last prompt positions whose queries measure the window reconstruction loss (the same for
        every press, whatever surrogate window the press itself uses).
    heldout_tokens : int
        Number of first generated tokens whose queries form the held-out set (0 disables it).
    """

    def __init__(self, loaded: LoadedModel, loss_window: int = PAPER_WINDOW, heldout_tokens: int = 8):
        self.loaded = loaded
        self.loss_window = loss_window
        self.heldout_tokens = heldout_tokens
        self.stop_ids = stop_token_ids(loaded)

    def evaluate_trials(self, sample: EvalSample, press_configs: list[PressConfig], decode: bool = True,
                        measure_reconstruction: bool = True) -> list[SampleResult]:
        """Evaluate several press configurations on one sample; one result per configuration, in order.

        With ``decode=False`` nothing is generated (screening): predictions and scores are empty, ``score``
        and ``heldout_loss`` are None and the losses that need no generation are measured.
        """
        results = [self.evaluate_sample(sample, press_config, measure_reconstruction) for press_config in press_configs]
        if not decode:
            results = [replace(result, predictions=[], scores=[], score=None, heldout_loss=None) for result in results]
        return results

    def evaluate_sample(self, sample: EvalSample, press_config: PressConfig,
                        measure_reconstruction: bool = True) -> SampleResult:
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        needs = required_attention(press_config.press)
        actual = model.config._attn_implementation
        if needs is not None and actual != needs:
            raise ValueError(f"press {press_config.press!r} needs attn_implementation={needs!r}; the model uses {actual!r}")
        if press_config.press in NOT_EAGER and actual == "eager":
            raise ValueError(f"press {press_config.press!r} does not work with eager attention; load with sdpa")
        started = time.perf_counter()
        context_ids, questions_ids = tokenize_sample(tokenizer, sample)
        press = press_config.build()
        on_cuda = model.device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(model.device)
        probe = _ReconstructionProbe(model, self.loss_window, self.heldout_tokens) if measure_reconstruction else None
        with probe if probe is not None else contextlib.nullcontext():
            prefill_start = time.perf_counter()
            cache = prefill(model, context_ids, press)
            if on_cuda:
                torch.cuda.synchronize(model.device)
            prefill_s = time.perf_counter() - prefill_start
            kv_bytes = _cache_bytes(cache)
            full_kv_bytes = _full_cache_bytes(model, context_ids.shape[1], cache)
            predictions, scores = [], []
            ttft_s = decode_s = 0.0
            generated = 0
            for index, question_ids in enumerate(questions_ids):
                if probe is not None:
                    probe.collect_heldout = index == 0
                answer = answer_question(model, cache, question_ids, context_ids.shape[1], sample.max_new_tokens,
                                         self.stop_ids)
                if index == 0:
                    ttft_s = prefill_s + answer.question_seconds
                decode_s += answer.decode_seconds
                generated += len(answer.token_ids)
                prediction = tokenizer.decode(answer.token_ids, skip_special_tokens=True)
                predictions.append(prediction)
                scores.append(score_prediction(sample, index, prediction))
        window_loss = heldout_loss = None
        if probe is not None and press is not None:
            views = probe.compressed_views(model, cache)
            window_loss = probe.window_loss(views)
            heldout_loss = probe.heldout_loss(views)
        elif probe is not None:
            window_loss, heldout_loss = 0.0, (0.0 if probe.heldout else None)
        peak = torch.cuda.max_memory_allocated(model.device) if on_cuda else _process_peak_rss()
        decode_steps = max(generated - len(questions_ids), 1)
        return SampleResult(
            sample_id=sample.sample_id, task=sample.task, predictions=predictions, scores=scores,
            score=statistics.fmean(scores), context_tokens=int(context_ids.shape[1]), ttft_s=ttft_s,
            prefill_s=prefill_s, decode_ms_per_token=1e3 * decode_s / decode_steps, generated_tokens=generated,
            kv_bytes=kv_bytes, full_kv_bytes=full_kv_bytes, peak_memory_bytes=int(peak), window_loss=window_loss,
            heldout_loss=heldout_loss, wall_s=time.perf_counter() - started,
        )


def _full_cache_bytes(model, context_tokens: int, cache) -> int:
    layer = cache.layers[0]
    per_token = 2 * layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.element_size()
    return per_token * context_tokens * len(cache.layers)


def _process_peak_rss() -> int:
    # NOTE: on CPU there is no per-sample allocator peak; this is the process's high-water mark (Linux: KiB).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def summarize(results: list[SampleResult]) -> dict:
    """Per-task mean scores (in %), their mean over tasks, and the mean of every cost and loss."""
    if not results:
        return {"tasks": {}, "mean_score": None, "samples": 0}
    by_task: dict[str, list[SampleResult]] = {}
    for result in results:
        by_task.setdefault(result.task, []).append(result)
    task_scores = {task: 100 * statistics.fmean(r.score for r in rows) for task, rows in sorted(by_task.items())}

    def mean_of(name):
        values = [getattr(r, name) for r in results if getattr(r, name) is not None]
        return statistics.fmean(values) if values else None

    costs = {name: mean_of(name) for name in COST_METRICS}
    return {"tasks": task_scores, "mean_score": statistics.fmean(task_scores.values()), "samples": len(results),
            "costs": costs}


def library_versions() -> dict[str, str]:
    import kvpress
    import transformers

    from grkv_core import __version__

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "kvpress": getattr(kvpress, "__version__", "0.5.5"), "grkv": __version__}


class ResultStore:
    """The output JSON of one evaluation, rewritten atomically after every sample (resume-safe)."""

    def __init__(self, path: Path, config: EvalConfig, model_dtype: str):
        self.path = Path(path)
        self.config = config
        self.model_dtype = model_dtype
        self.resolved_press = config.press.resolved()  # every field of the press, defaults included
        self.results: list[SampleResult] = []
        if self.path.exists():
            stored = json.loads(self.path.read_text())
            stored_config = EvalConfig.from_dict(stored["config"])
            if stored_config.resume_key() != config.resume_key():
                raise ValueError(
                    f"{self.path} holds results of a different configuration; choose another --output or delete it"
                )
            # NOTE: dtype="auto" resolves per device (float32 on the CPU), so equal configs can load different
            # dtypes; files written before the dtype was recorded carry none and resume as before.
            stored_dtype = stored.get("model_dtype")
            if stored_dtype is not None and stored_dtype != model_dtype:
                raise ValueError(
                    f"{self.path} was written with the model in {stored_dtype}, this run loads it in {model_dtype}; "
                    f"pass --dtype {stored_dtype} to resume it, or choose another --output"
                )
            self.results = [SampleResult(**row) for row in stored["samples"]]

    def add(self, result: SampleResult) -> None:
        self.results.append(result)
        self.write()

    def write(self) -> None:
        payload = {
            "schema_version": RESULT_SCHEMA_VERSION,
            "config": self.config.to_dict(),
            "label": self.config.press.label,
            "resolved_press": self.resolved_press,
            "model_dtype": self.model_dtype,
            "versions": library_versions(),
            "summary": summarize(self.results),
            "samples": [asdict(result) for result in self.results],
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps(payload, indent=1))
        os.replace(temporary, self.path)


@dataclass
class EvaluationSetup:
    """What an evaluation config loads once and any number of presses then share: the model, the samples
    and an evaluator (the CLI's comparisons and every Ray worker use one for many configurations)."""

    loaded: LoadedModel
    samples: list[EvalSample]
    evaluator: Evaluator

    @classmethod
    def load(cls, config: EvalConfig) -> EvaluationSetup:
        """Load ``config``'s model (with the attention its press needs) and samples.

        NOTE: everything but ``config.press`` is used; the press of each evaluation is passed separately.
        """
        attention = config.attn_implementation or required_attention(config.press.press)
        loaded = load_model(config.model, dtype=config.dtype, attn_implementation=attention, device=config.device)
        samples = load_dataset_samples(config.dataset, tasks=config.tasks, context_length=config.context_length,
                                       samples_per_task=config.samples, seed=config.seed, data_dir=config.data_dir,
                                       tokenizer=loaded.tokenizer)
        evaluator = Evaluator(loaded, loss_window=config.loss_window, heldout_tokens=config.heldout_tokens)
        return cls(loaded, samples, evaluator)


def run_evaluation(
    config: EvalConfig,
    output: str | Path | None = None,
    *,
    setup: EvaluationSetup | None = None,
    progress: bool = True,
) -> dict:
    """Evaluate ``config`` end to end; with ``output``, resume from and write to that JSON file.

    ``setup`` (loaded from a config that differs at most in its press) saves reloading the model and samples.
    Returns the summary dict (per-task scores, their mean, mean costs) with the config and versions.
    """
    setup = setup or EvaluationSetup.load(config)
    samples = setup.samples
    model_dtype = str(setup.loaded.dtype).removeprefix("torch.")
    store = ResultStore(Path(output), config, model_dtype) if output is not None else None
    results = list(store.results) if store is not None else []
    done = {result.sample_id for result in results}
    pending = [sample for sample in samples if sample.sample_id not in done]
    for sample in tqdm(pending, desc=config.press.label, disable=not progress, unit="sample"):
        result = setup.evaluator.evaluate_sample(sample, config.press)
        results.append(result)
        if store is not None:
            store.add(result)
    wanted = {sample.sample_id for sample in samples}
    summary = summarize([result for result in results if result.sample_id in wanted])
    return {"config": config.to_dict(), "label": config.press.label, "versions": library_versions(), **summary}


def format_table(summaries: list[dict]) -> str:
    """A plain-text comparison table: one row per configuration, one column per task plus costs."""
    tasks = sorted({task for summary in summaries for task in summary["tasks"]})
    header = ["method", *tasks, "mean", "KV MiB", "TTFT s", "window loss", "held-out loss"]
    rows = []
    for summary in summaries:
        costs = summary.get("costs", {})

        def number(value, digits=3):
            return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"

        rows.append([
            summary["label"], *(number(summary["tasks"].get(task), 1) for task in tasks),
            number(summary["mean_score"], 1), number((costs.get("kv_bytes") or 0) / 2**20, 1),
            number(costs.get("ttft_s"), 2), number(costs.get("window_loss"), 4), number(costs.get("heldout_loss"), 4),
        ])
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
