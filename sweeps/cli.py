"""The ``grkv`` command line: the library's commands (``grkv_core.cli``: eval, compare, analyze) and the sweep
service's: ``sweep`` (a sweep on the local Ray + MLflow stack), ``report``, ``export`` and ``demo`` (the whole
path for a newcomer: services, a small SmolLM2 sweep, its report and the recommended press).

NOTE: this module sits on top of every package (grkv_core, workers, tracking, sweeps); nothing below it
imports from here. The local stack and a sweep's Ray job are ``sweeps.local_stack``'s. Both console scripts start
here: ``grkv`` (``main``) and ``grkv-report`` (``report_main``, the alias of ``grkv report`` kept for existing
scripts).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from pathlib import Path

from sweeps.entry_points import (
    COMMAND_MLFLOW_RETRIES,
    GRKV_HOME,
    SERVICE_LOST,
    STOPPED,
    SUCCESS,
    SWEEP_NOT_FOUND,
    set_service_environment,
)

set_service_environment(COMMAND_MLFLOW_RETRIES)

from grkv_core.cli import add_command, build_parser  # noqa: E402
from grkv_core.command_runtime import run  # noqa: E402
from grkv_core.evaluation.kvpress_layout import KVPRESS_FOLDER  # noqa: E402
from sweeps.follow import SweepLostError  # noqa: E402
from sweeps.local_stack import REPO_ROOT, LocalStack, ServiceError, run_sweep  # noqa: E402
from workers.names import PRESS_ARTIFACT  # noqa: E402

DEMO_CONFIG = REPO_ROOT / "sweeps" / "configs" / "demo.yaml"
DEFAULT_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")


# ---- flags shared by several commands, defined once ------------------------------------------------------------


def _add_sweep_id(parser, required: bool, help: str) -> None:
    parser.add_argument("--sweep-id", required=required, default=None, help=help)


def _add_tracking(parser) -> None:
    parser.add_argument(
        "--tracking-uri",
        default=DEFAULT_TRACKING_URI,
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or http://127.0.0.1:5000)",
    )
    parser.add_argument("--experiment", default=None, help="look for the sweep only in this experiment")
    parser.add_argument("--no-log-artifacts", action="store_true", help="do not log the output on the parent run")


def _add_config(parser, default: Path | None) -> None:
    parser.add_argument(
        "--config",
        required=default is None,
        default=default,
        help="sweep YAML"
        + (f" (default: {default.relative_to(REPO_ROOT)})" if default else ", e.g. sweeps/configs/smoke.yaml"),
    )


def _add_state_dir(parser, default: Path) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=default,
        help=(
            f"the local stack's folder: Ray and MLflow (pids, logs, MLflow store) and each sweep's state under "
            f"sweeps/<id>; a healthy stack already running from it is reused (default: {default}; ports: the "
            f"GRKV_*_PORT variables of infra/local/common.sh)"
        ),
    )


def _add_stop(parser) -> None:
    parser.add_argument(
        "--stop",
        action="store_true",
        help="stop Ray and MLflow at the end (default: leave them running, e.g. for the MLflow UI)",
    )


def _add_output_dir(parser, default_text: str) -> None:
    parser.add_argument("--output-dir", type=Path, default=None, help=f"where to write the report ({default_text})")


def _leave_or_stop(stack: LocalStack, stop: bool, lost: SweepLostError | None = None) -> None:
    """At a command's end: stop the stack with ``stop``, else say that it keeps running (unless its Ray was lost:
    the next command's start.sh restarts what is left of it)."""
    if stop:
        stack.stop()
    elif lost is None and (stack.state_dir / "endpoints.env").is_file():
        print(f"Ray and MLflow keep running (re-used by the next run); stop them with: {stack.stop_command}")


def _sweep_words(config) -> str:
    """What a sweep config runs, in one sentence."""
    data = config.data
    tasks = f"{len(data.tasks)} task(s)" if data.tasks else "every task"
    stages = [
        f"{config.screening.trials} screening trials" if config.screening.trials else None,
        f"{config.trials} full trials",
        f"a test stage on {data.test.samples} held-out sample(s) per task" if config.test_stage else None,
    ]
    if config.bounded:
        what = config.stream_config()
        budget = f"kept at {what.target_size} tokens every {what.compression_interval}"
        data_words = f"{what.source} ({data.samples} text(s), {what.max_tokens} tokens each, streamed)"
    else:
        budget = f"at {1 - config.press.compression_ratio:.0%}"
        length = f", {data.context_length} tokens" if data.context_length else ""
        data_words = f"{data.dataset} ({tasks}, {data.samples} sample(s) each{length})"
    return (
        f"{config.model.name} on {data_words}, {config.press.name} {budget} + {'/'.join(config.merge)}: "
        + ", ".join(stage for stage in stages if stage)
    )


# ---- commands ------------------------------------------------------------------------------------------------


def _check_before_starting(config_path):
    """The sweep config, and the Optuna the driver will run with: checked before any service starts (a ValueError
    in one line)."""
    from sweeps.config import load_config
    from sweeps.state.optuna_storage import optuna_outside_tested_range

    if untested := optuna_outside_tested_range():
        raise ValueError(untested)
    return load_config(config_path)


def cmd_sweep(args) -> int:
    config = _check_before_starting(args.config)
    sweep_id = args.sweep_id or f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    stack = LocalStack(args.state_dir.expanduser(), postgres=args.postgres)
    print(f"sweep {sweep_id}: {_sweep_words(config)}")
    lost = None
    try:
        stack.start()
        status = run_sweep(stack, Path(args.config), sweep_id)
        print(
            f"sweep {sweep_id}: {status}; MLflow UI {stack.mlflow_url} (experiment {config.tracking.experiment})"
            + ("" if status == "FINISHED" else f"; resume with --sweep-id {sweep_id}")
        )
        if (press_file := stack.sweeps_dir / sweep_id / PRESS_ARTIFACT).is_file():
            print(f"recommended press configuration: {press_file} (also on the parent run, {PRESS_ARTIFACT})")
        _print_kvpress_folder(stack.sweeps_dir / sweep_id / KVPRESS_FOLDER)
    except SweepLostError as error:
        lost = error
    finally:
        _leave_or_stop(stack, args.stop, lost)
    if lost is not None:
        # NOTE: the last line the user sees; the same command restarts what is left of Ray (start.sh) and resumes.
        resume = ["grkv", "sweep", "--config", str(args.config), "--sweep-id", sweep_id]
        if args.state_dir != GRKV_HOME / "local":
            resume += ["--state-dir", str(args.state_dir)]
        resume += ["--postgres"] * args.postgres
        print(
            f"sweep {sweep_id}: stopped: {lost}; resume with: {shlex.join(resume + ['--stop'] * args.stop)}",
            file=sys.stderr,
            flush=True,
        )
        return SERVICE_LOST
    return SUCCESS if status == "FINISHED" else STOPPED


def _print_kvpress_folder(folder: Path) -> None:
    if folder.is_dir():
        print(
            f"the test stage in kvpress's evaluation layout: {folder} (beside kvpress's results: "
            f"grkv leaderboard {folder} KVPRESS_RESULTS_DIR)"
        )


def _reads_a_sweep(handler):
    """A command reading a sweep from MLflow: an unreachable server or an unknown sweep ends in one line, with
    its own exit status."""

    def checked(args) -> int:
        from tracking.mlflow_tracker import TrackingUnavailableError, check_tracking_server
        from tracking.reports import SweepNotFoundError

        try:
            check_tracking_server(args.tracking_uri)
            return handler(args)
        except TrackingUnavailableError as error:
            print(f"grkv {args.command}: {error}", file=sys.stderr)
            return SERVICE_LOST
        except SweepNotFoundError as error:
            print(f"grkv {args.command}: {error} at {args.tracking_uri}", file=sys.stderr)
            return SWEEP_NOT_FOUND

    return checked


def _write_report(tracking_uri: str, sweep_id: str, output_dir: Path, experiment: str | None, log: bool, **options):
    import optuna
    from mlflow.tracking import MlflowClient

    from tracking.reports import ReportOptions, build_report

    # The rebuilt study is an implementation detail; its "study created" log line is noise here.
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return build_report(
        MlflowClient(tracking_uri),
        sweep_id,
        output_dir,
        experiment=experiment,
        options=ReportOptions(**options),
        log_artifacts=log,
    )


@_reads_a_sweep
def cmd_report(args) -> int:
    report = _write_report(
        args.tracking_uri,
        args.sweep_id,
        args.output_dir or Path(f"grkv-report-{args.sweep_id}"),
        args.experiment,
        not args.no_log_artifacts,
        ttft_tolerance=args.ttft_tolerance,
        bootstrap_resamples=args.bootstrap_resamples,
    )
    print(report.summary)
    print(
        f"report: {report.output_dir / 'report.html'}"
        + (f"; logged to {report.artifact_uri}" if report.artifact_uri else "")
    )
    return SUCCESS


def _export(
    tracking_uri: str, sweep_id: str, output: Path | None, trial: int | None, experiment: str | None, log: bool
):
    from mlflow.tracking import MlflowClient

    from tracking.export import export_press

    return export_press(
        MlflowClient(tracking_uri), sweep_id, output, trial=trial, experiment=experiment, log_artifact=log
    )


@_reads_a_sweep
def cmd_export(args) -> int:
    exported = _export(
        args.tracking_uri, args.sweep_id, args.output, args.trial, args.experiment, not args.no_log_artifacts
    )
    print(exported.text, end="")
    print(f"press file: {exported.path}" + (f"; logged to {exported.artifact_uri}" if exported.artifact_uri else ""))
    return SUCCESS


def cmd_demo(args) -> int:
    began = time.monotonic()
    config = _check_before_starting(args.config)
    sweep_id = args.sweep_id or config.name
    stack = LocalStack(args.state_dir.expanduser())
    output_dir = args.output_dir or stack.state_dir / "outputs" / sweep_id
    print(
        f"grkv demo: sweep {sweep_id}, {_sweep_words(config)}.\n"
        f"Everything stays in {stack.state_dir}; re-running `grkv demo` resumes the same sweep."
    )
    lost = None
    try:
        stack.start()
        print(f"MLflow UI: {stack.mlflow_url}   Ray dashboard: {stack.dashboard_url}")
        status = run_sweep(stack, Path(args.config), sweep_id)
        if status != "FINISHED":
            raise ServiceError(f"sweep {sweep_id} ended {status}; re-run `grkv demo` to resume it")
        print("writing the report ...", flush=True)
        report = _write_report(stack.mlflow_url, sweep_id, output_dir, config.tracking.experiment, True)
        recommended = stack.sweeps_dir / sweep_id / PRESS_ARTIFACT  # written by the driver (SweepRecords)
        if not recommended.is_file():
            raise ServiceError(
                f"sweep {sweep_id} recommends no press (no trial finished with a score); see its Ray job's log"
            )
        press_file = output_dir / PRESS_ARTIFACT
        shutil.copyfile(recommended, press_file)
        runs = report.runs
        print(f"\n{report.summary.split(chr(10) + chr(10))[0]}\n")
        print(
            f"MLflow UI (the sweep's parent run): "
            f"{stack.mlflow_url}/#/experiments/{runs.experiment_id}/runs/{runs.parent_run_id}"
        )
        print(f"report: {report.output_dir / 'report.html'} (also on the parent run, under report/)")
        print(f"recommended press configuration: {press_file} (also on the parent run, {PRESS_ARTIFACT})")
        print("".join(f"  {line}\n" for line in press_file.read_text().splitlines()), end="")
        print(
            f"use it:\n  from grkv_core.presses.from_config import press_from_file\n"
            f'  with press_from_file("{press_file}")(model): ...\n'
            f"  or: grkv eval --press-config {press_file}"
        )
        _print_kvpress_folder(stack.sweeps_dir / sweep_id / KVPRESS_FOLDER)
        print(f"grkv demo: done in {(time.monotonic() - began) / 60:.1f} min")
    except SweepLostError as error:
        lost = error
    finally:
        _leave_or_stop(stack, args.stop, lost)
    if lost is not None:
        print(f"grkv demo: sweep {sweep_id} stopped: {lost}; re-run `grkv demo` to resume it", file=sys.stderr)
        return SERVICE_LOST
    return SUCCESS


def _add_service_commands(commands) -> None:
    sweep = add_command(
        commands,
        "sweep",
        "run a sweep on the local Ray + MLflow stack (started if needed), showing each finished trial",
        "grkv sweep --config sweeps/configs/smoke.yaml --sweep-id smoke-1   # again: resumes it",
    )
    _add_config(sweep, None)
    _add_sweep_id(sweep, False, "resume this sweep (default: a new one, <name>-<timestamp>)")
    _add_state_dir(sweep, GRKV_HOME / "local")
    sweep.add_argument(
        "--postgres",
        action="store_true",
        help="start the stack with a PostgreSQL server of its own for MLflow and Optuna, as a cluster stores them "
        "(infra/local/postgres.sh; needs pip install '.[postgres]')",
    )
    _add_stop(sweep)
    sweep.set_defaults(handler=cmd_sweep)

    report = add_command(
        commands,
        "report",
        "the report of one sweep, read from MLflow, written to a folder and to its parent run",
        "grkv report --sweep-id demo --tracking-uri http://127.0.0.1:5000 --output-dir report/",
    )
    _add_sweep_id(report, True, "the sweep's id (tag grkv.sweep_id), finished or running")
    _add_tracking(report)
    _add_output_dir(report, "default: ./grkv-report-<id>")
    report.add_argument(
        "--ttft-tolerance",
        type=float,
        default=0.10,
        help="relative TTFT gap counted as equal prefill in the iso-prefill comparison",
    )
    report.add_argument("--bootstrap-resamples", type=int, default=100_000)
    report.set_defaults(handler=cmd_report)

    export = add_command(
        commands,
        "export",
        "write one trial's press configuration as a press file "
        "(grkv_core.presses.from_config.press_from_file, grkv eval --press-config)",
        "grkv export --sweep-id demo --output press.yaml   # --trial 7 for another trial",
    )
    _add_sweep_id(export, True, "the sweep's id (tag grkv.sweep_id)")
    _add_tracking(export)
    export.add_argument(
        "--trial",
        type=int,
        default=None,
        help="export this full-stage trial (default: the best "
        "configuration of the test stage if the sweep has one, else the main study's best trial)",
    )
    export.add_argument("--output", type=Path, default=None, help="the press file (default: ./grkv-press-<id>.yaml)")
    export.set_defaults(handler=cmd_export)

    demo = add_command(
        commands,
        "demo",
        "the main job: start Ray and MLflow on 127.0.0.1, run a small SmolLM2 "
        "sweep, write its report and the recommended press configuration",
        "grkv demo            # again: resumes; --stop stops Ray and MLflow at the end",
    )
    _add_config(demo, DEMO_CONFIG)
    _add_sweep_id(demo, False, "the sweep's id (default: the config's name, so a re-run resumes it)")
    _add_state_dir(demo, GRKV_HOME / "demo")
    _add_output_dir(demo, "default: <state-dir>/outputs/<sweep-id>; the press file goes there too")
    _add_stop(demo)
    demo.set_defaults(handler=cmd_demo)


def build_service_parser():
    return build_parser(
        _add_service_commands,
        description="GRKV: KV-cache merging, its evaluation and the sweep service (Ray + Optuna + MLflow)",
        start_with="grkv demo",
    )


def main(argv: list[str] | None = None) -> int:
    # NOTE: a stack that cannot start or a job that failed is a service's problem (3), never a bad config's (2).
    return run(build_service_parser(), argv, other_errors={ServiceError: SERVICE_LOST})


def report_main(argv: list[str] | None = None) -> int:
    """``grkv-report ARGS``: ``grkv report ARGS``."""
    return main(["report", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
