"""Tables as CSV, Markdown and HTML, and the self-contained HTML page (figures embedded as base64 PNG)."""

from __future__ import annotations

import base64
import html
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from tracking.reports.analyses.metrics import BudgetFormat, higher_is_better

MISSING = "–"
SCORE_FORMAT = "{:.2f}"
BUDGET = BudgetFormat()
P_VALUE = "{:.3g}"


def format_value(value, spec: str = "{:.4g}") -> str:
    """``value`` through ``spec`` when it is a number, as text otherwise; NaN and None read as a dash."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return MISSING
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, float, np.number)):
        return spec.format(value)
    return str(value)


def p_value_text(p: float) -> str:
    """``p = 0.0374``, or ``p < 1e-300`` where the p-value underflowed to 0 (an exact linear relation)."""
    return "p < 1e-300" if p == 0 else f"p = {p:.3g}"


# How the report names the performance metrics in prose; other metrics go by their own name.
METRIC_NAMES = {
    "mean_score": "mean score",
    "answer_nll": "answer NLL",
    "answer_kl": "answer KL",
    "answer_top1": "answer top-1 agreement",
}
# The score is in points (0-100), two decimals; the answer metrics are nats or fractions, four significant digits.
METRIC_SPECS = {"mean_score": "{:.2f}"}


def metric_name(metric: str) -> str:
    return METRIC_NAMES.get(metric, metric)


def metric_spec(metric: str, signed: bool = False) -> str:
    """The format spec of ``metric``'s values (``signed``: of differences, with their sign)."""
    spec = METRIC_SPECS.get(metric, "{:.4g}")
    return spec.replace("{:", "{:+") if signed else spec


def metric_text(metric: str, value, signed: bool = False) -> str:
    """``value`` of ``metric`` as text (``metric_spec``); NaN reads as a dash."""
    return format_value(value, metric_spec(metric, signed))


def formatted(
    frame: pd.DataFrame, formats: dict[str, str] | None = None, names: dict[str, str] | None = None
) -> pd.DataFrame:
    """A copy of ``frame`` as text: ``formats`` per column (default ``{:.4g}``), columns renamed by ``names``."""
    formats = formats or {}
    text = pd.DataFrame(
        {column: [format_value(v, formats.get(column, "{:.4g}")) for v in frame[column]] for column in frame.columns},
        index=frame.index,
    )
    return text.rename(columns=names or {})


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table of an all-text frame (pipes in cells escaped)."""

    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    header = "| " + " | ".join(cell(c) for c in frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *body]) + "\n"


def ablation_display(
    table: pd.DataFrame,
    tasks: list[str],
    emphasis: Callable[[str], str],
    escape: Callable[[str], str] = str,
    score: str = "mean_score",
    metrics: tuple[str, ...] = (),
    paired_metric: str | None = None,
) -> pd.DataFrame:
    """The paper's ablation table layout: factor on its group's first row, † default, best Avg. (the mean of
    ``score``) and best of each answer metric in ``metrics`` emphasised, each in its own direction.

    Rows whose other hyperparameters were not held at the defaults get ‡ after their setting; a row paired per
    sample with the paper default or the base press (``vs_default``, ``vs_base``: ``AblationTable``) shows its
    difference in ``paired_metric`` (default: ``score``) with its 95% CI and p. Every cell goes through ``escape``
    (e.g. ``html.escape``) before the best values get ``emphasis``.
    """
    measured = {"Avg.": ("avg", score), **{metric: (metric, metric) for metric in metrics}}
    paired_metric = paired_metric or score
    paired_name = "Avg." if paired_metric == score else paired_metric
    paired_spec = "{:+.2f}" if paired_metric == "mean_score" else "{:+.3f}"
    paired = {
        f"Δ {paired_name} vs † [95% CI]": "vs_default",
        "p": "vs_default_p",
        f"Δ {paired_name} vs base [95% CI]": "vs_base",
        "p vs base": "vs_base_p",
    }
    rows = []
    for factor, group in table.groupby("factor", sort=False):
        best = {
            column: (group[column].max() if higher_is_better(metric) else group[column].min())
            for column, metric in measured.values()
        }
        for position, (_, row) in enumerate(group.iterrows()):
            setting = row["setting"] + ("†" if row["default"] else "") + ("‡" if row["held"] == "varied" else "")
            better = MISSING if pd.isna(row["better"]) else f"{int(row['better'])}/{len(tasks)}"
            cells = {
                "Factor": factor if position == 0 else "",
                "Setting": setting,
                "n": str(row["n"]),
                **{task: format_value(row[task], "{:.2f}") for task in tasks},
                "Better": better,
                **{
                    header: (
                        format_value(row.get(column), "{:.2g}")
                        if column.endswith("_p")
                        else _paired_difference(row, column, paired_spec)
                    )
                    for header, column in paired.items()
                },
            }
            values = {}
            for name, (column, metric) in measured.items():
                text = escape(format_value(row[column], "{:.2f}" if metric == "mean_score" else "{:.4g}"))
                values[name] = emphasis(text) if row[column] == best[column] else text
            rows.append({**{name: escape(text) for name, text in cells.items()}, **values})
    columns = ["Factor", "Setting", "n", *tasks, *measured, "Better", *paired]
    return pd.DataFrame(rows, columns=columns)


def _paired_difference(row: pd.Series, name: str, spec: str) -> str:
    """``+0.012 [-0.003, +0.027] (60)``: a row's paired difference ``name`` (``AblationTable``), its CI and samples."""
    if pd.isna(row.get(name)):
        return MISSING
    low, high = spec.format(row[f"{name}_low"]), spec.format(row[f"{name}_high"])
    return f"{spec.format(row[name])} [{low}, {high}] ({int(row[f'{name}_samples'])})"


@dataclass
class Section:
    """One part of the HTML page: prose lines, tables (already formatted) and figures."""

    title: str
    lines: list[str] = field(default_factory=list)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    figures: list[Path] = field(default_factory=list)
    raw_tables: list[tuple[str, str]] = field(default_factory=list)


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; font-size: .85em; margin: .6em 0 1.2em; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; margin: .5em 0; }
.caption { font-size: .85em; color: #555; } pre { background: #f7f7f7; padding: 1em; white-space: pre-wrap; }
"""


def _image(path: Path) -> str:
    encoded = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{encoded}">'


def html_page(title: str, headline: str, sections: list[Section]) -> str:
    """The report as one HTML document with every figure inline, so the file alone is the report."""
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
        f"<pre>{html.escape(headline)}</pre>",
    ]
    for section in sections:
        parts.append(f"<h2>{html.escape(section.title)}</h2>")
        parts += [f"<p>{html.escape(line)}</p>" for line in section.lines]
        for caption, table in section.tables:
            parts.append(f"<p class='caption'>{html.escape(caption)}</p>")
            parts.append(table.to_html(index=False, border=0, escape=True))
        for caption, markup in section.raw_tables:
            parts.append(f"<p class='caption'>{html.escape(caption)}</p>{markup}")
        parts += [_image(path) for path in section.figures]
    parts.append("</body></html>")
    return "\n".join(parts)


class TableWriter:
    """Writes tables (CSV + Markdown) and remembers every file, for the artifact upload."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.files: list[Path] = []

    def path(self, name: str) -> Path:
        path = self.output_dir / name
        self.files.append(path)
        return path

    def table(self, stem: str, raw: pd.DataFrame, display: pd.DataFrame, footer: str = "") -> None:
        raw.to_csv(self.path(f"{stem}.csv"), index=False)
        self.path(f"{stem}.md").write_text(markdown_table(display) + (f"\n{footer}\n" if footer else ""))

    def text(self, name: str, text: str) -> None:
        self.path(name).write_text(text)
