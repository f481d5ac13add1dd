"""A benchmark's rounds in fresh processes, one after another: each has its own allocator, caches and threads, so a
ratio measured side by side within a process is repeated across processes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


def worker_results(module: str, arguments: list[str], processes: int) -> Iterator[dict]:
    """``python -m module --worker arguments`` ``processes`` times; each run's last stdout line, parsed as JSON."""
    for process in range(processes):
        command = [sys.executable, "-m", module, "--worker", *arguments]
        found = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()[-1]
        yield json.loads(found)
        print(f"process {process + 1}/{processes} done", file=sys.stderr)


def add_round_arguments(parser: argparse.ArgumentParser) -> None:
    """``--rounds``, ``--processes``, ``--threads``, ``--output`` and the hidden ``--worker`` of such a benchmark."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None, help="also write the figures as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def write_summary(output: Path | None, summary: dict) -> None:
    """The figures as JSON in ``output`` (nothing for None), beside the command line that produced them."""
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps({"arguments": sys.argv[1:], "summary": summary}, indent=1) + "\n")
