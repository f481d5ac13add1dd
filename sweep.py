"""Ray job entrypoint: ``ray job submit --working-dir . -- python sweep.py --config sweeps/configs/smoke.yaml``.

Connects to the Ray cluster (``RAY_ADDRESS``, set by ``ray job submit``; a local one otherwise), runs the
Optuna sweep described by the config over Ray workers, and tracks every trial in MLflow. Re-running with
the same ``--sweep-id`` resumes it.

Exit status (``ray job submit`` exits 1 when it is not 0: the job is FAILED; ``ray job stop`` makes it STOPPED):
0 the sweep finished; 2 the config is invalid; 3 a service (Ray cluster, MLflow, Optuna storage, state
directory) is unusable at the start, or was lost mid-sweep (then the sweep can be resumed); 4 another driver
runs this sweep; 5 the sweep was stopped by a signal (resumable). ``ray stop`` kills the driver with its job, before
it can exit with any of these (``ray job submit`` may then exit 0; ``grkv sweep`` stops: ``sweeps.follow``).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time

from sweeps.entry_points import (
    DRIVER_MLFLOW_RETRIES,
    SERVICE_LOST,
    STOPPED,
    SUCCESS,
    SWEEP_BUSY,
    USER_ERROR,
    set_service_environment,
)

set_service_environment(DRIVER_MLFLOW_RETRIES)

from grkv_core.config import PROTOCOLS  # noqa: E402 - after the environment it must not override

# NOTE: a driver run by `ray job submit` finds its job's metadata here; its resume is submitted the same way.
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def resume_command(argv: list[str], sweep_id: str) -> str:
    """The command that resumes this sweep: this one's arguments with ``--sweep-id`` set."""
    arguments, skip = [], False
    for argument in argv:
        if skip or argument.startswith("--sweep-id="):
            skip = False
            continue
        if argument == "--sweep-id":
            skip = True
            continue
        arguments.append(argument)
    command = shlex.join(["python", "sweep.py", *arguments, "--sweep-id", sweep_id])
    return f"ray job submit --working-dir . -- {command}" if os.environ.get(RAY_JOB_CONFIG_ENV) else command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="sweep YAML, e.g. sweeps/configs/smoke.yaml")
    parser.add_argument("--sweep-id", default=None, help="resume this sweep (default: <name>-<timestamp>)")
    parser.add_argument("--tracking-uri", default=None, help="override tracking.tracking_uri")
    parser.add_argument(
        "--state-dir",
        default=os.environ.get("GRKV_SWEEP_STATE_DIR"),
        help=(
            "override storage.state_dir (journal, trial results, checkpoints; on a multi-node cluster a folder every "
            "node mounts; default: $GRKV_SWEEP_STATE_DIR, which infra/kuberay and infra/ray-up set)"
        ),
    )
    parser.add_argument(
        "--storage-url",
        default=os.environ.get("GRKV_OPTUNA_STORAGE"),
        help="override storage.url, the Optuna RDB (default: $GRKV_OPTUNA_STORAGE)",
    )
    parser.add_argument("--protocol", default=None, choices=PROTOCOLS, help="override data.protocol")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    # NOTE: the driver's own lines at INFO, other libraries' from WARNING (datasets 3.0 announces torch at INFO).
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("grkv").setLevel(logging.INFO)

    from sweeps.config import ConfigError, load_config
    from sweeps.lease import SweepBusyError
    from sweeps.state.optuna_storage import optuna_outside_tested_range
    from sweeps.state.rdb_storage import StorageUnavailableError
    from sweeps.state.state_dir import StateDirError
    from sweeps.worker_pool import ClusterLostError
    from tracking.mlflow_tracker import TrackingUnavailableError

    if untested := optuna_outside_tested_range():
        print(f"sweep: {untested}", file=sys.stderr)
        return USER_ERROR
    try:
        config = load_config(args.config)
    except ConfigError as error:
        print(f"sweep: invalid config: {error}", file=sys.stderr)
        return USER_ERROR
    if args.tracking_uri:
        config = config.model_copy(
            update={"tracking": config.tracking.model_copy(update={"tracking_uri": args.tracking_uri})}
        )
    if args.storage_url:
        config = config.model_copy(update={"storage": config.storage.model_copy(update={"url": args.storage_url})})
    if args.state_dir:
        config = config.model_copy(update={"storage": config.storage.model_copy(update={"state_dir": args.state_dir})})
    if args.protocol:
        config = config.model_copy(update={"data": config.data.model_copy(update={"protocol": args.protocol})})
    sweep_id = args.sweep_id or f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"

    from sweeps.driver import SweepDriver, SweepStopped

    resume = resume_command(argv, sweep_id)
    try:
        status = SweepDriver(config, sweep_id).run()
    except SweepStopped as error:
        if not error.cluster_lost:
            import ray

            # NOTE: Ray relays the workers' output to this process late, and would print it after the one line
            # that must be the user's last; disconnected first (the abandoned workers end with it), it cannot.
            ray.shutdown()
        print(
            f"sweep {sweep_id}: stopped: {error}; nothing finished is lost, the in-flight trials are re-queued; "
            f"resume with: {resume}",
            file=sys.stderr,
            flush=True,
        )
        if error.cluster_lost:
            # NOTE: Ray's exit handler would wait on the lost cluster until Ray aborts the process (its exit
            # status lost with it); everything of the sweep is written by now, so the process ends here.
            logging.shutdown()
            sys.stdout.flush()
            os._exit(SERVICE_LOST)
        return SERVICE_LOST
    except SweepBusyError as error:
        print(f"sweep: {error}", file=sys.stderr)
        return SWEEP_BUSY
    except (TrackingUnavailableError, StorageUnavailableError, StateDirError, ClusterLostError) as error:
        print(f"sweep: {error}", file=sys.stderr)
        return SERVICE_LOST
    if status != "FINISHED":
        print(f"sweep {sweep_id}: {status}; resume with: {resume}", file=sys.stderr)
        return STOPPED
    print(f"sweep {sweep_id}: {status}")
    return SUCCESS


if __name__ == "__main__":
    sys.exit(main())
