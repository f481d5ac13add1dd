"""Check folders that ``grkv eval --kvpress-dir`` (or a sweep's test stage) wrote against kvpress's own evaluation
code, from a kvpress checkout (its ``evaluation/`` is not in the wheel):

* ``config.yaml`` builds kvpress's ``EvaluationConfig`` (every key one of its fields), and that config's
  ``get_results_dir`` names the folder as it is named;
* kvpress's RULER scorer (``evaluation/benchmarks/ruler/calculate_metrics.py``) on ``predictions.csv``, read with
  pandas as kvpress would, gives ``metrics.json``.

    git clone --depth 1 --branch v0.5.5 https://github.com/NVIDIA/kvpress /tmp/kvpress   # or any checkout
    grkv eval --press full --samples 2 --kvpress-dir /tmp/kv
    python -m benchmarks.kvpress_layout_check --kvpress-repo /tmp/kvpress /tmp/kv

Prints one line per folder and exits 1 if any check fails. kvpress's ``evaluate.py`` imports its whole evaluation
stack (fire, datasets, every press); only its ``EvaluationConfig`` class is taken from the source, with the press
and dataset registries reduced to the names the folder uses.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

import pandas as pd
import yaml

from grkv_core.evaluation.kvpress_layout import CONFIG_FILE, METRICS_FILE, PREDICTIONS_FILE


def kvpress_evaluation_config(repo: Path, dataset: str, press_name: str) -> type:
    """kvpress's ``EvaluationConfig`` class, compiled from its source with registries holding only the given
    dataset and press."""
    source = (repo / "evaluation" / "evaluate.py").read_text()
    tree = ast.parse(source)
    node = next(item for item in tree.body if isinstance(item, ast.ClassDef) and item.name == "EvaluationConfig")
    namespace = {
        "dataclass": dataclass,
        "field": field,
        "asdict": asdict,
        "Optional": Optional,
        "Dict": Dict,
        "Any": Any,
        "Path": Path,
        "yaml": yaml,
        "logger": __import__("logging").getLogger("kvpress"),
        "DATASET_REGISTRY": {dataset: dataset},
        "SCORER_REGISTRY": {dataset: None},
        "PRESS_REGISTRY": {press_name: None},
    }
    exec(compile(ast.Module(body=[node], type_ignores=[]), "evaluate.py", "exec"), namespace)  # noqa: S102
    return namespace["EvaluationConfig"]


def kvpress_ruler_scorer(repo: Path):
    path = repo / "evaluation" / "benchmarks" / "ruler" / "calculate_metrics.py"
    spec = importlib.util.spec_from_file_location("kvpress_ruler_metrics", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.calculate_metrics


def check(folder: Path, repo: Path) -> list[str]:
    """The checks ``folder`` fails (empty: all hold)."""
    failures = []
    config = yaml.safe_load((folder / CONFIG_FILE).read_text())
    evaluation_config = kvpress_evaluation_config(repo, config["dataset"], config["press_name"])
    built = evaluation_config(**config)
    with tempfile.TemporaryDirectory() as scratch:
        expected = built.get_results_dir(Path(scratch)).name
    if expected != folder.name:
        failures.append(f"kvpress names it {expected!r}")
    if config["dataset"] == "ruler":
        frame = pd.read_csv(folder / PREDICTIONS_FILE, keep_default_na=False)
        frame["answer"] = frame["answer"].apply(ast.literal_eval)
        frame["predicted_answer"] = frame["predicted_answer"].astype(str)
        scored = kvpress_ruler_scorer(repo)(frame)
        stored = json.loads((folder / METRICS_FILE).read_text())
        if scored != stored:
            failures.append(f"kvpress's scorer gives {scored}, metrics.json holds {stored}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvpress-repo", type=Path, required=True, help="a kvpress checkout (with evaluation/)")
    parser.add_argument("roots", nargs="+", type=Path, help="folders holding kvpress-layout run folders")
    args = parser.parse_args()
    folders = sorted({path.parent for root in args.roots for path in root.rglob(METRICS_FILE)})
    if not folders:
        parser.error(f"no {METRICS_FILE} under {', '.join(map(str, args.roots))}")
    failed = 0
    for folder in folders:
        failures = check(folder, args.kvpress_repo)
        failed += bool(failures)
        print(f"{'FAIL' if failures else 'ok  '} {folder}" + "".join(f"\n     {text}" for text in failures))
    print(f"{len(folders) - failed} of {len(folders)} folders pass kvpress's own config and scorer")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
