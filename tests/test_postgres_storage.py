"""The cluster's storage on a real PostgreSQL server started by the tests (``postgres`` in conftest.py): a sweep end to
end with its Optuna storage and MLflow's backend store there, the MLflow server as ``infra/mlflow/`` starts it, and a
missing database driver named with its package."""

import os
import re
import subprocess
import sys
import time
import tomllib

import pytest
import sqlalchemy
import yaml
from conftest import VENV_BIN, free_ports
from mlflow.tracking import MlflowClient
from test_sweep_faults import one_line
from test_sweep_service import (
    REPO,
    SMOKE,
    assert_each_configuration_evaluated_once,
    assert_one_finished_child_per_complete_trial,
    child_env,
    complete_trials,
    local_stack,
    runs_of,
    study_of,
    wait_for,
)

from sweeps.state.optuna_storage import DRIVER_PACKAGES
from tracking.mlflow_tracker import check_tracking_server
from tracking.retry import TrackingUnavailableError
from workers.names import SCREEN_STAGE, SWEEP_TAG

INFRA = REPO / "infra"


@pytest.fixture(scope="module")
def stack(postgres, tmp_path_factory):
    """``GRKV_POSTGRES=1 bash infra/local/start.sh`` on the tests' PostgreSQL server: MLflow's backend store in its
    ``mlflow`` database, ``GRKV_OPTUNA_STORAGE`` (its ``optuna`` database) exported to the sweeps' drivers.

    NOTE: stop.sh stops that server with the stack; it is started again after, for the session's other users.
    """
    postgres.run("start")
    settings = dict(GRKV_POSTGRES=1, GRKV_POSTGRES_DIR=postgres.folder / "cluster", GRKV_POSTGRES_PORT=postgres.port)
    try:
        with local_stack(tmp_path_factory.mktemp("grkv-pg-stack"), **settings) as services:
            yield services
    finally:
        postgres.run("start")


def database_rows(url: str, query: str) -> int:
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as connection:
            return connection.execute(sqlalchemy.text(query)).scalar_one()
    finally:
        engine.dispose()


def test_the_smoke_sweep_runs_end_to_end_with_optuna_and_mlflow_on_postgresql(stack, postgres, tmp_path):
    """Submitted as a user would on the stack: no storage flag, the driver takes the head's GRKV_OPTUNA_STORAGE."""
    sweep_id, state, optuna_url = "pg-e2e", stack["state"] / "sweeps", postgres.url("optuna")
    assert stack["env"]["GRKV_OPTUNA_STORAGE"] == optuna_url
    submit = subprocess.run(
        ["ray", "job", "submit", "--address", stack["dashboard"], "--working-dir", str(REPO), "--"]
        + ["python", "sweep.py", "--config", "sweeps/configs/smoke.yaml", "--sweep-id", sweep_id]
        + ["--tracking-uri", stack["tracking_uri"], "--state-dir", str(state)],
        cwd=REPO,
        env=stack["env"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    assert not (state / sweep_id / "optuna.journal").exists(), "the study went to a journal, not to PostgreSQL"
    study = study_of(state, sweep_id, storage_url=optuna_url)
    screen = study_of(state, sweep_id, SCREEN_STAGE, storage_url=optuna_url)
    assert len(complete_trials(study)) == 8 and len(complete_trials(screen)) == 4
    parents, children = runs_of(stack["tracking_uri"], "grkv-smoke", sweep_id)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert all(run.info.status == "FINISHED" for run in children)
    assert_each_configuration_evaluated_once(children, study, SMOKE)
    assert_one_finished_child_per_complete_trial(children, study)
    assert_one_finished_child_per_complete_trial(children, screen, SCREEN_STAGE)
    # The runs are rows of the PostgreSQL backend store, the trials of the Optuna database (the session's server holds
    # other tests' sweeps too).
    runs = database_rows(
        postgres.url("mlflow"),
        "SELECT count(*) FROM runs JOIN tags ON tags.run_uuid = runs.run_uuid WHERE runs.status = 'FINISHED' "
        f"AND tags.key = '{SWEEP_TAG}' AND tags.value = '{sweep_id}'",
    )
    assert runs == len(parents) + len(children)
    trials = database_rows(
        optuna_url,
        "SELECT count(*) FROM trials JOIN studies ON studies.study_id = trials.study_id "
        f"WHERE trials.state = 'COMPLETE' AND studies.study_name IN ('{sweep_id}', '{sweep_id}.screen')",
    )
    assert trials == len(complete_trials(study)) + len(complete_trials(screen))


# ------------------------------------------------------------------------------- infra/'s MLflow server


def manifest_commands() -> dict[str, list[str]]:
    """The ``mlflow server`` argument lists infra/ gives: the Kubernetes Deployment's and docker compose's."""
    deployment = next(
        doc for doc in yaml.safe_load_all((INFRA / "mlflow/mlflow.yaml").read_text()) if doc["kind"] == "Deployment"
    )
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "mlflow"]
    assert container["command"] == ["mlflow", "server"]
    compose = yaml.safe_load((INFRA / "mlflow/docker-compose.yaml").read_text())["services"]["mlflow"]
    dockerfile = (INFRA / "mlflow/Dockerfile").read_text()
    assert 'ENTRYPOINT ["mlflow", "server"]' in dockerfile, "compose's command is the image entrypoint's arguments"
    return {"kubernetes": container["args"], "compose": compose["command"]}


def image_packages() -> set[str]:
    """The distributions infra/mlflow/Dockerfile pip-installs, by name."""
    dockerfile = (INFRA / "mlflow/Dockerfile").read_text()
    (install,) = re.findall(r"pip install ([^\n\\&]+)", dockerfile)
    return {re.split(r"[=<>\[]", spec.strip('"'))[0] for spec in install.split()}


def as_run_here(args: list[str], postgres, port: int, artifacts) -> list[str]:
    """The manifest's arguments with its in-cluster addresses and secrets replaced by the tests' server: its
    PostgreSQL user, password, host and port, a loopback port and a temporary artifact folder."""
    server = postgres.url("mlflow").split("://", 1)[1]  # grkv:<password>@127.0.0.1:<port>/mlflow
    user, _, rest = server.partition(":")
    password, _, _ = rest.partition("@")
    substitutions = {
        "$(POSTGRES_USER)": user,
        "$(POSTGRES_PASSWORD)": password,
        "${POSTGRES_USER:-grkv}": user,
        "${POSTGRES_PASSWORD}": password,
        "postgres.grkv.svc.cluster.local:5432": f"127.0.0.1:{postgres.port}",
        "postgres:5432": f"127.0.0.1:{postgres.port}",
    }
    replaced = []
    for arg in args:
        for placeholder, value in substitutions.items():
            arg = arg.replace(placeholder, value)
        name = arg.split("=", 1)[0]
        value = {"--host": "127.0.0.1", "--port": str(port), "--artifacts-destination": str(artifacts)}.get(name)
        replaced.append(f"{name}={value}" if value else arg)
    return replaced


@pytest.mark.parametrize("manifest", ["kubernetes", "compose"])
def test_infra_mlflow_server_starts_on_postgresql_as_the_manifests_give_it(postgres, tmp_path, manifest):
    postgres.run("start")
    args = manifest_commands()[manifest]
    (uri,) = [arg.split("=", 1)[1] for arg in args if arg.startswith("--backend-store-uri=")]
    driver = sqlalchemy.engine.make_url(re.sub(r"\$\{[^}]*\}|\$\([^)]*\)", "x", uri)).get_dialect().driver
    # The URI's driver is one the image installs (a bare postgresql:// needs psycopg 3 with SQLAlchemy 2: the server
    # exited with ModuleNotFoundError), and this environment has what the image has.
    assert DRIVER_PACKAGES[driver].split()[0] in image_packages(), (driver, image_packages())
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout
    assert {"mlflow", "psycopg2-binary"} <= {line.split("==")[0].lower() for line in installed.splitlines()}
    port = free_ports(1)[0]
    command = [str(VENV_BIN / "mlflow"), "server", *as_run_here(args, postgres, port, tmp_path / "artifacts")]
    log = open(tmp_path / "mlflow.log", "w")
    server = subprocess.Popen(
        command,
        env=child_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def answers():
        assert server.poll() is None, (tmp_path / "mlflow.log").read_text()[-3000:]
        try:
            check_tracking_server(f"http://127.0.0.1:{port}", timeout_s=2)
            return True
        except TrackingUnavailableError:
            return False

    try:
        wait_for(answers, 180, "the manifest's MLflow server")
        client = MlflowClient(f"http://127.0.0.1:{port}")
        experiment = client.create_experiment(f"infra-{manifest}-{time.time_ns()}")
        run = client.create_run(experiment)
        client.log_metric(run.info.run_id, "answer_nll", 1.5)
        client.set_terminated(run.info.run_id)
        query = f"SELECT count(*) FROM runs WHERE run_uuid = '{run.info.run_id}' AND status = 'FINISHED'"
        assert database_rows(postgres.url("mlflow"), query) == 1
    finally:
        os.killpg(server.pid, 9)
        server.wait()
        log.close()


# ------------------------------------------------------------------------------- the driver declared


def test_the_postgres_extra_brings_the_driver_the_error_names():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [re.split(r"[=<>]", spec)[0] for spec in pyproject["postgres"]] == ["psycopg2-binary"]
    assert "grkv[sweep,postgres]" in pyproject["dev"], "scripts/install.sh installs it for the tests"
    assert DRIVER_PACKAGES["psycopg2"].startswith("psycopg2-binary (pip install 'grkv[postgres]')")


# The driver's interpreter with psycopg2 blocked (importing it raises ModuleNotFoundError), running sweep.py.
WITHOUT_PSYCOPG2 = (
    "import runpy, sys; sys.modules['psycopg2'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


@pytest.mark.parametrize(
    "scheme, blocked, named",
    [
        (
            "postgresql+psycopg2",
            True,
            "driver module psycopg2 is not installed: install psycopg2-binary (pip install 'grkv[postgres]')",
        ),
        (
            "postgresql",
            False,
            "driver module psycopg is not installed: install psycopg[binary], or write the URL as postgresql+psycopg2://",
        ),
    ],
)
def test_a_missing_database_driver_is_one_line_naming_its_package(stack, postgres, tmp_path, scheme, blocked, named):
    """Without its driver the sweep stops before writing anything, exit 3, naming the package; psycopg2 is blocked
    in the driver's interpreter (it is installed here), psycopg (a bare postgresql:// URL) is not installed."""
    from sqlalchemy.engine import make_url

    if scheme == "postgresql" and make_url("postgresql://").get_dialect().driver != "psycopg":
        pytest.skip("below SQLAlchemy 2.1 a bare postgresql:// URL is psycopg2's, which is installed here")
    url = postgres.url("optuna").replace("postgresql+psycopg2://", f"{scheme}://")
    command = ["sweep.py", "--config", str(SMOKE), "--sweep-id", "no-driver", "--tracking-uri", stack["tracking_uri"]]
    command += ["--state-dir", str(tmp_path / "state"), "--storage-url", url]
    driver = subprocess.run(
        [sys.executable, *(["-c", WITHOUT_PSYCOPG2] if blocked else []), *command],
        cwd=REPO,
        env=dict(stack["env"], RAY_ADDRESS=stack["ray_address"]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert driver.returncode == 3, driver.stderr[-3000:]
    line = one_line(driver.stderr)
    assert named in line and postgres.url("optuna").split(":")[2].split("@")[0] not in line, line
    assert not (tmp_path / "state").exists(), "nothing half-created"


def test_a_running_stack_keeps_its_stores(stack):
    """start.sh asked for SQLite on a stack that runs on PostgreSQL refuses in one line and leaves it running."""
    again = subprocess.run(
        ["bash", str(REPO / "infra/local/start.sh")],
        env=dict(stack["env"], GRKV_POSTGRES="0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 1
    assert again.stderr.strip() == (
        f"grkv-local: error: the stack in {stack['state']} runs with GRKV_POSTGRES=1; stop it first "
        "(infra/local/stop.sh) to change that"
    )
    check_tracking_server(stack["tracking_uri"], timeout_s=5)
