"""Per-trial overhead of the sweep service (Ray dispatch + Optuna + MLflow) relative to trial evaluation time.

    python -m benchmarks.sweep_overhead --sweep-id ruler-snapkv-... --tracking-uri http://127.0.0.1:5000

Reads one finished sweep's child runs from MLflow. For every trial the driver logged ``trial_eval_s`` (time
inside the worker's ``evaluate``, as the worker clocked it) and ``service_overhead_s`` (driver time spent
asking Optuna and opening the MLflow run, Ray dispatch and result latency, writing the result and telling
Optuna). Prints both per trial and the ratio of their sums, plus the model loads each worker reported.
"""

from __future__ import annotations

import argparse
import statistics

from mlflow.tracking import MlflowClient

from workers.names import ROLE_TAG, SWEEP_TAG, TRIAL_TAG, WORKER_PID_TAG


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep-id", required=True)
    parser.add_argument("--tracking-uri", default="http://127.0.0.1:5000")
    parser.add_argument("--experiment", required=True)
    args = parser.parse_args()
    client = MlflowClient(args.tracking_uri)
    experiment = client.get_experiment_by_name(args.experiment)
    if experiment is None:
        raise SystemExit(f"no experiment {args.experiment!r} at {args.tracking_uri}")
    runs = client.search_runs(
        [experiment.experiment_id],
        f"tags.`{SWEEP_TAG}` = '{args.sweep_id}' and tags.`{ROLE_TAG}` = 'trial' and attributes.status = 'FINISHED'",
        max_results=10000,
    )
    if not runs:
        raise SystemExit(f"no finished trials for sweep {args.sweep_id!r}")
    rows = sorted(
        (
            (
                int(r.data.tags[TRIAL_TAG]),
                r.data.metrics["trial_eval_s"],
                r.data.metrics["service_overhead_s"],
                int(r.data.metrics["worker_model_loads"]),
                r.data.tags.get(WORKER_PID_TAG),
            )
            for r in runs
        )
    )
    print(f"{'trial':>5s} {'eval s':>9s} {'overhead s':>11s} {'overhead %':>11s} {'worker pid':>10s} {'loads':>5s}")
    for number, evaluation, overhead, loads, pid in rows:
        print(f"{number:5d} {evaluation:9.2f} {overhead:11.3f} {overhead / evaluation:11.2%} {pid:>10s} {loads:5d}")
    total_eval = sum(row[1] for row in rows)
    total_overhead = sum(row[2] for row in rows)
    print(
        f"trials={len(rows)} total eval={total_eval:.1f}s total overhead={total_overhead:.2f}s "
        f"overhead/eval={total_overhead / total_eval:.2%} median "
        f"per-trial={statistics.median(r[2] / r[1] for r in rows):.2%}"
    )
    print(f"model loads per worker: {sorted({(row[4], row[3]) for row in rows})}")


if __name__ == "__main__":
    main()
