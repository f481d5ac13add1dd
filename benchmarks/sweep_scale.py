"""A sweep at a cluster's scale, measured: hundreds of tiny-model trials from 8 logical workers against PostgreSQL.

    .venv/bin/python -m benchmarks.sweep_scale benchmarks/results/sweep-scale --trials 500

Starts the local stack with its PostgreSQL (``GRKV_POSTGRES=1 infra/local/start.sh``, on free ports kept in
``<work>/ports.json``) unless it runs already, writes a sweep config (``sweep_config``: tiny-llama, short contexts,
answer metrics, full trials only, ``--workers`` workers sharing the cores), runs ``sweep.py`` against it (the Optuna
study and MLflow's backend store both in PostgreSQL), then measures what the sweep left: trials per minute, the
driver's own seconds per trial by part (``sweeps.state.driver_times``) beside the trials' own evaluation time, the
sampler's ask time early and late, ``grkv report``'s wall time over the sweep and the size of both databases. Writes
``summary.json``, ``summary.md`` and ``driver_time.png`` (driver seconds per trial vs trial number) to ``out``.

Resumable: the sweep, its state and the stack live in ``--work-dir`` (default ``~/.grkv/sweep-scale``, never in the
checkout); run the same command again and the sweep resumes where it stopped. ``--stop-after-s`` stops the sweep
cleanly (SIGTERM, its in-flight trials re-queued) after that long, to run it in chunks; the figures are written once
it has finished. ``--stop-stack`` stops Ray, MLflow and PostgreSQL at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from grkv_core.files import write_atomically
from sweeps.local_stack import free_ports
from sweeps.state.driver_times import LOOP_PARTS, WRITER_PARTS

REPO = Path(__file__).resolve().parents[1]
PORT_SETTINGS = (
    "GRKV_RAY_PORT",
    "GRKV_RAY_DASHBOARD_PORT",
    "GRKV_RAY_CLIENT_PORT",
    "GRKV_RAY_AGENT_PORT",
    "GRKV_MLFLOW_PORT",
    "GRKV_POSTGRES_PORT",
)
SERVICE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "RAY_AUTH_MODE": "disabled",
}
EXPERIMENT = "grkv-sweep-scale"
DESCRIBED = (
    ("loop", "the driver's loop (ask, state, wait): what the trials wait for"),
    ("own", "the loop's own work (ask, state), its waits for the writer left out"),
    ("writer", "its writer (mlflow, tell, parent), beside the loop"),
    ("all", "both, as if made one after the other"),
)
GROUPS = {
    "loop": LOOP_PARTS,
    "own": tuple(part for part in LOOP_PARTS if part != "wait"),
    "writer": WRITER_PARTS,
    "all": LOOP_PARTS + WRITER_PARTS,
}
# The first and last this many trials compare the sampler's ask time early and late in the sweep.
EDGE = 50


def sweep_config(trials: int, workers: int, batch_size: int, tracking_uri: str) -> dict:
    """The measured sweep: tiny-llama on 512-token RULER contexts (the shortest its niah prompt and answer fit in),
    one sample, the reference answer's NLL as the objective, full trials only (no screening, no test stage),
    ``workers`` workers sharing the 2 cores."""
    return {
        "name": "sweep-scale",
        "model": {"name": "tiny-llama", "dtype": "float32"},
        "data": {"dataset": "ruler", "tasks": ["niah_single_1"], "context_length": 512, "samples": 1},
        "press": {"name": "snapkv", "compression_ratio": 0.75},
        "merge": ["grkv"],
        "search_space": {
            "lambda_k": {"type": "float", "low": 1.0e-4, "high": 1.0, "log": True, "include_zero": True},
            "lambda_v": {"type": "float", "low": 1.0e-4, "high": 1.0, "log": True},
            "beta": {"type": "float", "low": 0.0, "high": 0.3},
            "window_size": {"type": "categorical", "choices": [16, 32, 64]},
            "steps": {"type": "int", "low": 1, "high": 2},
            "components": {"type": "categorical", "choices": ["kv", "k", "v"]},
        },
        "objectives": [{"metric": "answer_nll"}],
        "sampler": {"type": "tpe", "seed": 0, "n_startup_trials": 10},
        "trials": trials,
        "workers": {"count": workers, "num_cpus": 2 / workers, "batch_size": batch_size, "max_retries": 2},
        "tracking": {"tracking_uri": tracking_uri, "experiment": EXPERIMENT},
    }


def stack_env(work: Path) -> dict[str, str]:
    """The environment of ``infra/local/start.sh`` for this work folder: its state dir, PostgreSQL and the ports
    chosen the first time (kept in ``ports.json``: the PostgreSQL cluster's folder is named by its port)."""
    ports_file = work / "ports.json"
    if not ports_file.is_file():
        work.mkdir(parents=True, exist_ok=True)
        ports_file.write_text(json.dumps(dict(zip(PORT_SETTINGS, map(str, free_ports(len(PORT_SETTINGS)))))))
    return {
        **os.environ,
        **SERVICE_ENV,
        **json.loads(ports_file.read_text()),
        "GRKV_STATE_DIR": str(work / "stack"),
        "GRKV_POSTGRES": "1",
        "GRKV_RAY_CPUS": "2",
    }


def start_stack(work: Path) -> tuple[dict[str, str], dict[str, str]] | None:
    """``infra/local/start.sh`` for ``work``: the environment it ran in (``stack_env``) and the values of the stack's
    ``env.sh``; None, its output printed to stderr, when it failed."""
    env = stack_env(work)
    started = subprocess.run(["bash", "infra/local/start.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    if started.returncode:
        print(started.stdout + started.stderr, file=sys.stderr)
        return None
    return env, env_file(work / "stack" / "env.sh")


def env_file(path: Path) -> dict[str, str]:
    """``KEY=value`` lines (``export`` allowed) of a shell file."""
    pairs = (line.removeprefix("export ").split("=", 1) for line in path.read_text().splitlines())
    return {pair[0]: pair[1] for pair in pairs if len(pair) == 2 and not pair[0].startswith("#")}


def lower_workers(niceness: int, stop: threading.Event) -> None:
    """Until ``stop``, every second: the trial workers' processes (Ray titles them ``ray::TrialWorker``) at
    ``niceness``.

    NOTE: on a cluster the driver, MLflow and PostgreSQL have machines of their own; on 2 shared cores, 8 busy workers
    at the same priority would take the CPU they need, and the driver's time per trial would measure the wait for it.
    """
    while not stop.wait(1.0):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes()
                if title.startswith(b"ray::TrialWorker") and os.getpriority(os.PRIO_PROCESS, int(pid)) < niceness:
                    os.setpriority(os.PRIO_PROCESS, int(pid), niceness)
            except OSError:  # the process ended meanwhile
                continue


def run_sweep(work: Path, env: dict, config_path: Path, sweep_id: str, options: argparse.Namespace) -> int:
    """``sweep.py`` on the stack (its Optuna storage and tracking URI from the stack's env.sh); its exit status.
    ``options``: ``stop_after_s``, SIGTERM after that long (a clean stop that the next run resumes); ``profile``,
    watched by ``py-spy record`` (collapsed stacks in ``<work>/driver-<time>.profile``); ``worker_nice``, the workers'
    niceness (``lower_workers``)."""
    stack = env_file(work / "stack" / "env.sh")
    command = [
        sys.executable,
        "sweep.py",
        "--config",
        str(config_path),
        "--sweep-id",
        sweep_id,
        "--state-dir",
        str(work / "state"),
        "--tracking-uri",
        stack["MLFLOW_TRACKING_URI"],
        "--storage-url",
        stack["GRKV_OPTUNA_STORAGE"],
    ]
    driver_env = {**env, "RAY_ADDRESS": stack["GRKV_RAY_ADDRESS"], "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    with open(work / "driver.log", "a") as log:
        driver = subprocess.Popen(command, cwd=REPO, env=driver_env, stdout=log, stderr=subprocess.STDOUT)
        stop = threading.Event()
        if options.worker_nice:
            threading.Thread(target=lower_workers, args=(options.worker_nice, stop), daemon=True).start()
        if options.profile:  # NOTE: attached, so that the driver's exit status and signals stay its own
            output = work / f"driver-{time.strftime('%H%M%S')}.profile"
            py_spy = str(Path(sys.executable).parent / "py-spy")
            subprocess.Popen(
                [py_spy, "record", "--format", "raw", "--rate", "50", "-o", str(output), "--pid", str(driver.pid)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            return driver.wait(timeout=options.stop_after_s)
        except subprocess.TimeoutExpired:
            driver.send_signal(signal.SIGTERM)
            return driver.wait()
        finally:
            stop.set()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(work: Path, out: Path, sweep_id: str, trials: int) -> dict:
    """The figures of the finished sweep (see the module's docstring)."""
    import optuna
    import sqlalchemy
    from mlflow.tracking import MlflowClient

    from workers.names import FULL_STAGE, ROLE_TAG, SWEEP_TAG, TRIAL_TAG

    stack = env_file(work / "stack" / "env.sh")
    postgres = env_file(work / "stack" / "postgres.env")
    client = MlflowClient(stack["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs(
        [experiment.experiment_id],
        f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{ROLE_TAG}` = 'trial'",
        max_results=50000,
    )
    finished = [run for run in runs if run.info.status == "FINISHED"]
    numbers = [int(run.data.tags[TRIAL_TAG]) for run in finished]
    study = optuna.load_study(study_name=sweep_id, storage=stack["GRKV_OPTUNA_STORAGE"])
    complete = sorted(t.number for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)))
    once = len(numbers) == len(set(numbers)) and sorted(numbers) == complete and len(complete) == trials

    rows = [
        json.loads(line)
        for line in (work / "state" / sweep_id / "driver_times.jsonl").read_text().splitlines()
        if line.strip()
    ]
    rows = [row for row in rows if row["stage"] == FULL_STAGE and int(row["key"]) in set(complete)]
    rows.sort(key=lambda row: int(row["key"]))
    evaluation = [run.data.metrics["trial_eval_s"] for run in finished]
    started = min(run.info.start_time for run in finished) / 1000
    ended = max(run.info.end_time for run in finished) / 1000
    chunks = json.loads((work / "chunks.json").read_text())

    report_started = time.perf_counter()
    report = subprocess.run(
        [sys.executable, "-m", "sweeps.cli", "report", "--sweep-id", sweep_id, "--tracking-uri",
         stack["MLFLOW_TRACKING_URI"], "--output-dir", str(work / "report")],
        cwd=REPO, env={**os.environ, **SERVICE_ENV}, capture_output=True, text=True,
    )  # fmt: skip
    report_s = time.perf_counter() - report_started
    sizes = {}
    for database in ("optuna", "mlflow"):
        engine = sqlalchemy.create_engine(f"{postgres['GRKV_POSTGRES_URL']}/{database}")
        with engine.connect() as connection:
            size = connection.execute(sqlalchemy.text("SELECT pg_database_size(current_database())"))
            sizes[database] = size.scalar()
        engine.dispose()

    figures = {
        "sweep_id": sweep_id,
        "trials": trials,
        "finished_runs": len(finished),
        "complete_trials": len(complete),
        "every_trial_finished_once": once,
        "runs_by_status": {s: sum(r.info.status == s for r in runs) for s in {r.info.status for r in runs}},
        "driver_chunks": chunks,
        "trials_per_minute_driver": len(complete) / (sum(chunk["wall_s"] for chunk in chunks) / 60),
        "trials_per_minute_runs": len(complete) / ((ended - started) / 60),
        "driver_process_cpu_s_per_trial": sum(chunk.get("cpu_s", math.nan) for chunk in chunks) / len(complete),
        "trial_eval_s": {"median": statistics.median(evaluation), "p95": percentile(evaluation, 0.95)},
        "dispatch_s": {"median": statistics.median(row["dispatch_s"] for row in rows)},
        "waited_for_writer": sum(row["wait_s"] > 0.001 for row in rows) / len(rows),
        "wall": driver_figures(rows, "_s"),
        "cpu": driver_figures(rows, "_cpu_s"),
        "report_s": report_s,
        "report_ok": report.returncode == 0,
        "database_bytes": sizes,
    }
    plot(rows, out / "driver_time.png")
    return figures


def driver_figures(rows: list[dict], suffix: str) -> dict:
    """The driver's seconds per trial (``suffix`` ``_s``: wall clock; ``_cpu_s``: CPU of the thread each part ran on)
    by group of parts (``GROUPS``: its loop, its writer, both) and by part, median and p95; each group and the ask,
    median of the first and the last ``EDGE`` trials."""
    figures = {"parts": {}}
    for name, parts in GROUPS.items():
        summed = [sum(row[part + suffix] for part in parts) for row in rows]
        figures[name] = {
            "median": statistics.median(summed),
            "p95": percentile(summed, 0.95),
            "max": max(summed),
            "first": statistics.median(summed[:EDGE]),
            "last": statistics.median(summed[-EDGE:]),
        }
    for part in GROUPS["all"]:
        values = [row[part + suffix] for row in rows]
        figures["parts"][part] = {"median": statistics.median(values), "p95": percentile(values, 0.95)}
    ask = [row["ask" + suffix] for row in rows]
    figures.update(ask_first=statistics.median(ask[:EDGE]), ask_last=statistics.median(ask[-EDGE:]))
    return figures  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    """The driver's seconds per trial (its loop's and its writer's wall clock, the sampler's ask CPU) against the trial
    number; the dashed line is the bar of issue #52 (50 ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numbers = [int(row["key"]) for row in rows]
    figure, axes = plt.subplots(figsize=(7, 3.2))
    for group, what in (("loop", "driver's loop"), ("writer", "its writer")):
        seconds = [1000 * sum(row[part + "_s"] for part in GROUPS[group]) for row in rows]
        axes.plot(numbers, seconds, ".", markersize=3, label=f"{what}, wall clock")
    axes.plot(numbers, [1000 * row["ask_cpu_s"] for row in rows], ".", markersize=3, label="ask (TPE), CPU")
    axes.axhline(50, color="grey", linewidth=0.8, linestyle="--")
    axes.set_xlabel("trial number")
    axes.set_ylabel("ms per trial")
    axes.set_yscale("log")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def markdown(figures: dict, command: str) -> str:
    wall, cpu = figures["wall"], figures["cpu"]

    def ms(value: float) -> str:
        return f"{1000 * value:.1f}"

    lines = [
        "# Sweep at scale: measured figures",
        "",
        f"Command: `{command}`",
        "",
        f"{figures['complete_trials']} of {figures['trials']} trials COMPLETE in Optuna, {figures['finished_runs']} "
        f"FINISHED MLflow runs; every trial finished exactly once: {figures['every_trial_finished_once']}. "
        f"{figures['trials_per_minute_driver']:.1f} trials per minute over {len(figures['driver_chunks'])} run(s) of "
        f"sweep.py. `grkv report` over the sweep: {figures['report_s']:.1f} s (ok: {figures['report_ok']}). "
        f"PostgreSQL databases: `optuna` {figures['database_bytes']['optuna'] / 2**20:.1f} MiB, `mlflow` "
        f"{figures['database_bytes']['mlflow'] / 2**20:.1f} MiB.",
        "",
        "| ms per trial | wall clock | CPU |",
        "|---|---|---|",
        *(f"| {what}: median / p95 | {ms(wall[group]['median'])} / {ms(wall[group]['p95'])} | "
          f"{ms(cpu[group]['median'])} / {ms(cpu[group]['p95'])} |" for group, what in DESCRIBED),
        *(f"| {what}: median of the first / last {EDGE} trials | {ms(wall[group]['first'])} / "
          f"{ms(wall[group]['last'])} | {ms(cpu[group]['first'])} / {ms(cpu[group]['last'])} |"
          for group, what in DESCRIBED),
        f"| ask (the sampler): median of the first / last {EDGE} trials | {ms(wall['ask_first'])} / "
        f"{ms(wall['ask_last'])} | {ms(cpu['ask_first'])} / {ms(cpu['ask_last'])} |",
        *(f"| {part}: median / p95 | {ms(wall['parts'][part]['median'])} / {ms(wall['parts'][part]['p95'])} | "
          f"{ms(cpu['parts'][part]['median'])} / {ms(cpu['parts'][part]['p95'])} |" for part in GROUPS["all"]),
        f"| the driver process's CPU, all threads, per trial (sweep.py's CPU / trials) | | "
        f"{ms(figures['driver_process_cpu_s_per_trial'])} |",
        f"| the trial's own evaluation (`trial_eval_s`): median / p95 | {ms(figures['trial_eval_s']['median'])} / "
        f"{ms(figures['trial_eval_s']['p95'])} | |",
        f"| its batch's Ray round trip, its share (`dispatch_s`): median | {ms(figures['dispatch_s']['median'])} | |",
        "",
        f"The loop waited for room on the writer (over 1 ms) on {100 * figures['waited_for_writer']:.0f}% of the "
        "trials.",
        "",
        "![driver time per trial](driver_time.png)",
        "",
    ]  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="where summary.json, summary.md and driver_time.png go")
    parser.add_argument("--trials", type=int, default=500)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--work-dir", type=Path, default=Path("~/.grkv/sweep-scale"))
    parser.add_argument("--sweep-id", default=None, help="default: sweep-scale-<trials>")
    parser.add_argument("--stop-after-s", type=float, default=None, help="stop the sweep cleanly after this long")
    parser.add_argument(
        "--worker-nice", type=int, default=19, help="the trial workers' niceness (0: left as Ray starts them)"
    )
    parser.add_argument("--profile", action="store_true", help="run the driver under py-spy (<work>/*.profile)")
    parser.add_argument("--stop-stack", action="store_true", help="stop Ray, MLflow and PostgreSQL at the end")
    args = parser.parse_args()
    work = args.work_dir.expanduser().resolve()
    sweep_id = args.sweep_id or f"sweep-scale-{args.trials}"
    started = start_stack(work)
    if started is None:
        return 1
    env, stack = started
    config_path = work / "sweep.yaml"
    config_path.write_text(
        yaml.safe_dump(sweep_config(args.trials, args.workers, args.batch_size, stack["MLFLOW_TRACKING_URI"]))
    )
    chunks_file = work / "chunks.json"
    chunks = json.loads(chunks_file.read_text()) if chunks_file.is_file() else []
    if not chunks or chunks[-1]["exit"] != 0:
        began, cpu_before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        status = run_sweep(work, env, config_path, sweep_id, args)
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime
        chunks.append({"wall_s": time.perf_counter() - began, "cpu_s": cpu_s, "exit": status})
        write_atomically(chunks_file, json.dumps(chunks))
        print(f"sweep {sweep_id}: sweep.py exited {status} after {chunks[-1]['wall_s']:.0f} s (log {work}/driver.log)")
        if status != 0:
            return 0 if status == 5 else status  # 5: stopped after --stop-after-s; run again to resume
    args.out.mkdir(parents=True, exist_ok=True)
    figures = measure(work, args.out, sweep_id, args.trials)
    command = f"python -m benchmarks.sweep_scale {args.out} --trials {args.trials}"
    write_atomically(args.out / "summary.json", json.dumps(figures, indent=1))
    write_atomically(args.out / "summary.md", markdown(figures, command))
    print(markdown(figures, command))
    if args.stop_stack:
        subprocess.run(["bash", "infra/local/stop.sh"], cwd=REPO, env=env, check=False)
    return 0 if figures["every_trial_finished_once"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
