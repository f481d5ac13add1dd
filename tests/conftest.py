"""What the test modules share: the tiny-model loader, free ports for the services, and the press checks."""

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from kvpress import ScorerPress

from grkv_core.catalog import EVICTION_PRESSES, merger_names
from grkv_core.evaluation.generation import prefill
from grkv_core.models import LoadedModel, load_model
from grkv_core.models.tiny import TINY_CONFIG_CLASSES
from sweeps.local_stack import free_ports

# Every tiny test model: the architecture-parametrised tests run on each.
TINY_ARCHITECTURES = tuple(TINY_CONFIG_CLASSES)
# kvpress's own presses that fail on a model family, whatever merges behind them.
KVPRESS_FAILURES = {
    ("gemma3", "expected_attention"): "kvpress 0.5.5's ExpectedAttentionPress calls the model's rotary embedding "
    "without a layer type, which Gemma 3's (one per layer type) requires",
}


# Pairs refused in one line before any layer runs (``grkv_core.presses.sliding_layers``).
REFUSED = {
    ("gemma3", "h2o"): "H2O needs eager attention, which cannot decode over Gemma 3's whole sliding layers beside "
    "its compressed global ones",
}


def model_and_press(models, presses):
    """pytest params (model, press name) over both lists; the pairs kvpress itself fails on are strict xfails, and so
    are the pairs refused with a ValueError."""

    def marks(model, press):
        return [
            pytest.mark.xfail(strict=True, reason=reason)
            for (family, failing), reason in KVPRESS_FAILURES.items()
            if family in model and failing == press
        ] + [
            pytest.mark.xfail(strict=True, raises=ValueError, reason=reason)
            for (family, refused), reason in REFUSED.items()
            if family in model and refused == press
        ]

    return [pytest.param(model, press, marks=marks(model, press)) for model in models for press in presses]


@functools.lru_cache(maxsize=None)
def tiny_model(name: str = "tiny-llama", attn_implementation: str = "sdpa", dtype: str = "float32") -> LoadedModel:
    """A tiny random model (``grkv_core.models.tiny``), or an embedded real one, loaded once per test session for
    each set of arguments.

    The defaults are what ``load_model`` picks on the CPU (its default device) for ``dtype="auto"`` and no
    attention implementation.

    NOTE: every test asking for the same arguments gets the same instance: a test may run presses on it (their
    hooks come off on exit) but must not change its parameters or configuration; load a fresh model to do that.
    """
    return load_model(name, attn_implementation=attn_implementation, dtype=dtype)


def needs_package(embedded) -> pytest.MarkDecorator:
    """Skip unless the PyPI package of the embedded real model ``embedded`` (an ``EmbeddedGGUFModel``) is installed."""
    return pytest.mark.skipif(
        importlib.util.find_spec(embedded.module) is None, reason=f"needs `{embedded.pip_install}`"
    )


def local_stack_ports() -> dict[str, str]:
    """``infra/local/start.sh``'s port settings (its ``GRKV_*_PORT`` variables), each on a free port."""
    names = (
        "GRKV_RAY_PORT",
        "GRKV_RAY_DASHBOARD_PORT",
        "GRKV_RAY_CLIENT_PORT",
        "GRKV_RAY_AGENT_PORT",
        "GRKV_MLFLOW_PORT",
    )
    return dict(zip(names, map(str, free_ports(len(names)))))


def assert_batch_elements_compressed_independently(model, ids, press, tolerance=2e-4):
    """Every batch element's compressed cache equals the one its own single-element prefill produces."""
    batched = prefill(model, ids, press)
    for b in range(ids.shape[0]):
        single = prefill(model, ids[b : b + 1], press)
        for layer_batched, layer_single in zip(batched.layers, single.layers):
            torch.testing.assert_close(layer_batched.keys[b], layer_single.keys[0], rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(layer_batched.values[b], layer_single.values[0], rtol=tolerance, atol=tolerance)


def sqlite_tracking_store(root: Path, experiment: str) -> str:
    """An MLflow tracking URI on a SQLite file in ``root``, with ``experiment`` created there first.

    NOTE: the sweep's tracker would create the experiment with MLflow's default artifact root (./mlruns, in the
    repository); creating it first keeps every artifact inside ``root``.
    """
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{root}/mlflow.db"
    MlflowClient(uri).create_experiment(experiment, artifact_location=(Path(root) / "artifacts").as_uri())
    return uri


def mergers_over(press: str) -> list[str]:
    """The merger names that take the eviction press ``press`` as their base: every one, but kvpress's own
    ``kvpress_merging`` takes a ScorerPress only (not AdaKV or CriticalAdaKV)."""
    return [
        merge
        for merge in merger_names()
        if merge != "kvpress_merging" or isinstance(EVICTION_PRESSES[press].load()(compression_ratio=0.5), ScorerPress)
    ]


REPO = Path(__file__).resolve().parents[1]
# The environment under test is the one running pytest (.venv, or scripts/floors.sh's .venv-floors): its ray, mlflow
# and grkv, never another's.
VENV_BIN = Path(sys.executable).parent


def stop_local_stack(env: dict, state: Path) -> None:
    """``infra/local/stop.sh`` on the stack kept in ``state``: a test's cleanup, whatever the test left running."""
    subprocess.run(
        ["bash", str(REPO / "infra/local/stop.sh")],
        env={**env, "GRKV_STATE_DIR": str(state)},
        capture_output=True,
        timeout=120,
    )


def sigterm_stops_everything(process: subprocess.Popen, command: str, state: Path, experiment: str, sweep_id: str):
    """Send SIGTERM to ``process``, a ``grkv COMMAND ... --state-dir STATE --stop`` mid-stage, and check what it must
    leave: exit 143 with its one line, nothing of the stack running, every run of the sweep closed. Returns the
    MLflow client of the stack's store and the experiment's id, for the resume's checks."""
    import signal

    from mlflow.tracking import MlflowClient

    from workers.names import SWEEP_TAG

    ray_pid = int((state / "ray.pid").read_text())
    process.send_signal(signal.SIGTERM)
    _, errors = process.communicate(timeout=300)
    assert process.returncode == 143, errors[-3000:]
    assert errors.strip().splitlines()[-1] == (
        f"grkv {command}: terminated (SIGTERM); what finished is saved, re-run the same command to resume"
    )
    # --stop: the job was stopped with the stack, and nothing of the stack is left.
    assert not (state / "ray.pid").exists() and not (state / "mlflow.pid").exists()
    assert subprocess.run(["ps", "-o", "pid=", "-g", str(ray_pid)], capture_output=True, text=True).stdout == ""
    client = MlflowClient(f"sqlite:///{state}/mlflow.db")
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    runs = client.search_runs([experiment_id], f"tags.`{SWEEP_TAG}` = '{sweep_id}'", max_results=100)
    assert runs and all(run.info.status != "RUNNING" for run in runs), "every run closed"
    return client, experiment_id


@dataclass(frozen=True)
class PostgresServer:
    """A PostgreSQL server of the tests' own, started by ``infra/local/postgres.sh`` (the script the local stack
    runs) on a free loopback port, its cluster in a temporary folder; ``url(database)`` is its SQLAlchemy URL."""

    folder: Path
    port: int

    @property
    def env(self) -> dict[str, str]:
        return dict(
            os.environ,
            GRKV_STATE_DIR=str(self.folder),
            GRKV_POSTGRES_DIR=str(self.folder / "cluster"),
            GRKV_POSTGRES_PORT=str(self.port),
        )

    def run(self, action: str) -> None:
        """``start`` (initialising the cluster and creating the ``optuna`` and ``mlflow`` databases the first time)
        or ``stop``."""
        done = subprocess.run(
            ["bash", str(REPO / "infra/local/postgres.sh"), action],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    def url(self, database: str) -> str:
        settings = dict(
            line.split("=", 1) for line in (self.folder / "postgres.env").read_text().splitlines() if "=" in line
        )
        return f"{settings['GRKV_POSTGRES_URL']}/{database}"


def postgres_missing() -> str | None:
    """Why no PostgreSQL server can be started here, or None."""
    if shutil.which("pg_ctl") is None and not list(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl")):
        return "needs PostgreSQL's server (initdb, pg_ctl): bash scripts/install_postgres.sh"
    if importlib.util.find_spec("psycopg2") is None:
        return "needs the PostgreSQL driver: pip install '.[postgres]'"
    return None


@pytest.fixture(scope="session")
def postgres():
    """One PostgreSQL server for the test session (``PostgresServer``), stopped and deleted at its end.

    NOTE: its folder is made under /tmp and opened to others: as root the server runs as the `postgres` user, which
    cannot enter pytest's own temporary folders (mode 0700).
    """
    missing = postgres_missing()
    if missing:
        pytest.skip(missing)
    folder = Path(tempfile.mkdtemp(prefix="grkv-pg-", dir="/tmp"))
    folder.chmod(0o755)
    server = PostgresServer(folder, free_ports(1)[0])
    server.run("start")
    try:
        yield server
    finally:
        server.run("stop")
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def local_ray(monkeypatch):
    """A Ray instance of the test's own in this process (never the latest cluster of the machine), on 127.0.0.1 only
    (as ``infra/local/start.sh`` binds it) with its own temp dir, shut down at the test's end."""
    import ray
    from ray._private import ray_constants

    # NOTE: Ray reads this switch once, at its import (earlier in the session); its processes read it at their start.
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    monkeypatch.setenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "0")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=tempfile.mkdtemp(prefix="grkv-", dir="/tmp"),
    )
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(autouse=True)
def no_ray_left_in_the_test_process():
    """Fail the test that leaves Ray initialised in pytest's own process: a later ``ray.init`` would then fail, or
    join an instance started on the machine's address (a Ray call auto-starts one)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail("the test left Ray initialised in the test process: use the local_ray fixture")
