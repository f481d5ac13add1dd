"""Side by side: the driver's time per trial in sweeps that ``benchmarks.sweep_scale`` ran, each from its work folder,
whatever the code that ran them (before the driver's writer, every part of a trial was on the driver's loop).

    .venv/bin/python -m benchmarks.sweep_scale_compare before=~/.grkv/ab-before-1 after=~/.grkv/ab-after-1 ...

Prints a markdown table, one column a folder: the sweep's rate once its workers were up (trials recorded per minute
between the first and the last trial recorded), and the medians (p95) of the driver's seconds per trial on its loop
(what the trials wait for) and its CPU, on its writer beside it, and by part, from
``<work>/state/<sweep>/driver_times.jsonl``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from benchmarks.sweep_scale import percentile
from sweeps.state.driver_times import LOOP_PARTS, PARTS, WRITER_PARTS


def driver_rows(work: Path) -> list[dict]:
    """The full stage's lines of the sweep's ``driver_times.jsonl`` in ``work``."""
    (times,) = (work / "state").glob("*/driver_times.jsonl")
    rows = [json.loads(line) for line in times.read_text().splitlines() if line.strip()]
    return [row for row in rows if row["stage"] == "full"]


def figures(rows: list[dict]) -> dict[str, str]:
    """One column of the table."""
    on_writer = "wait_s" in rows[0]  # NOTE: the code before the writer had no wait, and every part on its loop
    on_loop = LOOP_PARTS if on_writer else PARTS
    loop = [sum(row.get(f"{part}_s", 0.0) for part in on_loop) for row in rows]
    loop_cpu = [sum(row.get(f"{part}_cpu_s", 0.0) for part in on_loop) for row in rows]
    writer = [sum(row[f"{part}_s"] for part in WRITER_PARTS) for row in rows] if on_writer else None
    span = max(row["at"] for row in rows) - min(row["at"] for row in rows)

    def ms(values: list[float]) -> str:
        return f"{1000 * statistics.median(values):.1f} ({1000 * percentile(values, 0.95):.1f})"

    column = {
        "trials": str(len(rows)),
        "trials per minute, workers up": f"{len(rows) / (span / 60):.0f}",
        "driver's loop: median (p95) ms": ms(loop),
        "its CPU": ms(loop_cpu),
        "its writer, beside the loop": ms(writer) if writer else "none: on the loop",
    }
    for part in PARTS:
        if f"{part}_s" in rows[0]:
            column[f"{part}: median (p95) ms"] = ms([row[f"{part}_s"] for row in rows])
    return column


def main() -> int:
    columns = {}
    for argument in sys.argv[1:]:
        name, _, folder = argument.rpartition("=")
        columns[name or folder] = figures(driver_rows(Path(folder).expanduser()))
    rows = list(dict.fromkeys(key for column in columns.values() for key in column))
    print("| | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for row in rows:
        print(f"| {row} | " + " | ".join(column.get(row, "") for column in columns.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
