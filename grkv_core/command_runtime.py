"""How a ``grkv`` command runs: argument errors and user errors in one line, SIGTERM handled as Ctrl-C (what finished
is kept), each with its exit status."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

EXIT_USER_ERROR = 2


class OneLineErrorParser(argparse.ArgumentParser):
    """Argument errors end in one line naming the command, like every other ``grkv`` error."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message}\n")


def run(
    parser: argparse.ArgumentParser, argv: list[str] | None, other_errors: dict[type[BaseException], int] | None = None
) -> int:
    """Parse ``argv`` and run its command; a user error (bad names, missing data or packages) ends in one line, not a
    traceback, with ``EXIT_USER_ERROR``; so does each of ``other_errors``, with its own exit status."""
    args = parser.parse_args(argv)
    user_errors = (ValueError, FileNotFoundError, ImportError)
    statuses = {**(other_errors or {}), **dict.fromkeys(user_errors, EXIT_USER_ERROR)}
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        return args.handler(args)
    except tuple(statuses) as error:
        print(f"grkv {args.command}: error: {error}", file=sys.stderr)
        return next(status for kind, status in statuses.items() if isinstance(error, kind))
    except KeyboardInterrupt as stop:
        how = "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"
        print(
            f"grkv {args.command}: {how}; what finished is saved, re-run the same command to resume",
            file=sys.stderr,
        )
        return 128 + (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)
    finally:
        if previous is not None:  # NOTE: None also when the previous handler was not Python's: it cannot be put back
            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """A SIGTERM (what ``timeout``, systemd, Kubernetes and CI runners send), handled as a Ctrl-C: what a command
    started is stopped and what finished kept on the way out; it exits 143."""


def _terminate(signum, frame) -> None:
    # NOTE: once: a second SIGTERM during the clean-up ends the process as it would have without this handler.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated
