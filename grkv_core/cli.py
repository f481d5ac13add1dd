"""The library's ``grkv`` commands: ``eval`` (one configuration), ``compare`` (several, one table) and ``analyze``.

The full ``grkv`` command line (``sweeps.cli``) adds the sweep service's commands to this parser
(``build_parser(extension)``); ``main`` here serves library-only installs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from grkv_core.catalog import EVICTION_PRESSES, merger_names
from grkv_core.command_runtime import OneLineErrorParser, run
from grkv_core.config import (
    ATTN_IMPLEMENTATIONS,
    DATASETS,
    DEVICES,
    DTYPES,
    FULL_CACHE,
    PER_HEAD_CACHE_SPEC,
    PROTOCOLS,
    QUESTION_AGNOSTIC,
    PressConfig,
)
from grkv_core.merger_flags import add_merger_options, given_merge_options, merge_options, parse_merge_variant
from grkv_core.options import GRKV_PRESETS
from grkv_core.stream_cli import add_stream_flags
from grkv_core.stream_options import STREAM_PROTOCOLS

DEFAULT_COMPARE_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue")


PRESS_DEFAULTS = PressConfig()


def add_command(commands, name: str, help: str, example: str) -> argparse.ArgumentParser:
    """A ``grkv`` command whose ``--help`` ends with an example of its use."""
    return commands.add_parser(
        name,
        help=help,
        description=help[0].upper() + help[1:] + ".",
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="HF id, local dir, smollm2-135m, gemma3-270m or tiny-llama/-mistral/-qwen3/-gemma3",
    )
    parser.add_argument("--dataset", default="ruler", choices=DATASETS)
    parser.add_argument("--tasks", nargs="+", default=None, help="task names (default: all of the dataset's)")
    parser.add_argument("--context-length", type=int, default=2048, help="RULER prompt length in tokens")
    parser.add_argument("--samples", type=int, default=5, help="samples per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--attn-implementation", default=None, choices=ATTN_IMPLEMENTATIONS)
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument("--data-dir", default=None, help="folder with PaulGrahamEssays.json, squad/hotpotqa JSON")
    parser.add_argument(
        "--protocol",
        default=None,
        choices=(*PROTOCOLS, *STREAM_PROTOCOLS),
        help=(
            "question_agnostic: the context is compressed alone, then the question follows (kvpress's pipeline); "
            "query_aware: the question is compressed with the context (kvpress's evaluation query_aware); "
            "stream_nll / stream_answer: a cache kept at --target-size while long texts, or a context and then "
            f"its answer, stream through it (default: a press file's, else {QUESTION_AGNOSTIC})"
        ),
    )
    parser.add_argument("--no-progress", action="store_true")


def _add_evaluation_outputs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kvpress-dir",
        default=None,
        metavar="DIR",
        help="also write the results in kvpress's evaluation layout under DIR "
        "(dataset__data_dir__model__press__ratio[__query_aware]/ with predictions.csv, "
        "metrics.json, config.yaml; grkv leaderboard reads them)",
    )
    parser.add_argument(
        "--no-decode",
        dest="decode",
        action="store_false",
        help="generate no answers (no score): only the reference answer's NLL, KL and top-1, the "
        "losses and the prefill's costs, about a tenth of the time",
    )


def _quiet_model_loading() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()


def _config(
    args,
    press: str,
    ratio: float,
    merge: str,
    merge_options: dict,
    variant: str | None = None,
    protocol: str | None = None,
):
    from grkv_core.config import EvalConfig

    return EvalConfig(
        protocol=args.protocol or protocol or QUESTION_AGNOSTIC,
        model=args.model,
        dataset=args.dataset,
        tasks=tuple(args.tasks) if args.tasks else None,
        context_length=args.context_length if args.dataset == "ruler" else None,
        samples=args.samples,
        seed=args.seed,
        press=PressConfig(
            press,
            ratio if press != FULL_CACHE else 0.0,
            merge,
            merge_options,
            variant,
            per_head_cache=getattr(args, "per_head_cache", False) and press != FULL_CACHE,
        ),
        dtype=args.dtype,
        attn_implementation=args.attn_implementation,
        device=args.device,
        data_dir=args.data_dir,
        decode=getattr(args, "decode", True),
    )


def _eval_press(args) -> tuple[PressConfig, str | None]:
    """The press ``grkv eval`` evaluates and the protocol it was tuned under: the press file's, or the one its flags
    describe (defaults filled in; no protocol)."""
    flags = {
        "--press": args.press,
        "--compression-ratio": args.compression_ratio,
        "--merge": args.merge,
        "--preset": args.preset,
        "--per-head-cache": args.per_head_cache or None,
        **{"--" + name.replace("_", "-"): value for name, value in given_merge_options(args).items()},
    }
    if args.press_config:
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise ValueError(f"--press-config sets the whole press; drop {' '.join(given)}")
        from grkv_core.presses.from_config import load_press_file

        return load_press_file(args.press_config)
    merge = args.merge or ("grkv" if args.preset else PRESS_DEFAULTS.merge)
    return PressConfig(
        args.press or PRESS_DEFAULTS.press,
        PRESS_DEFAULTS.compression_ratio if args.compression_ratio is None else args.compression_ratio,
        merge,
        merge_options(args, merge),
    ), None


def _refuse_per_head_streams(args) -> None:
    if args.per_head_cache and args.protocol in STREAM_PROTOCOLS:
        raise ValueError(
            f"--per-head-cache is for prefill presses, not --protocol {args.protocol}: a bounded cache holds each "
            "head's own rows under --press adakv by itself"
        )


def _add_per_head_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--per-head-cache", action="store_true", help=PER_HEAD_CACHE_SPEC.help)


def cmd_eval(args) -> int:
    _quiet_model_loading()
    from grkv_core.evaluation.results import format_table
    from grkv_core.evaluation.run import run_evaluation

    press, protocol = _eval_press(args)
    args.protocol = args.protocol or protocol
    args.per_head_cache = args.per_head_cache or press.per_head_cache
    _refuse_per_head_streams(args)
    if args.protocol in STREAM_PROTOCOLS:
        from grkv_core.stream_cli import cmd_stream_eval

        return cmd_stream_eval(args, press)
    if press.bounded:
        raise ValueError(
            f"{args.press_config} is a bounded cache (decoding: {press.decoding}): evaluate it with --protocol "
            f"{' or '.join(STREAM_PROTOCOLS)}"
        )
    config = _config(args, press.press, press.compression_ratio, press.merge, press.merge_options, protocol=protocol)
    summary = run_evaluation(config, args.output, progress=not args.no_progress, kvpress_dir=args.kvpress_dir)
    print(format_table([summary]))
    if args.output:
        print(f"results: {args.output}")
    for folder in summary.get("kvpress_folders", []):
        print(f"kvpress layout: {folder}")
    return 0


def cmd_compare(args) -> int:
    _quiet_model_loading()
    from grkv_core.evaluation.results import format_table
    from grkv_core.evaluation.run import EvaluationSetup, run_evaluations

    output_dir = Path(args.output_dir)
    variants = [parse_merge_variant(text) for text in args.merge_variant]
    preset = GRKV_PRESETS[args.preset] if args.preset else {}
    _refuse_per_head_streams(args)
    if args.protocol in STREAM_PROTOCOLS:
        from grkv_core.stream_cli import bounded_refusal, cmd_stream_compare

        rows = [PressConfig(args.press, 0.0)]
        if not args.only_variants:
            default_row = PressConfig(args.press, 0.0, "grkv", preset)
            reason = bounded_refusal(args, default_row)
            if reason is None:
                rows.append(default_row)
            else:
                # NOTE: the row nobody asked for by name is left out; a variant asked for is refused with its reason.
                print(f"grkv compare: no + grkv row: {reason}", file=sys.stderr)
        rows += [PressConfig(args.press, 0.0, merge, options, name) for name, merge, options in variants]
        return cmd_stream_compare(args, rows)
    configs = [_config(args, FULL_CACHE, 0.0, "none", {})]
    for ratio in args.compression_ratios:
        configs.append(_config(args, args.press, ratio, "none", {}))
        configs.extend([] if args.only_variants else [_config(args, args.press, ratio, "grkv", preset)])
        configs.extend(_config(args, args.press, ratio, merge, options, name) for name, merge, options in variants)
    setup = EvaluationSetup.load(configs[1])  # NOTE: the press's, since it may need eager attention
    names = [
        config.press.label.replace(" + ", "+").replace(" (", "-").replace(")", "").replace(" ", "-").replace("%", "pct")
        for config in configs
    ]
    summaries = run_evaluations(
        configs,
        [output_dir / f"{name}.json" for name in names],
        setup=setup,
        progress=not args.no_progress,
        kvpress_dir=args.kvpress_dir,
    )
    table = format_table(summaries)
    (output_dir / "table.md").write_text(table + "\n")
    print(table)
    print(f"results: {output_dir}/" + (f"; in kvpress's layout: {args.kvpress_dir}/" if args.kvpress_dir else ""))
    return 0


def cmd_analyze(args) -> int:
    _quiet_model_loading()
    from grkv_core.diagnostics.carrier_report import carrier_report, format_carrier_table, plot_window_consistency
    from grkv_core.evaluation.run import EvaluationSetup

    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    from grkv_core.presses.from_config import required_attention

    presses = [args.press, *args.compare]
    if any(required_attention(name) for name in presses):
        args.attn_implementation = "eager"  # NOTE: one model serves every press, so the strictest need wins
    base = _config(args, args.press, args.compression_ratio, "none", {})
    setup = EvaluationSetup.load(base)
    loaded, samples = setup.loaded, setup.samples
    reports = [
        carrier_report(
            loaded,
            samples,
            name,
            args.compression_ratio,
            args.candidate_range,
            output_dir,
            progress=not args.no_progress,
        )
        for name in presses
    ]
    plot_window_consistency(loaded, samples[0], output_dir / "cross_window_consistency.png")
    table = format_carrier_table(reports)
    (output_dir / "carrier_concentration.md").write_text(table + "\n")
    (output_dir / "carrier_concentration.json").write_text(
        json.dumps([{"press": r.press, "units": r.units, **r.macro.__dict__} for r in reports], indent=1)
    )
    print(table)
    print(f"plots and tables: {output_dir}/")
    return 0


def cmd_leaderboard(args) -> int:
    from grkv_core.evaluation.leaderboard import leaderboard_figure, leaderboard_table, read_runs

    rows = read_runs(*args.folders)
    table = leaderboard_table(rows)
    print(table)
    if args.output_dir:
        output_dir = Path(args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "leaderboard.md").write_text(table + "\n")
        print(
            f"table and figure: {output_dir / 'leaderboard.md'}, "
            f"{leaderboard_figure(rows, output_dir / 'leaderboard.png')}"
        )
    return 0


def _add_library_commands(commands) -> None:
    evaluate = add_command(
        commands,
        "eval",
        "evaluate one press configuration",
        "grkv eval --press snapkv --compression-ratio 0.9 --merge grkv --samples 3 "
        "--output results.json\n  grkv eval --press-config press.yaml   # a file grkv export wrote",
    )
    _add_common(evaluate)
    evaluate.add_argument(
        "--press",
        default=None,
        choices=(*EVICTION_PRESSES, FULL_CACHE),
        help=f"eviction press (default: {PRESS_DEFAULTS.press})",
    )
    evaluate.add_argument(
        "--compression-ratio",
        type=float,
        default=None,
        help=f"fraction of the KV pairs removed (default: {PRESS_DEFAULTS.compression_ratio})",
    )
    evaluate.add_argument(
        "--merge",
        default=None,
        choices=merger_names(),
        help=f"merger behind the press (default: {PRESS_DEFAULTS.merge})",
    )
    evaluate.add_argument(
        "--press-config",
        default=None,
        metavar="FILE",
        help="a press file (grkv export) instead of --press, --compression-ratio, --merge and the merger options",
    )
    add_merger_options(evaluate)
    _add_per_head_flag(evaluate)
    add_stream_flags(evaluate, several_sizes=False)
    evaluate.add_argument("--output", default=None, help="results JSON; re-running with it resumes")
    _add_evaluation_outputs(evaluate)
    evaluate.set_defaults(handler=cmd_eval)

    compare = add_command(
        commands,
        "compare",
        "full cache vs an eviction press vs the press + GRKV",
        "grkv compare --samples 3 --compression-ratios 0.9 0.8",
    )
    _add_common(compare)
    compare.set_defaults(tasks=list(DEFAULT_COMPARE_TASKS), samples=3)
    compare.add_argument("--press", default="snapkv", choices=tuple(EVICTION_PRESSES))
    compare.add_argument("--compression-ratios", type=float, nargs="+", default=[0.9])
    compare.add_argument(
        "--merge-variant",
        action="append",
        default=[],
        metavar="NAME=MERGE[:k=v,...]",
        help="extra rows, e.g. grkv-capped=grkv:max_rel_update_k=0.025,accept=objective",
    )
    compare.add_argument("--only-variants", action="store_true", help="no row of the press + GRKV's defaults")
    compare.add_argument("--preset", choices=sorted(GRKV_PRESETS), help="that row with a preset's options instead")
    compare.add_argument("--output-dir", default="outputs/compare")
    _add_per_head_flag(compare)
    add_stream_flags(compare, several_sizes=True)
    _add_evaluation_outputs(compare)
    compare.set_defaults(handler=cmd_compare)

    analyze = add_command(
        commands,
        "analyze",
        "carrier concentration of eviction presses, merge maps, cross-window consistency",
        "grkv analyze --press snapkv --compare h2o --output-dir outputs/analyze",
    )
    _add_common(analyze)
    analyze.set_defaults(tasks=["niah_single_2", "qa_2"], samples=2)
    analyze.add_argument("--press", default="snapkv", choices=tuple(EVICTION_PRESSES))
    analyze.add_argument(
        "--compare",
        nargs="*",
        default=["h2o"],
        choices=tuple(EVICTION_PRESSES),
        help="more eviction presses to tabulate",
    )
    analyze.add_argument("--compression-ratio", type=float, default=0.9)
    analyze.add_argument(
        "--candidate-range", type=int, default=32, help="local matching rule: carriers at most this many positions away"
    )
    analyze.add_argument("--output-dir", default="outputs/analyze")
    analyze.set_defaults(handler=cmd_analyze)

    leaderboard = add_command(
        commands,
        "leaderboard",
        "results in kvpress's evaluation layout (kvpress's own, "
        "grkv eval --kvpress-dir, a sweep's kvpress/ folder) as one "
        "table and a score-vs-compression figure",
        "grkv leaderboard ~/kvpress/evaluation/results ~/.grkv/demo/sweeps/demo/kvpress --output-dir leaderboard/",
    )
    leaderboard.add_argument(
        "folders", nargs="+", metavar="FOLDER", help="run folders, or folders holding them at any depth"
    )
    leaderboard.add_argument("--output-dir", default=None, help="also write leaderboard.md and leaderboard.png here")
    leaderboard.set_defaults(handler=cmd_leaderboard)


def build_parser(
    *extensions: Callable[[argparse._SubParsersAction], None],
    description: str = "GRKV: KV-cache merging evaluation",
    start_with: str = "grkv compare --samples 3",
) -> argparse.ArgumentParser:
    """The ``grkv`` parser with the library's commands; each of ``extensions`` adds more (``add_command``)."""
    parser = OneLineErrorParser(
        prog="grkv",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"start with:\n  {start_with}\nthen `grkv COMMAND --help`: each ends with an example",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_library_commands(commands)
    for extend in extensions:
        extend(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
