"""Following a sweep of more than 5,000 runs as ``grkv sweep`` does: a line for every ended run, and what each look
costs from the first trial to the last.

    .venv/bin/python -m benchmarks.follow_scale benchmarks/results/follow-scale --trials 5100 --stop-stack

Runs ``benchmarks.sweep_scale``'s sweep (tiny-llama trials from 8 workers, the Optuna study and MLflow's backend store
in the stack's PostgreSQL; full trials only, so one run a trial) with the random sampler (TPE's proposal grows with the
trials, and is not what is measured here), while ``sweeps.follow.ProgressPrinter`` follows it from this process, a look
every ``POLL_S`` as ``grkv sweep`` looks. Each look's wall time and the runs MLflow returned are recorded
(``<work>/polls.jsonl``), its printed lines kept (``<work>/progress.log``). Writes ``summary.json``, ``summary.md``
and ``poll_cost.png`` to ``out``.

The sweep and its stack live in ``--work-dir`` (default ``~/.grkv/follow-scale``, never in the checkout). Run it in
one go (about 20 minutes here): a second run resumes the sweep, but its follower, like a resumed ``grkv sweep``, only
counts the runs that ended before it started, so their lines are not printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

import yaml

from benchmarks.sweep_scale import REPO, run_sweep, start_stack, sweep_config
from grkv_core.files import write_atomically
from sweeps.follow import POLL_S

EXPERIMENT = "grkv-follow-scale"
# The first and the last this many looks made while the sweep ran compare the cost of a look.
EDGE = 50


class CountingClient:
    """An MLflow client that counts the runs its searches return."""

    def __init__(self, client):
        self.client, self.returned = client, 0

    def __getattr__(self, name):
        return getattr(self.client, name)

    def search_runs(self, *args, **kwargs):
        page = self.client.search_runs(*args, **kwargs)
        self.returned += len(page)
        return page


def follow(progress, client: CountingClient, polls: Path, stop: threading.Event) -> None:
    """Look every ``POLL_S`` until ``stop``, then once more; one JSON line per look."""
    began = time.perf_counter()
    with open(polls, "a") as out:
        while True:
            final = stop.is_set()
            client.returned, start = 0, time.perf_counter()
            progress.update()
            seconds = time.perf_counter() - start
            row = {
                "at_s": start - began,
                "poll_s": seconds,
                "returned": client.returned,
                "seen": len(progress.stage_of),
            }
            out.write(json.dumps({**row, "during_sweep": not final}) + "\n")
            out.flush()
            if final:
                return
            stop.wait(POLL_S)


def ended_runs(client, sweep_id: str) -> int:
    from workers.names import ROLE_TAG, SWEEP_TAG

    experiment = client.get_experiment_by_name(EXPERIMENT)
    query = f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{ROLE_TAG}` = 'trial'"
    count, token = 0, None
    while True:
        page = client.search_runs([experiment.experiment_id], query, max_results=1000, page_token=token)
        count += sum(run.info.status in ("FINISHED", "FAILED") for run in page)
        token = page.token
        if not token:
            return count


def figures(rows: list[dict], lines: list[str], runs: int, sweep_id: str) -> dict:
    during = [row for row in rows if row["during_sweep"]]
    first, last = during[:EDGE], during[-EDGE:]
    ended_lines = [line for line in lines if "running" not in line]
    return {
        "sweep_id": sweep_id,
        "ended_runs": runs,
        "ended_run_lines": len(ended_lines),
        "a_line_for_every_ended_run": len(ended_lines) == runs,
        "looks": len(rows),
        "runs_seen_at_the_end": rows[-1]["seen"],
        "max_runs_returned_per_look": max(row["returned"] for row in rows),
        "first_looks_ms": 1000 * statistics.median(row["poll_s"] for row in first),
        "last_looks_ms": 1000 * statistics.median(row["poll_s"] for row in last),
        "first_looks_runs_seen": [first[0]["seen"], first[-1]["seen"]],
        "last_looks_runs_seen": [last[0]["seen"], last[-1]["seen"]],
        "first_looks_returned": statistics.median(row["returned"] for row in first),
        "last_looks_returned": statistics.median(row["returned"] for row in last),
    }


def plot(rows: list[dict], path: Path) -> None:
    """A look's wall time and the runs it returned, against the runs seen so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    during = [row for row in rows if row["during_sweep"]]
    figure, (cost, returned) = plt.subplots(2, 1, figsize=(7, 4.5), sharex=True)
    cost.plot([row["seen"] for row in during], [1000 * row["poll_s"] for row in during], ".", markersize=3)
    cost.set_ylabel("ms per look")
    returned.plot([row["seen"] for row in during], [row["returned"] for row in during], ".", markersize=3)
    returned.set_ylabel("runs returned")
    returned.set_xlabel("runs ended so far")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def markdown(summary: dict, command: str) -> str:
    ratio = summary["last_looks_ms"] / summary["first_looks_ms"]
    return "\n".join(
        [
            "# Following a sweep of more than 5,000 runs: measured figures",
            "",
            f"Command: `{command}`",
            "",
            f"{summary['ended_runs']} trial runs ended; the follower printed {summary['ended_run_lines']} lines for "
            f"ended runs (a line for every one: {summary['a_line_for_every_ended_run']}) over {summary['looks']} "
            f"looks; at most {summary['max_runs_returned_per_look']} runs returned by one look.",
            "",
            f"| a look, median of {EDGE} | runs ended by then | ms | runs returned |",
            "|---|---|---|---|",
            f"| the first | {summary['first_looks_runs_seen'][0]}–{summary['first_looks_runs_seen'][1]} | "
            f"{summary['first_looks_ms']:.1f} | {summary['first_looks_returned']:.0f} |",
            f"| the last | {summary['last_looks_runs_seen'][0]}–{summary['last_looks_runs_seen'][1]} | "
            f"{summary['last_looks_ms']:.1f} | {summary['last_looks_returned']:.0f} |",
            "",
            f"The last looks cost {ratio:.2f}× the first ones.",
            "",
            "![a look's cost](poll_cost.png)",
            "",
        ]
    )


def main() -> int:
    from mlflow.tracking import MlflowClient

    from sweeps.config import load_config
    from sweeps.follow import ProgressPrinter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="where summary.json, summary.md and poll_cost.png go")
    parser.add_argument("--trials", type=int, default=5100)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--work-dir", type=Path, default=Path("~/.grkv/follow-scale"))
    parser.add_argument("--worker-nice", type=int, default=19, help="the trial workers' niceness")
    parser.add_argument("--stop-stack", action="store_true", help="stop Ray, MLflow and PostgreSQL at the end")
    args = parser.parse_args()
    work = args.work_dir.expanduser().resolve()
    sweep_id = f"follow-scale-{args.trials}"
    started = start_stack(work)
    if started is None:
        return 1
    env, stack = started
    config = sweep_config(args.trials, args.workers, args.batch_size, stack["MLFLOW_TRACKING_URI"])
    config.update(name="follow-scale", sampler={"type": "random", "seed": 0})
    config["tracking"]["experiment"] = EXPERIMENT
    config_path = work / "sweep.yaml"
    config_path.write_text(yaml.safe_dump(config))

    client = CountingClient(MlflowClient(stack["MLFLOW_TRACKING_URI"]))
    progress = ProgressPrinter(client, load_config(config_path), sweep_id)
    progress.update(quiet=True)  # a resumed sweep's runs, counted as a resumed `grkv sweep` counts them
    stop = threading.Event()
    sweep_options = argparse.Namespace(stop_after_s=None, profile=False, worker_nice=args.worker_nice)
    with open(work / "progress.log", "a") as log, contextlib.redirect_stdout(log):
        follower = threading.Thread(target=follow, args=(progress, client, work / "polls.jsonl", stop))
        follower.start()
        try:
            status = run_sweep(work, env, config_path, sweep_id, sweep_options)
        finally:
            stop.set()
            follower.join()
    print(f"sweep {sweep_id}: sweep.py exited {status} (log {work}/driver.log)")
    if status != 0:
        return status
    rows = [json.loads(line) for line in (work / "polls.jsonl").read_text().splitlines()]
    lines = (work / "progress.log").read_text().splitlines()
    summary = figures(rows, lines, ended_runs(client.client, sweep_id), sweep_id)
    args.out.mkdir(parents=True, exist_ok=True)
    command = f"python -m benchmarks.follow_scale {args.out} --trials {args.trials}"
    write_atomically(args.out / "summary.json", json.dumps(summary, indent=1))
    write_atomically(args.out / "summary.md", markdown(summary, command))
    plot(rows, args.out / "poll_cost.png")
    print(markdown(summary, command))
    if args.stop_stack:
        subprocess.run(["bash", "infra/local/stop.sh"], cwd=REPO, env=env, check=False)
    return 0 if summary["a_line_for_every_ended_run"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
