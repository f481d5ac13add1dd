"""What an evaluation records: one ``SampleResult`` per sample, their summary, the resumable result file and the
comparison table.

NOTE: the summary averages every metric ``grkv_core.metrics.METRICS`` summarises by its ``SAMPLE_MEAN``, so a metric
added there and to ``SampleResult`` reaches the result files, MLflow and the reports with no change here.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from grkv_core.config import EvalConfig
from grkv_core.files import json_source, read_json, write_atomically
from grkv_core.metrics import SAMPLE_MEAN_METRICS
from grkv_core.options import GRKV_DEFAULTS
from grkv_core.presses.from_config import resolved

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
    """Per-task mean scores (in %), their mean over tasks, under ``costs`` the mean of every ``SAMPLE_MEAN_METRICS``
    (costs, losses and answer metrics), and what the score measures: the mean score of the samples whose answer lies
    outside the press's always-kept window (``mean_score_outside_window``; those inside score at any budget) and the
    mean score per needle depth (``depth_scores``: bin -> {"score", "samples"})."""
    if not results:
        return {"tasks": {}, "mean_score": None, "samples": 0}
    task_scores, mean_score = _task_mean(results)

    def mean_of(name):
        values = [getattr(r, name) for r in results if getattr(r, name) is not None]
        return statistics.fmean(values) if values else None

    costs = {name: mean_of(name) for name in SAMPLE_MEAN_METRICS}
    outside = [r for r in results if not r.answer_in_window]
    depths: dict[str, list[float]] = {}
    for result in results:
        if result.score is not None and result.answer_depth is not None:
            depths.setdefault(depth_bin(result.answer_depth), []).append(result.score)
    return {
        "tasks": task_scores,
        "mean_score": mean_score,
        "samples": len(results),
        "costs": costs,
        "mean_score_outside_window": _task_mean(outside)[1],
        "window_samples": sum(1 for r in results if r.answer_in_window),
        "depth_scores": {
            label: {"score": 100 * statistics.fmean(scores), "samples": len(scores)}
            for label, scores in sorted(depths.items())
        },
    }


def library_versions() -> dict[str, str]:
    import kvpress
    import transformers

    from grkv_core import __version__

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvpress": getattr(kvpress, "__version__", "0.5.5"),
        "grkv": __version__,
    }


class ResultStore:
    """The output JSON of one evaluation, rewritten atomically after every sample (resume-safe), resumed from the file
    or from its compressed copy (``grkv_core.files.read_json``)."""

    def __init__(self, path: Path, config: EvalConfig, model_dtype: str, settings: dict | None = None):
        """``settings``: every setting of the press (``BuiltPress.settings``, defaults included); None resolves
        ``config.press`` anew."""
        self.path = Path(path)
        self.config = config
        self.model_dtype = model_dtype
        self.resolved_press = resolved(config.press) if settings is None else settings
        self.results: list[SampleResult] = []
        # NOTE: a committed result file may be compressed (x.json.gz); a resumed run reads it and writes x.json.
        if json_source(self.path) is not None:
            stored = read_json(self.path)
            stored_config = EvalConfig.from_dict(stored["config"])
            if "decode" not in stored["config"] and stored["samples"]:
                # NOTE: files written before the field existed decoded exactly when their rows hold scores.
                stored_config = replace(
                    stored_config, decode=any(row.get("score") is not None for row in stored["samples"])
                )
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
                stored_press = {
                    **{name: value for name, value in GRKV_DEFAULTS.items() if name in self.resolved_press},
                    **stored_press,
                }
            if stored_press is not None and stored_press != self.resolved_press:
                changed = ", ".join(
                    f"{name}: {stored_press.get(name)!r} -> {self.resolved_press.get(name)!r}"
                    for name in sorted(stored_press.keys() | self.resolved_press.keys())
                    if stored_press.get(name) != self.resolved_press.get(name)
                )
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


def format_table(summaries: list[dict]) -> str:
    """A plain-text comparison table: one row per configuration, one column per task, the mean score overall and
    over the samples whose needle lies outside the press's window, the answer metrics and costs."""
    tasks = sorted({task for summary in summaries for task in summary["tasks"]})
    header = [
        "method",
        *tasks,
        "mean",
        "mean outside window",
        "answer NLL",
        "answer KL",
        "top-1",
        "KV MiB",
        "TTFT s",
        "window loss",
        "held-out loss",
    ]
    rows = []
    for summary in summaries:
        costs = summary.get("costs", {})

        def number(value, digits=3):
            return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"

        rows.append(
            [
                summary["label"],
                *(number(summary["tasks"].get(task), 1) for task in tasks),
                number(summary["mean_score"], 1),
                number(summary.get("mean_score_outside_window"), 1),
                number(costs.get("answer_nll"), 4),
                number(costs.get("answer_kl"), 4),
                number(costs.get("answer_top1"), 3),
                number((costs.get("kv_bytes") or 0) / 2**20, 1),
                number(costs.get("ttft_s"), 2),
                number(costs.get("window_loss"), 4),
                number(costs.get("heldout_loss"), 4),
            ]
        )
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
