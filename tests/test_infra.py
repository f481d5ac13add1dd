"""Checks of infra/: every YAML parses and has the expected structure (KubeRay RayCluster/RayJob,
ray-up cluster, MLflow + PostgreSQL manifests, docker compose), the Dockerfiles and shell scripts
are sane, plus one real run of infra/local/start.sh + stop.sh on free ports."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import VENV_BIN, free_ports

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
LOCAL = INFRA / "local"

YAML_FILES = sorted(p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml"))
CONFIG_PATTERN = re.compile(r"^sweeps/configs/[A-Za-z0-9_.-]+\.ya?ml$")
SHELL_SCRIPTS = [LOCAL / "start.sh", LOCAL / "stop.sh", LOCAL / "common.sh"]


def load_docs(rel):
    return [d for d in yaml.safe_load_all((INFRA / rel).read_text()) if d is not None]


def load_one(rel):
    docs = load_docs(rel)
    assert len(docs) == 1, f"{rel}: expected one document, got {len(docs)}"
    return docs[0]


def by_kind(docs, kind):
    found = [d for d in docs if d.get("kind") == kind]
    assert found, f"no {kind} in {[d.get('kind') for d in docs]}"
    return found


def env_map(container):
    return {e["name"]: e for e in container.get("env", [])}


def env_value(container, name):
    entry = env_map(container).get(name)
    return None if entry is None else entry.get("value")


def pod_containers(template):
    spec = template["spec"]
    return list(spec.get("containers", [])) + list(spec.get("initContainers", []))


def ray_cluster_spec_groups(spec):
    """(head template, [(group name, group spec)]) of a RayCluster spec."""
    head = spec["headGroupSpec"]["template"]
    groups = [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
    return head, groups


def dockerfile_arg(path, name):
    m = re.search(rf"^ARG {name}=(\S+)", path.read_text(), re.M)
    assert m, f"ARG {name} not found in {path}"
    return m.group(1)


def gpu_limit(container):
    limits = container.get("resources", {}).get("limits", {})
    return int(limits.get("nvidia.com/gpu", 0))


# --------------------------------------------------------------------------------- YAML parsing


def test_expected_files_exist():
    for rel in [
        "README.md",
        "local/start.sh",
        "local/stop.sh",
        "docker/Dockerfile",
        "docker/.dockerignore",
        "kuberay/raycluster.yaml",
        "kuberay/rayjob.yaml",
        "kuberay/state-volume.yaml",
        "ray-up/cluster.yaml",
        "mlflow/postgres.yaml",
        "mlflow/postgres-secret.template.yaml",
        "mlflow/mlflow.yaml",
        "mlflow/docker-compose.yaml",
    ]:
        assert (INFRA / rel).is_file(), rel


def test_the_job_package_leaves_out_the_committed_results():
    """`ray job submit --working-dir .` packs the repository; Ray's own ignore-file matcher must leave out the
    committed measurements and a sweep's state, and keep the code a job runs."""
    from ray._private.runtime_env.packaging import get_excludes_from_ignore_files

    excluded = get_excludes_from_ignore_files(ROOT, include_gitignore=True)
    left_out = lambda relative: any(match(ROOT / relative) for match in excluded)  # noqa: E731
    assert all(
        left_out(path)
        for path in (
            "benchmarks/results/regime-map/table.md",
            ".grkv-state/mlflow.db",
            "mlflow.db",
            "demo/optuna.journal",
            "demo/driver.lease",
        )
    )
    assert not any(
        left_out(path)
        for path in (
            "sweep.py",
            "grkv_core/solver/merge.py",
            "benchmarks/prefill_cost.py",
            "sweeps/configs/ablation.yaml",
        )
    )


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(INFRA)))
def test_every_yaml_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} is empty"
    for d in docs:
        assert isinstance(d, dict)
        if "apiVersion" in d:  # a Kubernetes object
            assert d.get("kind") and d.get("metadata", {}).get("name"), path


def test_kubernetes_objects_share_the_namespace():
    for path in YAML_FILES:
        rel = str(path.relative_to(INFRA))
        for d in yaml.safe_load_all(path.read_text()):
            if not d or "apiVersion" not in d or d["kind"] == "Namespace":
                continue
            assert d["metadata"].get("namespace") == "grkv", f"{rel}: {d['kind']} {d['metadata']['name']}"


# ------------------------------------------------------------------------------------- KubeRay


def test_raycluster_structure():
    rc = load_one("kuberay/raycluster.yaml")
    assert rc["apiVersion"] == "ray.io/v1"
    assert rc["kind"] == "RayCluster"
    spec = rc["spec"]
    assert spec["rayVersion"] == dockerfile_arg(INFRA / "docker/Dockerfile", "RAY_VERSION")
    assert spec["authOptions"]["mode"] == "token"  # auth mode explicit
    head, groups = ray_cluster_spec_groups(spec)
    assert "dashboard-host" in spec["headGroupSpec"]["rayStartParams"]
    head_ports = {p["containerPort"] for c in head["spec"]["containers"] for p in c.get("ports", [])}
    assert 8265 in head_ports  # the dashboard / Jobs API
    names = dict(groups)
    assert "gpu-workers" in names
    g = names["gpu-workers"]
    assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    worker = g["template"]["spec"]["containers"][0]
    assert gpu_limit(worker) >= 1
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"]
    for c in [*head["spec"]["containers"], worker]:
        assert c["image"] == "ghcr.io/grkv/grkv:latest"
        assert {"cpu", "memory"} <= set(c["resources"]["limits"])


def test_rayjob_structure():
    rj = load_one("kuberay/rayjob.yaml")
    assert rj["apiVersion"] == "ray.io/v1"
    assert rj["kind"] == "RayJob"
    spec = rj["spec"]
    m = re.fullmatch(r"python sweep\.py --config (\S+)", spec["entrypoint"].strip())
    assert m, spec["entrypoint"]
    # The config is referenced, not required to exist (sweep configs are written elsewhere).
    assert CONFIG_PATTERN.match(m.group(1)), m.group(1)
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == dockerfile_arg(INFRA / "docker/Dockerfile", "RAY_VERSION")
    assert cluster["authOptions"]["mode"] == "token"
    head, groups = ray_cluster_spec_groups(cluster)
    assert any(gpu_limit(c) >= 1 for _, g in groups for c in g["template"]["spec"]["containers"])

    head_c = head["spec"]["containers"][0]
    # MLflow: the in-cluster service of infra/mlflow/mlflow.yaml
    svc = next(s for s in by_kind(load_docs("mlflow/mlflow.yaml"), "Service") if s["metadata"]["name"] == "mlflow")
    port = svc["spec"]["ports"][0]["port"]
    assert env_value(head_c, "MLFLOW_TRACKING_URI") == (
        f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local:{port}"
    )
    # Optuna storage: PostgreSQL, credentials from the Secret
    storage = env_value(head_c, "GRKV_OPTUNA_STORAGE")
    assert storage.startswith("postgresql"), storage
    assert storage.endswith("/optuna")
    secret_name = load_one("mlflow/postgres-secret.template.yaml")["metadata"]["name"]
    for var in ("POSTGRES_USER", "POSTGRES_PASSWORD"):
        ref = env_map(head_c)[var]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret_name and ref["key"] == var
        assert f"$({var})" in storage


def _ray_pod_templates():
    rc = load_one("kuberay/raycluster.yaml")["spec"]
    rj = load_one("kuberay/rayjob.yaml")["spec"]["rayClusterSpec"]
    for name, spec in (("raycluster", rc), ("rayjob", rj)):
        head, groups = ray_cluster_spec_groups(spec)
        yield f"{name}/head", head
        for gname, g in groups:
            yield f"{name}/{gname}", g["template"]


def test_every_ray_container_disables_telemetry():
    for where, template in _ray_pod_templates():
        for c in pod_containers(template):
            assert env_value(c, "RAY_USAGE_STATS_ENABLED") == "0", f"{where}/{c['name']}"
            assert env_value(c, "MLFLOW_DISABLE_TELEMETRY") == "true", f"{where}/{c['name']}"
            assert env_value(c, "HF_HOME") == "/models/hf", f"{where}/{c['name']}"
    for rel in ("kuberay/raycluster.yaml", "kuberay/rayjob.yaml"):
        spec = load_one(rel)["spec"]
        spec = spec.get("rayClusterSpec", spec)
        autoscaler_env = {e["name"]: e.get("value") for e in spec["autoscalerOptions"]["env"]}
        assert autoscaler_env["RAY_USAGE_STATS_ENABLED"] == "0", rel


def test_no_plaintext_passwords_in_manifests():
    for path in YAML_FILES:
        for d in yaml.safe_load_all(path.read_text()):
            if not d or d.get("kind") in (None, "Secret"):
                continue
            text = json.dumps(d)
            for m in re.finditer(r'"name": "(\w*PASSWORD\w*)", "value": "([^"]*)"', text):
                pytest.fail(f"{path}: {m.group(1)} has a literal value")


# The variable the cluster configurations give sweep.py its --state-dir in, and the volume holding it.
STATE_DIR_ENV = "GRKV_SWEEP_STATE_DIR"
STATE_VOLUME = "grkv-state"


def test_sweep_py_takes_its_state_dir_from_the_variable_the_clusters_set():
    source = (ROOT / "sweep.py").read_text()
    assert re.search(rf'"--state-dir",\s*default=os\.environ\.get\("{STATE_DIR_ENV}"\)', source)


def kuberay_state_mounts():
    """Where each KubeRay pod (head and every worker group, RayCluster and RayJob) mounts the state volume, and the
    state directory each head's driver is given."""
    mounts, state_dirs = {}, {}
    for where, template in _ray_pod_templates():
        spec = template["spec"]
        claims = [v["name"] for v in spec["volumes"] if v.get("persistentVolumeClaim") == {"claimName": STATE_VOLUME}]
        assert len(claims) == 1, f"{where}: no volume of the claim {STATE_VOLUME}"
        (container,) = spec["containers"]
        mounts[where] = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == claims[0]]
        # NOTE: the image's user writes there: its group owns the volume
        assert spec["securityContext"]["fsGroup"] == int(dockerfile_arg(INFRA / "docker/Dockerfile", "USER_GID"))
        if where.endswith("/head"):
            state_dirs[where] = env_value(container, STATE_DIR_ENV)
    return mounts, state_dirs


def test_the_head_and_every_worker_group_mount_the_state_volume_where_the_sweeps_keep_their_state():
    """One ReadWriteMany volume at one path in every Ray pod, and the drivers' state directory on it: a restarted
    head keeps the finished results, a trial run again on another pod finds its checkpoints (docs/sweeps.md)."""
    claim = load_one("kuberay/state-volume.yaml")
    assert (claim["kind"], claim["metadata"]["name"]) == ("PersistentVolumeClaim", STATE_VOLUME)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    mounts, state_dirs = kuberay_state_mounts()
    assert len(mounts) >= 4 and len(state_dirs) == 2, mounts
    ((mount,),) = {tuple(paths) for paths in mounts.values()}
    for where, state_dir in state_dirs.items():
        assert state_dir and Path(state_dir).is_relative_to(mount), f"{where}: {STATE_DIR_ENV}={state_dir}"

    # ray up: the same path in every node's container (docker.run_options apply to the head and the workers alike),
    # from a host folder each node mounts before its container starts.
    cfg = load_one("ray-up/cluster.yaml")
    assert not any("docker" in node for node in cfg["available_node_types"].values()), "a node type's own docker"
    run_options = cfg["docker"]["run_options"]
    (host,) = [o.split()[1].split(":")[0] for o in run_options if o.startswith("-v ") and o.endswith(f":{mount}")]
    assert f"-e {STATE_DIR_ENV}={state_dirs['raycluster/head']}" in run_options
    assert any(re.search(rf"mount -t nfs4 .* {re.escape(host)}\)", c) for c in cfg["initialization_commands"]), host
    for doc in (INFRA / "README.md", ROOT / "docs/sweeps.md"):
        assert mount in doc.read_text() and STATE_DIR_ENV in doc.read_text(), doc


# --------------------------------------------------------------------------------------- ray up


def test_ray_up_cluster():
    cfg = load_one("ray-up/cluster.yaml")
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    workers = {k: v for k, v in types.items() if k != cfg["head_node_type"]}
    assert workers
    gpu_types = [v for v in workers.values() if v.get("resources", {}).get("GPU", 0) >= 1]
    assert gpu_types, "no worker node type with GPU resources"
    for t in gpu_types:
        assert 0 <= t["min_workers"] <= t["max_workers"] <= cfg["max_workers"]
    assert cfg["docker"]["image"] == "ghcr.io/grkv/grkv:latest"
    run_options = " ".join(cfg["docker"]["run_options"])
    for needle in (
        "RAY_USAGE_STATS_ENABLED=0",
        "MLFLOW_DISABLE_TELEMETRY=true",
        "HF_HOME=/models/hf",
        "RAY_AUTH_MODE=",
    ):
        assert needle in run_options, needle
    for key in ("setup_commands", "head_setup_commands", "worker_setup_commands", "initialization_commands"):
        assert isinstance(cfg[key], list), key
    head_start = " ".join(cfg["head_start_ray_commands"])
    assert "ray start --head" in head_start and "--dashboard-host=127.0.0.1" in head_start
    assert "ray start --address=$RAY_HEAD_IP:6379" in " ".join(cfg["worker_start_ray_commands"])


def test_ray_up_cluster_matches_ray_schema():
    ray = pytest.importorskip("ray")
    jsonschema = pytest.importorskip("jsonschema")
    schema_path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    if not schema_path.is_file():
        pytest.skip("ray-schema.json not shipped with this ray")
    jsonschema.validate(load_one("ray-up/cluster.yaml"), json.loads(schema_path.read_text()))


# ------------------------------------------------------------------------ MLflow + PostgreSQL


def test_mlflow_deployment_uses_postgres_backend():
    docs = load_docs("mlflow/mlflow.yaml")
    dep = by_kind(docs, "Deployment")[0]
    c = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "mlflow")
    argv = " ".join(c.get("command", []) + c.get("args", []))
    assert "mlflow server" in argv or c["command"][-1] == "server"
    backend = re.search(r"--backend-store-uri[= ](\S+)", argv)
    assert backend and backend.group(1).startswith("postgresql+psycopg2://"), argv
    assert "postgres.grkv.svc.cluster.local:5432/mlflow" in backend.group(1)
    assert re.search(r"--artifacts-destination[= ]\S+", argv)
    assert env_value(c, "MLFLOW_DISABLE_TELEMETRY") == "true"
    # artifacts volume is a PVC defined alongside
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in dep["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }
    pvcs = {p["metadata"]["name"] for p in by_kind(docs, "PersistentVolumeClaim")}
    assert claims and claims <= pvcs
    svc = by_kind(docs, "Service")[0]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert "mlflow.grkv.svc.cluster.local:5000" in argv  # --allowed-hosts lists the Service name


def test_postgres_statefulset_service_and_secret_template():
    docs = load_docs("mlflow/postgres.yaml")
    sts = by_kind(docs, "StatefulSet")[0]
    svc = by_kind(docs, "Service")[0]
    assert svc["metadata"]["name"] == "postgres" and svc["spec"]["ports"][0]["port"] == 5432
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["volumeClaimTemplates"]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["image"].startswith("postgres:")
    assert env_map(c)["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "grkv-postgres"
    init = by_kind(docs, "ConfigMap")[0]["data"]
    assert any("CREATE DATABASE optuna" in v for v in init.values())
    assert "CREATE DATABASE optuna" in (INFRA / "mlflow/initdb/10-create-optuna-db.sh").read_text()

    secret_text = (INFRA / "mlflow/postgres-secret.template.yaml").read_text()
    secret = load_one("mlflow/postgres-secret.template.yaml")
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "grkv-postgres"
    assert secret["stringData"]["POSTGRES_PASSWORD"] == "CHANGE_ME"  # a placeholder, never a password
    assert "PLACEHOLDER" in secret_text and "openssl rand" in secret_text
    assert "data" not in secret


def test_docker_compose_services():
    compose = load_one("mlflow/docker-compose.yaml")
    services = compose["services"]
    assert {"postgres", "mlflow"} <= set(services)
    pg, ml = services["postgres"], services["mlflow"]
    assert pg["image"].startswith("postgres:")
    assert pg["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")  # never hard-coded
    assert "healthcheck" in pg
    assert ml["depends_on"]["postgres"]["condition"] == "service_healthy"
    cmd = " ".join(ml["command"])
    assert "--backend-store-uri=postgresql+psycopg2://" in cmd and "--artifacts-destination=" in cmd
    assert ml["environment"]["MLFLOW_DISABLE_TELEMETRY"] == "true"
    for svc in services.values():
        for p in svc.get("ports", []):
            assert str(p).startswith("127.0.0.1:"), p
    for name in ("pgdata", "mlartifacts"):
        assert name in compose["volumes"]
    assert (INFRA / "mlflow" / ml["build"]["context"] / ml["build"]["dockerfile"]).is_file()
    mlflow_version = dockerfile_arg(INFRA / "mlflow/Dockerfile", "MLFLOW_VERSION")
    assert ml["image"].endswith(":" + mlflow_version)
    dep = by_kind(load_docs("mlflow/mlflow.yaml"), "Deployment")[0]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":" + mlflow_version)
    for example in (INFRA / "mlflow/.env.example", INFRA / "ray-up/ray-up.env.example"):
        assert "CHANGE_ME" in example.read_text(), example


# ------------------------------------------------------------------------------------ Dockerfile


def test_dockerfile_base_and_install():
    path = INFRA / "docker/Dockerfile"
    text = path.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(froms) == 1
    base = froms[0]
    if base.startswith("${"):
        base = dockerfile_arg(path, base.strip("${}"))
    assert base.startswith(("nvidia/cuda:", "rayproject/ray")), base
    assert dockerfile_arg(path, "PYTHON_VERSION") == "3.11"
    # the sweep and PostgreSQL extras, in the same RUN (line continuations)
    assert re.search(r'pip install(?:[^\n]|\\\n)*?"\.\[sweep,postgres\]"', text)
    assert "flash-attn" in text and "INSTALL_FLASH_ATTN" in text  # optional
    env_line = re.search(
        r"^ENV RAY_USAGE_STATS_ENABLED=0 MLFLOW_DISABLE_TELEMETRY=true HF_HOME=/models/hf$", text, re.M
    )
    assert env_line
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")


def test_dockerignore():
    rules = (INFRA / "docker/.dockerignore").read_text()
    # BuildKit reads <Dockerfile>.dockerignore; both copies must agree.
    assert (INFRA / "docker/Dockerfile.dockerignore").read_text() == rules
    assert "docker build -f infra/docker/Dockerfile ." in rules  # context = repo root, said in a comment
    patterns = {line.strip() for line in rules.splitlines() if line.strip() and not line.startswith("#")}
    for must in (".git", ".venv", ".grkv-state"):
        assert must in patterns
    for needed in ("pyproject.toml", "README.md", "grkv_core", "sweeps", "sweep.py", "workers", "tracking"):
        assert needed not in patterns


# --------------------------------------------------------------------------------- shell scripts


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_syntax_and_loopback_only(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = script.read_text()
    assert "0.0.0.0" not in text
    if script.name != "common.sh":
        assert os.access(script, os.X_OK), f"{script} is not executable"
        assert "set -euo pipefail" in text
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\bray\"?\s+stop\b|RAY_BIN\"?\s+stop", code), "must not call `ray stop`"


def test_start_script_settings():
    common = (LOCAL / "common.sh").read_text()
    start = (LOCAL / "start.sh").read_text()
    assert "GRKV_HOST=127.0.0.1" in common
    for needle in (
        "export RAY_USAGE_STATS_ENABLED=0",
        "export MLFLOW_DISABLE_TELEMETRY=true",
        'export RAY_AUTH_MODE="$RAY_AUTH"',
        "--node-ip-address=",
        "--dashboard-host=",
        "GRKV_RAY_CPUS:-2",
        "--backend-store-uri",
        "--artifacts-destination",
        "/health",
        "/api/v0/nodes",
        "ray job submit --address $RAY_DASHBOARD_URL --working-dir . -- python sweep.py --config "
        "sweeps/configs/smoke.yaml",
    ):
        assert needle in start, needle
    for var in ("GRKV_RAY_PORT", "GRKV_RAY_DASHBOARD_PORT", "GRKV_MLFLOW_PORT", "GRKV_STATE_DIR"):
        assert var in start + common, var


def test_a_server_started_by_the_scripts_holds_none_of_their_callers_descriptors():
    """``close_inherited_fds``, which start.sh and postgres.sh run before starting a server: a lock the caller holds
    (start.sh's own, a ``flock`` around the script) is not kept taken by a server that outlives it."""
    script = f"source {LOCAL / 'common.sh'}; exec 7>/dev/null 9>/dev/null; (close_inherited_fds; ls /proc/$BASHPID/fd)"
    listed = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert "7" not in listed and "9" not in listed and {"0", "1", "2"} <= set(listed)
    for name in ("start.sh", "postgres.sh"):
        assert "close_inherited_fds" in (LOCAL / name).read_text(), name


def test_postgres_init_script_syntax():
    r = subprocess.run(
        ["sh", "-n", str(INFRA / "mlflow/initdb/10-create-optuna-db.sh")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------- real local start + stop


def _bin(name):
    venv = VENV_BIN / name
    return str(venv) if venv.exists() else shutil.which(name)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its reaper counts as gone
        return Path(f"/proc/{pid}/cmdline").read_bytes() != b""
    except OSError:
        return False


# ~30 s here (2 busy cores): start ~21-25 s, stop ~5 s -- kept in the default run.
def test_local_start_and_stop():
    ray_bin, mlflow_bin = _bin("ray"), _bin("mlflow")
    if not ray_bin or not mlflow_bin:
        pytest.skip("ray / mlflow not installed")
    # A short path: Ray's Unix sockets live under <state>/ray/session_*/sockets (107-byte limit).
    state = Path(tempfile.mkdtemp(prefix="grkv-", dir="/tmp"))
    ray_port, dash_port, mlflow_port, client_port, agent_port = free_ports(5)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "GRKV_", "MLFLOW_"))}
    env.update(
        GRKV_VENV=str(VENV_BIN.parent),
        GRKV_STATE_DIR=str(state),
        GRKV_RAY_PORT=str(ray_port),
        GRKV_RAY_DASHBOARD_PORT=str(dash_port),
        GRKV_MLFLOW_PORT=str(mlflow_port),
        GRKV_RAY_CLIENT_PORT=str(client_port),
        GRKV_RAY_AGENT_PORT=str(agent_port),
        GRKV_RAY_CPUS="1",
    )
    pids = []
    t0 = time.monotonic()
    try:
        r = subprocess.run(["bash", str(LOCAL / "start.sh")], env=env, capture_output=True, text=True, timeout=400)
        assert r.returncode == 0, r.stdout + r.stderr
        t_started = time.monotonic() - t0
        assert f"http://127.0.0.1:{mlflow_port}" in r.stdout
        assert f"ray job submit --address http://127.0.0.1:{dash_port} --working-dir . -- python sweep.py" in r.stdout
        for name in ("ray", "mlflow"):
            pid = int((state / f"{name}.pid").read_text())
            assert _alive(pid)
            pids.append(pid)
            assert (state / f"{name}.log").is_file()

        with urllib.request.urlopen(f"http://127.0.0.1:{mlflow_port}/health", timeout=10) as resp:
            assert resp.status == 200 and resp.read().strip() == b"OK"
        status_env = dict(env, RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        st = subprocess.run(
            [ray_bin, "status", "--address", f"127.0.0.1:{ray_port}"],
            env=status_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert st.returncode == 0 and "node_" in st.stdout, st.stdout + st.stderr
        assert (state / "env.sh").read_text().count("RAY_AUTH_MODE=disabled") == 1

        again = subprocess.run(["bash", str(LOCAL / "start.sh")], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "already running" in again.stdout, again.stdout + again.stderr
    finally:
        t1 = time.monotonic()
        stop = subprocess.run(["bash", str(LOCAL / "stop.sh")], env=env, capture_output=True, text=True, timeout=300)
        t_stop = time.monotonic() - t1
        print(f"start {time.monotonic() - t0 - t_stop:.1f}s (incl. checks), stop {t_stop:.1f}s")
    try:
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert not (state / "ray.pid").exists() and not (state / "mlflow.pid").exists()
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(_alive(p) for p in pids)
        again = subprocess.run(["bash", str(LOCAL / "stop.sh")], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "not running" in again.stdout
        print(f"start answered after {t_started:.1f}s")
    finally:
        shutil.rmtree(state, ignore_errors=True)
