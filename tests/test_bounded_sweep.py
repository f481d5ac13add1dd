"""A bounded-cache sweep end to end on the tiny model, through a real Ray head, MLflow server and Optuna journal: its
trials stream long texts through caches kept at the searched target size, its report compares the methods across
target sizes, and its exported press is the decoding press."""

from __future__ import annotations

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from test_sweep_service import REPO, complete_trials, local_stack, of_stage, runs_of, start_driver, study_of

from grkv_core.presses.decoding import MergingDecodingPress
from grkv_core.presses.from_config import load_press_file, press_from_file
from sweeps.config import ConfigError, load_config
from sweeps.stages import presses_to_test
from tracking.reports.report import build_report
from workers.names import BASELINE_TAG, EVICTION_ONLY, FULL_STAGE, PRESS_ARTIFACT, TEST_OF_TAG, TEST_STAGE

CONFIG = REPO / "sweeps" / "configs" / "bounded-smoke.yaml"


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    with local_stack(tmp_path_factory.mktemp("grkv-state")) as stack:
        yield stack


def test_a_bounded_cache_sweep_runs_end_to_end_and_reports_across_target_sizes(services, tmp_path):
    sweep_id, state = "bounded", tmp_path / "state"
    driver = start_driver(services, CONFIG, sweep_id, state)
    output, _ = driver.communicate(timeout=1200)
    assert driver.returncode == 0, output[-3000:]
    parents, children = runs_of(services["tracking_uri"], "grkv-bounded-smoke", sweep_id)
    assert parents[0].info.status == "FINISHED" and all(r.info.status == "FINISHED" for r in children)
    study = study_of(state, sweep_id)
    assert len(complete_trials(study)) == 6
    full = of_stage(children, FULL_STAGE)
    for run in full:
        # The press as it streamed, sizes included, and what the protocol measures.
        assert {"stream_nll", "kv_bytes", "cache_rows", "streamed_tokens"} <= set(run.data.metrics)
        assert run.data.params["target_size"] in ("128", "192") and run.data.params["compression_interval"] == "64"
        assert run.data.metrics["cache_rows"] == float(run.data.params["target_size"])
    # Eviction alone at every target size the search may choose; the cache's real bytes follow its size.
    eviction = [r for r in full if r.data.tags.get(BASELINE_TAG) == EVICTION_ONLY]
    assert sorted(r.data.params["target_size"] for r in eviction) == ["128", "192"]
    assert all(r.data.params["merge"] == "none" for r in eviction)
    bytes_at = {int(r.data.params["target_size"]): r.data.metrics["kv_bytes"] for r in eviction}
    assert bytes_at[192] == pytest.approx(1.5 * bytes_at[128])
    # The test stage streams the eval split's texts: the best trial, the baselines, eviction alone at 256, D2O.
    expected = {label for label, _ in presses_to_test(study, load_config(CONFIG))}
    tested = of_stage(children, TEST_STAGE, "FINISHED")
    assert {r.data.tags[TEST_OF_TAG] for r in tested} == expected
    assert f"{EVICTION_ONLY}@256" in expected and "d2o" in expected
    larger = next(r for r in tested if r.data.tags[TEST_OF_TAG] == f"{EVICTION_ONLY}@256")
    assert larger.data.params["target_size"] == "256" and larger.data.metrics["cache_rows"] == 256.0

    report = build_report(MlflowClient(services["tracking_uri"]), sweep_id, tmp_path / "report")
    iso_memory = pd.read_csv(tmp_path / "report" / "iso_memory.csv")
    # The iso-memory table across target sizes: at each, eviction alone beside the mergers, at its own memory.
    assert set(iso_memory["budget"]) == {128.0, 192.0}
    alone = iso_memory[iso_memory["configuration"] == "eviction only"].set_index("budget")
    assert alone["kv_mib"].to_dict() == {size: bytes_at[size] / 2**20 for size in (128, 192)}
    assert (iso_memory.groupby("budget")["method"].nunique() >= 2).all()
    # Across budgets on the held-out texts: eviction alone at 128 and 256 tokens, shown as token counts.
    points = pd.read_csv(tmp_path / "report" / "budgets.csv")
    assert {128.0, 256.0} <= set(points.loc[points["is_eviction"], "budget"]) and "stream_nll" in points
    assert "Iso-memory at budget 192 tok" in report.summary and "stream_nll" in report.summary.splitlines()[1]

    # The sweep's recommendation is the decoding press, chosen under the bounded-cache protocol.
    press_file = state / sweep_id / PRESS_ARTIFACT
    config, protocol = load_press_file(press_file)
    assert protocol == "stream_nll" and config.decoding["compression_interval"] == 64
    press = press_from_file(press_file)
    assert isinstance(press, MergingDecodingPress) and press.target_size == config.decoding["target_size"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("search_space: {compression_ratio: {type: float, low: 0.1, high: 0.9}}", "search target_size"),
        ("screening: {trials: 2, promote: 1}", "screening.trials: data.protocol stream_nll has no screening stage"),
        ("objectives: [{metric: mean_score}]", "measures ['stream_nll', 'kv_bytes'], not mean_score"),
        ("test: {eviction_sizes: [64]}", "test.eviction_sizes: [64] must differ and exceed press.target_size (128)"),
        ("press: {name: streamingllm, target_size: 0}", "press.target_size: target_size must be an integer >= 1"),
        (
            "search_space: {target_size: {type: categorical, choices: [192, 256]}}",
            "press.target_size: the baselines run at 128, not among the choices of search_space.target_size",
        ),
    ],
)
def test_a_bounded_cache_sweep_config_that_cannot_run_fails_in_one_line(tmp_path, change, message):
    path = tmp_path / "sweep.yaml"
    path.write_text(CONFIG.read_text() + "\n" + change + "\n")
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as err:
        load_config(path)
    assert "\n" not in str(err.value)


def test_a_prefill_sweep_refuses_a_bounded_caches_sizes(tmp_path):
    path = tmp_path / "sweep.yaml"
    smoke = (REPO / "sweeps" / "configs" / "smoke.yaml").read_text()
    path.write_text(smoke + "\ntest: {eviction_sizes: [256]}\n")
    with pytest.raises(ConfigError, match="test.eviction_sizes: only a bounded-cache sweep"):
        load_config(path)
