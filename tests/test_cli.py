"""The ``grkv`` command line (``sweeps.cli``): every command's help, the shared flags, the library-only parser, what
it shares with the driver (``sweeps.entry_points``: environment, exit statuses), and ``grkv demo`` end to end on a
tiny model with the real local stack (Ray head + MLflow server on free ports)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import local_stack_ports, sigterm_stops_everything, stop_local_stack

from sweeps.cli import DEMO_CONFIG, build_service_parser, main
from sweeps.entry_points import (
    COMMAND_MLFLOW_RETRIES,
    DRIVER_MLFLOW_RETRIES,
    SERVICE_LOST,
    STOPPED,
    SUCCESS,
    SWEEP_BUSY,
    SWEEP_NOT_FOUND,
    USER_ERROR,
)
from workers.names import ROLE_TAG, STAGE_TAG, SWEEP_TAG, TEST_STAGE, TRIAL_TAG

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("eval", "compare", "analyze", "leaderboard", "sweep", "report", "export", "demo")
SHARED_FLAGS = {
    "sweep_id": "--sweep-id",
    "tracking_uri": "--tracking-uri",
    "config": "--config",
    "state_dir": "--state-dir",
}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_commands_help_ends_with_an_example_of_it(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])
    assert exit.value.code == 0
    assert re.search(rf"\nexample:\n  grkv {command} ", capsys.readouterr().out)


def test_shared_flags_are_spelled_the_same_in_every_command():
    used = {}
    for name, parser in subcommands(build_service_parser()).items():
        for action in parser._actions:
            if action.dest in SHARED_FLAGS:
                assert action.option_strings == [SHARED_FLAGS[action.dest]], (name, action.option_strings)
                used.setdefault(action.dest, set()).add(name)
    assert used == {
        "sweep_id": {"sweep", "report", "export", "demo"},
        "tracking_uri": {"report", "export"},
        "config": {"sweep", "demo"},
        "state_dir": {"sweep", "demo"},
    }
    assert set(subcommands(build_service_parser())) == set(COMMANDS)


def test_a_sweep_keeps_its_state_in_the_users_folder_by_default(tmp_path, monkeypatch):
    """Every default place of a sweep's state (the local stack's, which ``grkv sweep`` and infra/local share,
    ``grkv demo``'s, ``sweep.py``'s ``storage.state_dir``) is under ``~/.grkv``, outside the checkout."""
    from sweeps.config import StorageSection

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("GRKV_STATE_DIR", raising=False)
    parser = build_service_parser()
    defaults = {
        command: parser.parse_args([command, "--config", "x.yaml"]).state_dir.expanduser()
        for command in ("sweep", "demo")
    }
    shell = subprocess.run(
        ["bash", "-c", f'source {REPO / "infra/local/common.sh"} && echo "$STATE_DIR"'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shell.returncode == 0, shell.stderr
    assert defaults == {"sweep": home / ".grkv/local", "demo": home / ".grkv/demo"}
    assert Path(shell.stdout.strip()) == defaults["sweep"]
    assert Path(StorageSection().state_dir).expanduser() == home / ".grkv/sweeps"


def test_the_library_command_line_stands_alone():
    """``grkv_core.cli`` has the library's commands and imports none of the service's packages."""
    code = (
        "import sys, grkv_core.cli as cli; parser = cli.build_parser(); "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('service', 'sweeps', 'tracking', 'workers')]; "
        "print(sorted(parser._subparsers._group_actions[0].choices))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['analyze', 'compare', 'eval', 'leaderboard']"


SERVICE_ENVIRONMENT = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "RAY_AUTH_MODE": "disabled",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


@pytest.mark.parametrize(
    "entry_point, retries", [("sweep", DRIVER_MLFLOW_RETRIES), ("sweeps.cli", COMMAND_MLFLOW_RETRIES)]
)
def test_both_entry_points_set_the_service_environment_before_ray_and_mlflow(entry_point, retries):
    """The driver and the ``grkv`` command line set the same environment on import, differing only in MLflow's
    client retries, before either has imported Ray or MLflow; what the user set stays (``RAY_AUTH_MODE`` here), but
    not inherited client retries (a driver started under ``grkv sweep`` inherits the command's)."""
    names = [*SERVICE_ENVIRONMENT, "MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
    code = (
        f"import json, os, sys, {entry_point}; "
        f"print(json.dumps([{{name: os.environ.get(name) for name in {names!r}}}, "
        "sorted(m for m in ('ray', 'mlflow') if m in sys.modules)]))"
    )
    env = {name: value for name, value in os.environ.items() if name not in names} | {
        "RAY_AUTH_MODE": "token",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "7",
    }
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    environment, imported = json.loads(result.stdout)
    assert environment == {
        **SERVICE_ENVIRONMENT,
        "RAY_AUTH_MODE": "token",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(retries),
    }
    assert imported == []


def test_each_entry_point_tells_its_exit_statuses_apart():
    """One table for both entry points: within each, a status has one meaning; across them, only 4 differs (another
    driver holds the sweep / MLflow has no such sweep)."""
    driver = [SUCCESS, USER_ERROR, SERVICE_LOST, SWEEP_BUSY, STOPPED]
    commands = [SUCCESS, USER_ERROR, SERVICE_LOST, SWEEP_NOT_FOUND, STOPPED]
    assert len(set(driver)) == len(driver) and len(set(commands)) == len(commands)
    assert driver == commands == [0, 2, 3, 4, 5], "the statuses sweep.py's help and the README document"


def test_a_bad_config_fails_in_one_line_before_anything_starts(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({**yaml.safe_load(DEMO_CONFIG.read_text()), "trials": 0}))
    state = tmp_path / "state"
    assert main(["demo", "--config", str(config), "--state-dir", str(state)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "grkv demo: error:" in error and "trials" in error
    assert not state.exists(), "nothing may start for a config that cannot run"


def test_the_demo_config_is_the_product_default():
    from grkv_core.catalog import QUERY_POLICIES
    from sweeps.config import load_config

    config = load_config(DEMO_CONFIG)
    assert config.model.name == "smollm2-135m" and config.screening.trials and config.test_stage
    # NOTE: the queries decide whether GRKV helps the answer (docs/results/hypotheses.md): the demo searches them.
    assert config.search_space["query_policy"].choices == list(QUERY_POLICIES)


def tiny_demo_config(tmp_path: Path) -> Path:
    """The demo on the tiny model: 2 screening trials (1 promoted), the 3 baselines and the promoted one as full
    trials, a test stage on 1 held-out sample."""
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    config.update(
        name="tiny-demo",
        model={"name": "tiny-llama", "dtype": "float32"},
        trials=4,
        screening={"trials": 2, "promote": 1, "metric": "question_loss"},
        test={"top_k": 1, "eviction_ratios": [0.7]},
        tracking={"tracking_uri": "http://127.0.0.1:5000", "experiment": "grkv-tiny-demo"},
    )
    config["data"].update(tasks=["niah_single_1"], context_length=512, samples=1, test={"samples": 1})
    path = tmp_path / "tiny-demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_grkv_demo_runs_reports_exports_and_resumes(tmp_path):
    from mlflow.tracking import MlflowClient

    from grkv_core.presses.from_config import press_from_file

    state = tmp_path / "state"
    ports = local_stack_ports()
    env = {**os.environ, **ports, "GRKV_RAY_CPUS": "2", "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "sweeps.cli",
        "demo",
        "--config",
        str(tiny_demo_config(tmp_path)),
        "--state-dir",
        str(state),
    ]
    tracking_uri = f"http://127.0.0.1:{ports['GRKV_MLFLOW_PORT']}"
    try:
        first = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        out = first.stdout
        assert re.search(r"screen +2/2 +trial \d", out) and re.search(r"full +4/4 +trial \d", out)
        # Never silent for half a minute while a stage runs (the test stage's long evaluations included).
        minutes = [float(stamp) for stamp in re.findall(r"^  \[ *(\d+\.\d) min\]", out, re.M)]
        assert max(later - earlier for earlier, later in zip(minutes, minutes[1:])) <= 0.5
        assert re.search(rf"MLflow UI \(the sweep's parent run\): {tracking_uri}/#/experiments/\d+/runs/\w+", out)
        press_file = Path(re.search(r"recommended press configuration: (\S+)", out).group(1))
        assert press_file == state / "outputs" / "tiny-demo" / "press.yaml"
        assert f"report: {state / 'outputs' / 'tiny-demo' / 'report.html'}" in out
        assert (state / "outputs" / "tiny-demo" / "report.html").is_file()
        assert press_from_file(press_file) is not None
        assert "stop them with: GRKV_STATE_DIR=" in out

        client = MlflowClient(tracking_uri)
        experiment = client.get_experiment_by_name("grkv-tiny-demo")
        runs = client.search_runs([experiment.experiment_id], f"tags.`{SWEEP_TAG}` = 'tiny-demo'", max_results=100)
        (parent,) = [run for run in runs if run.data.tags[ROLE_TAG] == "sweep"]
        assert parent.info.status == "FINISHED"
        artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
        assert {"press.yaml", "report"} <= artifacts
        assert "report/report.html" in {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
        logged = Path(client.download_artifacts(parent.info.run_id, "press.yaml", str(tmp_path)))
        assert logged.read_text() == press_file.read_text()
        # The chosen press is one the test stage confirmed (the test stage ran: 1 best + 3 baselines + 1 ratio).
        assert sum(run.data.tags.get(STAGE_TAG) == TEST_STAGE for run in runs) == 5

        second = subprocess.run(
            [*command, "--stop"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        assert "already running" in second.stdout and "resuming, 11 run(s) already finished" in second.stdout
        assert "local stack stopped" in second.stdout
        assert len(
            client_runs := MlflowClient(f"sqlite:///{state}/mlflow.db").search_runs(
                [experiment.experiment_id], f"tags.`{SWEEP_TAG}` = 'tiny-demo'", max_results=100
            )
        ) == len(runs), "a resumed finished sweep redoes nothing"
        assert all(run.info.status == "FINISHED" for run in client_runs)
    finally:
        stop_local_stack(env, state)


@pytest.mark.slow
def test_grkv_demo_sent_sigterm_mid_stage_stops_its_stack_and_the_same_command_resumes(tmp_path):
    """What ``timeout``, systemd and CI runners send: exit 143 in one line, nothing of the stack left with ``--stop``,
    every run closed; the same command finishes each trial once."""
    state = tmp_path / "state"
    env = {**os.environ, **local_stack_ports(), "GRKV_RAY_CPUS": "2", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "sweeps.cli", "demo", "--config", str(tiny_demo_config(tmp_path))]
    command += ["--state-dir", str(state), "--stop"]
    try:
        demo = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for line in demo.stdout:  # the first ended trial: mid-stage
            if re.search(r"(screen|full) +1/\d+ +trial", line):
                break
        client, experiment_id = sigterm_stops_everything(demo, "demo", state, "grkv-tiny-demo", "tiny-demo")

        resumed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        runs = client.search_runs([experiment_id], f"tags.`{SWEEP_TAG}` = 'tiny-demo'", max_results=100)
        trials = [
            (run.data.tags[STAGE_TAG], run.data.tags[TRIAL_TAG])
            for run in runs
            if run.data.tags.get(ROLE_TAG) == "trial" and run.info.status == "FINISHED" and TRIAL_TAG in run.data.tags
        ]
        stages = [stage for stage, _ in trials]
        assert len(trials) == len(set(trials)) and stages.count("screen") == 2 and stages.count("full") == 4
    finally:
        stop_local_stack(env, state)


@pytest.mark.parametrize("command", ["eval", "compare"])
def test_no_decode_reaches_every_evaluated_configuration(command):
    from grkv_core.cli import _config, build_parser

    for flags, decode in (([], True), (["--no-decode"], False)):
        args = build_parser().parse_args([command, *flags])
        assert _config(args, "snapkv", 0.5, "grkv", {}).decode is decode
