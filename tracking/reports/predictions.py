"""The per-question rows a sweep's runs logged (``predictions.json``), as one frame for the reports' paired
comparisons."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tracking.mlflow_tracker import SAMPLE_FIELDS

PREDICTIONS_ARTIFACT = "predictions.json"
# NOTE: a row is one (sample, question), or one sample where nothing was decoded; its SAMPLE_FIELDS are the sample's.
PREDICTION_COLUMNS = ["run_id", "sample_id", "task", "question", "score", *SAMPLE_FIELDS]


def load_predictions(client: MlflowClient, run_ids: list[str], notes: list[str], stage: str) -> pd.DataFrame:
    """The per-question rows of each run's ``predictions.json`` (``PREDICTION_COLUMNS``; a key an older artifact
    lacks reads NaN).

    Runs without the artifact add no rows and one note (naming ``stage``) between them.
    """
    frames, missing = [], []
    with tempfile.TemporaryDirectory() as folder:
        for run_id in run_ids:
            try:
                path = client.download_artifacts(run_id, PREDICTIONS_ARTIFACT, str(Path(folder) / run_id))
            except (MlflowException, OSError):
                missing.append(run_id)
                continue
            rows = json.loads(Path(path).read_text())
            frames.append(pd.DataFrame(rows).assign(run_id=run_id).reindex(columns=PREDICTION_COLUMNS))
    if missing:
        notes.append(
            f"{len(missing)} {stage} run(s) have no {PREDICTIONS_ARTIFACT} (e.g. run {missing[0]}); "
            "their samples cannot be paired"
        )
    if not frames:
        return pd.DataFrame(columns=PREDICTION_COLUMNS)
    return _typed_predictions(pd.concat(frames, ignore_index=True))


def _typed_predictions(rows: pd.DataFrame) -> pd.DataFrame:
    """Numbers as floats (None -> NaN) and ``answer_in_window`` as a nullable boolean."""
    numeric = ["score", *(name for name in SAMPLE_FIELDS if name != "answer_in_window")]
    rows[numeric] = rows[numeric].apply(pd.to_numeric, errors="coerce").astype(float)
    rows["answer_in_window"] = rows["answer_in_window"].astype("boolean")
    return rows
