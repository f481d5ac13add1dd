"""``grkv-report``: the report of one sweep, read from MLflow, written to a folder and to its parent run."""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# NOTE: MLflow's client retries an unreachable server for minutes by default; a report should fail fast.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")

EXIT_TRACKING_UNAVAILABLE = 3
EXIT_SWEEP_NOT_FOUND = 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grkv-report", description=__doc__)
    parser.add_argument("--sweep-id", required=True, help="the sweep's id (tag grkv.sweep_id), finished or running")
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000"),
                        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or http://127.0.0.1:5000)")
    parser.add_argument("--experiment", default=None, help="look for the sweep only in this experiment")
    parser.add_argument("--output-dir", default=None, help="where to write the report (default: ./grkv-report-<id>)")
    parser.add_argument("--ttft-tolerance", type=float, default=0.10,
                        help="relative TTFT gap counted as equal prefill in the iso-prefill comparison")
    parser.add_argument("--bootstrap-resamples", type=int, default=100_000)
    parser.add_argument("--no-log-artifacts", action="store_true", help="do not log the report on the parent run")
    args = parser.parse_args(argv)

    import optuna
    from mlflow.tracking import MlflowClient

    from tracking.mlflow_tracker import TrackingUnavailableError, check_tracking_server
    from tracking.reports import ReportOptions, SweepNotFoundError, build_report

    try:
        check_tracking_server(args.tracking_uri)
    except TrackingUnavailableError as error:
        print(f"grkv-report: {error}", file=sys.stderr)
        return EXIT_TRACKING_UNAVAILABLE
    # The rebuilt study is an implementation detail; its "study created" log line is noise here.
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    options = ReportOptions(ttft_tolerance=args.ttft_tolerance, bootstrap_resamples=args.bootstrap_resamples)
    try:
        report = build_report(MlflowClient(args.tracking_uri), args.sweep_id,
                              args.output_dir or f"grkv-report-{args.sweep_id}", experiment=args.experiment,
                              options=options, log_artifacts=not args.no_log_artifacts)
    except SweepNotFoundError as error:
        print(f"grkv-report: {error} at {args.tracking_uri}", file=sys.stderr)
        return EXIT_SWEEP_NOT_FOUND
    print(report.summary)
    print(f"report: {report.output_dir / 'report.html'}"
          + (f"; logged to {report.artifact_uri}" if report.artifact_uri else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
