"""``grkv-report``: an alias of ``grkv report`` (``sweeps.cli``), kept for existing scripts."""

from __future__ import annotations

import sys

from sweeps.cli import EXIT_SWEEP_NOT_FOUND, EXIT_TRACKING_UNAVAILABLE, main as grkv_main

__all__ = ["EXIT_SWEEP_NOT_FOUND", "EXIT_TRACKING_UNAVAILABLE", "main"]


def main(argv: list[str] | None = None) -> int:
    return grkv_main(["report", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
