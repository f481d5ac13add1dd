"""Results in kvpress's evaluation layout, written beside kvpress's own and read back with them.

kvpress's ``evaluation/evaluate.py`` (0.5.5) writes one folder per run, named
``dataset__data_dir__model__press__ratio[__query_aware]``, holding ``predictions.csv`` (the dataset's rows but
the context, with ``predicted_answer`` and ``compression_ratio``), ``metrics.json`` (its scorer's output: for
RULER ``{task: {"string_match": score}}``, for a LongBench subset one number) and ``config.yaml`` (its
``EvaluationConfig``); its leaderboard takes rows of (dataset, data_dir, model, method, compression_ratio,
score), which ``grkv_core.evaluation.leaderboard`` reads back. ``write_run`` writes that layout for a ``grkv eval``
or a sweep's test-stage evaluation; what kvpress has no field for sits beside it: per-question columns after
kvpress's in ``predictions.csv`` (sample id, score, the answer metrics and losses) and ``grkv.json`` (our
configuration, resolved press, summary).

Names: the dataset is kvpress's (``ruler`` for the offline generator and the hub copy alike; ``data_dir`` the
context length, or the LongBench subset, one folder per subset as kvpress runs them). The method is the press's
name here (``snapkv``, ``grkv_snapkv``, ``merging_snapkv`` for kvpress's MergingPress, ``no_press`` for the full
cache), not a promise that kvpress's registry entry of that name is the same press (ours uses the paper's
SnapKV window of 32, kvpress's 64): ``config.yaml``'s ``press_init_command`` holds the press that ran. The model
is the name it was loaded by (``smollm2-135m`` is a dequantised GGUF, not the hub's weights).

NOTE: imports nothing heavy; the CSV and YAML are written with the standard library and PyYAML.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from grkv_core.config import FULL_CACHE, QUERY_AWARE, EvalConfig
from grkv_core.files import write_atomically
from grkv_core.metrics import ANSWER_METRICS, LOSS_METRICS

PREDICTIONS_FILE = "predictions.csv"
METRICS_FILE = "metrics.json"
CONFIG_FILE = "config.yaml"
EXTRAS_FILE = "grkv.json"
# Where a sweep keeps its test stage's runs in this layout: ``<state>/<sweep>/kvpress/<test_of>/`` and each test
# run's MLflow artifacts ``kvpress/``.
KVPRESS_FOLDER = "kvpress"
# kvpress's EvaluationConfig fields with the values a run of ours gives the ones it does not set, in kvpress's
# order (``asdict``), as ``EvaluationConfig.save_config`` writes them for a press with a compression ratio (it drops
# ``threshold`` and ``head_compression_ratio`` when unset). None stands for a value each run sets.
KVPRESS_CONFIG_DEFAULTS: dict[str, Any] = {
    "dataset": None,
    "data_dir": None,
    "model": None,
    "device": None,
    "press_name": None,
    "compression_ratio": None,
    "key_channel_compression_ratio": None,
    "fraction": 1.0,
    "max_new_tokens": None,
    "max_context_length": None,
    "query_aware": None,
    "needle_depth": None,
    "compression_interval": None,
    "target_size": None,
    "hidden_states_buffer_size": None,
    "output_dir": ".",
    "log_level": "INFO",
    "model_kwargs": {},
    "press_init_command": None,
    "seed": None,
    "fp8": False,
}
# The fields kvpress's other presses carry instead of ``compression_ratio`` (DMSPress, DuoAttentionPress).
KVPRESS_RATIO_STANDINS = ("threshold", "head_compression_ratio")
# Our per-question columns after kvpress's in predictions.csv.
EXTRA_COLUMNS = ("sample_id", "score", *ANSWER_METRICS, *LOSS_METRICS, "answer_depth", "answer_in_window")
KVPRESS_DATASETS = {"ruler": "ruler", "ruler-hub": "ruler", "longbench": "longbench"}
# kvpress's name for the mergers whose press is kvpress's own (its registry's ``merging_<press>``).
KVPRESS_MERGER_PREFIXES = {"kvpress_merging": "merging"}


def method_name(press: str, merge: str) -> str:
    """The leaderboard's method of a press: ``snapkv``, ``grkv_snapkv``, ``merging_snapkv``, ``no_press``."""
    if press == FULL_CACHE:
        return "no_press"
    return press if merge == "none" else f"{KVPRESS_MERGER_PREFIXES.get(merge, merge)}_{press}"


def run_name(config: EvalConfig, data_dir: str) -> str:
    """kvpress's folder name of a run (``EvaluationConfig.get_results_dir``)."""
    components = [
        KVPRESS_DATASETS[config.dataset],
        data_dir,
        config.model.replace("/", "--"),
        method_name(config.press.press, config.press.merge),
        f"{config.press.compression_ratio:.2f}",
    ]
    if config.protocol == QUERY_AWARE:
        components.append("query_aware")
    return "__".join(filter(None, components))


@dataclass(frozen=True)
class KvpressRun:
    """One folder of kvpress's layout, ready to write: its name, config.yaml, rows and metrics.json."""

    name: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    metrics: Any
    extras: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KvpressRun:
        return cls(**data)


def _percent(scores: Sequence[float]) -> float:
    return round(100 * statistics.fmean(scores), 2)


def kvpress_runs(
    config: EvalConfig,
    samples: Sequence,
    results: Sequence,
    press_init_command: str,
    extras: dict[str, Any] | None = None,
) -> list[KvpressRun]:
    """The kvpress folders of an evaluation: one for RULER, one per task for LongBench (kvpress's subsets).

    Parameters
    ----------
    config : EvalConfig
        The evaluation (dataset, model, press, protocol).
    samples : sequence of EvalSample
        The evaluated samples (their questions, references and answer prefixes fill predictions.csv).
    results : sequence of SampleResult
        The results of the samples that were decoded; a sample without a result is left out.
    press_init_command : str
        ``str(press)`` of the press that ran (kvpress records it; ``"None"`` for the full cache).
    extras : dict, optional
        More of our fields for ``grkv.json`` (e.g. the summary, versions).

    Raises
    ------
    ValueError
        If no result was decoded (screening results have no predictions to write).
    """
    by_id = {sample.sample_id: sample for sample in samples}
    decoded = [result for result in results if result.score is not None]
    if not decoded:
        raise ValueError("kvpress's layout holds decoded predictions; these results have none")
    longbench = config.dataset == "longbench"
    groups: dict[str, list[dict[str, Any]]] = {}
    for result in decoded:
        sample = by_id[result.sample_id]
        data_dir = sample.task if longbench else str(config.context_length or 4096)
        groups.setdefault(data_dir, []).extend(_rows(config, sample, result, longbench))
    # NOTE: JSON-native (lists, not tuples), so a run crosses Ray and the sweep's state files unchanged.
    ours = json.loads(
        json.dumps(
            {"config": config.to_dict(), "label": config.press.label, "protocol": config.protocol, **(extras or {})}
        )
    )
    runs = []
    for data_dir, rows in groups.items():
        kvpress_config = {
            **KVPRESS_CONFIG_DEFAULTS,
            "dataset": KVPRESS_DATASETS[config.dataset],
            "data_dir": data_dir,
            "model": config.model,
            "device": config.device,
            "press_name": method_name(config.press.press, config.press.merge),
            "compression_ratio": config.press.compression_ratio,
            "query_aware": config.protocol == QUERY_AWARE,
            "press_init_command": press_init_command,
            "seed": config.seed,
        }
        by_task: dict[str, list[float]] = {}
        for row in rows:
            by_task.setdefault(row["task"], []).append(row["score"])
        metrics = (
            _percent([score for scores in by_task.values() for score in scores])
            if longbench
            else {task: {"string_match": _percent(scores)} for task, scores in sorted(by_task.items())}
        )
        runs.append(KvpressRun(run_name(config, data_dir), kvpress_config, rows, metrics, ours))
    return runs


def _rows(config: EvalConfig, sample, result, longbench: bool) -> list[dict[str, Any]]:
    """predictions.csv's rows of one sample: one per question, kvpress's columns then ours."""
    rows = []
    query_aware = config.protocol == QUERY_AWARE
    for index, question in enumerate(sample.questions):
        row: dict[str, Any] = {
            "task": sample.task,
            # NOTE: kvpress's query_aware moves the question into the context and leaves it empty
            "question": "" if query_aware else question,
            "answer_prefix": sample.answer_prefix,
            "answers" if longbench else "answer": list(sample.references[index]),
            "max_new_tokens": sample.max_new_tokens,
        }
        if longbench:
            row["all_classes"] = list(sample.extra.get("all_classes") or [])
        row.update(
            predicted_answer=result.predictions[index],
            compression_ratio=config.press.compression_ratio,
            sample_id=sample.sample_id,
            score=result.scores[index],
        )
        row.update({name: getattr(result, name) for name in EXTRA_COLUMNS if name not in ("sample_id", "score")})
        rows.append(row)
    return rows


def write_run(output_dir: str | Path, run: KvpressRun) -> Path:
    """Write ``run`` under ``output_dir`` as kvpress does: ``<output_dir>/<name>/``, or ``<name>/1``, ``/2``...
    when that folder holds another configuration's results (kvpress never overwrites); the same configuration's
    folder is rewritten. Returns the folder.

    The columns of predictions.csv are kvpress's, then ours (``EXTRA_COLUMNS``); a list (the references) is
    written as a Python list literal.
    """
    folder = Path(output_dir) / run.name
    if _holds_other(folder, run):
        index = 1
        while (folder / str(index)).exists() and _holds_other(folder / str(index), run):
            index += 1
        folder = folder / str(index)
    folder.mkdir(parents=True, exist_ok=True)
    # NOTE: ours first, config.yaml last (kvpress's mark of a finished run): a write cut short leaves a folder that
    # ``_holds_other`` still knows as this configuration's, so writing it again rewrites it in place.
    write_atomically(folder / EXTRAS_FILE, json.dumps(run.extras, indent=1))
    columns = list(dict.fromkeys(key for row in run.rows for key in row))
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=columns)
    writer.writeheader()
    for row in run.rows:
        writer.writerow({key: repr(value) if isinstance(value, list) else _cell(value) for key, value in row.items()})
    write_atomically(folder / PREDICTIONS_FILE, table.getvalue())
    write_atomically(folder / METRICS_FILE, json.dumps(run.metrics, indent=4))
    config = dict(run.config, output_dir=str(Path(output_dir)))
    write_atomically(folder / CONFIG_FILE, yaml.safe_dump(config, default_flow_style=False, indent=2, sort_keys=False))
    return folder


def _cell(value):
    return "" if value is None else value


def _holds_other(folder: Path, run: KvpressRun) -> bool:
    """Whether ``folder`` holds results that are not ``run``'s configuration (kvpress's, or ours of another)."""
    if not (folder / METRICS_FILE).exists():
        return False
    extras = folder / EXTRAS_FILE
    if not extras.exists():
        return True
    stored = json.loads(extras.read_text()).get("config")
    return (
        stored is None
        or EvalConfig.from_dict(stored).resume_key() != EvalConfig.from_dict(run.extras["config"]).resume_key()
    )
