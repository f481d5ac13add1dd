"""kvpress's leaderboard over folders in its evaluation layout (``grkv_core.evaluation.kvpress_layout``), ours or
kvpress's: ``read_runs`` reads them as ``LeaderboardRow``s, ``leaderboard_table`` and ``leaderboard_figure`` show them
(``grkv leaderboard``).

NOTE: imports nothing heavy (matplotlib only inside ``leaderboard_figure``).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grkv_core.evaluation.kvpress_layout import (
    CONFIG_FILE,
    EXTRAS_FILE,
    KVPRESS_RATIO_STANDINS,
    METRICS_FILE,
    PREDICTIONS_FILE,
)
from grkv_core.metrics import ANSWER_METRICS


@dataclass(frozen=True)
class LeaderboardRow:
    """One run of kvpress's layout, ours or kvpress's: kvpress's leaderboard columns, then what ``grkv.json`` and
    our predictions.csv columns add (None for kvpress's runs).

    ``compression_ratio`` is the press's ``threshold`` or ``head_compression_ratio`` for the presses that have
    one of those instead (``ratio_field`` says which). ``score`` is metrics.json's mean over its tasks (RULER),
    or its one number (a LongBench subset).
    """

    dataset: str
    data_dir: str
    model: str
    method: str
    compression_ratio: float
    score: float
    query_aware: bool
    path: str
    ratio_field: str = "compression_ratio"
    label: str | None = None
    rows: int | None = None
    answer_nll: float | None = None
    answer_kl: float | None = None
    answer_top1: float | None = None


def _score(metrics: Any, path: Path) -> float:
    """metrics.json's one number: itself, or the mean over its tasks of each task's number (a task's
    ``{"string_match": x}`` counts as x)."""
    if isinstance(metrics, (int, float)):
        return float(metrics)
    if isinstance(metrics, dict) and metrics:
        values = [_score(value, path) for value in metrics.values()]
        return statistics.fmean(values)
    raise ValueError(f"{path}: metrics.json holds no score ({metrics!r})")


def _mean_column(rows: list[dict[str, str]], column: str) -> float | None:
    """The mean of a predictions.csv column over the rows that hold a finite number in it (None: none does)."""
    values = [float(row[column]) for row in rows if row.get(column) not in (None, "")]
    values = [value for value in values if math.isfinite(value)]
    return statistics.fmean(values) if values else None


def read_run(folder: str | Path) -> LeaderboardRow:
    """The leaderboard row of one folder of kvpress's layout (metrics.json and config.yaml; predictions.csv and
    grkv.json where present).

    Raises
    ------
    ValueError
        If a file is missing or does not hold what kvpress writes (the message names the file).
    """
    folder = Path(folder)
    for name in (METRICS_FILE, CONFIG_FILE):
        if not (folder / name).is_file():
            raise ValueError(f"{folder}: no {name}; not a finished kvpress evaluation folder")
    try:
        config = yaml.safe_load((folder / CONFIG_FILE).read_text()) or {}
        metrics = json.loads((folder / METRICS_FILE).read_text())
    except (yaml.YAMLError, json.JSONDecodeError) as error:
        raise ValueError(f"{folder}: unreadable results ({error})") from None
    missing = [name for name in ("dataset", "model", "press_name") if name not in config]
    ratio_field = next((name for name in ("compression_ratio", *KVPRESS_RATIO_STANDINS) if name in config), None)
    if missing or ratio_field is None:
        raise ValueError(f"{folder / CONFIG_FILE}: lacks {', '.join(missing or ['compression_ratio'])}")
    predictions = folder / PREDICTIONS_FILE
    rows = None
    if predictions.exists():
        with open(predictions, newline="") as file:
            rows = list(csv.DictReader(file))
    ours = folder / EXTRAS_FILE
    extras = json.loads(ours.read_text()) if ours.exists() else {}
    answer = {name: _mean_column(rows, name) for name in ANSWER_METRICS} if ours.exists() and rows is not None else {}
    return LeaderboardRow(
        dataset=str(config["dataset"]),
        data_dir=str(config.get("data_dir") or ""),
        model=str(config["model"]),
        method=str(config["press_name"]),
        compression_ratio=float(config[ratio_field]),
        score=_score(metrics, folder / METRICS_FILE),
        query_aware=bool(config.get("query_aware", False)),
        path=str(folder),
        ratio_field=ratio_field,
        label=extras.get("label"),
        rows=None if rows is None else len(rows),
        **answer,
    )


def read_runs(*roots: str | Path) -> list[LeaderboardRow]:
    """Every finished run under ``roots`` (each a run folder or a folder of them, at any depth: kvpress's
    ``output_dir``, a sweep's ``kvpress/`` folder), sorted by dataset, data_dir, model, method and ratio. A folder
    with metrics.json but no config.yaml (kvpress writes config.yaml last: an unfinished run) is skipped with a
    warning.

    Raises
    ------
    ValueError
        If a root does not exist or holds no run.
    """
    found = []
    for root in map(Path, roots):
        if not root.exists():
            raise ValueError(f"{root}: no such folder")
        folders = sorted({path.parent for path in root.rglob(METRICS_FILE)})
        if not folders:
            raise ValueError(f"{root}: holds no kvpress results (no {METRICS_FILE} below it)")
        for folder in folders:
            if not (folder / CONFIG_FILE).exists():
                warnings.warn(
                    f"{folder}: metrics.json without config.yaml (an unfinished kvpress run); skipped", stacklevel=2
                )
                continue
            found.append(read_run(folder))
    return sorted(
        found,
        key=lambda row: (
            row.dataset,
            row.data_dir,
            row.model,
            row.method,
            row.compression_ratio,
            row.query_aware,
            row.path,
        ),
    )


def leaderboard_table(rows: Sequence[LeaderboardRow]) -> str:
    """A markdown table of ``rows``: kvpress's leaderboard columns, then the answer metrics where a run has them."""

    def number(value, spec: str) -> str:
        return "" if value is None else format(value, spec)

    lines = [
        "| dataset | data_dir | model | method | compression ratio | query-aware | score | answer NLL | answer KL "
        "| top-1 | rows | configuration | folder |",
        "|" + "---|" * 13,
    ]
    for row in rows:
        ratio = number(row.compression_ratio, ".3g") + (
            "" if row.ratio_field == "compression_ratio" else f" ({row.ratio_field})"
        )
        lines.append(
            f"| {row.dataset} | {row.data_dir} | {row.model} | {row.method} | {ratio} | "
            f"{'yes' if row.query_aware else 'no'} | {row.score:.2f} | {number(row.answer_nll, '.4f')} | "
            f"{number(row.answer_kl, '.4f')} | {number(row.answer_top1, '.3f')} | {number(row.rows, 'd')} | "
            f"{row.label or ''} | {row.path} |"
        )
    return "\n".join(lines)


def leaderboard_figure(rows: Sequence[LeaderboardRow], path: str | Path) -> Path:
    """Score against compression ratio, a line per method (and protocol), a panel per (dataset, data_dir, model);
    the presses whose budget is a threshold are left out (their axis is another)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plotted = [row for row in rows if row.ratio_field == "compression_ratio"]
    if not plotted:
        raise ValueError("no run with a compression ratio to plot")
    panels = sorted({(row.dataset, row.data_dir, row.model) for row in plotted})
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        lines: dict[str, list[LeaderboardRow]] = {}
        for row in plotted:
            if (row.dataset, row.data_dir, row.model) == panel:
                lines.setdefault(row.method + (" (query-aware)" if row.query_aware else ""), []).append(row)
        for method, points in sorted(lines.items()):
            points.sort(key=lambda row: row.compression_ratio)
            ax.plot(
                [row.compression_ratio for row in points],
                [row.score for row in points],
                marker="o",
                linestyle="--" if "query-aware" in method else "-",
                label=method,
            )
        ax.set_title(" / ".join(filter(None, panel)), fontsize=10)
        ax.set_xlabel("compression ratio (fraction of the KV pairs removed)")
        ax.set_ylabel("score")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
