"""A sweep over AdaKV with and without GRKV, in the per-head layout, end to end on the tiny model through a real Ray
head, MLflow server and Optuna journal: every trial's cache holds the kept rows only, and the iso-memory report places
AdaKV (± GRKV) at those bytes."""

from __future__ import annotations

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from test_sweep_service import local_stack, of_stage, runs_of, start_driver, write_config

from grkv_core.presses.from_config import load_press_config
from sweeps.config import ConfigError, load_config
from tracking.reports.report import build_report
from workers.names import BASELINE_TAG, EVICTION_ONLY, FULL_STAGE, PRESS_ARTIFACT

RATIO = 0.9


def per_head_config(tmp_path, **changes):
    return write_config(
        tmp_path,
        drop=("screening", "test", "data.test"),
        trials=3,
        **{
            "press": {"name": "adakv", "compression_ratio": RATIO, "per_head_cache": True},
            "search_space": {"lambda_v": {"type": "float", "low": 1.0e-3, "high": 1.0, "log": True}},
            "data.samples": 1,
            "data.context_length": 1024,
            "tracking.experiment": "grkv-per-head",
            **changes,
        },
    )


def test_an_adakv_sweep_in_the_per_head_layout_reports_its_real_bytes(tmp_path):
    with local_stack(tmp_path / "stack") as services:
        sweep_id, state = "per-head", tmp_path / "state"
        driver = start_driver(services, per_head_config(tmp_path), sweep_id, state)
        output, _ = driver.communicate(timeout=1200)
        assert driver.returncode == 0, output[-3000:]
        _, children = runs_of(services["tracking_uri"], "grkv-per-head", sweep_id)
        full = of_stage(children, FULL_STAGE, "FINISHED")
        assert len(full) == 3 and {run.data.params["per_head_cache"] for run in full} == {"True"}
        assert {run.data.params["merge"] for run in full} == {"none", "grkv"}
        for run in full:
            held = run.data.metrics["kv_bytes"] / run.data.metrics["full_kv_bytes"]
            assert held <= 1 - RATIO + 0.02, (run.info.run_name, held)
        assert any(run.data.tags.get(BASELINE_TAG) == EVICTION_ONLY for run in full)
        report = build_report(MlflowClient(services["tracking_uri"]), sweep_id, tmp_path / "report")
    iso_memory = pd.read_csv(tmp_path / "report" / "iso_memory.csv")
    alone = iso_memory[iso_memory["configuration"] == "eviction only"]
    full_mib = full[0].data.metrics["full_kv_bytes"] / 2**20
    assert len(alone) == 1 and alone["kv_mib"].iloc[0] <= (1 - RATIO + 0.02) * full_mib
    assert (iso_memory["kv_mib"] <= (1 - RATIO + 0.02) * full_mib).all() and "Iso-memory" in report.summary
    assert load_press_config(state / sweep_id / PRESS_ARTIFACT).per_head_cache


@pytest.mark.parametrize(
    ("press", "message"),
    [
        ({"name": "h2o", "per_head_cache": True}, "press.per_head_cache: per_head_cache needs sdpa or flash attention"),
        ({"name": "adakv", "per_head_cache": "sometimes"}, "press.per_head_cache"),
    ],
)
def test_a_per_head_sweep_that_cannot_run_fails_in_one_line(tmp_path, press, message):
    with pytest.raises(ConfigError, match=message):
        load_config(per_head_config(tmp_path, press=press))
