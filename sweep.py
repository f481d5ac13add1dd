"""Ray job entrypoint: ``ray job submit --working-dir . -- python sweep.py --config sweeps/configs/smoke.yaml``.

Connects to the Ray cluster (``RAY_ADDRESS``, set by ``ray job submit``; a local one otherwise), runs the
Optuna sweep described by the config over Ray workers, and tracks every trial in MLflow. Re-running with
the same ``--sweep-id`` resumes it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# NOTE: Ray >= 2.52 switches to token auth when a token file exists unless told otherwise; say it explicitly.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# NOTE: MLflow's client retries unreachable servers for minutes by default; a sweep should fail fast.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="sweep YAML, e.g. sweeps/configs/smoke.yaml")
    parser.add_argument("--sweep-id", default=None, help="resume this sweep (default: <name>-<timestamp>)")
    parser.add_argument("--tracking-uri", default=None, help="override tracking.tracking_uri")
    parser.add_argument("--state-dir", default=None, help="override storage.state_dir (journal + trial results)")
    parser.add_argument("--storage-url", default=os.environ.get("GRKV_OPTUNA_STORAGE"),
                        help="override storage.url, the Optuna RDB (default: $GRKV_OPTUNA_STORAGE)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from sweeps.config import ConfigError, load_config
    from tracking.mlflow_tracker import TrackingUnavailableError

    try:
        config = load_config(args.config)
    except ConfigError as error:
        print(f"sweep: invalid config: {error}", file=sys.stderr)
        return 2
    if args.tracking_uri:
        config = config.model_copy(update={"tracking": config.tracking.model_copy(update={"tracking_uri": args.tracking_uri})})
    if args.storage_url:
        config = config.model_copy(update={"storage": config.storage.model_copy(update={"url": args.storage_url})})
    if args.state_dir:
        config = config.model_copy(update={"storage": config.storage.model_copy(update={"state_dir": args.state_dir})})
    sweep_id = args.sweep_id or f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"

    from sweeps.driver import SweepDriver

    try:
        status = SweepDriver(config, sweep_id).run()
    except TrackingUnavailableError as error:
        print(f"sweep: {error}", file=sys.stderr)
        return 3
    print(f"sweep {sweep_id}: {status}; resume with --sweep-id {sweep_id}" if status != "FINISHED"
          else f"sweep {sweep_id}: {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
