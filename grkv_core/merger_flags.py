"""The merger options on the command line: one flag per option of any registered merger (derived from its spec),
``--preset``, and ``--merge-variant NAME=MERGE[:key=value,...]``.

NOTE: imports nothing heavy, like the configurations it fills.
"""

from __future__ import annotations

import argparse
import json

from grkv_core.catalog import (
    merger_option_defaults,
    merger_option_names,
    merger_option_spec,
    merger_option_specs,
    mergers_taking,
)
from grkv_core.options import GRKV_PRESETS


def add_merger_options(parser: argparse.ArgumentParser) -> None:
    """One flag per merger option, derived from its spec; it applies to the --merge that takes it, and an option left
    out keeps the merger's default."""
    group = parser.add_argument_group("merger options (each with a --merge that takes it)")
    group.add_argument(
        "--preset",
        choices=sorted(GRKV_PRESETS),
        help=(
            "GRKV's options of a preset ('paper': Alg. 1; 'window32': the default until 2026-11-28; implies --merge "
            "grkv), which flags override"
        ),
    )
    for name in merger_option_names():
        spec = merger_option_spec(name)
        described = []
        for merge in mergers_taking(name):
            default = merger_option_defaults(merge)[name]
            shown = "none" if default is None else default
            described.append(f"{merge}: {merger_option_specs(merge)[name].help} (default: {shown})")
        text = "; ".join(described).replace("%", "%%")
        flag = "--" + name.replace("_", "-")
        if spec.kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif spec.kind is str:
            group.add_argument(flag, dest=name, choices=spec.choices, help=text)
        else:
            group.add_argument(flag, dest=name, type=spec.kind, metavar=spec.kind.__name__.upper(), help=text)


def given_merge_options(args) -> dict:
    return {name: getattr(args, name) for name in merger_option_names() if getattr(args, name) is not None}


def merge_options(args, merge: str) -> dict:
    """The merger options given as flags over the ``--preset``'s, each one ``merge`` takes (a ValueError names any it
    does not)."""
    given = given_merge_options(args)
    foreign = [name for name in given if name not in merger_option_specs(merge)]
    if foreign:
        flags = " ".join("--" + name.replace("_", "-") for name in foreign)
        owners = sorted({owner for name in foreign for owner in mergers_taking(name)})
        raise ValueError(f"--merge {merge} takes no {flags} (options of {', '.join(owners)})")
    if args.preset and merge != "grkv":
        raise ValueError(f"--preset {args.preset} is a set of GRKV's options; --merge {merge} takes none")
    return {**GRKV_PRESETS[args.preset], **given} if args.preset else given


def parse_merge_variant(text: str) -> tuple[str, str, dict]:
    """``NAME=MERGE[:key=value,...]`` -> (name, merger, options); values parsed as JSON where they can be."""
    name, _, spec = text.partition("=")
    merge, _, option_text = spec.partition(":")
    if not name or not merge:
        raise ValueError(f"--merge-variant {text!r}: expected NAME=MERGE[:key=value,...]")
    options = {}
    for item in filter(None, option_text.split(",")):
        key, separator, value = item.partition("=")
        if not separator:
            raise ValueError(f"--merge-variant {text!r}: option {item!r} is not key=value")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return name, merge, options
