"""The per-question rows a sweep's runs logged (``predictions.json``), as one frame for the reports' paired
comparisons."""

from __future__ import annotations

import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow.artifacts
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tracking.mlflow_tracker import SAMPLE_FIELDS

PREDICTIONS_ARTIFACT = "predictions.json"
# NOTE: a row is one (sample, question), or one sample where nothing was decoded; its SAMPLE_FIELDS are the sample's.
PREDICTION_COLUMNS = ["run_id", "sample_id", "task", "question", "score", *SAMPLE_FIELDS]
# Downloads at once: each is one small file, mostly waiting on the server.
DOWNLOADS = 8


def load_predictions(client: MlflowClient, artifact_uris: dict[str, str], notes: list[str], stage: str) -> pd.DataFrame:
    """The per-question rows of each run's ``predictions.json`` (``PREDICTION_COLUMNS``; a key an older artifact
    lacks reads NaN), in the order of ``artifact_uris`` (run id: its ``run.info.artifact_uri``).

    Runs without the artifact add no rows and one note (naming ``stage``) between them.

    NOTE: read from each run's artifact URI, ``DOWNLOADS`` at a time: through ``runs:/`` MLflow 3 also looks for the
    run's logged models, three more requests a run (docs/results/sweep-scale.md).
    """
    frames, missing = [], []
    with tempfile.TemporaryDirectory() as folder:

        def download(run_id: str) -> Path | None:
            try:
                return Path(
                    mlflow.artifacts.download_artifacts(
                        artifact_uri=f"{artifact_uris[run_id]}/{PREDICTIONS_ARTIFACT}",
                        dst_path=str(Path(folder) / run_id),
                        tracking_uri=client.tracking_uri,
                    )
                )
            except (MlflowException, OSError):
                return None

        with ThreadPoolExecutor(DOWNLOADS) as pool:
            paths = list(pool.map(download, artifact_uris))
        for run_id, path in zip(artifact_uris, paths):
            if path is None:
                missing.append(run_id)
                continue
            rows = json.loads(path.read_text())
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
