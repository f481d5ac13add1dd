"""Single-process evaluation: model + press + benchmark -> predictions, scores and costs.

The protocol is kvpress's (see ``grkv_core.generation``). Besides the score, every sample records what a
compression method costs and how faithful its cache is: time to first token (prefill including the
compression, plus the first question), decode latency, peak memory, the persistent KV bytes left after
compression, and the normalised reconstruction discrepancy of the compressed cache on the surrogate window,
on held-out queries (those of the first generated tokens) and on the question's own queries.

Several press configurations of one sample share its prefill and decode as one batch (``evaluate_trials``),
with the results of evaluating each alone: that is what makes a sweep's trials cheap.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import resource
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from grkv_core.answer_metrics import (
    AnswerMetrics,
    answer_log_probs,
    answer_metrics_batch,
    compare_to_reference,
    reference_ids,
)
from grkv_core.batched_decoding import answer_batch
from grkv_core.config import (
    COST_METRICS,
    GRKV_DEFAULTS,
    PAPER_WINDOW,
    PROTOCOL_SPEC,
    QUESTION_AGNOSTIC,
    EvalConfig,
    PressConfig,
)
from grkv_core.datasets import EvalSample, load_dataset_samples, score_prediction
from grkv_core.diagnostics.probe import ReconstructionProbe
from grkv_core.files import write_atomically
from grkv_core.generation import answer_position, stop_token_ids, tokenize_sample
from grkv_core.kvpress_layout import kvpress_runs, write_run
from grkv_core.models import LoadedModel, load_model
from grkv_core.registry import NOT_EAGER, build, protected_window, required_attention, resolved
from grkv_core.shared_prefill import prefill_shared

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
    answer_nll: float | None = None
    answer_kl: float | None = None
    answer_top1: float | None = None
    # Where the first reference sits in the prefill (position / prefill length; None where the context does not
    # hold it), and whether it lies in the last positions the press always keeps (its observation window).
    answer_depth: float | None = None
    answer_in_window: bool | None = None


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
    protocol : str
        One of ``grkv_core.config.PROTOCOLS``: what the prefill holds (``grkv_core.generation.render_sample``).
    """

    def __init__(self, loaded: LoadedModel, loss_window: int = PAPER_WINDOW, heldout_tokens: int = 8,
                 protocol: str = QUESTION_AGNOSTIC):
        PROTOCOL_SPEC.check("protocol", protocol)
        self.loaded = loaded
        self.loss_window = loss_window
        self.heldout_tokens = heldout_tokens
        self.protocol = protocol
        self.stop_ids = stop_token_ids(loaded)

    def evaluate_trials(self, sample: EvalSample, press_configs: list[PressConfig], decode: bool = True,
                        measure_reconstruction: bool = True, max_decode_rows: int | None = None,
                        measure_answer: bool = True) -> list[SampleResult]:
        """Evaluate several press configurations on one sample; one result per configuration, in order.

        One prefill serves every configuration (``grkv_core.shared_prefill``) and caches of equal lengths answer
        each question as one batch (``grkv_core.batched_decoding``); the results are those of evaluating each
        configuration alone (``evaluate_sample``), except the times, which describe the shared work: prefill_s is
        the forward without any press's hooks plus this press's own, and TTFT and decoding are the batch's.

        Parameters
        ----------
        decode : bool
            False screens without generating: predictions and scores are empty, ``score`` and ``heldout_loss`` are
            None; the window and question losses (and the memory) are measured all the same.
        max_decode_rows : int, optional
            At most this many caches decoded (and teacher-forced) as one batch (memory).
        measure_answer : bool
            False leaves the answer metrics (``grkv_core.answer_metrics``) None.
        """
        for press_config in press_configs:
            self._check_attention(press_config)
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        started = time.perf_counter()
        on_cuda = model.device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(model.device)
        context_ids, questions_ids = tokenize_sample(tokenizer, sample, self.protocol)
        context_length = context_ids.shape[1]
        presses = [build(press_config) for press_config in press_configs]
        probe = ReconstructionProbe(model, self.loss_window, self.heldout_tokens if decode else 0)
        with probe.watching_prefill() if measure_reconstruction else contextlib.nullcontext():
            shared = prefill_shared(model, context_ids, presses)
        answer_metrics = self._teacher_force(sample, shared, presses, questions_ids, context_length,
                                             probe if measure_reconstruction else None, measure_answer,
                                             max_decode_rows)
        position = answer_position(tokenizer, sample, self.protocol)
        depth = None if position is None else position / context_length
        predictions = [[] for _ in presses]
        scores = [[] for _ in presses]
        ttft = [cache.prefill_s for cache in shared.pressed]
        decode_s, decode_steps, generated = [0.0] * len(presses), [0] * len(presses), [0] * len(presses)
        if decode:
            for index, question_ids in enumerate(questions_ids):
                collect = measure_reconstruction and index == 0 and self.heldout_tokens > 0
                with probe.watching_decoding() if collect else contextlib.nullcontext():
                    answers = answer_batch(model, shared.pressed, question_ids, context_length,
                                           sample.max_new_tokens, self.stop_ids, max_rows=max_decode_rows,
                                           on_decode_step=probe.on_decode_step if collect else None)
                for trial, answer in enumerate(answers):
                    if index == 0:
                        ttft[trial] += answer.question_seconds
                    generated[trial] += len(answer.token_ids)
                    decode_s[trial] += answer.decode_seconds
                    decode_steps[trial] += answer.decode_steps
                    prediction = tokenizer.decode(answer.token_ids, skip_special_tokens=True)
                    predictions[trial].append(prediction)
                    scores[trial].append(score_prediction(sample, index, prediction))
        peak = torch.cuda.max_memory_allocated(model.device) if on_cuda else _process_peak_rss()
        full_kv_bytes = sum(keys.nbytes + values.nbytes for keys, values in shared.full)
        wall_s = (time.perf_counter() - started) / len(presses)
        results = []
        for trial, (press, cache) in enumerate(zip(presses, shared.pressed)):
            losses = dict(window_loss=None, heldout_loss=None, question_loss=None)
            if measure_reconstruction and press is None:
                losses = dict(window_loss=0.0, heldout_loss=0.0 if probe.heldout.get(trial) else None,
                              question_loss=0.0)
            elif measure_reconstruction:
                losses = probe.losses(trial, shared.full, cache)
            window = protected_window(press)
            results.append(SampleResult(
                sample_id=sample.sample_id, task=sample.task, predictions=predictions[trial], scores=scores[trial],
                score=statistics.fmean(scores[trial]) if decode else None, context_tokens=int(context_length),
                ttft_s=ttft[trial], prefill_s=cache.prefill_s,
                decode_ms_per_token=1e3 * decode_s[trial] / max(decode_steps[trial], 1),
                generated_tokens=generated[trial], kv_bytes=cache.nbytes(), full_kv_bytes=full_kv_bytes,
                peak_memory_bytes=int(peak), wall_s=wall_s, batch_trials=len(presses), **losses,
                **answer_metrics[trial], answer_depth=depth,
                answer_in_window=None if position is None else position >= context_length - window,
            ))
        return results

    def _teacher_force(self, sample: EvalSample, shared, presses: list, questions_ids: list[torch.Tensor],
                       context_length: int, probe: ReconstructionProbe | None, measure_answer: bool,
                       max_rows: int | None) -> list[dict[str, float]]:
        """Each question and its reference answer teacher-forced on the full cache (seen by ``probe``, if any) and,
        with ``measure_answer``, on every compressed cache; per press, its answer metrics averaged over the
        questions ({} when not measured)."""
        per_press: list[list[AnswerMetrics]] = [[] for _ in presses]
        if probe is None and not measure_answer:
            return [{} for _ in presses]
        model = self.loaded.model
        compressed = [trial for trial, press in enumerate(presses) if press is not None]
        for index, question_ids in enumerate(questions_ids):
            answer_ids = reference_ids(self.loaded.tokenizer, sample, index)
            with probe.watching_question() if probe is not None else contextlib.nullcontext():
                reference = answer_log_probs(model, DynamicCache(ddp_cache_data=shared.full), question_ids,
                                             answer_ids, context_length)[0]
            if not measure_answer:
                continue
            found = dict(zip(compressed, answer_metrics_batch(
                model, [shared.pressed[trial] for trial in compressed], reference, question_ids, answer_ids,
                context_length, max_rows=max_rows)))
            # NOTE: the full cache is its own reference (KL exactly 0, every top-1 agreeing).
            itself = compare_to_reference(reference, reference[None], answer_ids)[0]
            for trial, metrics in enumerate(per_press):
                metrics.append(found.get(trial, itself))
        return [AnswerMetrics.mean(metrics) if metrics else {} for metrics in per_press]

    def evaluate_sample(self, sample: EvalSample, press_config: PressConfig,
                        measure_reconstruction: bool = True) -> SampleResult:
        """Evaluate one press configuration on one sample (its own prefill and decoding)."""
        return self.evaluate_trials(sample, [press_config], measure_reconstruction=measure_reconstruction)[0]

    def _check_attention(self, press_config: PressConfig) -> None:
        needs = required_attention(press_config.press)
        actual = self.loaded.model.config._attn_implementation
        if needs is not None and actual != needs:
            raise ValueError(f"press {press_config.press!r} needs attn_implementation={needs!r}; the model uses {actual!r}")
        if press_config.press in NOT_EAGER and actual == "eager":
            raise ValueError(f"press {press_config.press!r} does not work with eager attention; load with sdpa")


def _process_peak_rss() -> int:
    # NOTE: on CPU there is no per-sample allocator peak; this is the process's high-water mark (Linux: KiB).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# Needle depths (``SampleResult.answer_depth``) are reported in these bins, each closed on the left (the last on
# both sides).
DEPTH_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def _task_mean(results: list[SampleResult]) -> tuple[dict[str, float], float | None]:
    """Per-task mean scores (in %) of the scored results, and their mean over tasks (None if none is scored)."""
    by_task: dict[str, list[SampleResult]] = {}
    for result in results:
        if result.score is not None:  # NOTE: screening results are unscored; their losses still count
            by_task.setdefault(result.task, []).append(result)
    task_scores = {task: 100 * statistics.fmean(r.score for r in rows) for task, rows in sorted(by_task.items())}
    return task_scores, statistics.fmean(task_scores.values()) if task_scores else None


def depth_bin(depth: float) -> str:
    """The label of the ``DEPTH_BINS`` bin holding ``depth``, e.g. ``"0.2-0.4"``."""
    for low, high in zip(DEPTH_BINS, DEPTH_BINS[1:]):
        if depth < high or high == DEPTH_BINS[-1]:
            return f"{low:.1f}-{high:.1f}"
    raise AssertionError("unreachable")


def summarize(results: list[SampleResult]) -> dict:
    """Per-task mean scores (in %), their mean over tasks, the mean of every cost, loss and answer metric, and
    what the score measures: the mean score of the samples whose answer lies outside the press's always-kept
    window (``mean_score_outside_window``; those inside score at any budget) and the mean score per needle depth
    (``depth_scores``: bin -> {"score", "samples"})."""
    if not results:
        return {"tasks": {}, "mean_score": None, "samples": 0}
    task_scores, mean_score = _task_mean(results)

    def mean_of(name):
        values = [getattr(r, name) for r in results if getattr(r, name) is not None]
        return statistics.fmean(values) if values else None

    costs = {name: mean_of(name) for name in COST_METRICS}
    outside = [r for r in results if not r.answer_in_window]
    depths: dict[str, list[float]] = {}
    for result in results:
        if result.score is not None and result.answer_depth is not None:
            depths.setdefault(depth_bin(result.answer_depth), []).append(result.score)
    return {"tasks": task_scores, "mean_score": mean_score, "samples": len(results), "costs": costs,
            "mean_score_outside_window": _task_mean(outside)[1],
            "window_samples": sum(1 for r in results if r.answer_in_window),
            "depth_scores": {label: {"score": 100 * statistics.fmean(scores), "samples": len(scores)}
                             for label, scores in sorted(depths.items())}}


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
        self.resolved_press = resolved(config.press)  # every field of the press, defaults included
        self.results: list[SampleResult] = []
        if self.path.exists():
            stored = json.loads(self.path.read_text())
            stored_config = EvalConfig.from_dict(stored["config"])
            if "decode" not in stored["config"] and stored["samples"]:
                # NOTE: files written before the field existed decoded exactly when their rows hold scores.
                stored_config = replace(stored_config, decode=any(row.get("score") is not None
                                                                  for row in stored["samples"]))
            if stored_config.resume_key() != config.resume_key():
                raise ValueError(
                    f"{self.path} holds results of a different configuration; choose another --output or delete it"
                )
            # NOTE: the config names only the options that were set; the settings they resolve to include the
            # library's defaults, which a newer version may change. Files written before the resolved settings
            # were recorded carry none and resume as before.
            stored_press = stored.get("resolved_press")
            if stored_press is not None:
                # NOTE: an option added since the file was written is absent from it: it ran at its default.
                stored_press = {**{name: value for name, value in GRKV_DEFAULTS.items() if name in self.resolved_press},
                                **stored_press}
            if stored_press is not None and stored_press != self.resolved_press:
                changed = ", ".join(f"{name}: {stored_press.get(name)!r} -> {self.resolved_press.get(name)!r}"
                                    for name in sorted(stored_press.keys() | self.resolved_press.keys())
                                    if stored_press.get(name) != self.resolved_press.get(name))
                raise ValueError(
                    f"{self.path} was written with other press settings ({changed}), e.g. under an earlier "
                    "version's defaults; set them explicitly to resume it, or choose another --output"
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
        write_atomically(self.path, json.dumps(payload, indent=1))


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
        evaluator = Evaluator(loaded, loss_window=config.loss_window, heldout_tokens=config.heldout_tokens,
                              protocol=config.protocol)
        return cls(loaded, samples, evaluator)

    @property
    def model_dtype(self) -> str:
        """The dtype the model loaded in (``"float32"``), as result files record it."""
        return str(self.loaded.dtype).removeprefix("torch.")


def run_evaluation(
    config: EvalConfig,
    output: str | Path | None = None,
    *,
    setup: EvaluationSetup | None = None,
    progress: bool = True,
    kvpress_dir: str | Path | None = None,
) -> dict:
    """Evaluate ``config`` end to end; with ``output``, resume from and write to that JSON file.

    ``setup`` (loaded from a config that differs at most in its press) saves reloading the model and samples.
    With ``kvpress_dir``, the results are also written there in kvpress's evaluation layout
    (``grkv_core.kvpress_layout``). Returns the summary dict (per-task scores, their mean, mean costs) with the
    config, versions and the kvpress folders written (``kvpress_folders``).
    """
    return run_evaluations([config], [output], setup=setup, progress=progress, kvpress_dir=kvpress_dir)[0]


def run_evaluations(
    configs: list[EvalConfig],
    outputs: list[str | Path | None],
    *,
    setup: EvaluationSetup | None = None,
    progress: bool = True,
    kvpress_dir: str | Path | None = None,
) -> list[dict]:
    """Evaluate several configurations (differing at most in their press) sample by sample, sharing each prefill.

    Each configuration resumes from and writes to its own output file (or None); a sample is evaluated for the
    configurations whose files lack it, all in one ``Evaluator.evaluate_trials``. Returns one summary per
    configuration, as ``run_evaluation`` (``kvpress_dir`` too).
    """
    if len(configs) != len(outputs):
        raise ValueError(f"{len(configs)} configurations but {len(outputs)} outputs")
    decode = configs[0].decode
    if any(config.decode != decode for config in configs):
        raise ValueError("configurations evaluated together either all decode or none does")
    if kvpress_dir is not None and not decode:
        raise ValueError("kvpress's evaluation layout holds predictions: decode (drop --no-decode) to write it")
    setup = setup or EvaluationSetup.load(configs[0])
    stores = [ResultStore(Path(output), config, setup.model_dtype) if output is not None else None
              for config, output in zip(configs, outputs)]
    label = configs[0].press.label if len(configs) == 1 else f"{len(configs)} configurations"
    results = evaluate_samples(setup.evaluator, setup.samples, [config.press for config in configs], stores,
                               decode=decode, progress=label if progress else None)
    summaries = [{"config": config.to_dict(), "label": config.press.label, "versions": library_versions(),
                  **summarize(rows)} for config, rows in zip(configs, results)]
    if kvpress_dir is not None:
        for config, rows, summary in zip(configs, results, summaries):
            runs = kvpress_runs(config, setup.samples, rows, str(build(config.press)),
                                {"summary": summary, "versions": summary["versions"]})
            summary["kvpress_folders"] = [str(write_run(kvpress_dir, run)) for run in runs]
    return summaries


def evaluate_samples(
    evaluator: Evaluator,
    samples: list[EvalSample],
    presses: list[PressConfig],
    stores: list[ResultStore | None],
    *,
    decode: bool = True,
    progress: str | None = None,
) -> list[list[SampleResult]]:
    """Every press's results on ``samples`` (in their order), sample by sample with one shared prefill each.

    Each press resumes from its store (or None): a sample is evaluated, in one ``Evaluator.evaluate_trials``,
    for the presses whose stores lack it, and each new result is added to its store at once, so an interrupted
    call loses at most the sample in progress. Results a store holds for other samples are left out.
    ``progress``: a progress bar's label (None: no bar).
    """
    order = {sample.sample_id: index for index, sample in enumerate(samples)}
    results = [[row for row in (store.results if store is not None else []) if row.sample_id in order]
               for store in stores]
    done = [{row.sample_id for row in rows} for rows in results]
    pending = [sample for sample in samples if any(sample.sample_id not in ids for ids in done)]
    for sample in tqdm(pending, desc=progress, disable=progress is None, unit="sample"):
        todo = [index for index, ids in enumerate(done) if sample.sample_id not in ids]
        evaluated = evaluator.evaluate_trials(sample, [presses[index] for index in todo], decode=decode)
        for index, result in zip(todo, evaluated, strict=True):
            results[index].append(result)
            if stores[index] is not None:
                stores[index].add(result)
    return [sorted(rows, key=lambda row: order[row.sample_id]) for rows in results]


def format_table(summaries: list[dict]) -> str:
    """A plain-text comparison table: one row per configuration, one column per task, the mean score overall and
    over the samples whose needle lies outside the press's window, the answer metrics and costs."""
    tasks = sorted({task for summary in summaries for task in summary["tasks"]})
    header = ["method", *tasks, "mean", "mean outside window", "answer NLL", "answer KL", "top-1", "KV MiB",
              "TTFT s", "window loss", "held-out loss"]
    rows = []
    for summary in summaries:
        costs = summary.get("costs", {})

        def number(value, digits=3):
            return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"

        rows.append([
            summary["label"], *(number(summary["tasks"].get(task), 1) for task in tasks),
            number(summary["mean_score"], 1), number(summary.get("mean_score_outside_window"), 1),
            number(costs.get("answer_nll"), 4), number(costs.get("answer_kl"), 4),
            number(costs.get("answer_top1"), 3), number((costs.get("kv_bytes") or 0) / 2**20, 1),
            number(costs.get("ttft_s"), 2), number(costs.get("window_loss"), 4), number(costs.get("heldout_loss"), 4),
        ])
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
