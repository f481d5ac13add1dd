"""The sweep service with real components: a Ray head and an MLflow server on 127.0.0.1, Optuna journal storage.

Started once per session through infra/local/start.sh (the script a user runs), with free ports and a
temporary state directory, and stopped through infra/local/stop.sh.
"""

import contextlib
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import VENV_BIN, free_ports, local_stack_ports
from mlflow.tracking import MlflowClient

from grkv_core.config import QUERY_AWARE
from grkv_core.evaluation.leaderboard import read_runs
from grkv_core.options import GRKV_DEFAULTS
from grkv_core.presses.from_config import build, load_press_file, press_from_file, resolved
from sweeps.config import ConfigError, load_config
from sweeps.space import press_of
from sweeps.state.ledgers import EXHAUSTED_AFTER_DUPLICATES
from tracking.export import press_of_run
from workers.names import (
    BASELINE_TAG,
    DESIGN_ROW_ATTR,
    EVICTION_ONLY,
    FULL_STAGE,
    LIBRARY_DEFAULT,
    PAPER_DEFAULT,
    PRESS_ARTIFACT,
    PROMOTED_FROM_TAG,
    RECOVERED_TAG,
    REUSES_ATTR,
    ROLE_TAG,
    SCREEN_STAGE,
    STAGE_TAG,
    SWEEP_TAG,
    TEST_OF_TAG,
    TEST_STAGE,
    TRIAL_TAG,
)

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "sweeps" / "configs" / "smoke.yaml"
REQUIRED_METRICS = {
    "mean_score",
    "score.niah_single_1",
    "ttft_s",
    "decode_ms_per_token",
    "peak_memory_bytes",
    "kv_bytes",
    "window_loss",
    "trial_eval_s",
    "batch_trials",
    "resumed_samples",
    "service_overhead_s",
}
# Screening generates nothing: losses and costs, no score.
SCREEN_METRICS = {"question_loss", "window_loss", "kv_bytes", "trial_eval_s", "batch_trials", "service_overhead_s"}


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}:{env['PATH']}"
    env.update({k: str(v) for k, v in extra.items()})
    return env


@contextlib.contextmanager
def local_stack(state: Path, **settings):
    """``infra/local/start.sh`` on free ports in ``state`` (more ``GRKV_*`` settings as keywords), stopped after."""
    ports = local_stack_ports()
    env = child_env(GRKV_STATE_DIR=state, GRKV_RAY_CPUS=2, **ports, **settings)
    subprocess.run(["bash", str(REPO / "infra/local/start.sh")], env=env, check=True, timeout=300)
    # A driver started directly (not through `ray job submit`) needs the variables the start script
    # exports for clients, e.g. the one that keeps Ray's node address on 127.0.0.1.
    for line in (state / "env.sh").read_text().splitlines():
        if line.startswith("export ") and "$" not in line:
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value
    try:
        yield {
            "env": env,
            "state": state,
            "tracking_uri": f"http://127.0.0.1:{ports['GRKV_MLFLOW_PORT']}",
            "dashboard": f"http://127.0.0.1:{ports['GRKV_RAY_DASHBOARD_PORT']}",
            "ray_address": f"127.0.0.1:{ports['GRKV_RAY_PORT']}",
        }
    finally:
        subprocess.run(["bash", str(REPO / "infra/local/stop.sh")], env=env, timeout=120)


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    with local_stack(tmp_path_factory.mktemp("grkv-state")) as stack:
        yield stack


def write_config(tmp_path: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    """The smoke config with dotted fields changed (``"data.samples": 4``) or dropped (``drop=("test",)``)."""
    config = yaml.safe_load(SMOKE.read_text())
    for dotted, value in [*changes.items(), *((name, None) for name in drop)]:
        node = config
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node[part]
        if dotted in drop:
            del node[leaf]
        else:
            node[leaf] = value
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def runs_of(tracking_uri: str, experiment: str, sweep_id: str):
    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, "the sweep created no MLflow experiment"
    runs = client.search_runs([found.experiment_id], f"tags.`{SWEEP_TAG}` = '{sweep_id}'", max_results=1000)
    parents = [r for r in runs if r.data.tags.get(ROLE_TAG) == "sweep"]
    children = [r for r in runs if r.data.tags.get(ROLE_TAG) == "trial"]
    return parents, children


def study_of(state_dir: Path, sweep_id: str, stage: str = FULL_STAGE, storage_url: str | None = None) -> optuna.Study:
    """The sweep's main study, or its screening study (``<sweep_id>.screen``), from the journal in its state
    directory, or from the database at ``storage_url``."""
    storage = storage_url or optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(state_dir / sweep_id / "optuna.journal"))
    )
    return optuna.load_study(study_name=sweep_id if stage == FULL_STAGE else f"{sweep_id}.{stage}", storage=storage)


def complete_trials(study):
    return [t for t in study.get_trials() if t.state == optuna.trial.TrialState.COMPLETE]


def reused_trials(study):
    """Proposals not evaluated because their configuration was: told as failed, naming the trial."""
    reused = [t for t in study.get_trials() if REUSES_ATTR in t.user_attrs]
    assert all(t.state == optuna.trial.TrialState.FAIL for t in reused)
    return reused


def assert_each_configuration_evaluated_once(children, study, config_path: Path, stage: str = FULL_STAGE):
    """No two finished runs of a stage ran the same press; every reused proposal proposed the press of the
    evaluated trial it names; every other trial was evaluated to the end."""
    config = load_config(config_path)
    configurations = [
        frozenset((k, v) for k, v in r.data.params.items() if not k.startswith("optuna."))
        for r in of_stage(children, stage, "FINISHED")
    ]
    assert len(set(configurations)) == len(configurations)
    trials = {t.number: t for t in study.get_trials()}
    reused = reused_trials(study)
    for trial in reused:
        original = trials[trial.user_attrs[REUSES_ATTR]]
        assert original.state == optuna.trial.TrialState.COMPLETE and REUSES_ATTR not in original.user_attrs
        assert press_of(trial.params, config, trial.user_attrs) == press_of(
            original.params, config, original.user_attrs
        )
    assert {t.number for t in complete_trials(study)} == set(trials) - {t.number for t in reused}


def of_stage(runs, stage: str, status: str | None = None) -> list:
    return [r for r in runs if r.data.tags.get(STAGE_TAG) == stage and status in (None, r.info.status)]


def assert_one_finished_child_per_complete_trial(children, study, stage: str = FULL_STAGE):
    finished = of_stage(children, stage, "FINISHED")
    numbers = sorted(int(r.data.tags[TRIAL_TAG]) for r in finished)
    assert numbers == sorted(t.number for t in complete_trials(study))
    for run in finished:
        # A trial recovered after a driver crash has no driver-side timing: nobody watched it finish.
        required = (REQUIRED_METRICS if stage == FULL_STAGE else SCREEN_METRICS) - (
            {"service_overhead_s"} if run.data.tags.get(RECOVERED_TAG) else set()
        )
        assert required <= set(run.data.metrics), sorted(required - set(run.data.metrics))
        assert "compression_ratio" in run.data.params


def expected_tests(config_path: Path, study: optuna.Study) -> set[str]:
    """What the test stage confirms, worked out here from the study: the best non-baseline trials (one
    objective, maximised; distinct configurations), the baselines, eviction-only at each larger budget, the other
    mergers."""
    config = load_config(config_path)
    ranked = sorted(
        (t for t in complete_trials(study) if BASELINE_TAG not in t.user_attrs), key=lambda t: (-t.value, t.number)
    )
    best, seen = [], []
    for trial in ranked:
        if trial.params not in seen and len(best) < config.test.top_k:
            seen.append(trial.params)
            best.append(str(trial.number))
    return {
        *best,
        *config.baselines,
        *(f"{EVICTION_ONLY}@{ratio:g}" for ratio in config.test.eviction_ratios),
        *config.test.mergers,
    }


def assert_one_finished_test_run_each(children, expected: set[str], state: Path, tracking_uri: str):
    finished = of_stage(children, TEST_STAGE, "FINISHED")
    labels = [r.data.tags[TEST_OF_TAG] for r in finished]
    assert sorted(labels) == sorted(expected), "exactly one FINISHED test-stage run per tested configuration"
    for run in finished:
        required = REQUIRED_METRICS - {"service_overhead_s"} if run.data.tags.get(RECOVERED_TAG) else REQUIRED_METRICS
        assert required <= set(run.data.metrics), sorted(required - set(run.data.metrics))
        assert "compression_ratio" in run.data.params and TRIAL_TAG not in run.data.tags
        assert (state / "test" / f"{run.data.tags[TEST_OF_TAG]}.json").is_file()
        # Its results in kvpress's layout, in the state directory and beside the run's other artifacts.
        (row,) = read_runs(state / "kvpress" / run.data.tags[TEST_OF_TAG])
        logged = MlflowClient(tracking_uri).list_artifacts(run.info.run_id, "kvpress")
        assert row.rows and f"kvpress/{Path(row.path).name}" in {artifact.path for artifact in logged}


def test_invalid_config_gives_one_line_error_naming_the_field(tmp_path):
    path = write_config(tmp_path, **{"workers.count": 0})
    result = subprocess.run(
        [sys.executable, "sweep.py", "--config", str(path)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "workers.count" in lines[0], result.stderr
    bad_space = write_config(tmp_path, **{"search_space.lambda_k.low": -1.0})
    with pytest.raises(ConfigError, match="search_space.lambda_k"):
        load_config(bad_space)


def test_safeguard_and_ridge_scale_are_searched_and_the_paper_default_trial_is_the_paper():
    from sweeps.space import baseline_params, suggest_press

    config = load_config(REPO / "sweeps" / "configs" / "ruler-snapkv.yaml")
    paper = dict(baseline_params(config))["paper_default"]
    assert paper["safeguard"] is False and paper["ridge_scale"] == "absolute" and paper["cg_max_iter"] == 200
    params = {**paper, "lambda_k": 0.5, "lambda_v": 0.5, "safeguard": True, "ridge_scale": "relative"}
    press = build(suggest_press(optuna.trial.FixedTrial(params), config))
    assert press.safeguard is True and press.ridge_scale == "relative" and press.lambda_k == 0.5


def test_mlflow_down_at_start_is_a_clear_error_and_writes_nothing(tmp_path):
    state = tmp_path / "state"
    result = subprocess.run(
        [
            sys.executable,
            "sweep.py",
            "--config",
            str(SMOKE),
            "--sweep-id",
            "down",
            "--tracking-uri",
            f"http://127.0.0.1:{free_ports(1)[0]}",
            "--state-dir",
            str(state),
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 3
    assert "not reachable" in result.stderr and "Traceback" not in result.stderr
    assert not state.exists(), "nothing may be written when the tracking server is down"


def test_ray_job_submit_runs_the_smoke_sweep_end_to_end(services, tmp_path):
    """Screening (4 trials, 2 promoted), 8 full trials in batches of 2 and a test stage, through the Jobs API,
    under the query-aware protocol (``--protocol`` overrides the config's)."""
    sweep_id = "e2e"
    state = services["state"] / "sweeps"
    submit = subprocess.run(
        [
            "ray",
            "job",
            "submit",
            "--address",
            services["dashboard"],
            "--working-dir",
            str(REPO),
            "--",
            "python",
            "sweep.py",
            "--config",
            "sweeps/configs/smoke.yaml",
            "--sweep-id",
            sweep_id,
            "--tracking-uri",
            services["tracking_uri"],
            "--state-dir",
            str(state),
            "--protocol",
            QUERY_AWARE,
        ],
        cwd=REPO,
        env=services["env"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    assert "FINISHED" in submit.stdout
    parents, children = runs_of(services["tracking_uri"], "grkv-smoke", sweep_id)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert all(r.info.status == "FINISHED" for r in children)
    assert all(r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for r in children)
    study, screen = study_of(state, sweep_id), study_of(state, sweep_id, SCREEN_STAGE)
    assert len(complete_trials(study)) == 8 and len(complete_trials(screen)) == 4
    assert_each_configuration_evaluated_once(children, study, SMOKE)
    assert_each_configuration_evaluated_once(children, screen, SMOKE, SCREEN_STAGE)
    assert_one_finished_child_per_complete_trial(children, study)
    assert_one_finished_child_per_complete_trial(children, screen, SCREEN_STAGE)
    assert_one_finished_test_run_each(
        children, expected_tests(SMOKE, study), state / sweep_id, services["tracking_uri"]
    )
    assert len(children) == 8 + 4 + 7  # the test stage: 2 best, 3 baselines, 1 larger budget, kvpress's merger
    # Baselines first: the paper's defaults, the eviction press alone, the library's defaults; then the 2 best
    # screened ones.
    first = sorted(complete_trials(study), key=lambda t: t.number)[:5]
    assert first[0].params["merge"] == "grkv" and first[0].params["lambda_k"] == 1e-2
    assert first[1].params == {} and first[1].user_attrs[BASELINE_TAG] == EVICTION_ONLY
    assert first[2].user_attrs[BASELINE_TAG] == LIBRARY_DEFAULT
    assert first[2].params["lambda_k"] == GRKV_DEFAULTS["lambda_k"]
    screened = sorted(complete_trials(screen), key=lambda t: (t.value, t.number))
    assert [t.user_attrs[PROMOTED_FROM_TAG] for t in first[3:]] == [t.number for t in screened[:2]]
    assert [t.params for t in first[3:]] == [t.params for t in screened[:2]]
    promoted_runs = [r for r in of_stage(children, FULL_STAGE) if PROMOTED_FROM_TAG in r.data.tags]
    assert sorted(int(r.data.tags[TRIAL_TAG]) for r in promoted_runs) == [3, 4]
    # Screening generated nothing; full trials ran in batches of 2. Every run measured the answer metrics.
    assert all("mean_score" not in r.data.metrics for r in of_stage(children, SCREEN_STAGE))
    assert all({"answer_nll", "answer_kl", "answer_top1"} <= set(r.data.metrics) for r in children)
    assert parents[0].data.params["data.protocol"] == QUERY_AWARE
    assert max(r.data.metrics["batch_trials"] for r in of_stage(children, FULL_STAGE)) == 2
    # A test-stage run logs its predictions per held-out sample and question.
    client = MlflowClient(services["tracking_uri"])
    tested = of_stage(children, TEST_STAGE)[0]
    rows = json.loads(
        Path(client.download_artifacts(tested.info.run_id, "predictions.json", str(tmp_path))).read_text()
    )
    assert rows and {"sample_id", "question", "prediction", "score"} <= set(rows[0])
    # Each worker loaded its model exactly once for the whole sweep.
    assert {r.data.metrics["worker_model_loads"] for r in children} == {1.0}
    artifacts = {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    assert {"study_trials.csv", "screen_trials.csv", PRESS_ARTIFACT} <= artifacts
    # The sweep ends by recommending the test stage's best press, in a press file beside its state and on its
    # parent run.
    press_file = state / sweep_id / PRESS_ARTIFACT
    assert "best of the test stage" in press_file.read_text() and press_from_file(press_file) is not None
    assert load_press_file(press_file)[1] == QUERY_AWARE
    logged = client.download_artifacts(parents[0].info.run_id, PRESS_ARTIFACT, str(tmp_path))
    assert Path(logged).read_text() == press_file.read_text()
    # The workers' per-sample checkpoints went with their trials' results into the state directory.
    assert (state / sweep_id / "checkpoints").is_dir()
    assert not list((state / sweep_id / "checkpoints").rglob("*.json"))


def test_a_configuration_is_evaluated_once_and_an_exhausted_space_ends_the_stage(services, tmp_path):
    """Eviction-only and CaM: two configurations in all. The first is the eviction-only baseline; every other
    proposal of either reuses its result (told at once, or when the in-flight one finishes) until the sampler
    has proposed nothing new ``EXHAUSTED_AFTER_DUPLICATES`` times in a row, and the stage ends."""
    sweep_id, state = "reuse", tmp_path / "state"
    config = write_config(
        tmp_path,
        drop=("screening", "test", "data.test"),
        merge=["none", "cam"],
        trials=4,
        search_space={},
        **{"tracking.experiment": "grkv-reuse"},
    )
    driver = start_driver(services, config, sweep_id, state)
    output, _ = driver.communicate(timeout=600)
    assert driver.returncode == 0, output[-3000:]
    assert "search space looks exhausted" in output
    parents, children = runs_of(services["tracking_uri"], "grkv-reuse", sweep_id)
    assert parents[0].info.status == "FINISHED" and all(r.info.status == "FINISHED" for r in children)
    study = study_of(state, sweep_id)
    evaluated = complete_trials(study)
    assert evaluated[0].number == 0 and evaluated[0].user_attrs[BASELINE_TAG] == EVICTION_ONLY
    assert len(evaluated) == 2 and evaluated[1].params == {"merge": "cam"}
    reused = len(reused_trials(study))
    assert reused >= EXHAUSTED_AFTER_DUPLICATES and len(study.trials) == reused + 2
    assert_one_finished_child_per_complete_trial(children, study)
    assert_each_configuration_evaluated_once(children, study, config)
    assert any(t.params == {"merge": "none"} for t in study.trials)  # proposed, and reused eviction-only's result
    assert parents[0].data.metrics["reused_proposals"] == reused and parents[0].data.metrics["completed_trials"] == 2


def test_a_one_at_a_time_design_runs_its_rows_and_fills_the_ablation_table(services, tmp_path):
    """The paper's ablation design on the tiny model: the two baselines, then each factor changed alone from the paper
    default (S = 2, GRV); the report's ablation table holds every row at the defaults, on the answer NLL."""
    from tracking.reports import ablation_table, load_sweep

    sweep_id, state = "one-at-a-time", tmp_path / "state"
    config = write_config(
        tmp_path,
        drop=("screening", "test", "data.test"),
        trials=4,
        baselines=[PAPER_DEFAULT, EVICTION_ONLY],
        objectives=[{"metric": "answer_nll"}],
        sampler={"type": "one_at_a_time"},
        search_space={
            "steps": {"type": "categorical", "choices": [1, 2]},
            "components": {"type": "categorical", "choices": ["kv", "v"]},
        },
        **{"tracking.experiment": "grkv-one-at-a-time"},
    )
    driver = start_driver(services, config, sweep_id, state)
    output, _ = driver.communicate(timeout=600)
    assert driver.returncode == 0, output[-3000:]
    trials = complete_trials(study_of(state, sweep_id))
    assert [t.user_attrs.get(BASELINE_TAG) for t in trials[:2]] == [PAPER_DEFAULT, EVICTION_ONLY]
    assert len(trials) == 4 and sorted(t.user_attrs[DESIGN_ROW_ATTR] for t in trials[2:]) == [0, 1]
    assert sorted((t.params["steps"], t.params["components"]) for t in trials[2:]) == [(1, "v"), (2, "kv")]
    client = MlflowClient(services["tracking_uri"])
    sweep = load_sweep(client, sweep_id)
    ran = [
        resolved(press_of_run(client, run_id))
        for run_id, baseline in zip(sweep.trials["run_id"], sweep.trials["baseline"])
        if baseline != EVICTION_ONLY
    ]
    assert len(ran) == 3 and all(press["safeguard"] is False and press["cg_max_iter"] == 200 for press in ran), (
        "the paper default and its rows run Alg. 1's unsearched options"
    )
    result = ablation_table(sweep, score="answer_nll")
    table = result.table.set_index(["factor", "setting"])
    for factor, settings in (("Update steps (S)", ["S=1", "S=2"]), ("Optimized cache components", ["GRKV", "GRV"])):
        assert [table.loc[(factor, setting), "held"] for setting in settings] == ["at defaults"] * 2
    assert not any("no trials vary it alone" in note for note in result.notes)
    assert table["avg"].notna().all() and {"answer_kl", "answer_top1"} <= set(result.metrics)
    # Each row against the paper default, paired per sample; float64 reference from the runs' predictions.
    per_sample = (
        sweep.trial_predictions.astype({"answer_nll": "float64"})
        .groupby(["run_id", "task", "sample_id"])["answer_nll"]
        .mean()
    )
    run_of = dict(zip(sweep.trials["trial_number"], sweep.trials["run_id"]))
    row = table.loc[("Update steps (S)", "S=2")]
    (trial,) = [int(n) for n in row["trials"].split(", ")]
    differences = per_sample.loc[run_of[trial]] - per_sample.loc[run_of[result.reference_trial]]
    assert row["vs_default_samples"] == len(differences) > 1
    assert row["vs_default"] == pytest.approx(differences.mean(), rel=1e-9, abs=1e-12)
    assert row["vs_default_low"] <= row["vs_default"] <= row["vs_default_high"]
    # The report's default score is the needle's, which ties: the rows are still paired on the answer NLL.
    by_score = ablation_table(sweep)
    assert by_score.paired_metric == "answer_nll"
    assert (
        by_score.table.set_index(["factor", "setting"]).loc[("Update steps (S)", "S=2"), "vs_default"]
        == row["vs_default"]
    )


def slow_config(tmp_path, trials, stages=False, **changes):
    """Enough work per trial (about seconds) to interrupt one while it runs; with ``stages``, the smoke config's
    screening and a test stage of 2 held-out samples, else full trials only; more dotted ``changes`` on top."""
    if stages:
        return write_config(
            tmp_path,
            trials=trials,
            **{
                "data.samples": 4,
                "data.context_length": 1536,
                "data.test.samples": 2,
                "tracking.experiment": "grkv-faults",
                **changes,
            },
        )
    return write_config(
        tmp_path,
        drop=("screening", "test", "data.test"),
        trials=trials,
        **{"data.samples": 4, "data.context_length": 1536, "tracking.experiment": "grkv-faults", **changes},
    )


def start_driver(services, config, sweep_id, state):
    return subprocess.Popen(
        [
            sys.executable,
            "sweep.py",
            "--config",
            str(config),
            "--sweep-id",
            sweep_id,
            "--tracking-uri",
            services["tracking_uri"],
            "--state-dir",
            str(state),
        ],
        cwd=REPO,
        env=dict(services["env"], RAY_ADDRESS=services["ray_address"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_killed_worker_mid_trial_is_retried_and_the_sweep_completes(services, tmp_path):
    from ray.util.state import list_actors

    sweep_id, state = "worker-kill", tmp_path / "state"
    driver = start_driver(services, slow_config(tmp_path, trials=4), sweep_id, state)
    try:

        def running_worker_pids():
            # The state API is asked over the dashboard's HTTP address: this process joins no Ray cluster.
            actors = list_actors(
                address=services["dashboard"], filters=[("class_name", "=", "TrialWorker"), ("state", "=", "ALIVE")]
            )
            return [a.pid for a in actors if a.pid]

        def a_trial_is_running():
            _, children = (
                runs_of(services["tracking_uri"], "grkv-faults", sweep_id)
                if MlflowClient(services["tracking_uri"]).get_experiment_by_name("grkv-faults")
                else (None, [])
            )
            return bool(running_worker_pids()) and any(r.info.status == "RUNNING" for r in children)

        wait_for(a_trial_is_running, 300, "a running trial")
        # Both workers take a trial as soon as they are up, so killing every worker hits a running trial.
        for pid in running_worker_pids():
            os.kill(pid, signal.SIGKILL)
        output, _ = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, output[-3000:]
    assert "retrying" in output
    _, children = runs_of(services["tracking_uri"], "grkv-faults", sweep_id)
    study = study_of(state, sweep_id)
    assert len(complete_trials(study)) == 4
    assert_one_finished_child_per_complete_trial(children, study)
    assert max(r.data.metrics["worker_attempts"] for r in children if r.info.status == "FINISHED") == 2


def sigkill_when(driver, predicate, timeout, what):
    try:
        wait_for(predicate, timeout, what)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()


def test_sigkilled_driver_resumes_every_stage_with_one_finished_run_each(services, tmp_path):
    """SIGKILL the driver while a batch of full trials is in flight, resume; SIGKILL it again in the test stage,
    resume: nothing finished is redone or logged twice and every stage ends with the right counts."""
    sweep_id, state = "driver-kill", tmp_path / "state"
    config = slow_config(tmp_path, trials=6, stages=True)

    def children():
        if not MlflowClient(services["tracking_uri"]).get_experiment_by_name("grkv-faults"):
            return []
        return runs_of(services["tracking_uri"], "grkv-faults", sweep_id)[1]

    def finished_runs():
        return {
            (r.data.tags[STAGE_TAG], r.data.tags.get(TRIAL_TAG) or r.data.tags[TEST_OF_TAG]): r.info.run_id
            for r in children()
            if r.info.status == "FINISHED"
        }

    def a_full_batch_in_flight():
        runs = children()
        return of_stage(runs, FULL_STAGE, "FINISHED") and of_stage(runs, FULL_STAGE, "RUNNING")

    sigkill_when(
        start_driver(services, config, sweep_id, state),
        a_full_batch_in_flight,
        600,
        "a batch of full trials in flight after one finished",
    )
    before_first_kill = finished_runs()
    sigkill_when(
        start_driver(services, config, sweep_id, state),
        lambda: of_stage(children(), TEST_STAGE, "RUNNING"),
        900,
        "a test-stage run in flight",
    )
    before_second_kill = finished_runs()

    resumed = start_driver(services, config, sweep_id, state)
    output, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, output[-3000:]
    parents, runs = runs_of(services["tracking_uri"], "grkv-faults", sweep_id)
    study, screen = study_of(state, sweep_id), study_of(state, sweep_id, SCREEN_STAGE)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(complete_trials(study)) == 6 and len(complete_trials(screen)) == 4
    assert_one_finished_child_per_complete_trial(runs, study)
    assert_one_finished_child_per_complete_trial(runs, screen, SCREEN_STAGE)
    assert_one_finished_test_run_each(runs, expected_tests(config, study), state / sweep_id, services["tracking_uri"])
    assert {PAPER_DEFAULT, EVICTION_ONLY} <= {r.data.tags[TEST_OF_TAG] for r in of_stage(runs, TEST_STAGE)}
    after = finished_runs()
    for before in (before_first_kill, before_second_kill):
        assert all(after[item] == run_id for item, run_id in before.items()), "finished runs must not be redone"
    # The runs in flight at each kill were closed as KILLED on resume, and redone (or recovered).
    assert of_stage(runs, FULL_STAGE, "KILLED") and of_stage(runs, TEST_STAGE, "KILLED")
    assert all(r.info.status in ("FINISHED", "KILLED") for r in runs), "no run may be left RUNNING"
