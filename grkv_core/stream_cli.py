"""``grkv eval`` and ``grkv compare`` under a bounded-cache protocol (``--protocol stream_nll`` or ``stream_answer``):
their flags, derived from ``DecodingOptions``' specs, and the two commands.

NOTE: imports nothing heavy until a command runs, like ``grkv_core.cli``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from grkv_core.config import FULL_CACHE, PressConfig, StreamConfig, stream_min_tokens
from grkv_core.datasets.long_texts import LONG_TEXT_DOMAINS
from grkv_core.option_specs import option_specs
from grkv_core.stream_options import STREAM_NLL, DecodingOptions

_DECODING_SPECS = option_specs(DecodingOptions)


def add_stream_flags(parser: argparse.ArgumentParser, several_sizes: bool) -> None:
    """The bounded-cache protocols' flags (used only with ``--protocol stream_nll`` / ``stream_answer``)."""
    group = parser.add_argument_group("bounded-cache protocols (--protocol stream_nll or stream_answer)")
    target = _DECODING_SPECS["target_size"].help
    if several_sizes:
        group.add_argument("--target-sizes", type=int, nargs="+", default=[512], metavar="INT", help=target + "s")
    else:
        group.add_argument("--target-size", type=int, default=512, metavar="INT", help=target)
    group.add_argument(
        "--compression-interval",
        type=int,
        default=128,
        metavar="INT",
        help=_DECODING_SPECS["compression_interval"].help,
    )
    group.add_argument(
        "--texts",
        default="essays",
        choices=LONG_TEXT_DOMAINS,
        help="stream_nll's long texts (Paul Graham's essays, Python's standard library)",
    )
    group.add_argument("--split", default="eval", choices=("eval", "tune"), help="which texts: never the other's")
    group.add_argument(
        "--max-tokens", type=int, default=8192, help="stream_nll: each text cut to this many tokens (>= 4096 kept)"
    )


def stream_config(args, press: PressConfig, target_size: int) -> StreamConfig:
    """The ``StreamConfig`` the command line describes for one press and size (a bounded press, from a press file,
    brings its own sizes)."""
    nll = args.protocol == STREAM_NLL
    max_tokens = args.max_tokens if nll else args.context_length
    return StreamConfig(
        protocol=args.protocol,
        target_size=target_size,
        compression_interval=args.compression_interval,
        model=args.model,
        source=args.texts if nll else args.dataset,
        split=args.split,
        samples=args.samples,
        min_tokens=stream_min_tokens(args.protocol, max_tokens),
        max_tokens=max_tokens,
        tasks=None if nll or not args.tasks else tuple(args.tasks),
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        data_dir=args.data_dir,
    ).with_press(press)


def bounded_refusal(args, press: PressConfig) -> str | None:
    """Why ``press`` cannot bound a stream as the command line asks (its build's one-line reason), or None."""
    from grkv_core.presses.from_config import build

    try:
        build(stream_config(args, press, args.target_sizes[0]).bounded_press)
    except ValueError as error:
        return str(error)
    return None


def _metric(protocol: str) -> str:
    return "nll" if protocol == STREAM_NLL else "answer_nll"


def cmd_stream_eval(args, press: PressConfig) -> int:
    from grkv_core.evaluation.stream_eval import format_stream_table, run_stream_evaluations

    config = stream_config(args, press, args.target_size)
    output = args.output or f"outputs/{args.protocol}/{_file_name(config.label)}.jsonl"
    summary = run_stream_evaluations([config], [output], progress=not args.no_progress)[0]
    print(format_stream_table([summary], _metric(args.protocol)))
    print(f"results: {output}")
    return 0


def cmd_stream_compare(args, rows: list[PressConfig]) -> int:
    """Full cache, then for each target size every row of ``rows`` (the press alone first): one table, each row's
    difference paired per text against the press alone at its size."""
    from grkv_core.evaluation.stream_eval import format_stream_table, run_stream_evaluations

    output_dir = Path(args.output_dir) / args.protocol
    configs = [stream_config(args, PressConfig(FULL_CACHE, 0.0), args.target_sizes[0])]
    configs += [stream_config(args, press, size) for size in args.target_sizes for press in rows]
    outputs = [output_dir / f"{_file_name(config.label)}.jsonl" for config in configs]
    summaries = run_stream_evaluations(configs, outputs, progress=not args.no_progress)
    metric = _metric(args.protocol)
    tables = [format_stream_table([summaries[0]], metric)]
    for start in range(1, len(summaries), len(rows)):
        tables.append(format_stream_table(summaries[start : start + len(rows)], metric, baseline=0))
    text = "\n\n".join(tables)
    (output_dir / "table.md").write_text(text + "\n")
    print(text)
    print(f"results: {output_dir}/")
    return 0


def _file_name(label: str) -> str:
    return label.replace(" + ", "+").replace(" ", "-")
