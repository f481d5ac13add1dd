"""One line on stderr per long step of model loading, instead of transformers' progress bars."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from transformers.utils import logging as transformers_logging


@contextmanager
def one_progress_line(step: str) -> Iterator[None]:
    """Report a step as one line on stderr, ``grkv: loading smollm2-135m … done in 3.2 s``, instead of
    transformers' progress bars (one frame per tensor: 272 lines per SmolLM2 load in a log).

    Only the progress bars are turned off, and only for the step: warnings and errors show as they come (an
    error ends the line with "failed" and propagates). Steps do not nest: a step's line stays open while it runs.
    """
    bars_were_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    print(f"grkv: {step} …", end="", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        yield
    except BaseException:
        print(" failed", file=sys.stderr, flush=True)
        raise
    else:
        print(f" done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    finally:
        if bars_were_on:
            transformers_logging.enable_progress_bar()
